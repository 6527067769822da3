"""Tensor-parallel loading: what each rank reads, holds and waits for, reading only its shards
(fastload's ``parts=`` and ``fastload.transformers`` with ``tp_plan="auto"``) against reading
whole tensors, on one llama-like checkpoint served by a counting HTTP server (and SeaweedFS),
each optionally behind the delay line (benches/latency_proxy.py).

    python benches/tp_bench.py --layers 4 --hidden 512 --delay-ms 0,10 --sources local,http,s3
    python benches/tp_bench.py --rows vllm,vllm-whole,vllm-safetensors,vllm-runai \
        --parallel tp1,tp2,pp2 --sources local,http

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

vLLM rows (each an engine, ``vllm.LLM`` in .venv-vllm with ``--parallel`` tpN/ppN, vLLM's own
``mp`` workers, one core each; ``--model moe``: a Mixtral, its TP rows with expert parallelism):
- ``vllm``: ``--load-format fastload`` (``slices: true``: lazy tensors, each worker reads what
  its weight loaders keep), from the folder, or ``weights_uri`` on the HTTP server or S3;
- ``vllm-whole``: the same with ``slices: false`` (every worker streams every tensor whole);
- ``vllm-safetensors``: vLLM's own loader (mmapped local files; bytes not counted);
- ``vllm-runai``: vLLM's ``runai_streamer`` (local files, and S3 where it reads the model
  itself; bytes not counted per worker: the delay line counts what SeaweedFS sent).
Their time to ready is each worker's ``BaseModelLoader.load_model`` (the model built, its weights
loaded and processed; timed by benches/vllm_site), their host peak the worker's whole peak RSS
(engine included: no base subtracted), bytes per rank fastload's sliced-read log line.
``TP_BENCH_PROFILE=DIR`` profiles each worker's ``load_model`` into ``DIR`` (benches/vllm_site).

Adding a row: a function ``(job) -> dict`` in ``ROWS`` that runs on each rank and returns
``seconds``, ``bytes_read`` (or None) and whatever else it measures (the worker adds the memory
figures); ``job`` has ``uri``, ``folder``, ``rank``, ``world``, ``source``.

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
from typing import Any

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
    # A rank's reads: its parts, its whole tensors and its row blocks of exchanged weights.
    read = (
        sum(stats.get(k, 0) for k in ("part_bytes", "whole_bytes", "exchanged_bytes"))
        if stats
        else job["weights"]
    )
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


# -- vLLM rows: one engine per row, started in .venv-vllm (vLLM starts a worker per rank) -----

VLLM_PYTHON = Path(os.environ.get("FASTLOAD_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"
# load format and model_loader_extra_config of each vLLM row
VLLM_ROWS = {
    "vllm": ("fastload", {"slices": True}),
    "vllm-whole": ("fastload", {"slices": False}),
    "vllm-safetensors": ("safetensors", None),
    "vllm-runai": ("runai_streamer", None),
}
# Sources each reads: vLLM's safetensors loader reads local files, runai_streamer local files
# and object stores.
VLLM_SOURCES = {"vllm-safetensors": ("local",), "vllm-runai": ("local", "s3")}
_LOAD_LINE = re.compile(r"tp_bench: rank (\d+) load_model took ([0-9.]+) s")
_SLICED_LINE = re.compile(
    r"fastload sliced reads on tp rank (\d+)/(\d+), pp rank (\d+)/(\d+): read (\d+) of"
)


def _peak(worker=None) -> dict:
    """Runs in each vLLM worker: its peak and current RSS."""
    return {"peak_rss": _status("VmHWM:"), "rss": _status("VmRSS:")}


def vllm_worker(job_path: str, out_dir: str) -> None:
    """In .venv-vllm: starts one engine as the job says, writes each worker's peak RSS and the
    engine's start time."""
    job = json.loads(Path(job_path).read_text())
    from vllm import LLM

    load_format, extra = VLLM_ROWS[job["row"]]
    extra = dict(extra or {})
    if load_format == "fastload" and job.get("weights_uri"):
        extra["weights_uri"] = job["weights_uri"]
        if job.get("storage_options"):
            extra["storage_options"] = job["storage_options"]
    kwargs: dict = {}
    if extra:
        kwargs["model_loader_extra_config"] = extra
    world = job["tp"] * job["pp"]
    if world > 1:
        kwargs["distributed_executor_backend"] = "mp"
    if job.get("ep"):
        kwargs["enable_expert_parallel"] = True
    start = time.perf_counter()
    llm = LLM(
        model=job["model"],
        load_format=load_format,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=4,
        enforce_eager=True,
        tensor_parallel_size=job["tp"],
        pipeline_parallel_size=job["pp"],
        **kwargs,
    )
    engine = time.perf_counter() - start
    peaks = llm.collective_rpc(_peak)
    shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
    if shutdown is not None:
        shutdown()
    Path(out_dir, "engine.json").write_text(json.dumps({"engine_seconds": engine, "peaks": peaks}))


