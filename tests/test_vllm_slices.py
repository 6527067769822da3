"""Sliced reads in vLLM (``load_format="fastload"`` where the model is split over workers): each
worker reads only the bytes it keeps (fastload._lazy).

vLLM's own layers first, in-process with a fake tensor-parallel group (``layers``: vLLM's
``get_tensor_model_parallel_rank``/``world_size`` patched where the layers look them up): every
weight loader of the usual layers (column/row parallel, QKV and merged column from separate and
fused tensors, KV heads replicated, vocab-parallel embedding and LM head with padding, an
unknown weight loader that transforms its tensor) fed lazy tensors gives the parameters it gives
with whole tensors, bitwise, reading exactly the regions below (the pin: a vLLM that stops
narrowing before it copies reads more, and fails here). Then real engines (vLLM's CPU build,
``mp`` workers, one core each): tensor parallel 2 gives the tokens of vLLM's own loader, from a
local folder and over HTTP, with the tensor data the server sent counted; pipeline parallel 2
over HTTP and a Mixtral at TP 2 with expert parallelism give each worker the state vLLM's own
loader gives it (the CPU build fails their forward passes whatever the loader).

Like tests/test_vllm.py, this file is also the script the vLLM venv runs
(``.venv-vllm/bin/python tests/test_vllm_slices.py layers|engines|moe WORK RESULT.json``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import slices_helpers as sh
import test_vllm as tv
from slices_helpers import HEAD, HEADS, INTER, KV_HEADS, VOCAB, H

# Plain HTTP has no listing: the engines' weights are named by their index.
INDEX = "model.safetensors.index.json"


# ---------------------------------------------------------------- driver (runs in .venv-vllm)


def _layers(tp: int, rank: int):
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    # vLLM's functions read the group's rank and size; nothing here communicates.
    parallel_state._TP = SimpleNamespace(rank_in_group=rank, world_size=tp)
    for module in (linear, vpe):
        module.get_tensor_model_parallel_rank = lambda: rank
        module.get_tensor_model_parallel_world_size = lambda: tp
    with set_current_vllm_config(VllmConfig()), torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)
        layers = {
            "qkv": linear.QKVParallelLinear(H, HEAD, HEADS, KV_HEADS, bias=False),
            "qkv_fused": linear.QKVParallelLinear(H, HEAD, HEADS, KV_HEADS, bias=False),
            "gate_up": linear.MergedColumnParallelLinear(H, [INTER, INTER], bias=False),
            "down": linear.RowParallelLinear(INTER, H, bias=False),
            "col": linear.ColumnParallelLinear(H, INTER, bias=True),
            "emb": vpe.VocabParallelEmbedding(VOCAB, H),
            "head": vpe.ParallelLMHead(VOCAB, H),
        }
        torch.set_default_dtype(torch.float32)
    sh.add_unknown_and_zero(layers)
    return layers


def _same(want, got) -> bool:
    """bfloat16 parameters bitwise equal, others equal."""
    import torch

    if want.dtype == torch.bfloat16:
        return torch.equal(want.view(torch.uint8), got.view(torch.uint8))
    return torch.equal(want, got)


def run_layers(work: Path, result_path: Path) -> None:
    """For TP 1 and 2, each rank: the layers loaded from whole tensors and from lazy ones."""
    from fastload._lazy import Checkpoint
    from safetensors.torch import save_file

    tensors = sh.checkpoint_tensors()
    path = work / "layers.safetensors"
    save_file(tensors, str(path))
    results: dict = {}
    for tp in (1, 2):
        for rank in range(tp):
            eager = _layers(tp, rank)
            sh.load(eager, tensors)
            lazy = _layers(tp, rank)
            checkpoint = Checkpoint(path)
            read: dict[str, int] = {}
            sh.load(lazy, dict(checkpoint), read, checkpoint.reader)
            results[f"{tp}/{rank}"] = {
                "differ": sh.differ(eager, lazy, _same),
                "read": read,
                "stats": checkpoint.stats.as_dict(),
                "loaded_nonzero": all(
                    bool(p.data.abs().sum() > 0)
                    for layer in lazy.values()
                    for p in layer.parameters()
                ),
            }
    import vllm

    results["vllm_file"] = vllm.__file__
    result_path.write_text(json.dumps(results))


def _write_model(out: Path) -> None:
    """The engines' tiny Llama (tests/hf_models.py) with one KV head (replicated at TP 2) and a
    vocabulary of 500 (padded at TP 2), in 1 MB shards."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=500,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="1MB")


