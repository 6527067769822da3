"""Writer soak: rounds of `fastload.save` and `fastload.copy` into one destination, a local folder
and an S3 prefix (SeaweedFS on 127.0.0.1 behind a fault proxy), with a failure injected at a
random point of most rounds; after each round the destination is loaded.

    python benches/soak_writes.py --rounds 200 [--seed 1] [--ops save,copy] [--json out.json]
    python benches/soak.py --writes 200           # the same run, inside the soak

Each round, in a process of its own, either saves a new checkpoint (1 to 4 shards of 6 MiB, values
that differ from every other checkpoint's, tensor names shared between checkpoints, so a mix
shows) with `overwrite=True`, or copies one of three saved checkpoints into the destination with
`overwrite=True`. The failure, drawn at random (seeded):
- local: none; the disk full (a tmpfs with a filler file leaving room for a random share of the
  new files; without a tmpfs, skipped); SIGINT; SIGKILL, each after a random delay;
- S3: none; the k-th write request (PUT, POST, DELETE) answered 500 with retries off, k random;
  SIGINT; SIGKILL.

A load of the destination then ends as: `new` (the round's checkpoint, whole), `old` (the
checkpoint the destination held before the round, whole), `earlier` (a checkpoint written there
before that one, whole: after a round that left the destination raising, a failed save's clean-up
can leave an older checkpoint's files alone), `raises` (an error), or `partial or mixed`
(anything else: fewer tensors, or values of two checkpoints). Only the last is wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

ELEMENTS = 6 << 18  # float32: 6 MiB a tensor, one tensor a shard, two upload parts
SHARD = "7MB"
PART = 5 << 20
SOURCES = {1: 100_001, 2: 100_002, 3: 100_003}  # shards -> version of the copy sources
SHARDS_OF: dict[int, int] = dict((v, n) for n, v in SOURCES.items())  # every version written

WORKER = r"""
import json, os, signal, sys, torch, fastload
signal.signal(signal.SIGINT, signal.default_int_handler)
op, dest, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
kw = {"overwrite": True, "part_size": spec["part"], "storage_options": spec["options"]}
if op == "save":
    sd = {f"w{i}": torch.full((spec["elements"],), float(spec["version"] * 10 + i))
          for i in range(spec["shards"])}
print("ready", flush=True)
try:
    if op == "save":
        fastload.save(sd, dest, max_shard_size=spec["shard"], **kw)
    else:
        fastload.copy(spec["source"], dest, progress=False, **kw)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    os._exit(3)
except Exception as e:
    print("error", type(e).__name__, str(e)[:300].replace("\n", " "), flush=True)
    os._exit(2)