def _vllm_env(job: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTLOAD_", "AWS_", "VLLM_"))}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_LOGGING_LEVEL="INFO",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",  # collective_rpc with a function
        # One core per worker (vLLM binds its threads to a NUMA node's cores otherwise).
        VLLM_CPU_OMP_THREADS_BIND=os.environ.get(
            "VLLM_CPU_OMP_THREADS_BIND",
            "|".join(str(r % (os.cpu_count() or 1)) for r in range(job["tp"] * job["pp"])),
        ),
        AWS_EC2_METADATA_DISABLED="true",
    )
    env.pop("VLLM_PLUGINS", None)
    # AMX permission and the load timer in every process vLLM starts (benches/vllm_site), and
    # this tree's fastload.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "benches" / "vllm_site"), str(ROOT / "python"), str(ROOT / "benches")]
    )
    env["TP_BENCH_TIME_LOADS"] = "1"
    opts = job.get("storage_options")
    if opts and job["row"] == "vllm-runai":  # runai_streamer's S3 settings are the AWS ones
        env.update(
            AWS_ACCESS_KEY_ID=opts["access_key_id"],
            AWS_SECRET_ACCESS_KEY=opts["secret_access_key"],
            AWS_DEFAULT_REGION=opts["region"],
            AWS_REGION=opts["region"],
            AWS_ENDPOINT_URL=opts["endpoint"],
            RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0",
            AWS_EC2_METADATA_DISABLED="true",
        )
    return env


def run_vllm(job: dict, tmp: Path, timeout: float) -> list[dict]:
    """One engine (``job``: row, tp, pp, model, weights_uri, ...); a result per worker, ranks in
    vLLM's order (TP rank within PP stage): time to ready (its ``load_model``, timed by
    benches/vllm_site), bytes it read (fastload's sliced-read line; the checkpoint for
    ``vllm-whole``; None where not counted), peak RSS."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    (out / "job.json").write_text(json.dumps(job))
    cmd = [str(VLLM_PYTHON), __file__, "--vllm-worker", str(out / "job.json"), str(out)]
    world = job["tp"] * job["pp"]
    try:
        done = subprocess.run(
            cmd, env=_vllm_env(job), capture_output=True, text=True, timeout=timeout, cwd=out
        )
        log = done.stdout + done.stderr
        failed = done.returncode != 0 and _last_error(log)
    except subprocess.TimeoutExpired as e:
        log = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(
            errors="replace"
        )
        failed = f"timed out after {timeout:.0f} s"
    if job.get("log"):
        Path(job["log"]).write_text(log)
    engine = out / "engine.json"
    if failed or not engine.exists():
        return [{"error": failed or _last_error(log)} for _ in range(world)]
    peaks = json.loads(engine.read_text())["peaks"]
    seconds = {int(m.group(1)): float(m.group(2)) for m in _LOAD_LINE.finditer(log)}
    read: dict[int, int] = {}
    for m in _SLICED_LINE.finditer(log):
        tp_rank, tp, pp_rank = int(m.group(1)), int(m.group(2)), int(m.group(3))
        read[pp_rank * tp + tp_rank] = int(m.group(5))
    return [
        {
            "rank": r,
            "seconds": seconds.get(r, float("nan")),
            # slices off: every worker streams every tensor whole (fastload's stream, PP too).
            "bytes_read": job["weights"] if job["row"] == "vllm-whole" else read.get(r),
            "peak_rss": peaks[r]["peak_rss"] if r < len(peaks) else 0,
            "base_rss": 0,
        }
        for r in range(world)
    ]


def _last_error(log: str) -> str:
    lines = [ln for ln in log.splitlines() if "Error" in ln or "error" in ln]
    return (lines[-1] if lines else log[-300:]).strip()[:300]


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
    """A random llama (``--layers``, ``--hidden``, ...) or, with ``--model moe``, a Mixtral of
    ``--experts`` experts (2 per token), saved by transformers, reused when its config
    matches."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or int(args.hidden * 2.75) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=max(args.hidden // 64, 1),
        num_key_value_heads=max(args.hidden // 128, 1),
        tie_word_embeddings=False,
        max_position_embeddings=1024,
    )
    if args.model == "moe":
        config = MixtralConfig(**common, num_local_experts=args.experts, num_experts_per_tok=2)
        cls = MixtralForCausalLM
    else:
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    stamp = folder / "bench-config.json"
    want = json.dumps(config.to_dict(), sort_keys=True, default=str)
    if stamp.exists() and stamp.read_text() == want:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(0)
    cls(config).to(torch.bfloat16).save_pretrained(folder)
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


