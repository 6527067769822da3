"""fastload inside the real SGLang (PyPI's ``sglang`` 0.5.23, installed without its CUDA-only
dependencies: requirements-sglang.txt): ``load_format=FastloadModelLoader`` and, through the
``sglang.srt.plugins`` entry point, ``load_format="fastload"``.

SGLang's engine does not start on a machine without CUDA (its CPU engine needs the CPU build of
``sgl_kernel``, which PyPI does not carry), so the tests go as far as SGLang runs here: its
parallel state (a gloo group and its model-parallel groups, as SGLang's own layer tests set them
up), its ``ModelConfig``/``LoadConfig``/``get_model_loader``, and its own ``LlamaForCausalLM``
built and loaded by the loader's ``load_model``. Every parameter loaded by fastload must be
bitwise the one SGLang's ``DefaultModelLoader`` loads from the same checkpoint.

SGLang keeps process-wide state, so each load runs in a subprocess: this file is also the script
they run (``python tests/test_sglang.py MODE WORK RESULT.json``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from servers.s3 import rendezvous_port

ROOT = Path(__file__).resolve().parent.parent
HUB_REPO = "org/tiny-llama"
S3_BUCKET = "models"

needs_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None,
    reason="sglang is not installed (pip install --no-deps -r requirements-sglang.txt)",
)


# ---------------------------------------------------------------- driver (runs in a subprocess)


def init_sglang(model: Path) -> None:
    """SGLang's parallel state for one CPU process over gloo, as
    ``sglang.test.layer_ut_utils.init_single_process_dist`` sets it up (that module imports
    SGLang's benchmark tools, which need ``datasets``). More ranks do not go on CPU: SGLang gives
    every model-parallel group of two or more ranks a PyNcclCommunicator, which wants CUDA."""
    # Neither CUDA nor SGLang's CPU engine (SGLANG_USE_CPU_ENGINE, which needs the CPU build of
    # sgl_kernel) is here, so SGLang's rotary embedding would import vLLM's CUDA op at
    # construction; told it runs on CPU, it keeps its native implementation. Loading weights
    # does not touch it.
    import sglang.srt.layers.rotary_embedding.base as rope
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    rope._is_cpu = True
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    args = ServerArgs(model_path=str(model), device="cpu", tp_size=1)
    publish(args, role="test", ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    parallel_state.initialize_model_parallel(backend="gloo")


def load(model_path: str, load_format, extra=None) -> tuple[str, dict]:
    """Builds SGLang's ModelConfig and LoadConfig, asks SGLang's get_model_loader for the loader
    and loads the model on CPU; returns the loader's class name and every parameter."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model_loader

    model_config = ModelConfig(model_path, dtype="bfloat16")
    load_config = LoadConfig(load_format=load_format, model_loader_extra_config=extra or {})
    loader = get_model_loader(load_config, model_config)
    model = loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
    assert type(model).__module__ == "sglang.srt.models.llama", type(model)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return type(loader).__name__, params


def same_bits(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def compare(expected: dict, got: dict) -> list[str]:
    """Names whose tensors differ (dtype, shape or any bit), or that only one side has."""
    names = sorted(set(expected) ^ set(got))
    names += [n for n in sorted(set(expected) & set(got)) if not same_bits(expected[n], got[n])]
    return names


def resolve_args(argv: list[str]):
    """``launch_server``'s steps: plugins loaded, the command line parsed, the arguments resolved
    (SGLang's resolution pipeline, where the plugin's steps run); returns the load format."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    args = prepare_server_args([*argv, "--device", "cpu"])
    args.resolve_once()
    return resolving_view(args).load_format


def run_driver(mode: str, work: Path, out: Path) -> None:
    import torch
    from safetensors.torch import load_file

    results: dict = {}
    model = work / "tiny-llama"
    if mode == "s3_model":
        # --model-path s3://... --load-format fastload, before any parallel state exists (the
        # launcher resolves its arguments first).
        uri = f"s3://{S3_BUCKET}/sglang/tiny-llama"
        extra = json.dumps({"storage_options": json.loads(os.environ["S3_TEST_STORAGE_OPTIONS"])})
        results["local_format"] = resolve_args(
            ["--model-path", str(model), "--load-format", "fastload"]
        )
        try:
            fmt = resolve_args(
                [
                    "--model-path",
                    uri,
                    "--load-format",
                    "fastload",
                    "--model-loader-extra-config",
                    extra,
                ]
            )
            results["s3_format"] = fmt
        except Exception as e:
            results["s3_format"] = f"{type(e).__name__}: {e}"
            out.write_text(json.dumps(results, default=str))
            return
        from sglang.srt.utils.runai_utils import ObjectStorageModel

        results["pulled"] = sorted(os.listdir(ObjectStorageModel.get_path(uri)))
    init_sglang(model)

    import fastload.sglang
    from fastload.sglang import FastloadModelLoader

    name, reference = load(str(model), "auto")
    results["reference_loader"] = name
    results["parameters"] = len(reference)
    # The reference did load the checkpoint (not left SGLang's initial values).
    on_disk = {}
    for f in sorted(model.glob("*.safetensors")):
        on_disk.update(load_file(f))
    results["reference_is_checkpoint"] = same_bits(
        reference["model.embed_tokens.weight"], on_disk["model.embed_tokens.weight"]
    ) and same_bits(reference["lm_head.weight"], on_disk["lm_head.weight"])

    def check(step: str, model_path: str, load_format, extra=None) -> None:
        try:
            loader_name, params = load(model_path, load_format, extra)
        except Exception as e:  # recorded: the test prints it
            results[step] = f"{type(e).__name__}: {e}"
            return
        results[step] = {"loader": loader_name, "differ": compare(reference, params)}

    if mode == "local":
        check("class", str(model), FastloadModelLoader)
        check("class_options", str(model), FastloadModelLoader, {"concurrency": 2})
        # distributed asks SGLang's TP group (one rank here: a plain read).
        check("distributed", str(model), FastloadModelLoader, {"distributed": True})
        # The plugin as SGLang runs it: its entry point found by load_plugins(), the hook applied.
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.plugins import load_plugins

        load_plugins()
        results["plugin_registered"] = fastload.sglang._state["registered"]
        results["plugin_load_format"] = repr(LoadConfig(load_format="fastload").load_format)
        check("string", str(model), "fastload")
        check("string_upper", str(model), "FastLoad")
        try:
            LoadConfig(load_format="fastload", model_loader_extra_config={"pattern": "x"})
        except Exception as e:
            results["bad_key"] = f"{type(e).__name__}: {e}"
        from sglang.srt.configs.load_config import LoadFormat

        results["auto_still_enum"] = LoadConfig(load_format="auto").load_format is LoadFormat.AUTO
    elif mode == "hub":
        check("hub", HUB_REPO, FastloadModelLoader)
        cache = Path(os.environ["HF_HUB_CACHE"])
        results["files_in_cache"] = sorted(p.name for p in cache.rglob("*") if p.is_file())
    elif mode == "s3_model":
        extra = {"storage_options": json.loads(os.environ["S3_TEST_STORAGE_OPTIONS"])}
        check("s3_model", f"s3://{S3_BUCKET}/sglang/tiny-llama", "fastload", extra)
    elif mode == "s3":
        config_only = work / "config-only"
        check(
            "s3_weights_uri",
            str(config_only),
            FastloadModelLoader,
            {
                "weights_uri": f"s3://{S3_BUCKET}/sglang/tiny-llama/",
                "storage_options": json.loads(os.environ["S3_TEST_STORAGE_OPTIONS"]),
            },
        )
    results["torch"] = torch.__version__
    out.write_text(json.dumps(results, default=str))


# ---------------------------------------------------------------- tests (run in the test venv)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from hf_models import write_engine_llama

    work = tmp_path_factory.mktemp("sglang")
    write_engine_llama(work / "tiny-llama")
    return work


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for var in [v for v in env if v.startswith(("FASTLOAD_", "AWS_", "SGLANG_"))]:
        del env[var]
    env.update(
        HF_HUB_OFFLINE="1",
        AWS_EC2_METADATA_DISABLED="true",
        TOKENIZERS_PARALLELISM="false",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(rendezvous_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    env.update(extra)
    return env


def _driver(mode: str, work: Path, **env: str) -> dict:
    out = work / f"{mode}.json"
    proc = subprocess.run(
        [sys.executable, __file__, mode, str(work), str(out)],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_import_needs_neither_sglang_nor_torch():
    code = "import sys, fastload.sglang; print('sglang' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@needs_sglang
def test_entry_point():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("fastload") == "fastload.sglang:register", eps


@needs_sglang
def test_hook_points_exist():
    """What the plugin hooks, pinned: a SGLang release that moves one fails here by name."""
    import importlib

    from fastload import sglang

    module, _, attr = sglang.VERIFY_TARGET.rpartition(".")
    owner = importlib.import_module(module.rpartition(".")[0])
    cls = getattr(owner, module.rpartition(".")[2])
    assert callable(getattr(cls, attr, None)), f"{sglang.VERIFY_TARGET} is gone"
    choices = importlib.import_module(sglang.CHOICES_MODULE)
    assert isinstance(choices.LOAD_FORMAT_CHOICES, list)
    assert callable(choices.add_load_format_choices)
    from sglang.srt.arg_groups import resolution_hooks
    from sglang.srt.model_loader import loader

    for step in sglang.RESOLUTION_STEPS:
        assert step in resolution_hooks._OVERRIDABLE_HOOKS, step
    # The loader's building blocks: DefaultModelLoader's own steps.
    for name in ("_get_quantization_config", "_initialize_model", "BaseModelLoader"):
        assert hasattr(loader, name), name
    for name in ("load_weights_and_postprocess", "_filter_mtp_weights"):
        assert callable(getattr(loader.DefaultModelLoader, name, None)), name
    from sglang.srt.utils.runai_utils import SUPPORTED_SCHEMES, ObjectStorageModel

    assert tuple(SUPPORTED_SCHEMES) == sglang.OBJECT_STORE_SCHEMES
    assert callable(ObjectStorageModel.get_path)


@needs_sglang
@pytest.mark.slow
def test_matches_default_loader(work):
    """The class and the plugin's string, local folder: every parameter of SGLang's
    LlamaForCausalLM bitwise the one DefaultModelLoader loads."""
    r = _driver("local", work)
    assert r["reference_loader"] == "DefaultModelLoader"
    assert r["reference_is_checkpoint"] is True
    assert r["parameters"] >= 2 + 2 * 6, r
    for step in ("class", "class_options", "distributed", "string", "string_upper"):
        assert r[step] == {"loader": "FastloadModelLoader", "differ": []}, (step, r[step])
    assert r["plugin_registered"] is True
    assert "fastload.sglang.FastloadModelLoader" in r["plugin_load_format"], r
    assert r["auto_still_enum"] is True
    assert r["bad_key"].startswith("ConfigError"), r["bad_key"]
    assert "'pattern'" in r["bad_key"] and "valid keys" in r["bad_key"], r["bad_key"]


@needs_sglang
@pytest.mark.slow
def test_repo_id_streams_from_the_hub(work, tmp_path):
    """``model_path=ORG/REPO``: SGLang's ModelConfig reads the config from the mock Hub, fastload
    streams the weights from it (ranged GETs, nothing written to the cache)."""
    from hf_models import engine_hub

    with engine_hub(work / "tiny-llama", HUB_REPO, tmp_path / "hf_home") as (hub, env):
        r = _driver("hub", work, **env)
        assert r["hub"] == {"loader": "FastloadModelLoader", "differ": []}, r["hub"]
        assert not [n for n in r["files_in_cache"] if n.endswith(".safetensors")], r
        storage = hub.requests(hub.storage)
        ours = [q for q in storage if q[2].get("user-agent", "").startswith("fastload/")]
        assert ours and all("range" in q[2] for q in ours), storage


@needs_sglang
@pytest.mark.slow
def test_weights_uri_from_s3(work, seaweed):
    """Config in a local folder without weights, the weights from SeaweedFS (``weights_uri`` with
    ``storage_options``): the same parameters as DefaultModelLoader from the local folder."""
    import shutil

    from servers import s3 as s3_server

    model = work / "tiny-llama"
    config_only = work / "config-only"
    config_only.mkdir(exist_ok=True)
    shutil.copy(model / "config.json", config_only / "config.json")
    s3_server.upload_dir(seaweed.client(), S3_BUCKET, "sglang/tiny-llama", model)
    options = json.dumps(seaweed.storage_options())
    r = _driver("s3", work, S3_TEST_STORAGE_OPTIONS=options)
    assert r["s3_weights_uri"] == {"loader": "FastloadModelLoader", "differ": []}, r


@needs_sglang
@pytest.mark.slow
def test_object_store_model_path(work, seaweed, tmp_path):
    """``--model-path s3://... --load-format fastload`` through SGLang's argument resolution: the
    plugin keeps the format (SGLang would switch to runai_streamer, which is not installed) and
    pulls the config through fastload's object-store client; then the weights stream from S3."""
    from fastload import _fastload
    from servers import s3 as s3_server

    s3_server.upload_dir(seaweed.client(), S3_BUCKET, "sglang/tiny-llama", work / "tiny-llama")
    options = json.dumps(seaweed.storage_options())
    env = {"S3_TEST_STORAGE_OPTIONS": options, "SGLANG_CACHE_DIR": str(tmp_path / "cache")}
    r = _driver("s3_model", work, SGLANG_PLUGINS="fastload", **env)
    assert r["local_format"] == "fastload", r
    if not hasattr(_fastload, "list_objects"):
        # This build's native module cannot list a prefix yet: one clear error, no runai import.
        assert r["s3_format"].startswith("ConfigError"), r
        assert "weights_uri" in r["s3_format"], r
        return
    assert r["s3_format"] == "fastload", r
    assert "config.json" in r["pulled"], r
    assert not [n for n in r["pulled"] if n.endswith(".safetensors")], r
    assert r["s3_model"] == {"loader": "FastloadModelLoader", "differ": []}, r


if __name__ == "__main__":
    run_driver(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
