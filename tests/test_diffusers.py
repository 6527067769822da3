"""fastload.diffusers.from_pretrained against diffusers' own from_pretrained: a tiny VAE, UNet
(sharded) and DiT transformer, and a tiny Stable Diffusion pipeline (its CLIP text encoder loaded
through fastload.transformers), from a local folder, the mock Hub and SeaweedFS (S3). State dicts
bitwise equal; no weight file written to disk."""

from __future__ import annotations

import inspect
import tempfile

import fastload
import fastload.diffusers
import pytest
import torch
from hf_models import (
    assert_same_state,
    safetensors_under,
    tiny_dit,
    tiny_unet,
    tiny_vae,
    tree,
    use_hub,
    write_pipeline,
)
from servers import s3 as s3_server
from servers.hub import MockHub

diffusers = pytest.importorskip("diffusers")
from diffusers import (  # noqa: E402
    AutoencoderKL,
    DiffusionPipeline,
    DiTTransformer2DModel,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)

MODELS = [
    (AutoencoderKL, "vae"),
    (UNet2DConditionModel, "unet"),
    (DiTTransformer2DModel, "dit"),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("df_models")
    models = root / "models"
    tiny_vae().save_pretrained(models / "vae")
    tiny_unet().save_pretrained(models / "unet", max_shard_size="40KB")
    tiny_dit().save_pretrained(models / "dit")
    write_pipeline(root / "pipe", root / "work")
    return root


def check_model(cls, uri, reference, subfolder, *, where=None, **kwargs):
    got = fastload.diffusers.from_pretrained(
        cls, uri, subfolder=subfolder, **kwargs, **(where or {})
    )
    want = cls.from_pretrained(reference, subfolder=subfolder, **kwargs)
    assert type(got) is type(want)
    assert_same_state(got, want)
    assert dict(got.config) | {"_name_or_path": None} == dict(want.config) | {"_name_or_path": None}


def check_pipeline(uri, reference, *, where=None, **kwargs):
    got = fastload.diffusers.from_pretrained(DiffusionPipeline, uri, **kwargs, **(where or {}))
    want = StableDiffusionPipeline.from_pretrained(reference, **kwargs)
    assert type(got) is StableDiffusionPipeline
    for name in ("vae", "unet", "text_encoder"):
        assert_same_state(getattr(got, name), getattr(want, name))
    assert got.tokenizer.get_vocab() == want.tokenizer.get_vocab()
    assert dict(got.scheduler.config) == dict(want.scheduler.config)


def test_the_fixtures_are_what_the_tests_need(root):
    assert (root / "models/unet/diffusion_pytorch_model.safetensors.index.json").is_file()
    assert (root / "pipe/unet/diffusion_pytorch_model.safetensors.index.json").is_file()
    assert (root / "pipe/text_encoder/model.safetensors").is_file()


@pytest.mark.parametrize(("cls", "subfolder"), MODELS)
@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_models_from_a_folder(root, cls, subfolder, dtype):
    kwargs = {} if dtype is None else {"torch_dtype": dtype}
    check_model(cls, root / "models", root / "models", subfolder, **kwargs)


def test_weights_are_read_by_fastload(root, monkeypatch):
    seen = []
    real = fastload.load
    monkeypatch.setattr(fastload, "load", lambda uri, **o: seen.append(uri) or real(uri, **o))
    fastload.diffusers.from_pretrained(UNet2DConditionModel, root / "models", subfolder="unet")
    shards = sorted(str(p) for p in (root / "models/unet").glob("*.safetensors"))
    assert sorted(seen) == shards and len(shards) > 1


@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_pipeline_from_a_folder(root, dtype):
    kwargs = {} if dtype is None else {"dtype": dtype}
    check_pipeline(root / "pipe", root / "pipe", **kwargs)


def test_pinned_diffusers_apis():
    """The private diffusers names the integration wraps. If this fails, diffusers changed them
    and fastload/diffusers.py must follow."""
    from diffusers.models import model_loading_utils, modeling_utils

    for module, name in [
        (modeling_utils, "_get_model_file"),
        (modeling_utils, "_get_checkpoint_shard_files"),
        (modeling_utils, "load_state_dict"),
        (model_loading_utils, "load_state_dict"),
    ]:
        assert callable(getattr(module, name)), name
    source = inspect.getsource(modeling_utils.ModelMixin.from_pretrained)
    assert "_get_model_file(" in source and "_get_checkpoint_shard_files(" in source
    assert "load_state_dict(resolved_model_file[0]" in source
    assert "load_state_dict(shard_file" in inspect.getsource(model_loading_utils._load_shard_file)
    # Nothing stays wrapped after a load.
    assert modeling_utils.load_state_dict is model_loading_utils.load_state_dict


# ---------------------------------------------------------------------------------------------
# The mock Hub and S3


@pytest.fixture(scope="module")
def hub(root):
    hub = MockHub()
    hub.add("org/models", tree(root / "models"))
    hub.add("org/pipe", tree(root / "pipe"))
    yield hub
    hub.close()


@pytest.fixture
def hub_env(hub, monkeypatch, tmp_path):
    return use_hub(hub, monkeypatch, tmp_path)


@pytest.mark.parametrize(("cls", "subfolder"), MODELS)
def test_models_from_the_hub(root, hub_env, cls, subfolder):
    check_model(cls, "hf://org/models", root / "models", subfolder)
    assert not safetensors_under(hub_env / "hf_home", hub_env / "tmp")


def test_pipeline_from_the_hub(root, hub_env):
    check_pipeline("org/pipe", root / "pipe")
    assert not safetensors_under(hub_env / "hf_home", hub_env / "tmp")
    cached = {p.name for p in (hub_env / "hf_home").rglob("*") if p.is_file()}
    assert {"model_index.json", "tokenizer_config.json", "scheduler_config.json"} <= cached


@pytest.fixture(scope="module")
def bucket(seaweed, root):
    files = {f"df/models/{k}": v for k, v in tree(root / "models").items()}
    files |= {f"df/pipe/{k}": v for k, v in tree(root / "pipe").items()}
    s3_server.upload(seaweed.client(), s3_server.BUCKET, files)
    return seaweed


@pytest.mark.parametrize(("cls", "subfolder"), MODELS)
def test_models_from_s3(root, bucket, cls, subfolder, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    where = {"storage_options": bucket.storage_options()}
    check_model(cls, f"s3://{s3_server.BUCKET}/df/models/", root / "models", subfolder, where=where)
    assert not list(tmp_path.iterdir())


def test_pipeline_from_s3(root, bucket, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    where = {"storage_options": bucket.storage_options()}
    check_pipeline(f"s3://{s3_server.BUCKET}/df/pipe", root / "pipe", where=where)
    assert not list(tmp_path.iterdir())
