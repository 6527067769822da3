"""fastload against its peers on S3: a local SeaweedFS (SigV4), with and without added latency.

    python benches/s3_bench.py                  # 2 GiB llama-like checkpoint, 3 rounds (~10 min)
    python benches/s3_bench.py --quick          # 256 MiB, 1 round, fewer rows (~2 min)
    python benches/s3_bench.py --size 1GiB --reps 5 --delay-ms 15 --concurrency 16,64
    python benches/s3_bench.py --raw-client both --boto3-concurrency 10,32 --no-latency

One run starts `weed mini` on 127.0.0.1 (tests/servers/s3.py), uploads the checkpoint made by
benches/make_checkpoint.py, starts a delaying TCP proxy in front of it (benches/latency_proxy.py:
--delay-ms each way, so twice that in round trip; this kernel has no netem), then measures, each
in a fresh process, rounds interleaved with a rotated order:

- raw:      a plain parallel ranged-GET client: `curl --parallel --parallel-max N` over 8 MiB
            ranges, SigV4-signed, bodies to /dev/null (--raw-client boto3: Python threads with
            boto3 get_object + readinto into a reused buffer, which is CPU-bound well below the
            server here). The most a simple client gets out of this server: the reference for
            "within 10% of raw" of stream and drain. raw keep: the same curl with each range
            written to a tmpfs file, so the bytes land in fresh memory as a load's must: the
            reference of load (fresh pages cost this VM more than the transfer itself).
- fastload: `fastload.load(uri, concurrency=N)` then every 4 KiB page of every tensor is read
            (load); `fastload.stream(...)` with each tensor copied into a destination allocated
            and pre-faulted before the clock (stream); `fastload.stream(...)` with each tensor
            page-touched and released as it arrives (drain: the raw client's work, bytes into
            reused memory and no copy); drain-warm times a second drain in the same process.
- runai:    runai-model-streamer 0.17 + runai-model-streamer-s3 (AWS CRT client):
            `SafetensorsStreamer().stream_files(["s3://..."])`, RUNAI_STREAMER_CONCURRENCY=N
            (its default for object storage is 8), same load/stream workloads.
- boto3:    `download_fileobj` with TransferConfig(max_concurrency=N, 8 MiB parts) into a
            BytesIO, then `safetensors.torch.load(buf.getvalue())` and the page touch: the time
            until the tensors exist (load only: nothing is usable before the download ends).

Cells are GB/s of tensor bytes (1e9 B/s; raw: object bytes): median (min-max) over rounds. The
server shares the VM's cores with the client (and the proxy), so absolute rates are low and drift;
compare rows of one run only. Results: benches/out/s3_results.md (also printed) and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MiB = 1 << 20
KEY = "bench/model.safetensors"


# ---------------------------------------------------------------- worker (one measurement) ------


def touch(tensors) -> int:
    """The suite's page touch and checksum (benches/loaders.py), imported when needed: it pulls in
    torch, which the parent process does not otherwise load."""
    from fastload._peers import touch as touch_pages

    return touch_pages(tensors)


def destination(layout: list, shm_path: str | None):
    """One pre-faulted tensor per checkpoint tensor, views into one buffer, filled before the
    clock. With shm_path, a tmpfs file mapped with MAP_POPULATE and shared by every measurement
    (fresh anonymous memory faults in slowly on these VMs)."""
    import mmap

    import torch

    dtypes = {
        "BF16": torch.bfloat16,
        "F16": torch.float16,
        "F32": torch.float32,
        "F64": torch.float64,
        "I64": torch.int64,
        "I32": torch.int32,
        "U8": torch.uint8,
    }
    total = max(1, layout[-1][3] + layout[-1][4]) if layout else 1
    if shm_path:
        fd = os.open(shm_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != total:
                os.ftruncate(fd, total)
            mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        buf = torch.frombuffer(mm, dtype=torch.uint8)
    else:
        buf = torch.empty(total, dtype=torch.uint8)
    buf.fill_(1)  # every page written: mapped, and no stale bytes from an earlier measurement
    out = {}
    for name, dtype, shape, off, nbytes in layout:
        out[name] = buf[off : off + nbytes].view(dtypes[dtype]).view(shape)
    return out


def curl_usable() -> bool:
    """curl with SigV4 signing (7.75+) and parallel transfers (7.66+)."""
    try:
        res = subprocess.run(["curl", "--help", "all"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--aws-sigv4" in res.stdout and "--parallel-max" in res.stdout


def _raw_curl(job: dict) -> dict:
    """curl --parallel: N ranged GETs in flight over N connections, SigV4-signed. C, no per-byte
    work beyond recv: the least a client can spend on this. Bodies go to /dev/null, or with the
    "keep" workload to one tmpfs file per range, so that the bytes end up in fresh memory as a
    loader's must (removed after the clock)."""
    if job["workload"] == "keep":
        keep = tempfile.mkdtemp(prefix="s3bench-raw-", dir="/dev/shm")
        try:
            return _raw_curl({**job, "workload": "load", "keep_dir": keep})
        finally:
            shutil.rmtree(keep, ignore_errors=True)
    n, block, size = job["concurrency"], job["block"], job["object_size"]
    url = f"{os.environ['AWS_ENDPOINT_URL'].rstrip('/')}/{job['bucket']}/{job['key']}"
    sig = f"aws:amz:{os.environ.get('AWS_REGION', 'us-east-1')}:s3"
    user = f"{os.environ['AWS_ACCESS_KEY_ID']}:{os.environ['AWS_SECRET_ACCESS_KEY']}"
    keep = job.get("keep_dir")
    transfers = []
    for off in range(0, size, block):
        end = min(size, off + block) - 1
        output = f"{keep}/{off}" if keep else "/dev/null"
        transfers.append(
            f'url = "{url}"\nrange = "{off}-{end}"\noutput = "{output}"\n'
            f'aws-sigv4 = "{sig}"\nuser = "{user}"\nsilent\nshow-error\n'
            'write-out = "%{http_code} %{size_download}\\n"\n'
        )
    fd, cfg = tempfile.mkstemp(prefix="s3bench-curl-", suffix=".cfg")  # 0600: holds the key
    try:
        with os.fdopen(fd, "w") as f:
            f.write("next\n".join(transfers))
        cmd = ["curl", "--parallel", "--parallel-immediate", "--parallel-max", str(n), "-K", cfg]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=job.get("timeout", 300))
        seconds = time.perf_counter() - t0
    finally:
        os.unlink(cfg)
    codes = [ln.split() for ln in res.stdout.splitlines() if ln.strip()]
    got = sum(int(b) for c, b in codes if c == "206")
    bad = [c for c, _ in codes if c != "206"]
    if res.returncode != 0 or bad or len(codes) != len(transfers) or got != size:
        raise OSError(
            f"curl rc={res.returncode}, {len(bad)} non-206 of {len(codes)}/{len(transfers)}, "
            f"{got} of {size} bytes: {res.stderr.strip()[-300:]}"
        )
    return {"seconds": seconds, "bytes": got, "tensors": 0, "checksum": None}