def _delay_line(port: str, delay_ms: float, args: Any, stops: list) -> tuple[int, Any]:
    """A delay line (benches/latency_proxy.py) in front of 127.0.0.1:``port``: ``delay_ms`` each
    way, and ``--rate-mbps``'s shared link; its port and the proxy (its relayed bytes)."""
    import latency_proxy

    rate = None if args.rate_mbps is None else args.rate_mbps * 1e6
    port_, stop = latency_proxy.start_in_thread(
        ("127.0.0.1", int(port)), delay_ms / 1000, rate=rate
    )
    stops.append(stop.set)
    return port_, stop.proxy


def _line_name(delay_ms: float, args: Any) -> str:
    """What a source's name says of its delay line."""
    name = f" +{2 * delay_ms:g} ms RTT" if delay_ms else ""
    return name + (f", {args.rate_mbps:g} MB/s link" if args.rate_mbps else "")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--vllm-worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="llama", choices=["llama", "moe"])
    ap.add_argument("--experts", type=int, default=4, help="--model moe: experts per layer")
    ap.add_argument(
        "--parallel",
        default="tp1,tp2,pp2",
        help="vLLM rows: engines to start, tpN / ppN / tpNpp2; with --model moe, tp2 runs with "
        "expert parallelism",
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=0, help="default 2.75 x hidden")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--world", type=int, default=2, help="ranks (tensor parallel size)")
    ap.add_argument("--rows", default=",".join(ROWS), help=", ".join([*ROWS, *VLLM_ROWS]))
    ap.add_argument("--sources", default="local,http", help="local, http, s3 (SeaweedFS)")
    ap.add_argument("--delay-ms", default="0", help="one-way delays for http/s3, e.g. 0,10")
    ap.add_argument(
        "--rate-mbps",
        type=float,
        default=None,
        help="MB/s of one link the delay line's replies share (all ranks: a node's card)",
    )
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=str(ROOT / "benches" / "out"))
    ap.add_argument("--allow-debug-build", action="store_true")
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return
    if args.vllm_worker:
        vllm_worker(*args.vllm_worker)
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
    folder = make_checkpoint(out / ("tp-ckpt" if args.model == "llama" else "tp-moe"), args)
    weights = (folder / "model.safetensors").stat().st_size
    print(f"checkpoint {folder}: {weights / 2**20:.1f} MiB", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="fastload-tpbench-"))
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    delays = [float(d) for d in args.delay_ms.split(",")]
    stops = []
    results: list[dict] = []
    try:
        # (name, job fields, counting server, delay line (its relayed bytes))
        sources: list[tuple[str, dict, object, object]] = []
        wanted = [s.strip() for s in args.sources.split(",")]
        if "local" in wanted:
            sources.append(("local", {"uri": str(folder), "kind": "local"}, None, None))
        if "http" in wanted:
            from servers import http as http_server

            server = http_server.start_server({})
            stops.append(server.close)
            server.put({f"m/{p.name}": p for p in folder.iterdir() if p.is_file()})
            for d in delays:
                url, line = server.url("m/"), None
                if d or args.rate_mbps:
                    port, line = _delay_line(url.split(":")[2].split("/")[0], d, args, stops)
                    url = f"http://127.0.0.1:{port}/m/"
                name = "http" + _line_name(d, args)
                sources.append((name, {"uri": url, "kind": "http"}, server, line))
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
                endpoint, line = weed.endpoint, None
                if d or args.rate_mbps:
                    port, line = _delay_line(endpoint.rsplit(":", 1)[1], d, args, stops)
                    endpoint = f"http://127.0.0.1:{port}"
                opts = {**weed.storage_options(), "endpoint": endpoint}
                job = {"uri": f"s3://{s3_server.BUCKET}/m/", "storage_options": opts, "kind": "s3"}
                sources.append(("s3" + _line_name(d, args), job, None, line))
        logs = out / "vllm-logs"
        logs.mkdir(exist_ok=True)
        for name, fields, server, line in sources:
            for row in rows:
                if row in LOCAL_ONLY and name != "local":
                    continue
                if row in VLLM_ROWS and fields["kind"] not in VLLM_SOURCES.get(
                    row, (fields["kind"],)
                ):
                    continue
                job = {"row": row, "source": name, "folder": str(folder), "weights": weights}
                job.update(fields)
                for label, extra, world in _engines(row, args):
                    job.update(extra)
                    since = len(server.behaviour.log) if server is not None else 0
                    relayed = line.bytes if line is not None else 0
                    if row in VLLM_ROWS:
                        job.update(_vllm_paths(job, fields))
                        job["log"] = str(logs / f"{row}-{label}-{name.split()[0]}.log")
                        ranks = run_vllm(job, tmp, args.timeout)
                    else:
                        ranks = run_row(job, world, tmp, args.timeout)
                    served = None
                    if server is not None:
                        served = _served(server.behaviour.log[since:], "/m/model.safetensors")
                    elif line is not None:  # what the delay line relayed (requests included)
                        served = line.bytes - relayed
                    res = {
                        "source": name,
                        "row": row + (f" {label}" if label else ""),
                        "ranks": ranks,
                        "served": served,
                    }
                    results.append(res)
                    print(table([res], weights).splitlines()[-1], flush=True)
    finally:
        for stop in reversed(stops):
            try:
                stop()
            except Exception:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
    kind = "llama-like" if args.model == "llama" else f"Mixtral-like ({args.experts} experts)"
    md = (
        f"Checkpoint: {kind}, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
        f"bf16, one file of {weights / 2**20:.1f} MiB; {args.world} ranks (torchrun rows) on "
        f"{os.cpu_count()} vCPUs.\n\n" + table(results, weights)
    )
    print("\n" + md)
    stem = "tp_bench" if args.model == "llama" else "tp_bench_moe"
    (out / f"{stem}.md").write_text(md + "\n")
    meta = {
        "weights": weights,
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "vllm_worker")},
    }
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))


