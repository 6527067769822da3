"""Soak: hundreds of loads against a fault-injecting server of ours, a local file that changes
under load, and a remote object overwritten under load; counts what each load ended as.

    python benches/soak.py                       # 300 remote, 100 local, 100 swap, 2 x 100 shared,
                                                 # 200 hostile names
    python benches/soak.py --remote 60 --local 40 --swap 40 --shared 40 --hostile 40 --json out.json
    python benches/soak.py --writes 200 ...       # and 200 rounds of failed saves and copies

Write rounds (`--writes`, benches/soak_writes.py): saves and copies into one local folder and one
S3 prefix with failures injected at random (disk full, S3 requests failed, SIGINT, SIGKILL), each
followed by a load that must return the earlier checkpoint or the new one whole, or raise; a
partial or mixed load is wrong.

Remote loads read a ~4 MiB checkpoint in 256 KiB blocks from `tests/servers/http.py`'s server on
127.0.0.1 with chaos on: a share of GETs (`--chaos`) answer 503, reset the connection midway, end
the body early, stall for seconds, or trickle, at random (seeded). Local loads read a file that a
thread shrinks and restores, or replaces by rename, while they run (`method` mmap and read in
turn). Swap loads read an object that a thread overwrites every few tens of milliseconds with
the other of two versions of the same size and header (the server honours If-Match, as real ones
do): each such load must return one version whole, or fail saying the object "changed while
loading". Loads run in a worker process, one JSON line each; a watchdog counts a load that does not
end within `--deadline` as a hang and a worker that dies as a crash.

Shared loads are streams from the same server, and of the same changing file, each drained by two
threads at once: each tensor must reach exactly one of them, and a load that fails must raise in
both (a plain end for one of them counts as an unclear error).

Hostile-name runs (`--hostile`) serve checkpoints whose index names a hostile entry (`..`, its
percent spellings, backslashes, absolute paths and URLs, drives, NUL, `?`, `#`, white space: a
fixed list, then names drawn from `tests/audit.py`'s pieces, seeded) beside another checkpoint
on the same server, and ask for the same names as small files into a destination: each name is
loaded (`load`), opened (`safe_open` of the index) and fetched (`fetch_small_files`). A name that
leaves its folder must be refused by all three with a `ConfigError` quoting it ("refused"); one
that stays inside may load, be missing, or fail otherwise ("inside"). Afterwards the server's
request log must show nothing outside the checkpoints' folders (and nothing of the other
checkpoint), and the sandbox folder nothing written outside the destinations.

Each load ends as one of:
- equal: every tensor bitwise equal to the reference (safetensors' own reader; for swap loads,
  to one of the two versions, all tensors the same one);
- clear error: a fastload exception naming the URL or file, in words (no bare "os error N"),
  within `--deadline` (for swap loads: a StorageError saying "changed while loading");
- wrong data, unclear error, hang, crash: each must be zero.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benches"))

from soak_writes import soak_writes  # noqa: E402

# Short timeouts so that a fault costs seconds, not minutes: the stall rule at 32 KiB/s over half
# a second, requests cut after 2 s, 3 retries.
STORAGE_OPTIONS = {
    "timeout": "2",
    "connect_timeout": "2",
    "max_retries": "3",
    "retry_timeout": "5",
    "min_rate": "32KiB",
    "min_rate_window": "0.5",
}

WORKER = r"""
import json, os, random, sys, threading, time
import torch, fastload
from safetensors.torch import load_file

kind, target, reference = sys.argv[1:4]
count, seed = int(sys.argv[4]), int(sys.argv[5])
options = json.loads(sys.argv[6])

