"""Tensor-parallel loading: what each rank reads, holds and waits for, reading only its shards
(fastload's ``parts=`` and ``fastload.transformers`` with ``tp_plan="auto"``) against reading
whole tensors, on one llama-like checkpoint served by a counting HTTP server (and SeaweedFS),
each optionally behind the delay line (benches/latency_proxy.py).

    python benches/tp_bench.py --layers 4 --hidden 512 --delay-ms 0,10 --sources local,http,s3

Per row and source, each rank is a fresh process (a ``torchrun`` group of ``--world`` ranks):
- bytes read by the rank (fastload's own count of the bytes it planned and read; for transformers'
  own loader, which reads local files through mmap, not counted), and the bytes the HTTP server
  sent for the weights over all ranks (its log: every ranged GET, header probes included), as a
  multiple of the checkpoint;
- host peak: the rank's peak RSS (VmHWM) and its RSS before the call (torch and transformers
  imported), so the difference is what the load held;
- time to ready: from the call to the tensors (every page of them read: a local file's mapped
  pages fault in inside the clock) or the sharded model in memory, the slowest rank.

Rows (``ROWS``; ``--rows`` picks some):
- ``parts``: ``fastload.load(uri, parts=...)``, each rank its Megatron-style shards (q/k/v, gate/up,
  embeddings and lm_head by rows; o_proj and down_proj by columns; norms whole): a generic plan
  from the tensor names (``llama_parts``), no model code.
- ``whole``: ``fastload.load(uri)`` on every rank: every tensor whole (what a rank reads when the
  loader hands whole tensors to a ``weight_loader`` that narrows them).
- ``tf-tp``: ``fastload.transformers.from_pretrained(AutoModelForCausalLM, uri, tp_plan="auto")``:
  transformers shards on read, indexing fastload slices (each rank reads its shards only).
- ``tf-tp-whole``: the same call with fastload handing transformers whole tensors (its state dict
  read whole, as before tensor-parallel slicing; transformers shards them in memory).
- ``tf-tp-own``: transformers' own ``from_pretrained(folder, tp_plan="auto")`` (safetensors'
  ``get_slice`` on mmapped files): local source only.

Adding a row (vLLM at TP 1/2/4 and PP 2 with ``--load-format fastload``, ``safetensors``,
``runai_streamer``): a function ``(job) -> dict`` in ``ROWS`` that runs on each rank and returns
``seconds``, ``bytes_read`` (or None) and whatever else it measures (the worker adds the memory
figures); ``job`` has ``uri``, ``folder``, ``rank``, ``world``, ``source``. A row that starts its
own workers (a vLLM engine starts one per rank itself) sets ``"launch": "single"`` in
``LAUNCH`` to run in one process, and reports per-rank figures as a list under ``ranks``.

Prints a markdown table and writes benches/out/tp_bench.json and tp_bench.md. A debug build of
fastload is refused unless --allow-debug-build (its HTTP path is several times slower).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


# -- the plan of a rank's shards (the parts row) -----------------------------------------------

_ROWS_SPLIT = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj|embed_tokens|lm_head)\.weight$")
_COLS_SPLIT = re.compile(r"(o_proj|down_proj)\.weight$")


def _chunk(n: int, rank: int, world: int) -> slice:
    """torch's ``Shard`` chunk: ``ceil(n / world)`` each, the last ones short or empty."""
    size = math.ceil(n / world)
    return slice(min(rank * size, n), min((rank + 1) * size, n))


def llama_parts(tensors: list[dict], rank: int, world: int) -> dict[str, tuple]:
    """``parts=`` for one rank of a llama-like checkpoint (``fastload.inspect``'s tensors)."""
    parts: dict[str, tuple] = {}
    for t in tensors:
        shape = t["shape"]
        if len(shape) == 2 and _ROWS_SPLIT.search(t["name"]):
            parts[t["name"]] = (_chunk(shape[0], rank, world),)
        elif len(shape) == 2 and _COLS_SPLIT.search(t["name"]):
            parts[t["name"]] = (slice(None), _chunk(shape[1], rank, world))
    return parts


# -- rows: each runs on one rank ----------------------------------------------------------------


def _storage_options(job: dict) -> dict | None:
    return job.get("storage_options")


def _file(job: dict) -> str:
    """The weights file (plain HTTP lists no prefix; fastload.transformers reads the index or
    ``model.safetensors`` under ``uri`` itself)."""
    uri = job["uri"]
    return uri + "model.safetensors" if uri.endswith("/") else uri


def touch(tensors) -> None:
    """Every page of every tensor read (a mapped file's pages fault in here), inside the clock."""
    from fastload._peers import touch as touch_pages

    touch_pages(list(tensors))


def _streamed(job: dict, **kwargs) -> tuple[dict, dict]:
    """``fastload.stream`` of the job's file (``kwargs``: its options), every page touched: the
    row's figures, and the stream's stats."""
    import fastload

    start = time.perf_counter()
    with fastload.stream(_file(job), storage_options=_storage_options(job), **kwargs) as s:
        got = dict(s)
        stats = s.stats()
    touch(got.values())
    row = {
        "seconds": time.perf_counter() - start,
        "bytes_read": stats["bytes_read"],
        "tensors": len(got),
    }
    return row, stats


