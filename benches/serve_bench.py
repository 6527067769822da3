"""Time to serve: ``LLM(model=...)`` construction in vLLM for a model kept in object storage.

    bash benches/setup_serve_bench.sh                 # .venv-serve-bench: .venv-vllm + runai
    python benches/serve_bench.py                     # ~300 MB Llama, 10 ms each way, 2 rounds
    python benches/serve_bench.py --layers 4 --rounds 1 --delay-ms 0

One run starts SeaweedFS (`weed mini`, tests/servers/s3.py) on 127.0.0.1, writes a random Llama
(bf16 safetensors shards, config and a tokenizer) with transformers and uploads it, puts the
delay line of the other benches in front (benches/latency_proxy.py: --delay-ms each way), then
times, each in a fresh process of .venv-serve-bench with vLLM in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), rounds interleaved with a rotated order:

- fastload:   ``LLM("s3://bucket/model", load_format="fastload")``: config and tokenizer pulled
              by fastload, the weights streamed into the model.
- runai:      ``LLM("s3://bucket/model", load_format="runai_streamer")``: vLLM's own path for
              object storage, runai-model-streamer + runai-model-streamer-s3
              (RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0, its default concurrency).
- download:   boto3 ``download_file`` of every object (TransferConfig: 8 MiB parts, 10 threads)
              into a fresh folder, then ``LLM(folder, load_format="safetensors")``.

The clock starts after ``import vllm`` (the same for every row, printed apart) and stops when
``LLM()`` returns, ready to generate; one greedy generation afterwards checks the model works
(its tokens must match across rows). Each row's seconds: median (min-max) over rounds. All three
read through the same proxy with the same credentials (AWS_* variables). Results:
benches/out/serve_results.md (also printed) and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VENV = Path(os.environ.get("FASTLOAD_SERVE_BENCH_VENV", ROOT / ".venv-serve-bench"))
PREFIX = "serve-bench/llama"
LOADERS = ("fastload", "runai", "download")
PROMPT = [1, 17, 42, 99, 7]

# ---------------------------------------------------------------- one measurement (bench venv)


def worker(job: dict) -> dict:
    """Runs in a fresh process of the bench venv: one LLM() construction, timed."""
    t0 = time.perf_counter()
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams

    imported = time.perf_counter() - t0
    uri = f"s3://{job['bucket']}/{PREFIX}"
    kwargs = dict(dtype="bfloat16", max_model_len=256, max_num_seqs=2, enforce_eager=True, seed=0)
    start = time.perf_counter()
    downloaded = None
    if job["loader"] == "download":
        import boto3
        from boto3.s3.transfer import TransferConfig

        s3 = boto3.client("s3")
        folder = Path(tempfile.mkdtemp(prefix="serve-bench-", dir=job["scratch"]))
        config = TransferConfig(multipart_chunksize=8 << 20, max_concurrency=10)
        listed = s3.list_objects_v2(Bucket=job["bucket"], Prefix=PREFIX + "/")["Contents"]
        for obj in listed:
            name = obj["Key"].rsplit("/", 1)[1]
            s3.download_file(job["bucket"], obj["Key"], str(folder / name), Config=config)
        downloaded = time.perf_counter() - start
        llm = LLM(str(folder), load_format="safetensors", **kwargs)
    elif job["loader"] == "runai":
        llm = LLM(uri, load_format="runai_streamer", **kwargs)
    else:
        llm = LLM(uri, load_format="fastload", **kwargs)
    ready = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    return {
        "seconds": ready,
        "import_seconds": imported,
        "download_seconds": downloaded,
        "tokens": list(out[0].outputs[0].token_ids),
    }


# ---------------------------------------------------------------- driver


def make_model(out: Path, layers: int, hidden: int) -> int:
    """A random Llama in the bench venv's transformers; returns the weight bytes."""
    code = f"""
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
torch.manual_seed(0)
config = LlamaConfig(vocab_size=32000, hidden_size={hidden},
    intermediate_size={hidden * 11 // 4}, num_hidden_layers={layers},
    num_attention_heads={hidden // 64}, num_key_value_heads={hidden // 256},
    head_dim=64, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2, torch_dtype="bfloat16")
model = LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained({str(out)!r}, safe_serialization=True, max_shard_size="100MB")
vocab = {{"<unk>": 0, "<s>": 1, "</s>": 2, **{{f"w{{i}}": i + 3 for i in range(31997)}}}}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
    eos_token="</s>").save_pretrained({str(out)!r})
"""
    subprocess.run([str(VENV / "bin" / "python"), "-c", code], check=True)
    return sum(p.stat().st_size for p in out.glob("*.safetensors"))


