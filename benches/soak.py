"""Soak: many loads against a fault-injecting server of ours, and local files changed under load.

Every load ends in one of: bitwise equal to the reference; a clear error (a FastloadError naming
the URL or file) within the bound; or a failure of fastload: a hang (over the bound), a crash (any
other exception) or wrong data (a load that returned different bytes). The last three must be 0.

    python benches/soak.py --loads 300 --seed 1

Remote loads go through tests/s3_server.HttpFaultProxy in front of tests/http_server.RangeServer,
with a random plan per load drawn from: 5xx answers, bodies cut (FIN) or reset (RST) mid-way,
stalls after the head or before it, and some loads from a server that trickles every body (20
bytes/s). Local loads stream a file that another thread truncates, or replaces, at a random
moment (or leaves alone). Loads run one at a time in this process, each with a bound.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import fastload  # noqa: E402
import torch  # noqa: E402
from http_server import Behaviour, start_server  # noqa: E402
from s3_server import Fault, HttpFaultProxy  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

# Quick retries and a short stall rule, so that each load's bound stays small; the defaults
# differ only in their numbers.
OPTIONS = {
    "timeout": "10",
    "max_retries": "3",
    "retry_timeout": "8",
    "min_rate": "64KiB",
    "stall_window": "2",
}
BOUND_S = 60.0


def checkpoint(directory: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(64 * 1024 + i, generator=g) for i in range(12)}  # ~3 MiB
    path = directory / "soak.safetensors"
    save_file(tensors, path)
    return path, {k: v.clone() for k, v in load_file(path).items()}


def random_plan(rng: random.Random) -> list[Fault]:
    kinds = [
        lambda: Fault("status", status=rng.choice([500, 502, 503]), code="SlowDown"),
        lambda: Fault("cut", after=rng.randrange(1, 200_000)),
        lambda: Fault("reset", after=rng.randrange(1, 200_000)),
        lambda: Fault("stall", after=rng.randrange(0, 100_000), seconds=rng.uniform(1, 5)),
        lambda: Fault("stall_head", seconds=rng.uniform(1, 5)),
    ]
    return [rng.choice(kinds)() for _ in range(rng.randrange(0, 6))]


def classify(fn, want, names) -> tuple[str, float, str]:
    started = time.monotonic()
    try:
        got = fn()
    except fastload.FastloadError as e:
        took = time.monotonic() - started
        named = any(n in str(e) for n in names)
        kind = "clear_error" if named and took < BOUND_S else "unclear_or_slow_error"
        return kind, took, f"{type(e).__name__}: {e}"[:300]
    except Exception as e:  # anything else is a crash of the contract
        return "crash", time.monotonic() - started, repr(e)[:300]
    took = time.monotonic() - started
    if took > BOUND_S:
        return "hang", took, ""
    same = got.keys() == want.keys() and all(
        got[k].view(torch.uint8).equal(want[k].view(torch.uint8)) for k in want
    )
    return ("equal" if same else "wrong_data"), took, ""


def remote_load(rng, files, want) -> tuple[str, float, str]:
    if rng.random() < 0.05:
        server = start_server(files, Behaviour(trickle=20))
        try:
            url = server.url("soak.safetensors")
            return classify(lambda: fastload.load(url, storage_options=OPTIONS), want, [url])
        finally:
            server.close()
    server = start_server(files)
    proxy = HttpFaultProxy(("127.0.0.1", server.server_address[1]), random_plan(rng))
    try:
        url = f"{proxy.endpoint}/soak.safetensors"
        block = rng.choice(["64KiB", "256KiB", "1MiB"])
        return classify(
            lambda: fastload.load(url, block_size=block, storage_options=OPTIONS), want, [url]
        )
    finally:
        proxy.close()
        server.close()


def local_load(rng, original: Path, want, work: Path) -> tuple[str, float, str]:
    path = work / "local.safetensors"
    path.write_bytes(original.read_bytes())
    change = rng.choice(["none", "truncate", "replace"])
    delay = rng.uniform(0, 0.05)

    def changer():
        time.sleep(delay)
        if change == "truncate":
            with open(path, "r+b") as f:
                f.truncate(rng.randrange(1, path.stat().st_size))
        elif change == "replace":
            other = work / "other.safetensors"
            save_file({k: v + 1 for k, v in want.items()}, other)
            os.replace(other, path)

    def run():
        t = threading.Thread(target=changer)
        t.start()
        try:
            out = {}
            method = rng.choice(["mmap", "read"])
            with fastload.stream(path, method=method, block_size="64KiB", memory_limit="1MiB") as s:
                for name, tensor in s:
                    # A tensor handed out must be the original bytes, whatever happened later.
                    # (Copied at once: an mmap-backed tensor of a file truncated after it was
                    # handed out may fault, as safetensors' own do; see README.)
                    out[name] = tensor.clone()
                    time.sleep(0.005)  # a consumer that takes its time: changes land mid-load
            return out
        finally:
            t.join()

    kind, took, detail = classify(run, want, [str(path)])
    if kind == "equal" or kind == "clear_error":
        return kind, took, detail
    return kind, took, f"{change}: {detail}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", type=int, default=300)
    ap.add_argument("--local-share", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    counts: dict[str, int] = {}
    worst: dict[str, float] = {}
    problems: list[str] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        path, want = checkpoint(work)
        files = {"/soak.safetensors": path.read_bytes()}
        for i in range(args.loads):
            local = rng.random() < args.local_share
            kind, took, detail = (
                local_load(rng, path, want, work) if local else remote_load(rng, files, want)
            )
            key = f"{'local' if local else 'remote'}_{kind}"
            counts[key] = counts.get(key, 0) + 1
            worst[kind] = max(worst.get(kind, 0.0), took)
            if kind not in ("equal", "clear_error"):
                problems.append(f"load {i}: {key} after {took:.1f} s {detail}")
    result = {
        "loads": args.loads,
        "seconds": round(time.monotonic() - started, 1),
        "counts": dict(sorted(counts.items())),
        "slowest_s": {k: round(v, 1) for k, v in sorted(worst.items())},
        "problems": problems,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
