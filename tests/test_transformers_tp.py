"""``fastload.transformers.from_pretrained(..., tp_plan="auto")`` under ``torchrun`` (2 ranks,
gloo on the CPU): each rank reads only its shards, from a local folder, over HTTP and from S3
(SeaweedFS), the row-parallel weights once over the two ranks (each a block of rows, exchanged
for the other's columns), and the model computes exactly the logits of transformers' own
tensor-parallel load (and those of a load without tensor parallelism, up to the order of the
reductions).

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
    # A default group without gloo (NCCL, on GPUs, which this machine has none of): the exchange
    # builds a gloo group of the same ranks for the load, and destroys it after.
    dist.barrier()
    gloo_groups = []
    new_group = dist.new_group

    def recorded(*args, **kwargs):
        group = new_group(*args, **kwargs)
        if kwargs.get("backend") == "gloo":
            gloo_groups.append(group)
        return group

    dist.new_group = recorded
    fastload.transformers._default_backend = lambda: "nccl"
    model = fastload.transformers.from_pretrained(AutoModelForCausalLM, folder, tp_plan="auto")
    result["own_group"] = _logits(model)
    result["own_group_stats"] = model._fastload_stats
    # The gloo groups built during the load, and how many of them are still there.
    alive = dist.distributed_c10d._world.pg_map
    result["groups"] = (len(gloo_groups), sum(g in alive for g in gloo_groups))
    dist.new_group = new_group
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


def _served(log, path: str, since: int) -> tuple[int, int]:
    """Bytes the server sent for ``path`` in ranged GETs, and how many GETs."""
    total = gets = 0
    for method, p, rng, status in log[since:]:
        if method == "GET" and p == path:
            assert rng and status == 206, (rng, status)
            a, b = rng.removeprefix("bytes=").split("-")
            total += int(b) - int(a) + 1
            gets += 1
    return total, gets


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
    served, gets = _served(log, "/tp/model.safetensors", since)

    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        row_parallel = sum(
            f.get_slice(n).get_shape()[0] * f.get_slice(n).get_shape()[1] * 4
            for n in f.keys()
            if n.endswith(("o_proj.weight", "down_proj.weight"))
        )
    whole = _logits(AutoModelForCausalLM.from_pretrained(folder))
    print(f"transformers TP 2 over HTTP: {served / weights:.3f}x the checkpoint in {gets} GETs")
    for where in ("local", "http", "s3"):
        for r, res in enumerate(ranks):
            assert res["sharded"], "transformers did not shard down_proj: no tensor parallelism"
            assert torch.equal(res[where], res["transformers"]), (r, where)
            torch.testing.assert_close(res[where], whole, rtol=1e-4, atol=1e-5)
            stats = res[f"{where}_stats"]
            # The column-parallel weights were read as parts (half of each), the norms whole,
            # the row-parallel ones (o_proj, down_proj of 2 layers) as a block of rows each,
            # exchanged over the group for the other rank's columns.
            assert stats["part_tensors"] == 12 and stats["whole_tensors"] == 5, (where, stats)
            assert stats["part_bytes"] * 2 == stats["part_tensor_bytes"], (where, stats)
            assert stats["exchanged_tensors"] == 4, (where, stats)
            assert stats["exchanged_bytes"] * 2 == row_parallel, (where, stats)
    # Both ranks together: the checkpoint about once (each rank's header probe included), where
    # reading whole tensors is twice; in a few ranged GETs per tensor, where reading the
    # row-parallel weights' columns took one per row (256 rows each: over 2,000 per rank).
    for r, res in enumerate(ranks):
        # The default group "without gloo": exchanged all the same, over a group built for it.
        assert torch.equal(res["own_group"], res["transformers"]), r
        assert res["own_group_stats"] == res["local_stats"], r
        assert res["groups"] == (1, 0), ("one gloo group built, none left", res["groups"])
    assert served <= 1.1 * weights, (served, weights)
    assert served >= weights, (served, weights)
    assert gets <= 200, gets


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == WORKER:
    _worker(*sys.argv[2:])