def run_engines(work: Path, result_path: Path) -> None:
    """TP 2 then PP 2, each with vLLM's safetensors loader (the reference), and fastload from
    the HTTP server at TEST_SLICES_URL (under tp2/ and pp2/, so the server's log tells the two
    apart); TP 2 from the local folder too, and over HTTP with ``distributed`` (under tp2s/).
    Workers are vLLM's ``mp`` processes."""
    model = work / "tiny-llama"
    results: dict = {}
    url = os.environ["TEST_SLICES_URL"]

    def step(name: str, load_format: str, **kwargs) -> None:
        tv._generate(name, model, load_format, results, distributed_executor_backend="mp", **kwargs)
        result_path.write_text(json.dumps(results))

    tp2 = {"tensor_parallel_size": 2}
    step("tp2_safetensors", "safetensors", **tp2)
    step("tp2_local", "fastload", **tp2)
    extra = {"weights_uri": url + "tp2/" + INDEX}
    step("tp2_http", "fastload", model_loader_extra_config=extra, **tp2)
    # Sliced and distributed: what both workers read whole, read once and broadcast.
    extra = {"weights_uri": url + "tp2s/" + INDEX, "slices": True, "distributed": True}
    step("tp2_http_shared", "fastload", model_loader_extra_config=extra, **tp2)
    # vLLM's CPU build loads a pipeline-parallel model but fails its first forward pass (an
    # assertion in gpu_model_runner's sync_and_gather_intermediate_tensors, whatever the
    # loader): each stage's state, as loaded, is compared instead of tokens.
    pp2 = {"pipeline_parallel_size": 2}
    results["pp2_safetensors"] = _states(model, "safetensors", **pp2)
    extra = {"weights_uri": url + "pp2/" + INDEX}
    results["pp2_http"] = _states(model, "fastload", model_loader_extra_config=extra, **pp2)
    result_path.write_text(json.dumps(results))


def _write_moe(out: Path) -> None:
    """A tiny Mixtral: 4 experts, 2 per token, in 1 MB shards."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = MixtralForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="1MB")


def _digests(worker) -> dict[str, str]:
    """Runs in each worker: the sha256 of every tensor of its model's state, as loaded."""
    import hashlib

    import torch

    out = {}
    for name, t in worker.model_runner.get_model().state_dict().items():
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        out[name] = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
    return out


def _states(model: Path, load_format: str, **kwargs) -> list[dict[str, str]]:
    """Starts an engine (``mp`` workers), returns each worker's ``_digests``, stops it."""
    with tv._engine(model, load_format, distributed_executor_backend="mp", **kwargs) as llm:
        return llm.collective_rpc(_digests)


def run_moe(work: Path, result_path: Path) -> None:
    """A Mixtral at TP 2 with expert parallelism, loaded by vLLM's safetensors loader and by
    fastload: each worker's state, digested (vLLM's CPU MoE kernel crashes on this model in a
    forward pass whatever the loader, so no tokens)."""
    model = work / "tiny-mixtral"
    _write_moe(model)
    results: dict = {}
    for load_format in ("safetensors", "fastload"):
        results[load_format] = _states(
            model, load_format, tensor_parallel_size=2, enable_expert_parallel=True
        )
        result_path.write_text(json.dumps(results))


if __name__ == "__main__":
    commands = {
        "layers": run_layers,
        "engines": run_engines,
        "model": _write_model,
        "moe": run_moe,
    }
    commands[sys.argv[1]](*map(Path, sys.argv[2:4]))  # type: ignore[operator]


# ---------------------------------------------------------------- tests (run by pytest)