def _engines(row: str, args) -> list[tuple[str, dict, int]]:
    """The runs of ``row``: ``(label, job fields, ranks)``; a vLLM row once per ``--parallel``
    entry, the others once on ``--world`` ranks."""
    if row not in VLLM_ROWS:
        return [("", {}, args.world)]
    out = []
    for spec in [p.strip() for p in args.parallel.split(",") if p.strip()]:
        m = re.fullmatch(r"(?:tp(\d+))?(?:pp(\d+))?", spec)
        if not m or not spec:
            raise SystemExit(f"--parallel: {spec!r} is not tpN, ppN or tpNppM")
        tp, pp = int(m.group(1) or 1), int(m.group(2) or 1)
        ep = args.model == "moe" and tp > 1
        label = f"TP {tp}" + (f" PP {pp}" if pp > 1 else "") + (" EP" if ep else "")
        if pp > 1 and tp == 1:
            label = f"PP {pp}"
        out.append((label, {"tp": tp, "pp": pp, "ep": ep}, tp * pp))
    return out


def _vllm_paths(job: dict, fields: dict) -> dict:
    """Where a vLLM row's engine finds the model (its config) and fastload the weights."""
    kind, folder = fields["kind"], job["folder"]
    if kind == "local":
        return {"model": folder, "weights_uri": None}
    if kind == "http":
        return {"model": folder, "weights_uri": fields["uri"] + "model.safetensors"}
    # s3: runai_streamer reads the model (config too) from the bucket; fastload the weights.
    model = fields["uri"] if job["row"] == "vllm-runai" else folder
    return {"model": model, "weights_uri": fields["uri"] + "model.safetensors"}


def _served(log: list, path: str) -> int:
    total = 0
    for method, p, rng, status in log:
        if method == "GET" and p == path and rng and status == 206:
            a, b = rng.removeprefix("bytes=").split("-")
            total += int(b) - int(a) + 1
    return total


if __name__ == "__main__":
    main()
