"""fastload.transformers.from_pretrained against transformers' own from_pretrained: tiny models
written by save_pretrained (safetensors, one file or shards with an index, tied embeddings), read
from a local folder, the mock Hub (tests/servers/hub.py, through the real huggingface_hub) and
SeaweedFS (S3). The state dicts must be bitwise equal, and no weight file may reach the disk."""

from __future__ import annotations

import inspect
import re
import tempfile

import fastload
import fastload.transformers
import pytest
import torch
from hf_models import (
    assert_same_state,
    safetensors_under,
    tree,
    use_hub,
    write_gpt2_tied,
    write_llama,
)
from servers import s3 as s3_server
from servers.hub import MockHub

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, GPT2LMHeadModel, LlamaForCausalLM  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tf_models")
    return {
        "llama": write_llama(root / "llama"),
        "sharded": write_llama(root / "sharded", max_shard_size="20KB"),
        "tied": write_gpt2_tied(root / "tied"),
    }


def check(model_class, uri, reference_dir, *, hub_kwargs=None, **kwargs):
    """Loads ``uri`` with fastload (``kwargs`` and ``hub_kwargs``: where in the repo) and
    ``reference_dir`` (the same checkpoint) with transformers (``kwargs``), and compares."""
    got = fastload.transformers.from_pretrained(model_class, uri, **kwargs, **(hub_kwargs or {}))
    want = model_class.from_pretrained(reference_dir, **kwargs)
    assert type(got) is type(want)
    assert_same_state(got, want)
    assert got.config.to_diff_dict() | {"_name_or_path": None} == (
        want.config.to_diff_dict() | {"_name_or_path": None}
    )
    assert got.generation_config.to_dict() == want.generation_config.to_dict()
    return got


def test_the_fixtures_are_what_the_tests_need(models):
    assert (models["sharded"] / "model.safetensors.index.json").is_file()
    assert len(list(models["sharded"].glob("*.safetensors"))) > 2
    assert (models["llama"] / "model.safetensors").is_file()
    assert (models["llama"] / "generation_config.json").is_file()


@pytest.mark.parametrize("name", ["llama", "sharded"])
@pytest.mark.parametrize("model_class", [LlamaForCausalLM, AutoModelForCausalLM])
@pytest.mark.parametrize("dtype", [None, "auto", torch.float32, torch.float16])
def test_local_folder(models, name, model_class, dtype):
    kwargs = {} if dtype is None else {"dtype": dtype}
    got = check(model_class, models[name], models[name], **kwargs)
    assert got.config.name_or_path == str(models[name])


def test_tied_embeddings_stay_tied(models):
    got = check(GPT2LMHeadModel, models["tied"], models["tied"])
    assert got.lm_head.weight is got.transformer.wte.weight
    check(AutoModelForCausalLM, models["tied"], models["tied"], torch_dtype=torch.bfloat16)


def test_config_overrides_and_device_map(models):
    got = check(LlamaForCausalLM, models["llama"], models["llama"], output_attentions=True)
    assert got.config.output_attentions
    check(AutoModelForCausalLM, models["sharded"], models["sharded"], device_map="cpu")


TF_MAJOR = int(transformers.__version__.split(".")[0])
_LLAMA_MODULES = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]


def _split(**where):
    return {m: where.get(m, "cpu") for m in _LLAMA_MODULES} | {"model.rotary_emb": "cpu"}


DEVICE_MAPS = {
    "auto": {"device_map": "auto"},
    "sequential": {"device_map": "sequential"},
    "cpu dict": {"device_map": _split()},
    "disk dict": {"device_map": _split(**{"model.layers.1": "disk", "lm_head": "disk"})},
    "meta dict": {"device_map": _split(**{"model.layers.1": "meta"})},
    # 1 KB of CPU memory: accelerate's planner sends nearly everything to disk.
    "auto, disk by max_memory": {"device_map": "auto", "max_memory": {"cpu": "1KB"}},
}


def _load_or_error(load):
    try:
        return load(), None
    except Exception as e:  # what transformers raises is what is compared
        return None, e