def _raw(job: dict) -> dict:
    """N threads of ranged GETs, each body read into a reused per-thread buffer."""
    import boto3
    from botocore.config import Config

    n, block, size = job["concurrency"], job["block"], job["object_size"]
    s3 = boto3.client(
        "s3",
        config=Config(
            s3={"addressing_style": "path"},
            max_pool_connections=n + 4,
            retries={"max_attempts": 3},
        ),
    )
    ranges = [(off, min(block, size - off)) for off in range(0, size, block)]
    lock = threading.Lock()
    nxt = [0]
    done = [0]
    errors: list[BaseException] = []

    def worker() -> None:
        buf = memoryview(bytearray(block))
        try:
            while True:
                with lock:
                    if nxt[0] >= len(ranges):
                        return
                    off, length = ranges[nxt[0]]
                    nxt[0] += 1
                resp = s3.get_object(
                    Bucket=job["bucket"], Key=job["key"], Range=f"bytes={off}-{off + length - 1}"
                )
                raw = resp["Body"]._raw_stream  # urllib3 response: readinto, no new bytes
                got = 0
                while got < length:
                    k = raw.readinto(buf[got:length])
                    if not k:
                        raise OSError(f"body ended at {got} of {length} bytes")
                    got += k
                with lock:
                    done[0] += got
        except BaseException as e:
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return {"seconds": seconds, "bytes": done[0], "tensors": 0, "checksum": None}