def row_parts(job: dict) -> dict:
    import fastload

    tensors = fastload.inspect(_file(job), storage_options=_storage_options(job))["tensors"]
    parts = llama_parts(tensors, job["rank"], job["world"])
    row, stats = _streamed(job, parts=parts)
    return {**row, "part_bytes": stats["part_bytes"], "whole_bytes": stats["whole_bytes"]}


def row_whole(job: dict) -> dict:
    return _streamed(job)[0]


def _tf_tp(job: dict, slices: bool) -> dict:
    import fastload.transformers
    from transformers import AutoModelForCausalLM

    if not slices:
        # Whole tensors: the state dict read whole and sharded by transformers in memory.
        fastload.transformers._tensor_parallel = lambda kwargs: False
    kw = {}
    if job.get("storage_options"):
        kw["storage_options"] = job["storage_options"]
    start = time.perf_counter()
    model = fastload.transformers.from_pretrained(
        AutoModelForCausalLM, job["uri"], tp_plan="auto", **kw
    )
    seconds = time.perf_counter() - start
    stats = getattr(model, "_fastload_stats", None)
    read = (stats["part_bytes"] + stats["whole_bytes"]) if stats else job["weights"]
    return {"seconds": seconds, "bytes_read": read}


def row_tf_tp(job: dict) -> dict:
    return _tf_tp(job, slices=True)


def row_tf_tp_whole(job: dict) -> dict:
    return _tf_tp(job, slices=False)


def row_tf_tp_own(job: dict) -> dict:
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(job["folder"], tp_plan="auto")
    return {"seconds": time.perf_counter() - start, "bytes_read": None}


ROWS = {
    "parts": row_parts,
    "whole": row_whole,
    "tf-tp": row_tf_tp,
    "tf-tp-whole": row_tf_tp_whole,
    "tf-tp-own": row_tf_tp_own,
}
# Rows that need a torch.distributed group (the others only read RANK and WORLD_SIZE).
NEEDS_GROUP = {"tf-tp", "tf-tp-whole", "tf-tp-own"}
# Rows that read local files only.
LOCAL_ONLY = {"tf-tp-own"}
# How a row is launched: "ranks" (a torchrun group, the row on each rank) or "single".
LAUNCH: dict[str, str] = {}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def worker(job_path: str, out_dir: str) -> None:
    job = json.loads(Path(job_path).read_text())
    job["rank"] = int(os.environ.get("RANK", "0"))
    job["world"] = int(os.environ.get("WORLD_SIZE", "1"))
    # Imported before the clock and the base RSS (as a server would have them imported).
    import fastload  # noqa: F401
    import torch  # noqa: F401

    if job["row"] in NEEDS_GROUP:
        import transformers  # noqa: F401
    base = _status("VmRSS:")
    try:
        result = ROWS[job["row"]](job)
    except Exception as e:  # reported in the table
        result = {"error": f"{type(e).__name__}: {e}"[:300]}
    result.update(rank=job["rank"], base_rss=base, peak_rss=_status("VmHWM:"))
    Path(out_dir, f"rank{job['rank']}.json").write_text(json.dumps(result))


# -- the driver -----------------------------------------------------------------------------------