@pytest.mark.parametrize("case", list(DEVICE_MAPS))
def test_device_map_offload_as_transformers(models, case, tmp_path):
    """device_map strategies and dicts across cpu, disk and meta: the model transformers' own
    load gives (same placement, same weights where they are in memory, same logits), or the
    error it gives. Only transformers 4.x cannot offload given weights to disk: there fastload
    refuses with one ConfigError naming device_map (4.57's own load of a folder does it)."""
    kwargs = {**DEVICE_MAPS[case], "offload_folder": str(tmp_path / "off_want")}
    want, want_err = _load_or_error(
        lambda: AutoModelForCausalLM.from_pretrained(models["sharded"], **kwargs)
    )
    kwargs["offload_folder"] = str(tmp_path / "off_got")
    got, got_err = _load_or_error(
        lambda: fastload.transformers.from_pretrained(
            AutoModelForCausalLM, models["sharded"], **kwargs
        )
    )
    if TF_MAJOR < 5 and "disk" in case:
        assert isinstance(got_err, fastload.ConfigError), got_err
        assert got_err.option == "device_map" and "'disk'" in str(got_err)
        return
    if want_err is not None:
        assert type(got_err) is type(want_err), (got_err, want_err)
        return
    assert got_err is None, got_err
    assert type(got) is type(want)
    assert getattr(got, "hf_device_map", None) == getattr(want, "hf_device_map", None)
    a, b = dict(want.named_parameters()), dict(got.named_parameters())
    assert list(a) == list(b)
    for k in a:
        assert (a[k].device, a[k].dtype, a[k].shape) == (b[k].device, b[k].dtype, b[k].shape), k
        if a[k].device.type != "meta":
            assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k
    if "meta" in case:
        return  # no forward pass without those weights
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)


def test_fastload_options_reach_the_loader(models, monkeypatch):
    seen = []
    real = fastload.stream

    def spy(uris, **options):
        seen.append((list(uris), options))
        return real(uris, **options)

    monkeypatch.setattr(fastload, "stream", spy)
    fastload.transformers.from_pretrained(
        LlamaForCausalLM, models["sharded"], load_options={"concurrency": 3, "block_size": "64KiB"}
    )
    [(uris, options)] = seen
    assert sorted(uris) == sorted(str(p) for p in models["sharded"].glob("*.safetensors"))
    assert options["concurrency"] == 3 and options["block_size"] == "64KiB"


def test_bad_arguments_are_refused(models):
    with pytest.raises(fastload.ConfigError, match="use_safetensors"):
        fastload.transformers.from_pretrained(
            LlamaForCausalLM, models["llama"], use_safetensors=False
        )
    with pytest.raises(fastload.NotFoundError):
        fastload.transformers.from_pretrained(LlamaForCausalLM, "/no/such/folder/")


def test_pinned_transformers_apis():
    """The transformers APIs the integration relies on. If this fails, transformers changed them
    and fastload/transformers.py must follow."""
    from transformers import PreTrainedModel
    from transformers.dynamic_module_utils import get_class_from_dynamic_module
    from transformers.generation.utils import GenerationMixin
    from transformers.models.auto import auto_factory

    # from_pretrained(None, config=..., state_dict=...): transformers' public way in.
    source = inspect.getsource(PreTrainedModel.from_pretrained)
    assert 'kwargs.pop("state_dict", None)' in source
    # What it takes for itself, which fastload keeps from the generation config's kwargs.
    own = set(re.findall(r'kwargs\.pop\("(\w+)"', source))
    own |= set(inspect.signature(PreTrainedModel.from_pretrained).parameters)
    own -= {"cls", "pretrained_model_name_or_path", "model_args", "kwargs"}
    assert own <= fastload.transformers._OWN_KWARGS, own - fastload.transformers._OWN_KWARGS
    # Private: the auto class's choice of concrete class, and remote code's generation mixin.
    assert callable(auto_factory._get_model_class)
    assert callable(auto_factory.add_generation_mixin_to_remote_model)
    assert callable(get_class_from_dynamic_module)
    if int(transformers.__version__.split(".")[0]) >= 5:
        params = list(inspect.signature(GenerationMixin.adjust_generation_fn).parameters)
        assert params[:13] == [
            "self",
            "generation_config",
            "from_auto_class",
            "from_pipeline",
            "pretrained_model_name_or_path",
            "cache_dir",
            "force_download",
            "proxies",
            "local_files_only",
            "token",
            "revision",
            "subfolder",
            "trust_remote_code",
        ]
    else:
        # 4.x reads the generation config inline (as fastload then does), and probes the Hub for
        # the config's commit unless given `_commit_hash`.
        assert not hasattr(GenerationMixin, "adjust_generation_fn")
        assert "GenerationConfig.from_pretrained(" in source
        assert 'commit_hash = kwargs.pop("_commit_hash", None)' in source
        assert "if commit_hash is None:" in source
        params = list(inspect.signature(GenerationMixin.load_custom_generate).parameters)
        assert params[:3] == ["self", "pretrained_model_name_or_path", "trust_remote_code"]


