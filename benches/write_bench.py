"""fastload.save_file against safetensors' save_file, locally and to S3 (a local SeaweedFS).

    python benches/write_bench.py                    # 256 MiB state dict, 3 rounds (~1 min)
    python benches/write_bench.py --size 2GiB        # the issue's size
    python benches/write_bench.py --no-s3 --reps 5
    python benches/write_bench.py --no-s3 --fresh --size 512MiB --reps 9   # fresh processes
    python benches/write_bench.py --reps 1 --copy-size 64MiB   # once, with the copy rows
    python benches/write_bench.py --size 2GiB --reps 1 --warmup 0 --rtt-ms 0,20 \
        --copy-size 1GiB --hub-rate 100MiB      # the issue's table

Rows, each timed in this process with rounds interleaved (order rotated each round), after one
untimed warm-up round:

- local: `fastload.save_file(tensors, path)` (temporary file, fsync, rename) against
  `safetensors.torch.save_file(tensors, path)` followed by an fsync of the file, so both end with
  the bytes on disk. The destination folder is `--dir` (default: a temporary folder on the disk
  of benches/out/), the file removed between runs. With `--fresh` each local run is a process
  of its own, which makes the state dict and imports torch and its writer (fastload, or
  safetensors) before its clock, then times one save: a script's one save, which pays for
  first-touch memory and its writer's cold start as a user's does.
- s3: `fastload.save_file(tensors, "s3://...")` (parallel multipart upload straight from the
  tensors' memory) against `save_file` to a local file then boto3's `upload_file` (multipart,
  16 MiB parts, 10 threads), the way a checkpoint reaches a bucket today, and against a raw
  parallel multipart client: the file's bytes already in memory (`safetensors.torch.save`,
  untimed), then `create_multipart_upload`, 16 MiB `upload_part` calls from a pool of
  `--raw-threads` threads (32), `complete_multipart_upload`: what the link and the server allow
  with no serialisation at all. SeaweedFS runs on 127.0.0.1 (tests/servers/s3.py) and shares the
  VM's cores with the client: compare rows of one run only. `--rtt-ms 0,20` repeats the S3 rows
  through a delaying TCP proxy (benches/latency_proxy.py, in its own process: half the round
  trip each way); the object is deleted and SeaweedFS's volumes vacuumed after each upload, so a
  2 GiB run does not fill the disk.

- copy: `fastload.copy("hf://org/bench", "s3://.../")` (each file read once in ranged parallel
  GETs from the mock Hub, uploaded in parallel parts, sha256 checked in flight) against
  huggingface_hub's `snapshot_download` into a fresh cache then boto3's `upload_file` of each file
  (the seeds' `hf download` + `aws s3 sync`). The mock Hub (tests/servers/hub.py) serves a model
  folder of `--copy-size` bytes (one safetensors file, or `--copy-files` shards and an index,
  plus config files) from its own process,
  at `--hub-rate` bytes/s (0: unlimited); the destination prefix is emptied between runs. With a
  rate, the table also gives each copy's time against the Hub link's wire time (folder bytes /
  rate), the issue's "slower link".

Cells are GB/s of tensor bytes (1e9 B/s): median (min-max) over rounds; the ratio is fastload's
median over the peer's. Results are printed and written to benches/out/write_results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

MiB = 1 << 20


def state_dict(size: int):
    """A llama-like mix: large bf16 matrices and a few small fp32 norms, `size` bytes in all."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = {}
    layer = 32 * MiB
    i = 0
    while size > 0:
        n = min(layer, size)
        out[f"model.layers.{i}.mlp.weight"] = torch.randn(n // 2, generator=g).to(torch.bfloat16)
        out[f"model.layers.{i}.norm.weight"] = torch.ones(1024)
        size -= n
        i += 1
    return out


def nbytes(tensors) -> int:
    return sum(t.nbytes for t in tensors.values())


def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fresh_save(writer: str, size: int, dest: str) -> float:
    """Seconds of one local save by `writer` in a process of its own (see `--fresh`)."""
    import subprocess

    cmd = [sys.executable, __file__, "--child", writer, "--size", str(size), "--dest", dest]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(out.split()[-1])


def child(writer: str, size: int, dest: str) -> None:
    """The `--fresh` process: everything imported and made before the clock, one save timed."""
    import torch  # noqa: F401  (both writers' processes import it before the clock)

    tensors = state_dict(size)
    if writer == "fastload":
        import fastload

        def save() -> None:
            fastload.save_file(tensors, dest)
    else:
        from safetensors.torch import save_file

        def save() -> None:
            save_file(tensors, dest)
            fsync(dest)

    start = time.perf_counter()
    save()
    print(time.perf_counter() - start)


def summary(rates: list[float]) -> str:
    return f"{statistics.median(rates):.2f} ({min(rates):.2f}-{max(rates):.2f})"


def raw_multipart(client, bucket: str, key: str, blob: bytes, part: int, threads: int) -> None:
    """`blob` up as one object: parts of `part` bytes from a pool of `threads` threads."""
    from concurrent.futures import ThreadPoolExecutor

    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    view = memoryview(blob)

    def one(n: int) -> dict:
        body = view[n * part : (n + 1) * part].tobytes()
        got = client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload, PartNumber=n + 1, Body=body
        )
        return {"PartNumber": n + 1, "ETag": got["ETag"]}

    try:
        with ThreadPoolExecutor(threads) as pool:
            parts = list(pool.map(one, range(-(-len(blob) // part))))
        client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
        )
    except BaseException:
        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
        raise


def delay_line(port: int, rtt_ms: float):
    """A delaying proxy in front of 127.0.0.1:`port` in its own process: (endpoint, process)."""
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, str(HERE / "latency_proxy.py"), "--target", f"127.0.0.1:{port}",
         "--delay-ms", str(rtt_ms / 2)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    line = proc.stdout.readline().split()
    if line[:1] != ["PORT"]:
        proc.kill()
        raise RuntimeError(f"latency proxy did not start: {line}")
    return f"http://127.0.0.1:{line[1]}", proc


def vacuum(server) -> None:
    """Has SeaweedFS reclaim the space of deleted objects now (it would keep it for a while)."""
    import urllib.request

    args = server.proc.args if server.proc is not None else []
    port = next((a.split("=", 1)[1] for a in args if a.startswith("-master.port=")), None)
    if port is not None:
        url = f"http://127.0.0.1:{port}/vol/vacuum?garbageThreshold=0.0001"
        urllib.request.urlopen(url, timeout=120).read()


def copy_rows(args, client, bucket: str, transfer, server):
    """The copy rows: a mock Hub in its own process serving a model folder, and the two ways of
    putting that folder into the bucket. Returns (jobs, bytes of the folder, the Hub process,
    the Hub's folder)."""
    import subprocess

    import fastload

    size = fastload._fastload.parse_size(args.copy_size)
    src = Path(tempfile.mkdtemp(prefix="write-bench-hub-"))
    if args.copy_files <= 1:
        (src / "model.safetensors").write_bytes(os.urandom(size))
    else:  # shards of equal size and their index, as a sharded Hub repo holds them
        n = args.copy_files
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for name in names:
            (src / name).write_bytes(os.urandom(size // n))
        index = {"metadata": {}, "weight_map": {f"w{i}": name for i, name in enumerate(names)}}
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        (src / name).write_bytes(b'{"bench": true}')
    folder_bytes = sum(p.stat().st_size for p in src.iterdir())
    rate = str(fastload._fastload.parse_size(args.hub_rate)) if args.hub_rate != "0" else "0"
    proc = subprocess.Popen(
        [sys.executable, "-m", "servers.hub", "--dir", str(src),
         "--rate", rate],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
    )  # fmt: skip
    base = proc.stdout.readline().strip()
    os.environ["HF_ENDPOINT"] = base
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    prefix = "bench-copy/"

    def empty() -> None:
        listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
        if listed:
            keys = [{"Key": o["Key"]} for o in listed]
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})

    def ours_copy() -> None:
        empty()
        fastload.copy(
            "hf://org/bench",
            f"s3://{bucket}/{prefix}",
            block_size=args.copy_block_size,
            progress=False,
        )

    def theirs_copy() -> None:
        empty()
        import huggingface_hub

        cache = tempfile.mkdtemp(prefix="write-bench-snap-")
        try:
            local = huggingface_hub.snapshot_download("org/bench", cache_dir=cache, endpoint=base)
            for p in Path(local).rglob("*"):
                if p.is_file():
                    key = prefix + str(p.relative_to(local))
                    client.upload_file(str(p), bucket, key, Config=transfer)
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    def tidy() -> None:
        empty()
        vacuum(server)

    jobs = [
        ("copy", "fastload copy", ours_copy, tidy),
        ("copy", "snapshot_download+boto3", theirs_copy, tidy),
    ]
    return jobs, folder_bytes, proc, src


def main() -> None:
    import fastload
    from safetensors.torch import save_file

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="256MiB", help="bytes of tensors (default 256MiB)")
    ap.add_argument("--reps", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--dir", default=None, help="local destination folder")
    ap.add_argument("--no-s3", action="store_true", help="local rows only")
    ap.add_argument("--copy-size", default="64MiB", help="bytes of the copied model (64MiB)")
    ap.add_argument("--hub-rate", default="0", help="mock Hub storage bytes/s (0: unlimited)")
    ap.add_argument("--no-copy", action="store_true", help="no copy rows")
    ap.add_argument("--copy-block-size", default=None, help="fastload.copy's block_size")
    ap.add_argument("--copy-files", type=int, default=1, help="shards of the copied model (1)")
    ap.add_argument("--rtt-ms", default="0", help="S3 round trips to measure, e.g. 0,20 (ms)")
    ap.add_argument("--raw-threads", type=int, default=32, help="raw multipart client's threads")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    ap.add_argument("--fresh", action="store_true", help="each local run in a fresh process")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dest", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, int(args.size), args.dest)
        return

    size = fastload._fastload.parse_size(args.size)
    tensors = state_dict(size)
    total = nbytes(tensors)
    out_dir = HERE / "out"
    out_dir.mkdir(exist_ok=True)
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(dir=out_dir, prefix="write-"))
    folder.mkdir(parents=True, exist_ok=True)
    dest = str(folder / "model.safetensors")

    def clean() -> None:
        if os.path.exists(dest):
            os.remove(dest)

    def ours_local() -> float | None:
        if args.fresh:
            return fresh_save("fastload", size, dest)
        fastload.save_file(tensors, dest)
        return None

    def theirs_local() -> float | None:
        if args.fresh:
            return fresh_save("safetensors", size, dest)
        save_file(tensors, dest)
        fsync(dest)
        return None

    rows: dict[str, dict[str, object]] = {}
    jobs = [
        ("local", "fastload", ours_local, clean),
        ("local", "safetensors+fsync", theirs_local, clean),
    ]
    delay_procs: list = []

    server = None
    hub_proc = None
    copy_bytes = 0
    # Folders the run makes for its servers (SeaweedFS's data, the mock Hub's files): removed
    # at the end, as the written files are (each holds a copy of every round's bytes).
    scratch: list[Path] = []
    if not args.no_s3:
        from servers import s3 as s3_server

        if s3_server.find_weed() is None:
            print("SeaweedFS `weed` not found: S3 rows skipped", file=sys.stderr)
        else:
            root = Path(tempfile.mkdtemp(prefix="write-bench-weed-"))
            scratch.append(root)
            server = s3_server.start_seaweed(root)
            client = server.client()
            if s3_server.BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
                client.create_bucket(Bucket=s3_server.BUCKET)
            for k, v in server.env().items():
                os.environ[k] = v
            key = "bench/model.safetensors"
            uri = f"s3://{s3_server.BUCKET}/{key}"
            from boto3.s3.transfer import TransferConfig
            from safetensors.torch import save as save_bytes

            transfer = TransferConfig(
                multipart_threshold=16 * MiB, multipart_chunksize=16 * MiB, max_concurrency=10
            )
            blob = save_bytes(tensors)  # the raw client's input, made once, untimed
            s3_port = int(server.endpoint.rsplit(":", 1)[1])

            def s3_jobs(where: str, endpoint: str):
                c = s3_server.client(endpoint)
                opts = {"endpoint": endpoint}

                def reclaim() -> None:
                    c.delete_object(Bucket=s3_server.BUCKET, Key=key)
                    vacuum(server)

                def ours_s3() -> None:
                    fastload.save_file(tensors, uri, overwrite=True, storage_options=opts)

                def theirs_s3() -> None:
                    save_file(tensors, dest)
                    c.upload_file(dest, s3_server.BUCKET, key, Config=transfer)
                    os.remove(dest)

                def raw_s3() -> None:
                    raw_multipart(c, s3_server.BUCKET, key, blob, 16 * MiB, args.raw_threads)

                return [
                    (where, "fastload", ours_s3, reclaim),
                    (where, "save_file+boto3", theirs_s3, reclaim),
                    (where, "raw multipart", raw_s3, reclaim),
                ]

            for rtt in [float(x) for x in args.rtt_ms.split(",") if x.strip()]:
                if rtt == 0:
                    jobs += s3_jobs("s3", server.endpoint)
                else:
                    endpoint, proxy = delay_line(s3_port, rtt)
                    delay_procs.append(proxy)
                    jobs += s3_jobs(f"s3 +{rtt:g}ms RTT", endpoint)
            if not args.no_copy:
                copy_jobs, copy_bytes, hub_proc, hub_dir = copy_rows(
                    args, client, s3_server.BUCKET, transfer, server
                )
                scratch.append(hub_dir)
                jobs += copy_jobs

    times: dict[tuple[str, str], list[float]] = {(w, n): [] for w, n, _, _ in jobs}
    try:
        # Negative rounds warm up (page cache, connections), untimed.
        for r in range(-args.warmup, args.reps):
            order = jobs[r % len(jobs) :] + jobs[: r % len(jobs)]
            for where, name, fn, after in order:
                clean()
                start = time.perf_counter()
                took = fn()  # a fresh process's own clock, or None: this one's
                if r >= 0:
                    times[(where, name)].append(took or time.perf_counter() - start)
                    print(f"{where} | {name}: {times[(where, name)][-1]:.2f} s", flush=True)
                after()
        clean()
    finally:
        for p in delay_procs:
            p.kill()
        if hub_proc is not None:
            hub_proc.stdin.close()
            hub_proc.wait(timeout=30)
        if server is not None:
            server.stop()
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
        for path in scratch:
            shutil.rmtree(path, ignore_errors=True)

    how = ", each local run a fresh process" if args.fresh else ""
    print(f"save_file of {total / 1e9:.3f} GB ({len(tensors)} tensors), {args.reps} rounds{how}")
    print("| where | writer | GB/s median (min-max) | fastload vs this row |")
    print("|---|---|---|---|")
    wheres = list(dict.fromkeys(w for w, _ in times))
    for where in wheres:
        names = [n for w, n in times if w == where]
        size = copy_bytes if where == "copy" else total
        if where == "copy":
            print(f"copy of a {size / 1e9:.3f} GB model folder, hf:// (mock Hub) to s3://")
        rates = {n: [size / t / 1e9 for t in times[(where, n)]] for n in names}
        ours = statistics.median(rates[names[0]])
        for n in names:
            # fastload's row against each peer: fastload's median rate / the peer's.
            ratio = ours / statistics.median(rates[n])
            print(f"| {where} | {n} | {summary(rates[n])} | {ratio:.2f}x |")
            rows[f"{where}/{n}"] = {"gb_per_s": rates[n], "fastload_vs": ratio}
        if where == "copy" and args.hub_rate != "0":
            wire = size / fastload._fastload.parse_size(args.hub_rate)
            for n in names:
                t = statistics.median(times[(where, n)])
                print(f"  {n}: {t:.2f} s = {t / wire:.2f}x the Hub link's wire time ({wire:.2f} s)")
    (out_dir / "write_results.json").write_text(
        json.dumps({"bytes": total, "reps": args.reps, "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