def _runai_env(job: dict) -> None:
    os.environ["RUNAI_STREAMER_CONCURRENCY"] = str(job["concurrency"])
    os.environ["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = "0"
    os.environ.setdefault("RUNAI_STREAMER_LOG_LEVEL", "WARNING")


def measure(job: dict) -> dict:
    loader, workload = job["loader"], job["workload"]
    if loader == "raw":
        return _raw_curl(job) if job.get("client") == "curl" else _raw(job)
    uri = f"s3://{job['bucket']}/{job['key']}"
    dst = None
    if loader == "runai":
        _runai_env(job)
        from runai_model_streamer import SafetensorsStreamer
    elif loader == "fastload":
        import fastload
    elif loader == "boto3":
        import io

        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config
        from safetensors.torch import load as st_load

        s3 = boto3.client(
            "s3",
            config=Config(
                s3={"addressing_style": "path"}, max_pool_connections=job["concurrency"] + 4
            ),
        )
        cfg = TransferConfig(
            max_concurrency=job["concurrency"],
            multipart_chunksize=job["block"],
            multipart_threshold=job["block"],
            use_threads=True,
        )
    import torch  # noqa: F401 - imported before the clock by every loader

    if workload == "stream":
        dst = destination(job["layout"], job.get("dst_shm"))

    first = None
    t0 = time.perf_counter()
    if workload == "load":
        if loader == "fastload":
            tensors = fastload.load(uri, concurrency=job["concurrency"])
        elif loader == "runai":
            with SafetensorsStreamer() as s:
                s.stream_files([uri], owned=True)
                tensors = dict(s.get_tensors())
        else:  # boto3
            buf = io.BytesIO()
            s3.download_fileobj(job["bucket"], job["key"], buf, Config=cfg)
            tensors = st_load(buf.getvalue())
            del buf
        checksum = touch(tensors.values())
        seconds = time.perf_counter() - t0
        count, nbytes = len(tensors), sum(t.nbytes for t in tensors.values())
    elif workload == "stream":
        count = nbytes = 0
        if loader == "fastload":
            it = fastload.stream(uri, concurrency=job["concurrency"])
            for name, t in it:
                if first is None:
                    first = time.perf_counter() - t0
                dst[name].copy_(t)
                count += 1
                nbytes += t.nbytes
        elif loader == "runai":
            with SafetensorsStreamer() as s:
                s.stream_files([uri], owned=False)
                for name, t in s.get_tensors():
                    if first is None:
                        first = time.perf_counter() - t0
                    dst[name].copy_(t)
                    count += 1
                    nbytes += t.nbytes
        else:
            raise ValueError(f"{loader} has no stream workload")
        seconds = time.perf_counter() - t0
        checksum = touch(dst.values())
    elif workload in ("drain", "drain-warm"):
        # The raw client's work: bytes into reused memory, nothing copied. Each tensor is
        # page-touched (the checksum) and released as it arrives. drain-warm times a second
        # pass in the same process, so the loader's buffers are no longer fresh memory: what
        # a long stream (a checkpoint many times the memory limit) runs at after its start.
        def drain(tensors) -> None:
            nonlocal first, count, nbytes, checksum
            for _name, t in tensors:
                if first is None:
                    first = time.perf_counter() - t0
                checksum += touch((t,))
                count += 1
                nbytes += t.nbytes
                del t

        def one_pass() -> None:
            if loader == "fastload":
                drain(fastload.stream(uri, concurrency=job["concurrency"]))
            elif loader == "runai":
                with SafetensorsStreamer() as s:
                    s.stream_files([uri], owned=False)
                    drain(s.get_tensors())
            else:
                raise ValueError(f"{loader} has no drain workload")

        if workload == "drain-warm":
            count = nbytes = checksum = 0
            one_pass()
            t0 = time.perf_counter()
        count = nbytes = checksum = 0
        first = None
        one_pass()
        seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "bytes": nbytes,
        "tensors": count,
        "checksum": checksum,
        "first_tensor_s": first,
    }