def run_one(job: dict, env: dict) -> dict:
    out = subprocess.run(
        [str(VENV / "bin" / "python"), __file__, "--worker", json.dumps(job)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=1800,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        return {"error": (out.stdout + out.stderr)[-3000:]}
    return json.loads(lines[-1][len("RESULT ") :])


def cell(values: list[float]) -> str:
    if not values:
        return "failed"
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--delay-ms", type=float, default=10.0)
    ap.add_argument("--loaders", default=",".join(LOADERS))
    ap.add_argument("--out", type=Path, default=HERE / "out" / "serve_results")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    if not (VENV / "bin" / "python").exists():
        sys.exit(f"{VENV} is missing: bash benches/setup_serve_bench.sh")
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(HERE))
    import latency_proxy
    from servers import s3 as s3_server

    loaders = [name for name in args.loaders.split(",") if name]
    tmp = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    model = tmp / "model"
    size = make_model(model, args.layers, args.hidden)
    print(f"model: {size / 1e6:.0f} MB of bf16 weights in {len(list(model.iterdir()))} files")
    server = s3_server.start_seaweed(tmp / "seaweed")
    try:
        s3_server.upload_dir(server.client(), s3_server.BUCKET, PREFIX, model)
        host, port = server.endpoint.rsplit("//", 1)[1].split(":")
        proxy_port, stop = latency_proxy.start_in_thread((host, int(port)), args.delay_ms / 1e3)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FASTLOAD_"))}
        env |= server.env() | {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy_port}"}
        env |= {
            "AWS_EC2_METADATA_DISABLED": "true",
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_ASSETS_CACHE": str(tmp / "assets"),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            # AMX permission for vLLM's kernels (see tests/vllm_site/sitecustomize.py).
            "PYTHONPATH": str(ROOT / "tests" / "vllm_site"),
        }
        results: dict[str, list[dict]] = {name: [] for name in loaders}
        job = {"bucket": s3_server.BUCKET, "scratch": str(tmp)}
        for r in range(args.rounds):
            order = loaders[r % len(loaders) :] + loaders[: r % len(loaders)]
            for name in order:
                result = run_one({**job, "loader": name}, env)
                results[name].append(result)
                shown = result.get("seconds", result.get("error", "")[-400:])
                print(f"round {r + 1} {name}: {shown}", flush=True)
        stop.set()
    finally:
        server.stop()
    tokens = {json.dumps(r["tokens"]) for rs in results.values() for r in rs if "tokens" in r}
    rows = [
        "# Time to serve: LLM() from object storage (SeaweedFS on 127.0.0.1)",
        "",
        f"`python benches/serve_bench.py --layers {args.layers} --hidden {args.hidden} "
        f"--rounds {args.rounds} --delay-ms {args.delay_ms:g}`: {size / 1e6:.0f} MB of bf16 "
        f"weights, {args.delay_ms:g} ms each way, vLLM CPU in-process, {os.cpu_count()} vCPUs "
        f"shared with the server and the proxy. Same greedy tokens in every row: "
        f"{len(tokens) == 1}.",
        "",
        "| loader | LLM() to ready, s | of which download, s | import vllm, s |",
        "|---|---|---|---|",
    ]
    for name in loaders:
        ok = [r for r in results[name] if "seconds" in r]
        downloads = [r["download_seconds"] for r in ok if r.get("download_seconds") is not None]
        rows.append(
            f"| {name} | {cell([r['seconds'] for r in ok])} | "
            f"{cell(downloads) if downloads else '-'} | "
            f"{cell([r['import_seconds'] for r in ok])} |"
        )
        errors = [r["error"] for r in results[name] if "error" in r]
        if errors:
            rows.append(f"\n{name} failed:\n```\n{errors[0][-1500:]}\n```\n")
    text = "\n".join(rows)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
