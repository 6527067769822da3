"""Tiny transformers and diffusers checkpoints for tests/test_transformers.py,
tests/test_diffusers.py and the serving engines' tests (test_vllm.py, test_sglang.py), written by
the libraries' own save_pretrained (safetensors), and the checks those tests share."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by its relative path (what a repo or bucket prefix holds)."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def assert_same_state(got: torch.nn.Module, want: torch.nn.Module) -> None:
    """Same keys, dtypes, shapes, devices and bits, and tied parameters tied alike."""
    a, b = want.state_dict(), got.state_dict()
    assert list(a) == list(b)
    for k in a:
        x, y = a[k], b[k]
        assert (x.dtype, x.shape, x.device) == (y.dtype, y.shape, y.device), k
        assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)), k
    ties_a = {k: v.data_ptr() for k, v in a.items()}
    ties_b = {k: v.data_ptr() for k, v in b.items()}
    shared = [(k, j) for k in a for j in a if k < j and ties_a[k] == ties_a[j]]
    assert shared == [(k, j) for k in b for j in b if k < j and ties_b[k] == ties_b[j]]


def use_hub(hub, monkeypatch, tmp_path: Path) -> Path:
    """The mock ``hub`` as the Hub, without a token or offline mode; the HF cache
    (``tmp_path/hf_home``) and Python's temporary files (``tmp_path/tmp``) under ``tmp_path``,
    which it returns, so that a test sees every file a load wrote."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", hub.base)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return tmp_path


def safetensors_under(*folders: Path) -> list[Path]:
    return [p for f in folders if f.exists() for p in f.rglob("*.safetensors")]


def write_llama(folder: Path, *, max_shard_size: str | None = None) -> Path:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, max_new_tokens=5)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kw)
    return folder


ENGINE_VOCAB = 512


def write_engine_llama(out: Path, **config) -> None:
    """The serving engines' tiny model (test_vllm.py, test_sglang.py): a random Llama (hidden 256,
    head_dim 64, 2 layers, GQA; ``config`` added to its config) saved in bf16 safetensors shards
    of 1 MB with an index."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaConfig(
        vocab_size=ENGINE_VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        **config,
    )
    model = LlamaForCausalLM(llama).to(torch.bfloat16)
    with torch.no_grad():  # a little more spread than the default init, for varied tokens
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="1MB")


@contextmanager
def engine_hub(folder: Path, repo: str, home: Path) -> Iterator[tuple[Any, dict[str, str]]]:
    """The mock Hub holding the files of ``folder`` as ``repo``, and the environment an engine's
    process reaches it with (online, its HF cache in ``home``); the Hub closed after."""
    from servers.hub import MockHub

    hub = MockHub()
    try:
        hub.add(repo, {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()})
        env = {"HF_ENDPOINT": hub.base, "HF_HUB_OFFLINE": "0", "HF_HOME": str(home)}
        env["HF_HUB_CACHE"] = str(home / "hub")
        yield hub, env
    finally:
        hub.close()


def write_gpt2_tied(folder: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    assert config.tie_word_embeddings
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def write_tokenizer(folder: Path) -> Path:
    """A CLIP tokenizer with a 7-token vocabulary (no download)."""
    from transformers import CLIPTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, "!": 2, "a</w>": 3, "b</w>": 4, "a": 5}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tok = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    tok.save_pretrained(folder)
    return folder


def tiny_vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(2)
    return AutoencoderKL(
        block_out_channels=(8, 16),
        norm_num_groups=4,
        latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
    )


def tiny_unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(3)
    return UNet2DConditionModel(
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        cross_attention_dim=16,
        attention_head_dim=2,
        sample_size=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    )


def tiny_dit():
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(4)
    return DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        norm_num_groups=4,
        num_embeds_ada_norm=10,
    )


def write_pipeline(folder: Path, work: Path) -> Path:
    """A tiny StableDiffusionPipeline: VAE, UNet (sharded), CLIP text encoder and tokenizer,
    DDIM scheduler."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(5)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=6,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            projection_dim=16,
            max_position_embeddings=16,
        )
    )
    pipe = StableDiffusionPipeline(
        vae=tiny_vae(),
        unet=tiny_unet(),
        text_encoder=text_encoder,
        tokenizer=CLIPTokenizer.from_pretrained(write_tokenizer(work / "tokenizer")),
        scheduler=DDIMScheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(folder)
    # The UNet in shards too, so a pipeline reads an index.
    pipe.unet.save_pretrained(folder / "unet", max_shard_size="40KB")
    return folder