def worker_main(arg: str) -> None:
    job = json.loads(arg)
    try:
        result = measure(job)
    except Exception as e:
        import traceback

        result = {"error": f"{type(e).__name__}: {e}"[:2000], "tb": traceback.format_exc()[-3000:]}
    sys.stdout.write("\nRESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip teardown (untimed; some native threads make it slow)


# ---------------------------------------------------------------- driver ------------------------


def make_checkpoint(size: str, out: Path) -> dict:
    cmd = [sys.executable, str(HERE / "make_checkpoint.py"), "--size", size, "--out", str(out)]
    res = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"make_checkpoint failed:\n{res.stderr[-3000:]}")
    stamp = json.loads(res.stdout.strip().splitlines()[-1])
    files = sorted(stamp["files"])
    if len(files) != 1:
        raise RuntimeError(f"expected one file, got {files}")
    stamp["path"] = os.path.join(stamp["dir"], files[0])
    return stamp


def layout_of(path: str) -> list:
    """(name, dtype, shape, offset, nbytes) of each tensor, packed with 64-byte alignment."""
    import struct

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    out, off = [], 0
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        start, end = info["data_offsets"]
        out.append((name, info["dtype"], info["shape"], off, end - start))
        off += (end - start + 63) // 64 * 64
    return out


def reference_checksum(path: str) -> tuple[int, int, int]:
    from safetensors.torch import load_file

    tensors = load_file(path)
    return touch(tensors.values()), len(tensors), sum(t.nbytes for t in tensors.values())


def run_job(job: dict, env: dict, timeout: float, log) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(job)]
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        log.write(f"--- {job['row']} TIMEOUT\n{(e.stderr or '')[-3000:]}\n")
        return {"error": f"timed out after {timeout:.0f} s"}
    log.write(f"--- {job['row']} [{job['net']}] rc={res.returncode}\n{res.stderr[-4000:]}\n")
    log.flush()
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"error": f"worker exited {res.returncode}: {res.stderr.strip()[-500:]}"}
    return json.loads(lines[-1][len("RESULT ") :])


def rows_for(args) -> list[dict]:
    spec = [("raw", "load", args.raw_concurrency, c) for c in args.raw_clients]
    if "curl" in args.raw_clients:
        spec.append(("raw", "keep", args.raw_concurrency, "curl"))
    spec += [
        ("fastload", "load", args.concurrency, None),
        ("fastload", "stream", args.stream_concurrency, None),
        ("fastload", "drain", args.stream_concurrency, None),
        ("fastload", "drain-warm", args.stream_concurrency, None),
        ("runai", "load", args.runai_concurrency, None),
        ("runai", "stream", args.runai_stream_concurrency, None),
        ("runai", "drain", args.runai_stream_concurrency, None),
        ("runai", "drain-warm", args.runai_stream_concurrency, None),
        ("boto3", "load", args.boto3_concurrency, None),
    ]
    rows = []
    for loader, workload, ns, client in spec:
        for n in ns:
            if loader == "raw":
                name = f"raw {client}" + (" keep" if workload == "keep" else "")
            else:
                name = f"{loader} {workload}"
            rows.append(
                {
                    "loader": loader,
                    "workload": workload,
                    "concurrency": n,
                    "client": client,
                    "row": f"{name} c={n}",
                }
            )
    return rows


def summarize(results: list[dict]) -> dict:
    ok = [r for r in results if "seconds" in r and not r.get("wrong")]
    out = {"runs": len(results), "ok": len(ok)}
    if ok:
        rates = [r["bytes"] / r["seconds"] / 1e9 for r in ok]
        out["gbps_median"] = statistics.median(rates)
        out["gbps_min"], out["gbps_max"] = min(rates), max(rates)
        out["seconds_median"] = statistics.median(r["seconds"] for r in ok)
        firsts = [r["first_tensor_s"] for r in ok if r.get("first_tensor_s") is not None]
        if firsts:
            out["first_tensor_ms_median"] = 1000 * statistics.median(firsts)
    bad = [r for r in results if "error" in r or r.get("wrong")]
    if bad:
        out["errors"] = sorted({r.get("error") or r.get("wrong") for r in bad})
    return out


