"""Loading from a peer: `fastload serve` in front of an S3 origin, side by side in one run.

    python benches/peer_bench.py             # 256 MiB checkpoint, 3 runs a row
    python benches/peer_bench.py --size 64MiB --runs 1

Starts SeaweedFS (`weed mini`, tests/servers/s3.py) on 127.0.0.1 and uploads a checkpoint of
`--size` (4 shards of float32 tensors); puts the origin behind a delay line of 20 ms round trip
and 200 MB/s (benches/latency_proxy.py: `--origin-delay-ms` each way, `--origin-rate-mbps`);
starts `python -m fastload serve s3://bucket/peer-bench/` (port 0) reading SeaweedFS directly,
and fills it (one raw read of every file); puts the serve behind its own delay line
(`--peer-rate-mbps`, 2000 by default, 0.25 ms each way). Both lines are latency_proxy.py's
SpliceLine: the replies' bytes never enter Python, so the line carries GB/s on a 2-core VM.
Then, each load in a fresh process (`fastload.load`, CPU):

- origin:        the origin URI through its delay line, no peer.
- peer:          the same URI with `peers=[the serve's delay line]`; its wire time is
                 bytes / the peer link's rate, and the row's ratio is wire time / seconds.
- peer loopback: `peers=[the serve]` on loopback, the origin pinned without its delay line too,
                 against
- raw GET:       a raw parallel-GET client (16 threads, 8 MiB ranges, http.client) reading every
                 file from the serve on loopback (the serve's own ceiling here), and through
                 the peer's delay line (the delay line's ceiling: it must reach about the
                 link's rate for the peer row's ratio to be the loader's).
- kill at P%:    the loopback peer row with the serve SIGKILLed once it sent P% of the bytes
                 (`/metrics`); the load must finish from the origin, bitwise equal (sha256 of
                 every tensor against a load from the origin), and the bytes the origin sent
                 (the origin delay line's counter) must stay within what the peer had not sent
                 plus one block per read in flight. The serve is started again afterwards.

Each load row also gives the time from the call to its first tensor (a stream's first item; the
load is `dict(fastload.stream(...))`, which is what `fastload.load` does): what the load waits
for before the peer's bytes flow, the origin's listing and the peer's manifest among it.

Results: printed as a markdown table, and benches/out/peer_results.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))

PREFIX = "peer-bench"
BLOCK = 8 << 20
CONCURRENCY = 16


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, mult in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def make_checkpoint(out: Path, size: int) -> list[Path]:
    import numpy as np
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    shards, per = 4, size // 4
    paths = []
    for s in range(shards):
        n = per // 4 // 8
        tensors = {f"s{s}.t{i}": rng.standard_normal(n, dtype=np.float32) for i in range(8)}
        path = out / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(path))
        paths.append(path)
    return paths


# ------------------------------------------------------------------ one load (fresh process)

WORKER = r"""
import hashlib, json, sys, time
import fastload
job = json.loads(sys.argv[1])
times, firsts = [], []
got = None
for _ in range(job["loads"]):
    got = None  # the last load's tensors freed first: each load lands in memory it can reuse
    t = time.perf_counter()
    got, arrived = {}, None
    # load() is dict(stream(...)): the same work, with the first tensor's arrival seen.
    with fastload.stream(job["uri"], peers=job["peers"], block_size=job["block"],
                         concurrency=job["concurrency"]) as s:
        for name, tensor in s:
            if arrived is None:
                arrived = time.perf_counter() - t
            got[name] = tensor
    times.append(time.perf_counter() - t)
    firsts.append(arrived)
seconds, first = times[-1], times[0]
h = hashlib.sha256()
for k in sorted(got):
    h.update(k.encode()); h.update(got[k].numpy().tobytes())
print(json.dumps({"seconds": seconds, "first": first, "first_tensor": firsts[-1],
                  "digest": h.hexdigest(),
                  "bytes": sum(v.numel() * v.element_size() for v in got.values())}))