def hostile(first, count):
    # Names that come from data: each one loaded, opened and fetched as a small file. `seed` is
    # the index of the first name (run_worker restarts from the next one).
    from audit import rust_debug
    from fastload import _fastload
    from fastload._remote_files import fetch_small_files

    names = json.loads(open(reference).read())
    for i in range(first, first + count):
        name, base = names[i], f"{target}/h{i}/"
        try:
            _fastload.check_inside(name, "")
            inside = True
        except fastload.ConfigError:
            inside = False
        calls = {
            "load": lambda: fastload.load(base),
            "safe_open": lambda: fastload.safe_open(base + "model.safetensors.index.json"),
            "small_files": lambda: fetch_small_files(
                base, [name], os.path.join(options["sandbox"], "dest", str(i))),
        }
        seen = {}
        start = time.monotonic()
        for what, call in calls.items():
            try:
                call()
                seen[what] = "ok"
            except fastload.FastloadError as e:
                # A refusal quotes the name; anything else of ours is an error of a name inside
                # (no such object, safe_open of an index naming two files, ...).
                refusal = isinstance(e, fastload.ConfigError) and f'"{rust_debug(name)}"' in str(e)
                seen[what] = "refused" if refusal else "error"
            except Exception as e:
                seen[what] = "unclear " + type(e).__name__
        if not inside:
            outcome = "refused" if set(seen.values()) == {"refused"} else "unclear error"
        else:
            outcome = "inside" if set(seen.values()) <= {"ok", "error"} else "unclear error"
        print(json.dumps({"outcome": outcome, "i": i, "name": name, "calls": seen,
                          "took": round(time.monotonic() - start, 3)}), flush=True)

if kind == "hostile":
    sys.path.insert(0, options["tests"])
    hostile(seed, count)
    sys.exit(0)

versions = [load_file(r) for r in reference.split(os.pathsep)]
want = versions[0]
flat = lambda t: t.reshape(-1).view(torch.uint8)
lock = threading.Lock()  # held while a local file is changed; verification takes it too
stop = False

def mutate():
    # Shrinks the file and writes it back in place, or replaces it with a fresh copy by rename.
    data = open(reference, "rb").read()
    rng = random.Random(seed)
    while not stop:
        time.sleep(rng.uniform(0.0, 0.2))
        with lock:
            if rng.random() < 0.25:
                with open(target, "r+b") as f:
                    f.truncate(rng.randrange(len(data)))
                    time.sleep(rng.uniform(0.0, 0.01))
                    f.seek(0)
                    f.write(data)
            else:
                tmp = target + ".tmp"
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, target)

if kind in ("local", "shared_local"):
    threading.Thread(target=mutate, daemon=True).start()

def is_clear(e):
    # Clear: ours, naming the URL or file, and saying what happened in words (not errno text);
    # for an object overwritten midway, a StorageError that says it "changed while loading".
    text = str(e)
    clear = (isinstance(e, fastload.FastloadError) and os.path.basename(target) in text
             and "os error" not in text)
    if kind == "swap":
        clear = (clear and isinstance(e, fastload.StorageError)
                 and "changed while loading" in text)
    return clear