def fmt_cell(s: dict | None) -> str:
    if not s:
        return "-"
    if "gbps_median" not in s:
        return "failed"
    cell = (
        f"**{s['gbps_median']:.3f}** ({s['gbps_min']:.3f}-{s['gbps_max']:.3f}) "
        f"{s['seconds_median']:.1f}s"
    )
    if s.get("errors"):
        cell += f" [{len(s['errors'])} failed]"
    return cell


def best(summary: dict, rows: list[dict], net: str, pred) -> tuple[float, str] | None:
    """(median GB/s, row name) of the fastest row that `pred` accepts, on network `net`."""
    cands = [
        (summary[(r["row"], net)]["gbps_median"], r["row"])
        for r in rows
        if pred(r) and "gbps_median" in summary.get((r["row"], net), {})
    ]
    return max(cands) if cands else None


DEFAULT_CONCURRENCY = 64  # fastload's default for object stores (16 for local files)


def report(summary: dict, rows: list[dict], nets: list[str], meta: dict) -> str:
    lines = [
        "# fastload on S3: local SeaweedFS, side by side",
        "",
        f"{meta['size_gb']:.2f} GB llama-like bf16 checkpoint ({meta['tensors']} tensors, one "
        f"object), {meta['reps']} round(s), each measurement in a fresh process. Network: "
        + ", ".join(f"`{n}`" for n in nets)
        + f" (`+RTT` = delaying TCP proxy, {meta['delay_ms']:g} ms each way). "
        f"SeaweedFS `weed mini` shares the {os.cpu_count()} vCPUs with the client and the proxy.",
        "",
        "Cells: GB/s median (min-max) and median seconds. load: tensors in a dict + every page "
        "touched; stream: each tensor copied into a pre-faulted destination as it arrives; "
        "drain: each tensor page-touched and released as it arrives, the raw client's work; "
        "drain-warm: the same, timing a second pass in the process (buffers no longer fresh) "
        "(first tensor ms in the last column).",
        "",
        "| row | " + " | ".join(nets) + " | first tensor ms |",
        "|---|" + "---|" * len(nets) + "---|",
    ]
    for r in rows:
        cells = [fmt_cell(summary.get((r["row"], n))) for n in nets]
        firsts = [summary.get((r["row"], n), {}).get("first_tensor_ms_median") for n in nets]
        first = " / ".join(f"{f:.0f}" for f in firsts if f is not None) or "-"
        lines.append(f"| {r['row']} | " + " | ".join(cells) + f" | {first} |")
    lines += ["", "## Ratios (medians)", ""]
    lines += ["| | " + " | ".join(nets) + " |", "|---|" + "---|" * len(nets)]

    def ratio(a, b) -> str:
        if a is None or b is None:
            return "-"
        return f"**{a[0] / b[0]:.2f}** ({a[1]} / {b[1]})"

    clients = {r["client"] for r in rows if r["loader"] == "raw"}
    for workload in ("load", "stream", "drain", "drain-warm"):
        cells = {"best fastload / best peer": [], "best fastload / raw": []}
        cells[f"fastload c={DEFAULT_CONCURRENCY} (default) / raw"] = []
        for net in nets:

            def fast(r, w=workload):
                return r["loader"] == "fastload" and r["workload"] == w

            fl = best(summary, rows, net, fast)
            default = best(
                summary, rows, net, lambda r: fast(r) and r["concurrency"] == DEFAULT_CONCURRENCY
            )
            peer = best(
                summary,
                rows,
                net,
                lambda r, w=workload: r["loader"] in ("runai", "boto3") and r["workload"] == w,
            )
            # A load keeps every byte in fresh memory: its reference is the raw client doing
            # the same (curl into tmpfs) when that row exists; stream and drain compare with
            # the raw client discarding bodies.
            raw_workload = "keep" if workload == "load" and "curl" in clients else "load"
            raw = best(
                summary,
                rows,
                net,
                lambda r, w=raw_workload: r["loader"] == "raw" and r["workload"] == w,
            )
            values = [ratio(fl, peer), ratio(fl, raw), ratio(default, raw)]
            for key, v in zip(cells, values):
                cells[key].append(v)
        for key, values in cells.items():
            lines.append(f"| {workload}: {key} | " + " | ".join(values) + " |")
    notes = [
        f"- `{row}` [{net}]: {'; '.join(s['errors'])[:300]}"
        for (row, net), s in summary.items()
        if s.get("errors")
    ]
    if notes:
        lines += ["", "Failures:", *notes]
    lines += ["", f"Command: `{meta['command']}`", ""]
    return "\n".join(lines)


