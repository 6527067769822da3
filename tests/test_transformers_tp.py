"""``fastload.transformers.from_pretrained(..., tp_plan="auto")`` under ``torchrun`` (2 ranks,
gloo on the CPU): each rank reads only its shards, from a local folder, over HTTP and from S3
(SeaweedFS), and the
model computes exactly the logits of transformers' own tensor-parallel load (and those of a load
without tensor parallelism, up to the order of the reductions).

This file is also the ranks' script: ``python -m torch.distributed.run ... test_transformers_tp.py
worker FOLDER URL S3_URI S3_OPTIONS OUT``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers") if __name__ != "__main__" else None

WORKER = "worker"
# A group that has not finished by then is stuck (it takes seconds).
GROUP_DEADLINE = 240
# Input ids the logits are computed for.
IDS = list(range(3, 40, 3))


def write_model(folder: Path) -> Path:
    """A random Llama (hidden 256, GQA, untied embeddings) in float32, about 5.5 MiB: large beside
    the 256 KiB each rank's header probe reads, so that the bytes the server sees are the
    shards'."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits.float()


def _worker(folder: str, url: str, s3_uri: str, s3_options: str, out: str) -> None:
    import fastload.transformers
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto")
    rank = dist.get_rank()
    result = {"transformers": _logits(ref)}
    shard = ref.model.layers[0].mlp.down_proj.weight
    result["sharded"] = type(shard).__name__ == "DTensor" and shard.to_local().shape != shard.shape
    del ref
    sources = (("local", folder, None), ("http", url, None), ("s3", s3_uri, json.loads(s3_options)))
    for where, uri, storage_options in sources:
        dist.barrier()
        model = fastload.transformers.from_pretrained(
            AutoModelForCausalLM, uri, tp_plan="auto", storage_options=storage_options
        )
        result[where] = _logits(model)
        result[f"{where}_stats"] = model._fastload_stats
        del model
    dist.barrier()
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _run_group(folder: Path, url: str, s3_uri: str, s3_options: dict, out: Path) -> list[dict]:
    import fastload

    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTLOAD_", "TORCH"))}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(Path(fastload.__file__).resolve().parent.parent),
        TOKENIZERS_PARALLELISM="false",
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        __file__,
        WORKER,
        str(folder),
        url,
        s3_uri,
        json.dumps(s3_options),
        str(out),
    ]
    done = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=GROUP_DEADLINE, cwd=out
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _served_bytes(log, path: str, since: int) -> int:
    total = 0
    for method, p, rng, status in log[since:]:
        if method == "GET" and p == path:
            assert rng and status == 206, (rng, status)
            a, b = rng.removeprefix("bytes=").split("-")
            total += int(b) - int(a) + 1
    return total


def test_tp_ranks_read_only_their_shards(range_server, seaweed, tmp_path):
    from servers import s3 as s3_server
    from transformers import AutoModelForCausalLM

    folder = write_model(tmp_path / "llama")
    files = {f"tp/{p.name}": p for p in folder.iterdir()}
    range_server.put(files)
    url = range_server.url("tp/")
    s3_server.upload(seaweed.client(), s3_server.BUCKET, files)
    s3_uri = f"s3://{s3_server.BUCKET}/tp/"
    weights = (folder / "model.safetensors").stat().st_size
    log = range_server.behaviour.log
    since = len(log)
    out = tmp_path / "out"
    out.mkdir()
    ranks = _run_group(folder, url, s3_uri, seaweed.storage_options(), out)
    served = _served_bytes(log, "/tp/model.safetensors", since)

    whole = _logits(AutoModelForCausalLM.from_pretrained(folder))
    for r, res in enumerate(ranks):
        assert res["sharded"], "transformers did not shard down_proj: no tensor parallelism"
        for where in ("local", "http", "s3"):
            assert torch.equal(res[where], res["transformers"]), (r, where)
            torch.testing.assert_close(res[where], whole, rtol=1e-4, atol=1e-5)
            stats = res[f"{where}_stats"]
            # The sharded weights were read as parts, the norms whole: half of each, but
            # o_proj and down_proj (sharded by columns, rows narrower than a read's cost) as the
            # span of the rows they cross (fastload._parts.merge_runs), nearly whole.
            assert stats["part_tensors"] == 16 and stats["whole_tensors"] == 5, stats
            by_columns = 2 * 4 * (256 * 256 + 256 * 512)  # 2 layers, float32
            half = stats["part_tensor_bytes"] // 2
            assert half < stats["part_bytes"] <= half + by_columns // 2, stats
    # Both ranks together: the checkpoint about 1.27 times plus each rank's header probe,
    # where reading whole tensors is twice: the columns' spans are the 0.27.
    assert served <= 1.4 * weights, (served, weights)
    assert served >= weights, (served, weights)


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == WORKER:
    _worker(*sys.argv[2:])