def _run(
    command: str, work: Path, timeout: int = 600, build: str = "cpu", **env: str
) -> tuple[dict, str]:
    result, log = work / f"{command}.json", work / f"{command}.log"
    env = {**tv.vllm_env(build), **env}
    env["PYTHONPATH"] = os.pathsep.join([str(tv.ROOT / "python"), env.get("PYTHONPATH", "")])
    with open(log, "w") as out:
        proc = subprocess.run(
            [str(tv.VENV_PYTHON), __file__, command, str(work), str(result)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tv.ROOT,
            timeout=timeout,
        )
    output = log.read_text(errors="replace")
    assert proc.returncode == 0 and result.exists(), output[-8000:]
    return json.loads(result.read_text()), output


@pytest.fixture(scope="module", params=tv.VLLM_BUILDS)
def layers(request, tmp_path_factory):
    """The layers driver's results, with the vLLM of one of ``tv.VLLM_BUILDS``."""
    work = tmp_path_factory.mktemp(f"vllm_layers_{request.param}")
    results, output = _run("layers", work, build=request.param)
    tv.assert_build(request.param, results.pop("vllm_file"))
    return results, output


def test_vllm_weight_loaders_read_only_each_ranks_part(layers):
    import torch

    results, _ = layers
    shapes = sh.tensor_shapes()
    for tp in (1, 2):
        for rank in range(tp):
            got = results[f"{tp}/{rank}"]
            assert got["differ"] == [], (tp, rank, got["differ"])
            assert got["loaded_nonzero"], (tp, rank)
            for name, regions in sh.expected_regions(tp, rank).items():
                want = sh.regions_read(shapes[name], 2, regions)
                assert got["read"][name] == want, (tp, rank, name, got["read"][name], want)
            total = sum(got["read"].values())
            assert got["stats"]["read_bytes"] == total
            assert got["stats"]["fallbacks"] == {"t": 1}, got["stats"]
    # At TP 2 the ranks read the column-parallel tensors once between them, plus the replicated
    # KV heads twice: about half of the checkpoint each.
    whole = sum(torch.Size(s).numel() * 2 for s in shapes.values())
    for rank in (0, 1):
        assert results[f"2/{rank}"]["stats"]["read_bytes"] < 0.7 * whole, results[f"2/{rank}"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The tiny model written, served under tp2/ and pp2/, and the engines run in turn.
    Returns (results, output, the model's files, the server's log)."""
    from servers.http import Behaviour, RangeServer

    work = tmp_path_factory.mktemp("vllm_slices")
    model = work / "tiny-llama"
    proc = subprocess.run(
        [str(tv.VENV_PYTHON), __file__, "model", str(model)],
        capture_output=True,
        text=True,
        env={**tv._engine_env(), "PYTHONPATH": str(tv.ROOT / "python")},
        cwd=tv.ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    files = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    server = RangeServer(
        {
            f"{prefix}/{name}": data
            for prefix in ("tp2", "tp2s", "pp2")
            for name, data in files.items()
        },
        Behaviour(),
    )
    try:
        env = {
            "TEST_SLICES_URL": server.url(""),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with a function
            # One core per worker: vLLM's CPU workers bind their threads, one NUMA node each
            # by default, which a small machine does not have.
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"),
        }
        results, output = _run("engines", work, timeout=tv.ENGINE_TIMEOUT_S, **env)
        yield results, output, files, list(server.behaviour.log)
    finally:
        server.close()


def _sent(log, prefix: str, files: dict[str, bytes]) -> tuple[int, int]:
    """Bytes the server sent in ranged GETs under ``prefix``: of tensor data (ranges from a
    file's data on), and in all (with the reads of headers, a first 256 KiB of each file by
    each worker, a large share of these 1 MB files)."""
    data_start = {
        name: 8 + int.from_bytes(body[:8], "little")
        for name, body in files.items()
        if name.endswith(".safetensors")
    }
    data = total = 0
    for method, path, rng, status in log:
        if method == "GET" and path.startswith(f"/{prefix}/") and status == 206:
            a, b = (int(x) for x in rng.removeprefix("bytes=").split("-"))
            total += b - a + 1
            if a >= data_start.get(path.rsplit("/", 1)[1], 0):
                data += b - a + 1
    return data, total


def _weights(files: dict[str, bytes]) -> int:
    """Tensor bytes of the checkpoint (its files less their headers)."""
    return sum(
        len(body) - 8 - int.from_bytes(body[:8], "little")
        for name, body in files.items()
        if name.endswith(".safetensors")
    )


def _stat_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "fastload sliced reads on" in line]


@pytest.mark.slow
@tv.needs_vllm
def test_tensor_parallel_2_reads_each_ranks_part(engines):
    """TP 2 with a replicated KV head and a padded vocabulary: the tokens of vLLM's own loader,
    from a local folder and over HTTP, the two workers together fetching at most 1.2x the
    checkpoint (whole-tensor reads fetch 2x)."""
    results, output, files, log = engines
    want = results["tp2_safetensors"]
    assert len(want) == len(tv.PROMPTS) and all(len(t) == tv.MAX_TOKENS for t in want)
    assert results.get("tp2_local") == want, output[-8000:]
    assert results.get("tp2_http") == want, output[-8000:]
    weights = _weights(files)
    sent, total = _sent(log, "tp2", files)
    print(f"TP 2 over HTTP: {sent} bytes of tensor data sent, {sent / weights:.2f}x the weights")
    print(f"  ({total} bytes with the headers' reads)")
    # Whole-tensor reads would send 2x. Column-parallel tensors are read once over the two
    # workers, the one KV head and the norms by both; row-parallel ones (o_proj, down_proj: a
    # short run per row, which alone each worker would read as the span of the rows, nearly
    # whole: 1.33x here) once, each worker a block of rows, exchanged for the other's columns.
    assert weights < sent <= 1.2 * weights
    # One line per worker and load (local, then HTTP, then HTTP with distributed), each rank
    # reading part of the bytes; over HTTP exchanging the 4 row-parallel weights (o_proj and
    # down_proj of 2 layers), from the mapped local folder copying its columns itself.
    lines = [line for line in _stat_lines(output) if "pp rank 0/1" in line]
    assert len(lines) == 6, output[-8000:]
    assert {line.split("tp rank ")[1][:3] for line in lines} == {"0/2", "1/2"}, lines
    exchanged = [ln for ln in lines if "as row blocks of 4 tensors exchanged over the group" in ln]
    assert len(exchanged) == 4 and exchanged == lines[2:], lines


@pytest.mark.slow
@tv.needs_vllm
def test_tensor_parallel_2_sliced_and_distributed_reads_replicated_tensors_once(engines):
    """``slices`` and ``distributed`` both: the tokens of vLLM's own loader, the tensors both
    workers keep whole (the one KV head's k/v, the norms) read by one worker and broadcast, so
    the server sends less than with slices alone, and each worker logs what it received."""
    results, output, files, log = engines
    assert results.get("tp2_http_shared") == results["tp2_safetensors"], output[-8000:]
    weights = _weights(files)
    alone, _ = _sent(log, "tp2", files)
    shared, _ = _sent(log, "tp2s", files)
    print(f"TP 2 over HTTP, distributed: {shared / weights:.3f}x, alone {alone / weights:.3f}x")
    assert weights <= shared < alone, (shared, alone, weights)
    lines = [ln for ln in _stat_lines(output) if "read by another rank and received" in ln]
    assert {ln.split("tp rank ")[1][:3] for ln in lines} == {"0/2", "1/2"}, lines


@pytest.mark.slow
@tv.needs_vllm
def test_pipeline_parallel_2_reads_each_stages_layers(engines):
    """PP 2 over HTTP: each stage's weights, as loaded, are those vLLM's own loader gives it;
    each stage leaves the other stage's layers unread, so the two stages together fetch the
    checkpoint about once."""
    results, output, files, log = engines
    want = results["pp2_safetensors"]
    assert len(want) == 2 and all(want) and want[0].keys() != want[1].keys(), want
    assert results.get("pp2_http") == want, output[-8000:]
    weights = _weights(files)
    sent, total = _sent(log, "pp2", files)
    print(f"PP 2 over HTTP: {sent} bytes of tensor data sent, {sent / weights:.2f}x the weights")
    print(f"  ({total} bytes with the headers' reads)")
    assert weights * 0.99 <= sent <= 1.05 * weights
    lines = [line for line in _stat_lines(output) if "pp rank" in line and "tp rank 0/1" in line]
    assert len(lines) == 2, output[-8000:]
    for line in lines:
        skipped = int(line.split(" tensors not read")[0].rsplit(" ", 1)[1])
        assert skipped > 0, line


@pytest.mark.slow
@tv.needs_vllm
def test_expert_parallel_reads_only_the_ranks_experts(tmp_path):
    """A tiny Mixtral at TP 2 with expert parallelism: each worker's weights, as loaded, equal
    those vLLM's own loader gives it, and each leaves the other worker's experts unread."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with a function
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"),
    }
    results, output = _run("moe", tmp_path, timeout=tv.ENGINE_TIMEOUT_S, **env)
    want, got = results["safetensors"], results.get("fastload")
    assert len(want) == 2 and all(want), want
    assert got == want, output[-8000:]
    lines = _stat_lines(output)
    assert len(lines) == 2, output[-8000:]
    # 2 layers x 4 experts x 3 weights; each worker keeps 2 experts and never reads the others.
    for line in lines:
        skipped = int(line.split(" tensors not read")[0].rsplit(" ", 1)[1])
        assert skipped == 12, line


def test_slices_key_is_checked():
    """``slices``: true, false or absent (the loader decides), for load format fastload only;
    with ``distributed: true`` (tensors read whole shared over the group)."""
    from fastload import ConfigError, vllm

    def parse(extra, load_format="fastload"):
        allowed = vllm._SHARDED_KEYS if load_format == "fastload_sharded" else vllm._KEYS
        return vllm._Options.parse(load_format, extra, allowed)

    assert parse({}).slices is None
    assert parse({"slices": False}).slices is False
    assert parse({"slices": True}).slices is True
    assert parse({"slices": False, "distributed": True}).distributed is True
    with pytest.raises(ConfigError) as info:
        parse({"slices": "yes"})
    assert info.value.option == "slices"
    both = parse({"slices": True, "distributed": True})
    assert both.slices is True and both.distributed is True
    with pytest.raises(ConfigError, match="'slices' belongs to load format 'fastload'"):
        parse({"slices": True}, "fastload_sharded")