"""


def load(uri: str, peers: list[str], env: dict, on_start=None, loads: int = 2) -> dict:
    """`loads` loads in one fresh process: the first pays the process's start (the runtime, the
    buffer pool), the last is the one timed."""
    job = {"uri": uri, "peers": peers, "block": BLOCK, "concurrency": CONCURRENCY, "loads": loads}
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, json.dumps(job)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if on_start is not None:
        on_start()
    out, err = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"load failed: {err[-2000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result["dropped"] = "dropped" in err
    return result


# ------------------------------------------------------------------ the serve


class Serve:
    def __init__(self, uri: str, env: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fastload", "serve", uri, "--port", "0"],
            env={**env, "PYTHONPATH": str(ROOT / "python")},
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self.proc.stdout.readline()
        if "serving on" not in line:
            raise RuntimeError(f"serve did not start: {line!r}")
        self.base = line.split("serving on", 1)[1].strip()
        self.port = int(self.base.rsplit(":", 1)[1])

    def get(self, path: str, headers: dict | None = None) -> bytes:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request("GET", path, headers=headers or {})
        r = conn.getresponse()
        body = r.read()
        conn.close()
        if r.status >= 300:
            raise RuntimeError(f"{path}: {r.status}")
        return body

    def manifest(self) -> dict:
        return json.loads(self.get("/v1/manifest"))

    def bytes_served(self) -> int:
        total = 0
        for line in self.get("/metrics").decode().splitlines():
            if line.startswith("fastload_serve_bytes_total"):
                total += int(float(line.rsplit(" ", 1)[1]))
        return total

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def raw_get(port: int, files: list[tuple[str, int]]) -> float:
    """Every file read from the serve with 16 threads of 8 MiB ranges, each into its thread's
    buffer (http.client's readinto: the bytes are copied once); seconds."""
    jobs = [(p, a, min(a + BLOCK, size)) for p, size in files for a in range(0, size, BLOCK)]
    local = threading.local()

    def fetch(job) -> int:
        path, a, b = job
        if not hasattr(local, "conn"):
            local.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            local.buf = memoryview(bytearray(BLOCK))  # one buffer a thread: no allocation a GET
        local.conn.request("GET", path, headers={"Range": f"bytes={a}-{b - 1}"})
        r = local.conn.getresponse()
        got = 0
        while got < b - a:
            n = r.readinto(local.buf[got : b - a])
            if not n:
                break
            got += n
        return got

    t = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        got = sum(pool.map(fetch, jobs))
    seconds = time.perf_counter() - t
    assert got == sum(s for _, s in files)
    return seconds


def files_of(manifest: dict) -> list[tuple[str, int]]:
    out = []
    for c in manifest["checkpoints"]:
        for f in c["files"]:
            out.append((f"/v1/files/{c['name']}/{f['path']}", f["size"]))
    return out


def cell(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--origin-delay-ms", type=float, default=10.0)
    ap.add_argument("--origin-rate-mbps", type=float, default=200.0)
    ap.add_argument("--peer-delay-ms", type=float, default=0.25)
    ap.add_argument("--peer-rate-mbps", type=float, default=2000.0)
    ap.add_argument("--kills", default="30,60,90")
    args = ap.parse_args()

    import latency_proxy
    from servers import s3 as s3_server

    size = parse_size(args.size)
    tmp = Path(tempfile.mkdtemp(prefix="peer-bench-"))
    seaweed = s3_server.start_seaweed(tmp / "weed")
    rows: list[dict] = []
    try:
        paths = make_checkpoint(tmp / "ckpt", size)
        s3_server.upload(
            seaweed.client(), s3_server.BUCKET, {f"{PREFIX}/{p.name}": p for p in paths}
        )
        total = sum(p.stat().st_size for p in paths)
        port = int(seaweed.endpoint.rsplit(":", 1)[1])
        o_port, o_stop = latency_proxy.start_in_thread(
            ("127.0.0.1", port),
            args.origin_delay_ms / 1000,
            rate=args.origin_rate_mbps * 1e6,
            splice=True,
        )
        base_env = {**os.environ, **seaweed.env()}
        base_env.pop("FASTLOAD_PEERS", None)
        origin_env = {**base_env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{o_port}"}
        serve_env = {**base_env, "AWS_ENDPOINT_URL": seaweed.endpoint}
        uri = f"s3://{s3_server.BUCKET}/{PREFIX}/"

        serve = Serve(uri, serve_env)
        files = files_of(serve.manifest())
        raw_get(serve.port, files)  # fills the serve from the origin
        # In a process of its own: the raw GET's threads would share its GIL here.
        p_port, p_line = latency_proxy.start_process(
            ("127.0.0.1", serve.port), args.peer_delay_ms / 1000, rate=args.peer_rate_mbps * 1e6
        )
        via_link = f"127.0.0.1:{p_port}"
        loop = f"127.0.0.1:{serve.port}"
        wire = total / (args.peer_rate_mbps * 1e6)

        timings: dict[str, list[float]] = {k: [] for k in ("origin", "peer", "loopback", "raw")}
        digest = None
        firsts: dict[str, list[float]] = {}
        first_tensor: dict[str, list[float]] = {}  # ms from the call to the first tensor
        for _ in range(args.runs):
            # Loopback: no delay line at all, the origin's pinning (a listing) included.
            for row, peers, env in (
                ("origin", [], origin_env),
                ("peer", [via_link], origin_env),
                ("loopback", [loop], serve_env),
            ):
                r = load(uri, peers, env)
                digest = digest or r["digest"]
                assert r["digest"] == digest, f"{row}: bytes differ"
                timings[row].append(r["seconds"])
                firsts.setdefault(row, []).append(r["first"])
                first_tensor.setdefault(row, []).append(r["first_tensor"] * 1e3)
            timings["raw"].append(raw_get(serve.port, files))
            timings.setdefault("raw_link", []).append(raw_get(p_port, files))
        for row in ("origin", "peer", "loopback"):
            print(f"{row}: a process's first load {cell(firsts[row])} s", file=sys.stderr)
        rows.append(
            {
                "row": "origin (20 ms, 200 MB/s)",
                "seconds": timings["origin"],
                "first_ms": first_tensor["origin"],
            }
        )
        rows.append(
            {
                "row": f"peer ({args.peer_rate_mbps:.0f} MB/s link)",
                "seconds": timings["peer"],
                "first_ms": first_tensor["peer"],
                "vs": f"{wire / statistics.median(timings['peer']):.2f}x wire time {wire:.2f} s",
            }
        )
        raw_link = statistics.median(timings["raw_link"])
        rows.append(
            {
                "row": "raw parallel GET through the same delay line",
                "seconds": timings["raw_link"],
                "vs": f"{wire / raw_link:.2f}x wire time: the delay line's own ceiling",
            }
        )
        ratio = statistics.median(timings["raw"]) / statistics.median(timings["loopback"])
        rows.append(
            {
                "row": "peer, loopback",
                "seconds": timings["loopback"],
                "first_ms": first_tensor["loopback"],
                "vs": f"{ratio:.2f}x raw GET",
            }
        )
        rows.append({"row": "raw parallel GET, loopback", "seconds": timings["raw"]})

        for pct in [int(p) for p in args.kills.split(",") if p]:
            o_stop.proxy.bytes = 0  # type: ignore[attr-defined]
            killed = threading.Event()
            start_bytes = serve.bytes_served()

            def killer(serve=serve, pct=pct, start_bytes=start_bytes, killed=killed) -> None:
                while serve.proc.poll() is None:
                    try:
                        sent = serve.bytes_served() - start_bytes
                    except OSError:
                        return
                    if sent >= total * pct / 100:
                        killed.sent = sent  # type: ignore[attr-defined]
                        serve.kill()
                        killed.set()
                        return
                    time.sleep(0.002)

            r = load(
                uri,
                [loop],
                origin_env,
                on_start=lambda k=killer: threading.Thread(target=k, daemon=True).start(),
                loads=1,
            )
            sent = getattr(killed, "sent", None)
            origin_bytes = o_stop.proxy.bytes  # type: ignore[attr-defined]
            bound = (total - (sent or 0)) + CONCURRENCY * BLOCK
            rows.append(
                {
                    "row": f"serve killed at {pct}%",
                    "seconds": [r["seconds"]],
                    "vs": (
                        f"bitwise {'equal' if r['digest'] == digest else 'DIFFERENT'}; peer sent "
                        f"{(sent or 0) / 1e6:.0f} MB, origin relayed {origin_bytes / 1e6:.0f} MB "
                        f"(bound {bound / 1e6:.0f} MB){'' if killed.is_set() else '; not killed'}"
                    ),
                    "ok": r["digest"] == digest and origin_bytes <= bound + (1 << 20),
                }
            )
            serve = Serve(uri, serve_env)
            raw_get(serve.port, files_of(serve.manifest()))
            loop = f"127.0.0.1:{serve.port}"
        serve.kill()
        p_line.kill()
        o_stop.set()
    finally:
        seaweed.stop()

    lines = [
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs); "
        f"checkpoint {total / 1e6:.0f} MB, {len(paths)} shards; {args.runs} runs a row "
        f"(median (min-max) s of a process's second load; kill rows: its first); block "
        f"{BLOCK >> 20} MiB, concurrency {CONCURRENCY}",
        "",
        "| row | seconds | GB/s | first tensor ms | vs |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        gbs = total / statistics.median(r["seconds"]) / 1e9
        first = cell(r["first_ms"]) if "first_ms" in r else ""
        lines.append(
            f"| {r['row']} | {cell(r['seconds'])} | {gbs:.2f} | {first} | {r.get('vs', '')} |"
        )
    text = "\n".join(lines)
    print(text)
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "peer_results.json").write_text(json.dumps({"rows": rows, "bytes": total}, indent=1))
    if not all(r.get("ok", True) for r in rows):
        sys.exit("a killed-serve row failed its check")


if __name__ == "__main__":
    main()