REMOTE_CONFIG = """
from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"
"""
REMOTE_MODEL = """
from transformers import LlamaForCausalLM

from .configuration_tiny import TinyRemoteConfig


class TinyRemoteModel(LlamaForCausalLM):
    config_class = TinyRemoteConfig
"""


def test_trust_remote_code(models, tmp_path):
    """A model whose code is in the checkpoint (auto_map): run when trust_remote_code=True."""
    import json
    import shutil

    folder = tmp_path / "remote"
    shutil.copytree(models["llama"], folder)
    (folder / "configuration_tiny.py").write_text(REMOTE_CONFIG)
    (folder / "modeling_tiny.py").write_text(REMOTE_MODEL)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "tiny_remote"
    config["auto_map"] = {
        "AutoConfig": "configuration_tiny.TinyRemoteConfig",
        "AutoModelForCausalLM": "modeling_tiny.TinyRemoteModel",
    }
    (folder / "config.json").write_text(json.dumps(config))
    got = check(AutoModelForCausalLM, folder, folder, trust_remote_code=True)
    assert type(got).__name__ == "TinyRemoteModel"


# ---------------------------------------------------------------------------------------------
# The mock Hub


@pytest.fixture(scope="module")
def hub(models):
    hub = MockHub()
    for name, folder in models.items():
        hub.add(f"org/{name}", tree(folder))
    yield hub
    hub.close()


@pytest.fixture
def hub_env(hub, monkeypatch, tmp_path):
    return use_hub(hub, monkeypatch, tmp_path)


@pytest.mark.parametrize("name", ["llama", "sharded", "tied"])
@pytest.mark.parametrize("form", ["org/{name}", "hf://org/{name}", "hf://org/{name}@main"])
def test_from_the_hub(models, hub, hub_env, name, form):
    check(AutoModelForCausalLM, form.format(name=name), models[name])
    # The HF cache holds the small files only; nothing else was written.
    assert not safetensors_under(hub_env / "hf_home", hub_env / "tmp")
    cached = {p.name for p in (hub_env / "hf_home").rglob("*") if p.is_file()}
    assert "config.json" in cached
    # The weights went through fastload's ranged reads of the storage host.
    assert any(r[0] == "GET" and "range" in r[2] for r in hub.requests(hub.storage))


def test_hub_subfolder_and_revision(models, hub, hub_env):
    hub.add("org/nested", {f"ckpt/{k}": v for k, v in tree(models["sharded"]).items()})
    where = {"subfolder": "ckpt", "revision": "main"}
    check(LlamaForCausalLM, "org/nested", models["sharded"], hub_kwargs=where)
    check(LlamaForCausalLM, "hf://org/nested@main/ckpt", models["sharded"])
    assert not safetensors_under(hub_env / "hf_home", hub_env / "tmp")


def test_hub_uris_name_what_a_load_reads(models, hub, hub_env):
    """The small files come from the repo, revision and folder the weights stream from, as
    fastload.load reads the URI: a ``refs/convert/NAME`` revision written as is, and the scheme
    in any case."""
    nested = {f"ckpt/{k}": v for k, v in tree(models["sharded"]).items()}
    hub.add("org/converted", nested)  # main: another model, which must not be read
    converted = {f"ckpt/{k}": v for k, v in tree(models["llama"]).items()}
    hub.add("org/converted", converted, branch="refs/convert/fastload")
    check(LlamaForCausalLM, "hf://org/converted@refs/convert/fastload/ckpt", models["llama"])
    check(LlamaForCausalLM, "HF://org/llama", models["llama"])
    assert not safetensors_under(hub_env / "hf_home", hub_env / "tmp")


@pytest.mark.parametrize("uri", ["hf://org/../llama", "hf://../org/llama", "hf://./llama@main"])
def test_hub_uris_with_dot_segments_in_the_repo_are_refused(hub, hub_env, uri):
    """``.`` and ``..`` as a repo's org or name: ConfigError before anything is fetched, as a
    load refuses them."""
    before = len(hub.requests())
    with pytest.raises(fastload.ConfigError) as e:
        fastload.transformers.from_pretrained(LlamaForCausalLM, uri)
    assert e.value.option == "uri" and ".." in str(e.value)
    assert len(hub.requests()) == before


