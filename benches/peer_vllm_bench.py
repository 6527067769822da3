"""vLLM time to ready from a peer: `LLM(model="s3://...")` with fastload reading the origin, with
fastload and `FASTLOAD_PEERS` (a `fastload serve` of the same origin), and with vLLM's
runai_streamer reading the origin; side by side in one run, each engine in a fresh process.

    python benches/peer_vllm_bench.py                      # the vLLM tests' tiny model
    python benches/peer_vllm_bench.py --runs 3 --vllm-python /path/to/.venv-vllm/bin/python

Starts SeaweedFS (tests/servers/s3.py) and uploads the vLLM tests' tiny Llama and its tokenizer
(tests/test_vllm.py's make_model); puts the origin behind a delay line of 20 ms round trip and
200 MB/s, and `python -m fastload serve s3://bucket/peer-vllm/tiny-llama/` (filled by one read of
every file) behind its own of 2 GB/s (benches/latency_proxy.py's splice line, as
benches/peer_bench.py). Then, each row an engine in a fresh .venv-vllm process
(`LLM(..., enforce_eager=True)` on the CPU, then greedy tokens for two prompts):

- fastload, origin:   `load_format="fastload"`, no peers;
- fastload, peer:     the same with `FASTLOAD_PEERS` set to the serve's delay line;
- runai_streamer:     `load_format="runai_streamer"` (runai-model-streamer and its S3 client
                      reading the origin through the same delay line).

Each row reports `LLM(...)` seconds (the import of vllm apart) and the bytes the peer served
(its `/metrics`); every row's tokens must equal the first's. Results: a markdown table, and
benches/out/peer_vllm_results.json.
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
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))

PREFIX = "peer-vllm/tiny-llama"

ENGINE = r"""
import json, sys, time
t0 = time.perf_counter()
from vllm import LLM, SamplingParams
t1 = time.perf_counter()
job = json.loads(sys.argv[1])
llm = LLM(model=job["model"], load_format=job["format"], skip_tokenizer_init=True,
          dtype="bfloat16", max_model_len=256, max_num_seqs=4, enforce_eager=True, seed=0)