print("done", flush=True)
"""


def checkpoint(shards: int, version: int) -> dict:
    import torch

    return {f"w{i}": torch.full((ELEMENTS,), float(version * 10 + i)) for i in range(shards)}


def whole_version(got) -> int | None:
    """The version of the checkpoint `got` is, whole (every tensor of one checkpoint, nothing
    else), or None: tensor `wI` of version V holds V * 10 + I throughout."""
    import torch

    if not got or set(got) != {f"w{i}" for i in range(len(got))}:
        return None
    found = set()
    for i in range(len(got)):
        t = got[f"w{i}"]
        if t.numel() != ELEMENTS or not bool(torch.all(t == t[0])):
            return None
        found.add((round(t[0].item()) - i) / 10)
    if len(found) != 1:
        return None
    version = int(found.pop())
    return version if SHARDS_OF.get(version) == len(got) else None


def classify(got, held: int | None, new: int) -> tuple[str, int | None]:
    """ "new", "old" (the version the destination held before), "earlier" (another checkpoint
    written there before, whole), "raises" (`got` is an exception) or "partial or mixed"; and the
    version now held whole."""
    if isinstance(got, BaseException):
        return "raises", None
    version = whole_version(got)
    if version is None:
        return "partial or mixed", None
    if version == new:
        return "new", version
    return ("old" if version == held else "earlier"), version


def mount_tmpfs(path: Path, size_mib: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)],
                          capture_output=True)  # fmt: skip
    return done.returncode == 0


class Destination:
    """One destination (a local folder or an S3 prefix), and what it held complete last."""

    def __init__(self, name: str, uri: str, load_options: dict | None) -> None:
        self.name, self.uri, self.load_options = name, uri, load_options
        self.held: int | None = None  # the version it held whole

    def load(self):
        import fastload

        try:
            return fastload.load(self.uri, storage_options=self.load_options)
        except Exception as e:
            return e


def run_round(
    rng: random.Random,
    dest: Destination,
    work: Path,
    env: dict,
    s3,
    tmpfs: Path | None,
    ops: tuple[str, ...] = ("save", "save", "copy"),
) -> dict:
    """One save or copy into `dest` with a failure drawn from `rng`; the load that follows."""
    from servers.s3 import Fault, HttpFaultProxy

    op = rng.choice(ops)
    shards = rng.randint(1, 4) if op == "save" else rng.choice(list(SOURCES))
    version = len(SHARDS_OF) + 1 if op == "save" else SOURCES[shards]  # each save its own
    SHARDS_OF[version] = shards
    faults = ["none", "sigint", "sigkill"] + (["full"] if dest.name == "local" and tmpfs else [])
    faults += ["request"] * 2 if dest.name == "s3" else []
    fault = rng.choice(faults)
    spec = {
        "part": PART,
        "elements": ELEMENTS,
        "shard": SHARD,
        "version": version,
        "shards": shards,
        "source": str(work / f"source-{shards}"),
        "options": None,
    }
    child_env = dict(env)
    proxy = None
    if dest.name == "s3":
        k = rng.randint(1, 3 * shards + 4)
        seen = [0]

        def nth(method: str, headers: dict) -> bool:
            if method not in ("PUT", "POST", "DELETE"):
                return False
            seen[0] += 1
            return fault == "request" and seen[0] == k

        port = int(s3.endpoint.rsplit(":", 1)[1])
        proxy = HttpFaultProxy(("127.0.0.1", port), plan=[Fault("status", status=500)], match=nth)
        child_env["AWS_ENDPOINT_URL"] = proxy.endpoint
        spec["options"] = {"max_retries": "0", "retry_timeout": "5"} if fault == "request" else None
    filler = None
    if fault == "full":
        filler = tmpfs / "filler"
        st = os.statvfs(tmpfs)
        room = int(rng.uniform(0, shards * ELEMENTS * 4 * 1.05))
        filler.write_bytes(b"\0" * max(st.f_bavail * st.f_frsize - room, 0))
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, op, dest.uri, json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=child_env,
    )
    try:
        ready = proc.stdout.readline()
        if fault in ("sigint", "sigkill") and ready == b"ready\n":
            # A save of one 6 MiB shard takes about 0.1 s here: most signals land mid-write.
            time.sleep(rng.uniform(0.0, 0.12 * shards))
            proc.send_signal(signal.SIGINT if fault == "sigint" else signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
        if proxy is not None:
            proxy.close()
        if filler is not None:
            filler.unlink()
    got = dest.load()
    outcome, dest.held = classify(got, dest.held, version)
    ended = (out.decode().strip().splitlines() or ["killed"])[-1]
    return {"dest": dest.name, "op": op, "shards": shards, "fault": fault, "ended": ended[:200],
            "outcome": outcome, "took": round(time.monotonic() - started, 3),
            "load_error": str(got)[:200] if isinstance(got, BaseException) else None}  # fmt: skip


def prepare_sources(work: Path) -> None:
    import fastload

    for shards, version in SOURCES.items():
        fastload.save(checkpoint(shards, version), work / f"source-{shards}", max_shard_size=SHARD)


def soak_writes(
    rounds: int, seed: int, work: Path, ops: str = "save,copy"
) -> tuple[list[dict], dict]:
    """`rounds` rounds, alternately into the local folder and the S3 prefix (local only when
    SeaweedFS cannot start), of `ops` (saves twice as often as copies). Returns the records and
    a summary."""
    chosen = tuple(op for op in ("save", "save", "copy") if op in ops.split(","))
    from servers.s3 import BUCKET, start_seaweed

    prepare_sources(work)
    tmpfs = work / "tmpfs"
    mounted = mount_tmpfs(tmpfs, 128)
    local_root = tmpfs if mounted else work / "local"
    dests = [Destination("local", str(local_root / "model"), None)]
    s3 = None
    try:
        s3 = start_seaweed(work / "seaweedfs")
    except Exception as e:  # no `weed` binary: local rounds only
        print(f"soak_writes: no S3 server ({e}); local rounds only", file=sys.stderr)
    import fastload

    package = os.path.dirname(os.path.dirname(fastload.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([package, str(REPO / "tests")])}
    if s3 is not None:
        env.update(s3.env())
        os.environ.update(s3.env())
        dests.append(Destination("s3", f"s3://{BUCKET}/soak-writes/", s3.storage_options()))
    rng = random.Random(seed)
    records = []
    try:
        for i in range(rounds):
            dest = dests[i % len(dests)]
            records.append(run_round(rng, dest, work, env, s3, tmpfs if mounted else None, chosen))
    finally:
        if s3 is not None:
            s3.stop()
        if mounted:
            subprocess.run(["umount", "-l", str(tmpfs)], check=False)
    return records, summarize(records, mounted, s3 is not None)


def summarize(records: list[dict], tmpfs: bool, s3: bool) -> dict:
    counts: dict[str, dict[str, int]] = {}
    for r in records:
        key = f"{r['dest']} {r['op']} {r['fault']}"
        by = counts.setdefault(key, {})
        by[r["outcome"]] = by.get(r["outcome"], 0) + 1
    outcomes: dict[str, int] = {}
    for r in records:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    return {
        "rounds": len(records),
        "outcomes": outcomes,
        "partial_or_mixed": outcomes.get("partial or mixed", 0),
        "by_case": dict(sorted(counts.items())),
        "full_disk": tmpfs,
        "s3": s3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--ops", default="save,copy", help="what the rounds do: save, copy or both")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write the summary (and each bad round) here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fastload-soak-writes-"))
    records, summary = soak_writes(args.rounds, args.seed, work, args.ops)
    summary["bad"] = [r for r in records if r["outcome"] == "partial or mixed"]
    text = json.dumps(summary, indent=2)
    if args.json:
        args.json.write_text(json.dumps({**summary, "records": records}, indent=2))
    print(text)
    return 0 if not summary["bad"] else 1


if __name__ == "__main__":
    sys.exit(main())