@pytest.mark.parametrize("var", ["HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"])
def test_small_files_go_to_the_cache_the_environment_names(models, hub, hub_env, monkeypatch, var):
    """The config lands in the Hugging Face cache the environment names when the model is
    loaded, the one the weights' hf:// reads use: the legacy ``HUGGINGFACE_HUB_CACHE`` (over
    ``HF_HOME``) and ``XDG_CACHE_HOME`` (without ``HF_HOME``) included, though huggingface_hub
    read its variables when it was imported."""
    import huggingface_hub  # noqa: F401 (imported before the variable changes)

    named = hub_env / "named"
    monkeypatch.setenv(var, str(named))
    if var == "XDG_CACHE_HOME":
        monkeypatch.delenv("HF_HOME")
    check(AutoModelForCausalLM, "hf://org/llama", models["llama"])
    cache = named if var == "HUGGINGFACE_HUB_CACHE" else named / "huggingface" / "hub"
    assert [p.name for p in (cache / "models--org--llama").rglob("config.json")] == ["config.json"]
    assert not (hub_env / "hf_home").exists()


# ---------------------------------------------------------------------------------------------
# S3 (SeaweedFS)


@pytest.fixture(scope="module")
def bucket(seaweed, models):
    client = seaweed.client()
    files = {}
    for name, folder in models.items():
        for rel, data in tree(folder).items():
            files[f"tf/{name}/{rel}"] = data
    s3_server.upload(client, s3_server.BUCKET, files)
    return seaweed


@pytest.mark.parametrize("name", ["llama", "sharded", "tied"])
def test_from_s3(models, bucket, name, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    uri = f"s3://{s3_server.BUCKET}/tf/{name}/"
    where = {"storage_options": bucket.storage_options()}
    check(AutoModelForCausalLM, uri, models[name], hub_kwargs=where)
    # The small files went to a temporary folder, removed afterwards; no weights on disk.
    assert not list(tmp_path.iterdir())


def test_a_url_password_is_not_kept_in_the_model(models):
    """The URI becomes the model's ``name_or_path`` (saved as config.json's ``_name_or_path``,
    shown in its repr): without the URL's password (issue 29, item 3)."""
    from servers.http import start_server

    server = start_server({f"/m/{k}": v for k, v in tree(models["llama"]).items()})
    try:
        host = server.base.removeprefix("http://")
        uri = f"http://user:PASS_w0rd_9@{host}/m/"
        got = check(AutoModelForCausalLM, uri, models["llama"])
    finally:
        server.close()
    assert got.config.name_or_path == f"http://user:***@{host}/m/"
    assert "PASS_w0rd_9" not in got.config.to_json_string()


def test_small_files_for_a_tokenizer(bucket, tmp_path):
    folder = fastload.transformers.small_files(
        f"s3://{s3_server.BUCKET}/tf/llama",
        storage_options=bucket.storage_options(),
        dest=tmp_path / "small",
    )
    assert (folder / "config.json").is_file() and (folder / "generation_config.json").is_file()
    assert not safetensors_under(tmp_path)


def test_a_failure_while_the_weights_stream_stops_them(hub_env, monkeypatch, tmp_path):
    """The weights stream in a thread while transformers reads the config: when that fails, the
    stream is closed (its reads cancelled: the weights, ~2 MB at 200 KB/s, are not all read) and
    the thread gone; the error is transformers' own."""
    import threading

    from transformers import LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    streams = []
    real = fastload.stream
    monkeypatch.setattr(
        fastload, "stream", lambda *a, **o: streams.append(real(*a, **o)) or streams[-1]
    )
    slow = MockHub(rate=200_000)  # bytes/s
    try:
        slow.add("org/slow", tree(tmp_path / "model"))
        monkeypatch.setenv("HF_ENDPOINT", slow.base)
        with pytest.raises(OSError):
            fastload.transformers.from_pretrained(
                AutoModelForCausalLM, "org/slow", config=str(tmp_path / "no_config_here")
            )
        assert not [t for t in threading.enumerate() if t.name == "fastload-weights"]
        [stream] = streams
        stats = stream.stats()
        assert stats["total_bytes"] > 2_000_000
        assert stats["tensors_delivered"] < stats["tensor_count"], stats
    finally:
        slow.close()
    with pytest.raises(fastload.ConfigError, match="block_size"):
        fastload.transformers.from_pretrained(
            LlamaForCausalLM, tmp_path / "model", load_options={"block_size": "nonsense"}
        )