def make_checkpoint(folder: Path, args) -> Path:
    """A random llama (``--layers``, ``--hidden``, ...) saved by transformers, reused when its
    config matches."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or int(args.hidden * 2.75) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=max(args.hidden // 64, 1),
        num_key_value_heads=max(args.hidden // 128, 1),
        tie_word_embeddings=False,
    )
    stamp = folder / "bench-config.json"
    want = json.dumps(config.to_dict(), sort_keys=True, default=str)
    if stamp.exists() and stamp.read_text() == want:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    stamp.write_text(want)
    return folder


def run_row(job: dict, world: int, tmp: Path, timeout: float) -> list[dict]:
    """Runs ``job`` on ``world`` ranks (a torchrun group); each rank's result."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    (out / "job.json").write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTLOAD_", "TORCH"))}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **job.get("env", {}))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        __file__,
        "--worker",
        str(out / "job.json"),
        str(out),
    ]
    try:
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=out
        )
        failed = done.returncode != 0 and (done.stderr[-400:] or done.stdout[-400:])
    except subprocess.TimeoutExpired:
        failed = f"timed out after {timeout:.0f} s"
    ranks = []
    for r in range(world):
        p = out / f"rank{r}.json"
        ranks.append(json.loads(p.read_text()) if p.exists() else {"error": failed or "no result"})
    return ranks


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def table(results: list[dict], weights: int) -> str:
    lines = [
        "| source | row | ranks | bytes read per rank (MiB) | server bytes / checkpoint | "
        "host peak per rank (MiB, over base) | time to ready (s, slowest rank) |",
        "|---|---|---|---|---|---|---|",
    ]
    for res in results:
        ranks = res["ranks"]
        errors = [r["error"] for r in ranks if "error" in r]
        if errors:
            cells = [f"error: {errors[0][:80]}", "", "", ""]
        else:
            read = [r.get("bytes_read") for r in ranks]
            served = res.get("served")
            cells = [
                " / ".join(_mib(b) for b in read),
                "-" if served is None else f"{served / weights:.2f}x",
                " / ".join(_mib(r["peak_rss"] - r["base_rss"]) for r in ranks),
                f"{max(r['seconds'] for r in ranks):.2f}",
            ]
        lines.append(
            f"| {res['source']} | {res['row']} | {len(ranks)} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=0, help="default 2.75 x hidden")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--world", type=int, default=2, help="ranks (tensor parallel size)")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--sources", default="local,http", help="local, http, s3 (SeaweedFS)")
    ap.add_argument("--delay-ms", default="0", help="one-way delays for http/s3, e.g. 0,10")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=str(ROOT / "benches" / "out"))
    ap.add_argument("--allow-debug-build", action="store_true")
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return

    import fastload
    from transformers_bench import is_debug_build

    if is_debug_build(Path(fastload._fastload.__file__)) and not args.allow_debug_build:
        sys.exit(
            f"{fastload._fastload.__file__} is a debug build: build with `maturin develop "
            "--release` (or pass --allow-debug-build)"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = make_checkpoint(out / "tp-ckpt", args)
    weights = (folder / "model.safetensors").stat().st_size
    print(f"checkpoint {folder}: {weights / 2**20:.1f} MiB", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="fastload-tpbench-"))
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    delays = [float(d) for d in args.delay_ms.split(",")]
    stops = []
    results: list[dict] = []
    try:
        sources: list[tuple[str, dict, object]] = []  # (name, job fields, counting server)
        wanted = [s.strip() for s in args.sources.split(",")]
        if "local" in wanted:
            sources.append(("local", {"uri": str(folder)}, None))
        if "http" in wanted:
            from servers import http as http_server

            server = http_server.start_server({})
            stops.append(server.close)
            server.put({f"m/{p.name}": p for p in folder.iterdir() if p.is_file()})
            for d in delays:
                url = server.url("m/")
                if d:
                    import latency_proxy

                    port, stop = latency_proxy.start_in_thread(
                        ("127.0.0.1", int(url.split(":")[2].split("/")[0])), d / 1000
                    )
                    stops.append(stop.set)
                    url = f"http://127.0.0.1:{port}/m/"
                sources.append((f"http +{2 * d:g} ms RTT" if d else "http", {"uri": url}, server))
        if "s3" in wanted:
            from servers import s3 as s3_server

            weed = s3_server.start_seaweed(tmp / "seaweed")
            stops.append(weed.stop)
            s3_server.upload(
                weed.client(),
                s3_server.BUCKET,
                {f"m/{p.name}": p for p in folder.iterdir() if p.is_file()},
            )
            for d in delays:
                endpoint = weed.endpoint
                if d:
                    import latency_proxy

                    port, stop = latency_proxy.start_in_thread(
                        ("127.0.0.1", int(endpoint.rsplit(":", 1)[1])), d / 1000
                    )
                    stops.append(stop.set)
                    endpoint = f"http://127.0.0.1:{port}"
                opts = {**weed.storage_options(), "endpoint": endpoint}
                job = {"uri": f"s3://{s3_server.BUCKET}/m/", "storage_options": opts}
                sources.append((f"s3 +{2 * d:g} ms RTT" if d else "s3", job, None))
        for name, fields, server in sources:
            for row in rows:
                if row in LOCAL_ONLY and name != "local":
                    continue
                job = {"row": row, "source": name, "folder": str(folder), "weights": weights}
                job.update(fields)
                since = len(server.behaviour.log) if server is not None else 0
                ranks = run_row(job, args.world, tmp, args.timeout)
                served = None
                if server is not None:
                    served = _served(server.behaviour.log[since:], "/m/model.safetensors")
                res = {"source": name, "row": row, "ranks": ranks, "served": served}
                results.append(res)
                print(table([res], weights).splitlines()[-1], flush=True)
    finally:
        for stop in reversed(stops):
            try:
                stop()
            except Exception:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
    md = (
        f"Checkpoint: llama-like, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
        f"bf16, one file of {weights / 2**20:.1f} MiB; {args.world} ranks on "
        f"{os.cpu_count()} vCPUs.\n\n" + table(results, weights)
    )
    print("\n" + md)
    (out / "tp_bench.md").write_text(md + "\n")
    meta = {"weights": weights, "args": {k: v for k, v in vars(args).items() if k != "worker"}}
    (out / "tp_bench.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))


def _served(log: list, path: str) -> int:
    total = 0
    for method, p, rng, status in log:
        if method == "GET" and p == path and rng and status == 206:
            a, b = rng.removeprefix("bytes=").split("-")
            total += int(b) - int(a) + 1
    return total


if __name__ == "__main__":
    main()