def parse_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--size", default=None, help="checkpoint size (default 2GiB; --quick 256MiB)")
    ap.add_argument("--quick", action="store_true", help="256 MiB, 1 round, fewer rows")
    ap.add_argument("--reps", type=int, default=None, help="rounds (default 3; --quick 1)")
    ap.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay of the +RTT runs")
    ap.add_argument("--no-latency", action="store_true", help="skip the +RTT runs")
    # Row lists (comma-separated concurrencies); --quick has its own shorter defaults.
    ap.add_argument("--concurrency", help="fastload load rows (default 8,16,32,64; quick 16,64)")
    ap.add_argument("--stream-concurrency", help="fastload stream rows (default 16,64; quick 64)")
    ap.add_argument("--raw-concurrency", help="raw client rows (default 32,64; quick 32)")
    ap.add_argument("--runai-concurrency", help="runai load rows (default 8,32; quick 8,32)")
    ap.add_argument("--runai-stream-concurrency", help="runai stream rows (default 8; quick 8)")
    ap.add_argument("--boto3-concurrency", help="boto3 rows (default 32; quick 32)")
    ap.add_argument(
        "--raw-client",
        choices=["curl", "boto3", "both"],
        default="curl",
        help="raw ranged-GET client: curl --parallel (default; boto3 threads if curl lacks "
        "--aws-sigv4) or Python threads with boto3 get_object + readinto",
    )
    ap.add_argument(
        "--skip", default="", help="rows to leave out, comma-separated: 'runai drain-warm c=8'"
    )
    ap.add_argument("--block", default="8MiB", help="raw and boto3 part size")
    ap.add_argument("--out", default=str(HERE / "out"))
    ap.add_argument("--timeout", type=float, default=300, help="seconds per measurement")
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return

    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(HERE))
    import latency_proxy
    from make_checkpoint import parse_size
    from servers import s3 as s3_server

    quick = args.quick
    size = args.size or ("256MiB" if quick else "2GiB")
    reps = args.reps or (1 if quick else 3)
    # (full run, --quick): about 10 and 2 minutes here.
    defaults = {
        "concurrency": ("8,16,32,64", "16,64"),
        "stream_concurrency": ("16,64", "64"),
        "raw_concurrency": ("32,64", "32"),
        "runai_concurrency": ("8,32", "8,32"),
        "runai_stream_concurrency": ("8", "8"),
        "boto3_concurrency": ("32", "32"),
    }
    for name, (full, short) in defaults.items():
        value = getattr(args, name)
        setattr(args, name, parse_list(value if value else (short if quick else full)))
    args.raw_clients = ["curl", "boto3"] if args.raw_client == "both" else [args.raw_client]
    if "curl" in args.raw_clients and not curl_usable():
        print("curl without --aws-sigv4/--parallel: the raw row uses boto3 threads", flush=True)
        args.raw_clients = ["boto3"]
    block = parse_size(args.block)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    stamp = make_checkpoint(size, out / "ckpt")
    path = stamp["path"]
    object_size = os.path.getsize(path)
    layout = layout_of(path)
    ref_sum, ref_count, ref_bytes = reference_checksum(path)
    print(f"checkpoint {path}: {object_size / 1e9:.2f} GB, {ref_count} tensors", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="fastload-s3bench-"))
    server = s3_server.start_seaweed(tmp / "seaweed")
    proxy_stop = None
    shm = f"/dev/shm/fastload-s3bench-{os.getpid()}"
    try:
        t = time.monotonic()
        s3_server.upload(server.client(), s3_server.BUCKET, {KEY: Path(path)})
        print(f"uploaded in {time.monotonic() - t:.1f} s to {server.endpoint}", flush=True)
        nets = {"direct": server.endpoint}
        if not args.no_latency:
            port = int(server.endpoint.rsplit(":", 1)[1])
            pport, proxy_stop = latency_proxy.start_in_thread(
                ("127.0.0.1", port), args.delay_ms / 1000.0
            )
            nets[f"+{2 * args.delay_ms:g}ms RTT"] = f"http://127.0.0.1:{pport}"
        base_env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("AWS_", "FASTLOAD_", "RUNAI_STREAMER_"))
        }
        base_env["OMP_NUM_THREADS"] = "1"  # torch's pool made copy loops erratic on 2 vCPUs
        skip = {x.strip() for x in args.skip.split(",") if x.strip()}
        rows = [r for r in rows_for(args) if r["row"] not in skip]
        results: dict[tuple[str, str], list[dict]] = {}
        log = open(out / "s3_bench.log", "w")
        total = reps * len(rows) * len(nets)
        k = 0
        for rep in range(reps):
            order = rows[rep % len(rows) :] + rows[: rep % len(rows)]
            for net, endpoint in nets.items():
                env = dict(base_env)
                env.update(server.env())
                env["AWS_ENDPOINT_URL"] = endpoint
                for r in order:
                    k += 1
                    job = {
                        **r,
                        "net": net,
                        "bucket": s3_server.BUCKET,
                        "key": KEY,
                        "object_size": object_size,
                        "block": block,
                        "dst_shm": shm,
                        "timeout": args.timeout,
                    }
                    if r["workload"] == "stream":
                        job["layout"] = layout
                    res = run_job(job, env, args.timeout, log)
                    if "seconds" in res and r["loader"] != "raw":
                        if (res["checksum"], res["tensors"], res["bytes"]) != (
                            ref_sum,
                            ref_count,
                            ref_bytes,
                        ):
                            res["wrong"] = "WRONG DATA (checksum, count or bytes differ)"
                    results.setdefault((r["row"], net), []).append(res)
                    rate = (
                        f"{res['bytes'] / res['seconds'] / 1e9:.3f} GB/s in {res['seconds']:.1f}s"
                        if "seconds" in res
                        else res.get("error", "?")
                    )
                    print(
                        f"[{k}/{total}] round {rep + 1} {net:>12} {r['row']:<26} {rate}"
                        + (f" {res['wrong']}" if res.get("wrong") else ""),
                        flush=True,
                    )
        log.close()
    finally:
        if proxy_stop is not None:
            proxy_stop.set()
        server.stop()
        try:
            os.unlink(shm)
        except OSError:
            pass
        shutil.rmtree(tmp, ignore_errors=True)

    summary = {key: summarize(v) for key, v in results.items()}
    net_names = list(nets)
    meta = {
        "size_gb": ref_bytes / 1e9,
        "object_bytes": object_size,
        "tensors": ref_count,
        "reps": reps,
        "delay_ms": args.delay_ms,
        "command": "python benches/s3_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "wall_s": time.monotonic() - started,
    }
    md = report(summary, rows, net_names, meta)
    (out / "s3_results.md").write_text(md)
    (out / "s3_results.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "networks": nets,
                "rows": rows,
                "summary": [{"row": r, "net": n, **s} for (r, n), s in summary.items()],
                "runs": [{"row": r, "net": n, "results": v} for (r, n), v in results.items()],
            },
            indent=1,
        )
    )
    print()
    print(md)
    print(f"({meta['wall_s']:.0f} s; written to {out / 's3_results.md'} and .json)")


if __name__ == "__main__":
    main()