def shared(method, kw):
    # Two threads drain one stream (several segments: memory_limit 1 MiB); each tensor must come
    # to exactly one of them, and a failed load must fail for both (neither sees a plain end).
    s = fastload.stream(target, method=method, block_size="256KiB", memory_limit="1MiB", **kw)
    names, wrong, raised = [], [], [None, None]

    def consume(k):
        try:
            for name, t in s:
                names.append(name)
                with lock:
                    ok = (name in want and t.dtype == want[name].dtype
                          and t.shape == want[name].shape
                          and torch.equal(flat(t), flat(want[name])))
                if not ok:
                    wrong.append(name)
        except Exception as e:
            raised[k] = e

    threads = [threading.Thread(target=consume, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # a hang is the watchdog's to count
    errors = [e for e in raised if e is not None]
    if not errors:
        same = not wrong and sorted(names) == sorted(want)
        return {"outcome": "equal" if same else "wrong",
                "lost": len(want) - len(set(names)), "twice": len(names) - len(set(names))}
    e = errors[0]
    out = {"type": type(e).__name__, "message": str(e)[:300]}
    if len(errors) < 2:
        out["outcome"] = "unclear error"
        out["message"] = "one consumer saw a plain end of a failed load: " + out["message"]
    elif wrong or len(names) != len(set(names)):
        out["outcome"] = "wrong"
    else:
        out["outcome"] = "clear error" if all(map(is_clear, errors)) else "unclear error"
    return out

for i in range(count):
    method = ("mmap", "read")[i % 2] if kind in ("local", "shared_local") else "auto"
    start = time.monotonic()
    try:
        kw = {"storage_options": options} if kind in ("remote", "shared", "swap") else {}
        if kind.startswith("shared"):
            out = shared(method, kw)
            out.update(i=i, took=round(time.monotonic() - start, 3), method=method)
            print(json.dumps(out), flush=True)
            continue
        got = fastload.load(target, method=method, block_size="256KiB", **kw)
        took = time.monotonic() - start
        with lock:
            same = any(sorted(got) == sorted(want) and all(
                got[n].dtype == want[n].dtype and got[n].shape == want[n].shape
                and torch.equal(flat(got[n]), flat(want[n])) for n in want) for want in versions)
        del got
        out = {"outcome": "equal" if same else "wrong"}
    except Exception as e:
        took = time.monotonic() - start
        out = {"outcome": "clear error" if is_clear(e) else "unclear error",
               "type": type(e).__name__, "message": str(e)[:300]}
    out.update(i=i, took=round(took, 3), method=method)
    print(json.dumps(out), flush=True)
stop = True
"""


def write_checkpoint(path: Path, layers: int = 4, width: int = 512, seed: int = 7) -> Path:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {
        f"layer.{i}.{k}": torch.randn(shape, generator=g).to(dtype)
        for i in range(layers)
        for k, shape, dtype in [
            ("w", (width // 2, width), torch.bfloat16),
            ("b", (512,), torch.float32),
            ("ids", (40_001,), torch.int64),
        ]
    }
    save_file(tensors, str(path))
    return path


def run_worker(
    kind: str,
    target: str,
    reference: Path | str,
    count: int,
    seed: int,
    deadline: float,
    options: dict | None = None,
):
    """Runs `count` loads in worker processes; yields one record per load, restarting the worker
    after a hang or a crash. `options`: the worker's (STORAGE_OPTIONS by default)."""
    done = 0
    while done < count:
        cmd = [sys.executable, "-c", WORKER, kind, target, str(reference), str(count - done)]
        cmd += [str(seed + done), json.dumps(STORAGE_OPTIONS if options is None else options)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        last = time.monotonic()
        while done < count:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                line = proc.stdout.readline()
                if line:
                    yield json.loads(line)
                    done += 1
                    last = time.monotonic()
                    continue
                proc.wait()
                yield {
                    "outcome": "crash",
                    "i": done,
                    "returncode": proc.returncode,
                    "stderr": proc.stderr.read()[-2000:],
                }
                done += 1
                break
            # Allow for the worker's start-up (imports) before its first load.
            if time.monotonic() - last > deadline + 20:
                proc.kill()
                proc.wait()
                yield {"outcome": "hang", "i": done}
                done += 1
                break
        else:
            proc.wait(timeout=30)


def swapper(server, path: str, versions: list[bytes], seed: int, stop) -> list[int]:
    """Overwrites `path` on `server` with the other version every 5 to 50 ms until `stop` is
    set; the returned list counts the swaps as they happen."""
    import random
    import threading

    swaps = [0]

    def run() -> None:
        rng = random.Random(seed)
        while not stop.wait(rng.uniform(0.005, 0.05)):
            swaps[0] += 1
            with server.behaviour.lock:  # the ETag and the bytes change together
                server.put({path: versions[swaps[0] % 2]})

    threading.Thread(target=run, daemon=True).start()
    return swaps


# Index entries and small-file names that leave their folder, each run as it is; generated
# ones follow.
HOSTILE = [
    "../victim/model.safetensors",
    "sub/../../victim/model.safetensors",
    "%2e%2e/victim/model.safetensors",
    "..%2fvictim%2fmodel.safetensors",
    "..\\victim\\model.safetensors",
    "/victim/model.safetensors",
    "{victim}",
    "s3://other/model.safetensors",
    "C:model.safetensors",
    "ok.safetensors\0",
    "ok.safetensors?x=../../victim/model.safetensors",
    "ok.safetensors#../victim",
    "..  ",
]


def hostile_names(count: int, seed: int, victim: str) -> list[str]:
    """`count` names: HOSTILE (with `victim` the other checkpoint's URL), then generated ones."""
    import random

    from audit import hostile_name

    rng = random.Random(seed)
    names = [n.format(victim=victim) for n in HOSTILE]
    names += [hostile_name(rng) for _ in range(max(0, count - len(names)))]
    return names[:count]


def hostile_run(count: int, seed: int, deadline: float, work: Path) -> tuple[list, dict]:
    """The hostile-names run (see the module's docstring): records, and the audits' findings."""
    if not count:
        return [], {"requests": 0, "outside_requests": [], "outside_writes": []}
    import torch
    from audit import Tree, normal
    from safetensors.torch import save
    from servers.http import start_server

    victim_file = save({"w": torch.full((4,), 666.0)})
    server = start_server({"/victim/model.safetensors": victim_file})
    sandbox = work / "sandbox"
    (sandbox / "dest").mkdir(parents=True)
    (sandbox / "outside").mkdir()
    names = hostile_names(count, seed, server.url("victim/model.safetensors"))
    for i, name in enumerate(names):
        index = {"weight_map": {"ok": "ok.safetensors", "w": name}}
        server.put(
            {
                f"/h{i}/model.safetensors.index.json": json.dumps(index).encode(),
                f"/h{i}/ok.safetensors": save({"ok": torch.ones(2)}),
                f"/h{i}/config.json": b"{}",
                # The name itself as an object: a name inside is fetched (and written).
                f"/h{i}/{name}": b"x",
            }
        )
    listing = work / "hostile-names.json"
    listing.write_text(json.dumps(names))
    before = Tree(sandbox)
    try:
        options = {"sandbox": str(sandbox), "tests": str(REPO / "tests")}
        records = list(run_worker("hostile", server.base, listing, count, 0, deadline, options))
    finally:
        server.close()
    asked = [p for _, p, _, _ in server.behaviour.log]
    found = {
        "requests": len(asked),
        "outside_requests": [p for p in asked if not re.match(r"^/h\d+/.", normal(p))][:20],
        "outside_writes": before.created(sandbox / "dest")[:20],
    }
    return records, found


def soak(
    remote: int,
    local: int,
    shared: int,
    swap: int,
    chaos: float,
    seed: int,
    deadline: float,
    hostile: int = 0,
    writes: int = 0,
    write_ops: str = "save,copy",
) -> dict:
    import threading

    from servers.http import Behaviour, start_server

    work = Path(tempfile.mkdtemp(prefix="fastload-soak-"))
    reference = write_checkpoint(work / "reference.safetensors")
    # Locally, 64 MiB: a load takes long enough for changes to land in the middle of it.
    local_reference = write_checkpoint(work / "local.safetensors", layers=16, width=2048)
    target = work / "changing.safetensors"
    target.write_bytes(local_reference.read_bytes())
    behaviour = Behaviour(chaos=chaos, seed=seed)
    server = start_server({"/model.safetensors": reference.read_bytes()}, behaviour)
    # The same checkpoint with other values: same size, same header.
    other = write_checkpoint(work / "other.safetensors", seed=8)
    assert other.stat().st_size == reference.stat().st_size
    versions = [reference.read_bytes(), other.read_bytes()]
    swapping = start_server({"/swapped.safetensors": versions[0]})
    stop = threading.Event()
    swaps = swapper(swapping, "/swapped.safetensors", versions, seed, stop)
    both = f"{reference}{os.pathsep}{other}"
    records = []
    try:
        runs = [
            ("remote", server.url("model.safetensors"), reference, remote),
            ("local", str(target), local_reference, local),
            ("shared", server.url("model.safetensors"), reference, shared),
            ("shared_local", str(target), local_reference, shared),
            ("swap", swapping.url("swapped.safetensors"), both, swap),
        ]
        for kind, where, ref, count in runs:
            started = time.monotonic()
            for rec in run_worker(kind, where, ref, count, seed, deadline):
                rec["kind"] = kind
                if rec["outcome"] == "clear error" and rec["took"] > deadline:
                    rec["outcome"] = "slow error"
                records.append(rec)
            print(f"{kind}: {count} loads in {time.monotonic() - started:.0f} s", file=sys.stderr)
        started = time.monotonic()
        hostile_records, audits = hostile_run(hostile, seed, deadline, work)
        for rec in hostile_records:
            rec["kind"] = "hostile"
            records.append(rec)
        print(f"hostile: {hostile} names in {time.monotonic() - started:.0f} s", file=sys.stderr)
        started = time.monotonic()
        write_records, write_summary = (
            soak_writes(writes, seed, work, write_ops) if writes else ([], {})
        )
        print(f"writes: {writes} rounds in {time.monotonic() - started:.0f} s", file=sys.stderr)
    finally:
        stop.set()
        server.close()
        swapping.close()
    summary: dict = {}
    for kind in ("remote", "local", "shared", "shared_local", "swap", "hostile"):
        mine = [r for r in records if r["kind"] == kind]
        counts: dict[str, int] = {}
        for r in mine:
            counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        took = sorted(r["took"] for r in mine if "took" in r)
        summary[kind] = {
            "loads": len(mine),
            "outcomes": counts,
            "max_s": took[-1] if took else None,
            "median_s": took[len(took) // 2] if took else None,
        }
    summary["faults_injected"] = dict(behaviour.faults)
    summary["swaps"] = swaps[0]
    summary["swap_refused_if_match"] = swapping.behaviour.refused_if_match
    summary["hostile_audits"] = audits
    summary["writes"] = write_summary
    summary["bad"] = [r for r in write_records if r["outcome"] == "partial or mixed"]
    fine = ("equal", "clear error", "refused", "inside")
    summary["bad"] += [r for r in records if r["outcome"] not in fine]
    if audits["outside_requests"] or audits["outside_writes"]:
        summary["bad"].append({"outcome": "outside", **audits})
    summary["errors_seen"] = sorted(
        {r.get("message", "")[:160] for r in records if r["outcome"] == "clear error"}
    )[:12]
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--remote", type=int, default=300, help="loads from the chaotic server")
    ap.add_argument("--local", type=int, default=100, help="loads of the changing local file")
    ap.add_argument(
        "--shared",
        type=int,
        default=100,
        help="streams drained by two threads, from the server and of the changing file (each)",
    )
    ap.add_argument("--swap", type=int, default=100, help="loads of an object overwritten midway")
    ap.add_argument(
        "--hostile", type=int, default=200, help="hostile index entries and small-file names"
    )
    ap.add_argument("--writes", type=int, default=200, help="rounds of failed saves and copies")
    ap.add_argument("--write-ops", default="save,copy", help="what write rounds do: save, copy")
    ap.add_argument("--chaos", type=float, default=0.3, help="share of GETs that misbehave")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--deadline", type=float, default=30.0, help="seconds a load may take")
    ap.add_argument("--json", type=Path, help="write the summary here")
    args = ap.parse_args()
    summary = soak(
        args.remote,
        args.local,
        args.shared,
        args.swap,
        args.chaos,
        args.seed,
        args.deadline,
        args.hostile,
        args.writes,
        args.write_ops,
    )
    text = json.dumps(summary, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)
    return 0 if not summary["bad"] else 1


if __name__ == "__main__":
    sys.exit(main())