t2 = time.perf_counter()
params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False)
prompts = [[1, 17, 42, 99, 7, 300, 12], [1, 250, 251, 252, 5]]
out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
tokens = [list(o.outputs[0].token_ids) for o in out]
print("RESULT " + json.dumps({"import": t1 - t0, "ready": t2 - t1, "tokens": tokens}), flush=True)
"""


def engine_env(base: dict[str, str], cache: Path) -> dict[str, str]:
    """What test_vllm.py's engines run with (CPU KV cache, no hub, no telemetry, the AMX
    permission site), and this tree's fastload first on the path."""
    env = dict(base)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_ASSETS_CACHE=str(cache),
        AWS_EC2_METADATA_DISABLED="true",
        # runai-model-streamer's S3 client: path-style requests to the endpoint.
        RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0",
    )
    env.pop("FASTLOAD_PEERS", None)
    paths = [str(ROOT / "tests" / "vllm_site"), str(ROOT / "python"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def engine(python: str, model: str, fmt: str, env: dict[str, str]) -> dict:
    proc = subprocess.run(
        [python, "-c", ENGINE, json.dumps({"model": model, "format": fmt})],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout + proc.stderr)[-3000:]
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument(
        "--vllm-python",
        default=os.environ.get("FASTLOAD_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python")),
    )
    ap.add_argument("--origin-delay-ms", type=float, default=10.0)
    ap.add_argument("--origin-rate-mbps", type=float, default=200.0)
    ap.add_argument("--peer-delay-ms", type=float, default=0.25)
    ap.add_argument("--peer-rate-mbps", type=float, default=2000.0)
    args = ap.parse_args()

    import latency_proxy
    from peer_bench import Serve, files_of, raw_get
    from servers import s3 as s3_server
    from test_vllm import make_model

    tmp = Path(tempfile.mkdtemp(prefix="peer-vllm-bench-"))
    make_model(tmp / "tiny-llama")
    files = {f"{PREFIX}/{p.name}": p for p in sorted((tmp / "tiny-llama").iterdir())}
    weights = sum(p.stat().st_size for p in files.values() if p.suffix == ".safetensors")
    seaweed = s3_server.start_seaweed(tmp / "weed")
    rows: list[dict] = []
    try:
        s3_server.upload(seaweed.client(), s3_server.BUCKET, files)
        port = int(seaweed.endpoint.rsplit(":", 1)[1])
        o_port, o_stop = latency_proxy.start_in_thread(
            ("127.0.0.1", port),
            args.origin_delay_ms / 1000,
            rate=args.origin_rate_mbps * 1e6,
            splice=True,
        )
        base = {**os.environ, **seaweed.env()}
        base.pop("FASTLOAD_PEERS", None)
        uri = f"s3://{s3_server.BUCKET}/{PREFIX}/"
        serve = Serve(uri, {**base, "AWS_ENDPOINT_URL": seaweed.endpoint})
        raw_get(serve.port, files_of(serve.manifest()))  # fills the serve from the origin
        p_port, p_stop = latency_proxy.start_in_thread(
            ("127.0.0.1", serve.port),
            args.peer_delay_ms / 1000,
            rate=args.peer_rate_mbps * 1e6,
            splice=True,
        )
        origin = {**base, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{o_port}"}
        cases = [
            ("fastload, origin", "fastload", {}),
            (
                "fastload, peer (FASTLOAD_PEERS)",
                "fastload",
                {"FASTLOAD_PEERS": f"127.0.0.1:{p_port}"},
            ),
            ("runai_streamer, origin", "runai_streamer", {}),
        ]
        results: dict[str, list[dict]] = {name: [] for name, _, _ in cases}
        for run in range(args.runs):
            for name, fmt, extra in cases:
                env = engine_env(origin, tmp / f"assets-{run}-{fmt}-{len(extra)}")
                env.update(extra)
                before = serve.bytes_served()
                t = time.perf_counter()
                r = engine(args.vllm_python, uri.rstrip("/"), fmt, env)
                r["process"] = time.perf_counter() - t
                r["peer_bytes"] = serve.bytes_served() - before
                results[name].append(r)
                print(f"{name}: {json.dumps({k: v for k, v in r.items() if k != 'tokens'})[:400]}",
                      file=sys.stderr)  # fmt: skip
        serve.kill()
        p_stop.set()
        o_stop.set()
    finally:
        seaweed.stop()

    want = next((r["tokens"] for rs in results.values() for r in rs if "tokens" in r), None)
    for name, rs in results.items():
        ok = [r for r in rs if "ready" in r]
        row = {"row": name, "runs": rs}
        if ok:
            row["ready"] = statistics.median(r["ready"] for r in ok)
            row["import"] = statistics.median(r["import"] for r in ok)
            row["peer_bytes"] = max(r["peer_bytes"] for r in ok)
            row["same_tokens"] = all(r["tokens"] == want for r in ok)
        rows.append(row)
    lines = [
        f"tiny Llama ({weights / 1e6:.1f} MB of weights); origin "
        f"{2 * args.origin_delay_ms:.0f} ms, {args.origin_rate_mbps:.0f} MB/s; "
        f"peer {args.peer_rate_mbps:.0f} MB/s; {args.runs} run(s) a row, median",
        "",
        "| row | LLM(...) s | import vllm s | bytes from the peer | tokens |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if "ready" not in r:
            err = r["runs"][-1].get("error", "")[-300:].replace("\n", " ").replace("|", "/")
            lines.append(f"| {r['row']} | failed | | | {err} |")
            continue
        same = "same" if r["same_tokens"] else "DIFFERENT"
        lines.append(
            f"| {r['row']} | {r['ready']:.1f} | {r['import']:.1f} | "
            f"{r['peer_bytes'] / 1e6:.1f} MB | {same} |"
        )
    print("\n".join(lines))
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "peer_vllm_results.json").write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
