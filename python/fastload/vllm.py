"""vLLM integration: ``--load-format fastload`` and ``--load-format fastload_sharded``.

Installing fastload is enough: its ``vllm.general_plugins`` entry point makes every vLLM process
call :func:`register`, which adds two load formats through vLLM's ``register_model_loader``::

    vllm serve MODEL --load-format fastload
    LLM(MODEL, load_format="fastload", model_loader_extra_config={"concurrency": 32})

``model_loader_extra_config`` takes ``concurrency``, ``block_size``, ``memory_limit``,
``storage_options``, ``cache`` (a local copy of remote weights, written while they stream:
``True`` or a directory; see ``fastload.Options``) and ``verify`` as ``fastload.load`` does, plus
``weights_uri`` and ``distributed``.

``fastload`` streams the checkpoint (a local directory, a Hugging Face repo id streamed from the
Hub as ``hf://ORG/REPO@REVISION`` without writing the weights to disk, or an object-store URI
given as ``weights_uri``) into ``model.load_weights``; vLLM still fetches config and tokenizer
files from the Hub as usual. ``fastload_sharded`` reads the per-rank files vLLM's
``save_sharded_state`` writes (``model-rank-{rank}-part-{part}.safetensors``), each worker only its
own, and copies them straight into the model's state dict, as vLLM's ``sharded_state`` does.

This is the only fastload module that imports vllm, and it does so inside functions: importing it
imports neither vllm nor torch, and ``register()`` may run any number of times in any process
(it registers when vLLM imports its loader registry, which only weight-loading processes do).
"""

from __future__ import annotations

import glob
import importlib.abc
import importlib.util
import logging
import os
import string
import sys
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["LOAD_FORMAT", "SHARDED_LOAD_FORMAT", "register"]

LOAD_FORMAT = "fastload"
SHARDED_LOAD_FORMAT = "fastload_sharded"

# A child of vLLM's "vllm" logger, so the lines come out through vLLM's handler and format.
logger = logging.getLogger("vllm.fastload")

# vLLM's own names for the sharded-state files (vllm ShardedStateLoader.TP_ONLY_PATTERN and
# PP_AND_TP_PATTERN); {rank} is the tensor-parallel rank, as in older vLLM releases.
TP_ONLY_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
PP_AND_TP_PATTERN = "model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"
_PATTERN_FIELDS = frozenset({"rank", "tp_rank", "pp_rank", "part"})

_KEYS = frozenset(
    {
        "concurrency",
        "block_size",
        "memory_limit",
        "weights_uri",
        "storage_options",
        "distributed",
        "cache",
        "verify",
    }
)
_SHARDED_KEYS = _KEYS | {"pattern"}
# The keys that are load options, checked and passed on to fastload.stream as given.
_LOAD_KEYS = ("concurrency", "block_size", "memory_limit", "storage_options", "cache", "verify")

# vLLM's loader registry. Importing it costs about 2 s and 700 modules, which the processes that
# never load weights (API server, engine core) would otherwise pay for the plugin alone.
_LOADER_MODULE = "vllm.model_executor.model_loader"
_state = {"registered": False, "hooked": False}


def register() -> None:
    """Registers the ``fastload`` and ``fastload_sharded`` load formats with vLLM.

    vLLM calls this through the ``vllm.general_plugins`` entry point in every process it starts.
    Idempotent and cheap: when vLLM's loader registry is not imported yet, the registration waits
    until vLLM imports it (the processes that load weights do, before they look a format up).
    """
    if _state["registered"] or _state["hooked"]:
        return
    if _LOADER_MODULE in sys.modules:
        _register_now()
    else:
        _state["hooked"] = True
        sys.meta_path.insert(0, _RegisterOnImport())


def _register_now() -> None:
    if _state["registered"]:
        return
    from vllm.model_executor.model_loader import (  # type: ignore[import-not-found]
        register_model_loader,
    )

    loaders = _loader_classes()
    register_model_loader(LOAD_FORMAT)(loaders["FastloadModelLoader"])
    register_model_loader(SHARDED_LOAD_FORMAT)(loaders["FastloadShardedStateLoader"])
    _state["registered"] = True


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """One-shot import hook: registers right after vLLM's loader registry module has run."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _LOADER_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the real one, from the other finders
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            _register_now()

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def __getattr__(name: str) -> Any:
    """``FastloadModelLoader`` and ``FastloadShardedStateLoader``, built on first use."""
    if name in ("FastloadModelLoader", "FastloadShardedStateLoader"):
        return _loader_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class _Options:
    """``model_loader_extra_config``, checked."""

    load_format: str
    weights_uri: str | None = None
    pattern: str | None = None
    stream_kwargs: dict[str, Any] = field(default_factory=dict)
    distributed: bool = False

    @classmethod
    def parse(cls, load_format: str, extra: Any, allowed: frozenset[str]) -> _Options:
        from . import ConfigError, _fastload

        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ConfigError(
                f"model_loader_extra_config for load format {load_format!r} must be a dict, "
                f"not {type(extra).__name__}"
            )
        unknown = sorted(set(extra) - allowed, key=str)
        if unknown:
            hint = ""
            if "pattern" in unknown and load_format == LOAD_FORMAT:
                hint = f" ('pattern' belongs to load format {SHARDED_LOAD_FORMAT!r})"
            raise ConfigError(
                f"unknown model_loader_extra_config key(s) for load format {load_format!r}: "
                f"{', '.join(map(repr, unknown))}{hint}; "
                f"valid keys: {', '.join(sorted(allowed))}"
            )
        distributed = extra.get("distributed", False)
        if not isinstance(distributed, bool):
            raise ConfigError(
                f"distributed must be true or false, got {distributed!r}", option="distributed"
            )

        stream_kwargs = {k: extra[k] for k in _LOAD_KEYS if extra.get(k) is not None}
        # Checked now, at engine start, by the same code that reads them at load time (a bad
        # value raises ConfigError naming the key).
        _fastload.resolve_options(**stream_kwargs)

        weights_uri = extra.get("weights_uri")
        if weights_uri is not None:
            if not isinstance(weights_uri, (str, os.PathLike)) or not os.fspath(weights_uri):
                raise ConfigError(
                    "weights_uri must be a non-empty path or URI", option="weights_uri"
                )
            weights_uri = os.fspath(weights_uri)
        pattern = extra.get("pattern")
        if pattern is not None:
            _check_pattern(pattern)
        return cls(load_format, weights_uri, pattern, stream_kwargs, distributed)


def _check_pattern(pattern: Any) -> None:
    from . import ConfigError

    if not isinstance(pattern, str) or not pattern:
        raise ConfigError("pattern must be a non-empty string", option="pattern")
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(pattern) if f is not None}
    except ValueError as e:
        raise ConfigError(
            f"pattern {pattern!r} is not a valid format string: {e}", option="pattern"
        ) from None
    if fields - _PATTERN_FIELDS:
        raise ConfigError(
            f"pattern {pattern!r} uses {', '.join(sorted(fields - _PATTERN_FIELDS))}; "
            f"the fields it may use are {', '.join(sorted(_PATTERN_FIELDS))}",
            option="pattern",
        )


def _is_url(uri: str) -> bool:
    """Whether fastload reads ``uri`` itself (no download): a ``file:`` URL, which fastload's
    local path resolution takes, or an object-store URI, whose schemes the native module owns
    (``_fastload.SCHEMES``)."""
    from . import _fastload

    return uri.startswith("file:") or _fastload.is_remote_uri(uri)


def _weights_location(options: _Options, model_config: Any) -> str:
    """Where the weights are: ``weights_uri``, else ``model_weights`` (the original object-store
    URI when vLLM pulled config files to a local directory), else ``model``."""
    return options.weights_uri or getattr(model_config, "model_weights", "") or model_config.model


# Weight files a Hub download leaves out when fastload streams the safetensors from the Hub.
_WEIGHT_PATTERNS = ["*.safetensors", "*.bin", "*.pt", "*.pth"]


def _hub_uri(repo: str, revision: str | None) -> str | None:
    """``hf://ORG/REPO[@REVISION]`` for a Hugging Face repo id, which fastload streams from the
    Hub; None where vLLM's download must be used instead (ModelScope, a name without an org)."""
    if os.environ.get("VLLM_USE_MODELSCOPE", "").strip().lower() in ("1", "true"):
        return None
    org, _, name = repo.partition("/")
    if not org or not name or "/" in name or org in (".", ".."):
        return None
    at = f"@{urllib.parse.quote(revision, safe='')}" if revision else ""
    return f"hf://{repo}{at}"


def _download_all_but_weights(load_config: Any, repo: str, revision: str | None) -> str:
    """A Hub repo's files but the weights (config, tokenizer, ...), into vLLM's download dir."""
    import huggingface_hub

    ignore = load_config.ignore_patterns or []
    ignore = [ignore] if isinstance(ignore, str) else list(ignore)
    return str(
        huggingface_hub.snapshot_download(
            repo,
            revision=revision,
            cache_dir=load_config.download_dir,
            ignore_patterns=[*ignore, *_WEIGHT_PATTERNS],
            local_files_only=huggingface_hub.constants.HF_HUB_OFFLINE,
        )
    )


def _download(load_config: Any, repo: str, revision: str | None, index: bool) -> str:
    """A Hugging Face (or ModelScope) repo's safetensors, fetched with vLLM's own helpers."""
    from vllm.model_executor.model_loader import (  # type: ignore[import-not-found]
        weight_utils,
    )

    modelscope = getattr(weight_utils, "maybe_download_from_modelscope", None)
    if modelscope is not None:
        local = modelscope(repo, revision)
        if local:
            return str(local)
    folder = weight_utils.download_weights_from_hf(
        repo,
        load_config.download_dir,
        ["*.safetensors"],
        revision,
        ignore_patterns=load_config.ignore_patterns,
    )
    if index:
        # Repos that hold both sharded and consolidated files: the index says which to load.
        weight_utils.download_safetensors_index_file_from_hf(
            repo, "model.safetensors.index.json", load_config.download_dir, revision=revision
        )
    return str(folder)


def _device(recorded: Any, model: Any) -> torch.device:
    """The device fastload streams to: the worker's load device when fastload can write there."""
    import torch

    import fastload

    device = recorded
    if device is None:
        # load_weights called on its own (weight reloads): the model already sits on its device.
        devices = (p.device for p in model.parameters() if p.device.type != "meta")
        device = next(devices, "cpu")
    device = torch.device(device)
    if device.type == "cuda" and getattr(torch.version, "hip", None):
        device = torch.device("cpu")  # ROCm: stream to host, the weight loaders copy over.
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in fastload.DEVICE_TYPES:
        # A device fastload does not write to (XPU, TPU, ...): stream to host memory, as vLLM's
        # own loaders do; the weight loaders copy into the parameters on the device.
        device = torch.device("cpu")
    return device


class _Meter:
    """Bytes delivered, and the log line vLLM users look for."""

    def __init__(self) -> None:
        self.bytes = 0
        self.start = time.perf_counter()

    def count(self, items: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in items:
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def log(self) -> None:
        seconds = time.perf_counter() - self.start
        rate = self.bytes / seconds / 1e9 if seconds > 0 else float("inf")
        logger.info("Loading weights took %.2f seconds (%.2f GB/s)", seconds, rate)


def _world_group(device: Any) -> Any:
    """vLLM's world group for a shared read (fastload.distributed), or None for a lone worker."""
    from vllm.distributed import get_world_group  # type: ignore[import-not-found]

    world = get_world_group()
    if world.world_size <= 1:
        return None
    # Host tensors travel over the gloo group; device tensors over the device (NCCL) group.
    return world.cpu_group if str(device).startswith("cpu") else world.device_group


def _stream(uri: Any, device: Any, options: _Options, prefix: str = "") -> Iterator[Any]:
    import fastload

    group = _world_group(device) if options.distributed else None
    kwargs = dict(options.stream_kwargs)
    if group is not None:
        # Every worker of the model reads 1/N of the bytes and gets the rest from the others.
        kwargs["process_group"] = group
    with fastload.stream(uri, device=device, **kwargs) as tensors:
        for name, tensor in tensors:
            yield prefix + name, tensor


@contextmanager
def _released() -> Iterator[None]:
    """Runs a load, then gives back the host memory fastload keeps for a next load (the pinned
    staging ring of GPU loads, freed host buffers): a vLLM worker loads its weights once, and
    that memory would otherwise stay with it while it serves."""
    import fastload

    try:
        yield
    finally:
        freed = fastload.release_memory()
        logger.debug("fastload gave back %s bytes of cached host memory", freed)


def _check_all_loaded(model: Any, model_config: Any, loaded: Any) -> None:
    """The check vLLM's default loader makes on unquantized models: every parameter was loaded."""
    if getattr(model_config, "quantization", None) is not None or not isinstance(loaded, set):
        return
    loaded = set(loaded)
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "uses_meta_device", False) or getattr(
            method, "process_weights_after_loading", None
        ):
            loaded.update(f"{name}.{p}" if name else p for p, _ in module.named_parameters())
    missing = {name for name, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"Following weights were not initialized from checkpoint: {missing}")


@cache
def _loader_classes() -> dict[str, type]:
    from vllm.model_executor.model_loader.base_loader import (  # type: ignore[import-not-found]
        BaseModelLoader,
    )

    class _Loader(BaseModelLoader):  # type: ignore[misc]
        _allowed = _KEYS
        # Repo ids become hf:// URIs streamed from the Hub (else: downloaded first).
        _stream_hub = False

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.options = _Options.parse(
                load_config.load_format, load_config.model_loader_extra_config, self._allowed
            )
            self._load_device: Any = None

        def load_model(self, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
            # load_weights() is not told the device; vLLM builds the model on this one.
            load_device = getattr(vllm_config.load_config, "device", None)
            self._load_device = load_device or vllm_config.device_config.device
            return super().load_model(vllm_config, *args, **kwargs)

        def _location(self, model_config: Any, index: bool) -> str:
            """A local path or URL fastload can read; repo ids are downloaded first."""
            location = _weights_location(self.options, model_config)
            if _is_url(location) or os.path.exists(location):
                return location
            revision = model_config.revision if location == model_config.model else None
            hub = _hub_uri(location, revision) if self._stream_hub else None
            return hub or _download(self.load_config, location, revision, index)

    class FastloadModelLoader(_Loader):
        """``load_format="fastload"``: a safetensors checkpoint streamed into
        ``model.load_weights``."""

        _stream_hub = True

        def download_model(self, model_config: Any) -> None:
            location = self._location(model_config, index=True)
            if location.startswith("hf://"):
                # Everything but the weights, which load_weights streams from the Hub.
                repo = _weights_location(self.options, model_config)
                revision = model_config.revision if repo == model_config.model else None
                _download_all_but_weights(self.load_config, repo, revision)

        def _sources(self, model: Any, model_config: Any) -> list[tuple[Any, str]]:
            """(uri, prefix) for the checkpoint and any secondary weights the model asks for."""
            root = self._location(model_config, index=True)
            sources: list[tuple[Any, str]] = [(self._apply_overrides(model, root), "")]
            for extra in getattr(model, "secondary_weights", ()):
                where = extra.model_or_path
                if not (_is_url(where) or os.path.exists(where)):
                    where = _hub_uri(where, extra.revision) or _download(
                        self.load_config, where, extra.revision, index=True
                    )
                if getattr(extra, "subfolder", None):
                    where = where.rstrip("/") + "/" + extra.subfolder
                sources.append((where, getattr(extra, "prefix", "")))
            return sources

        @staticmethod
        def _apply_overrides(model: Any, root: str) -> Any:
            # A model may name its weight files itself (vLLM's allow_patterns_overrides).
            patterns = getattr(model, "allow_patterns_overrides", None)
            if not patterns or not os.path.isdir(root):
                return root
            for pattern in patterns:
                files = sorted(glob.glob(os.path.join(root, pattern)))
                if files:
                    return files
            return root

        def load_weights(self, model: Any, model_config: Any) -> None:
            device = _device(self._load_device, model)
            sources = self._sources(model, model_config)
            meter = _Meter()

            def weights() -> Iterator[tuple[str, Any]]:
                for uri, prefix in sources:
                    yield from _stream(uri, device, self.options, prefix)

            with _released():
                loaded = model.load_weights(meter.count(weights()))
            meter.log()
            _check_all_loaded(model, model_config, loaded)

    class FastloadShardedStateLoader(_Loader):
        """``load_format="fastload_sharded"``: the files vLLM's ``save_sharded_state`` wrote,
        each worker reading only its own and copying them into its state dict."""

        _allowed = _SHARDED_KEYS

        def download_model(self, model_config: Any) -> None:
            self._location(model_config, index=False)

        def _files(self, root: str) -> list[str]:
            name = _render_pattern(self.options.pattern, part="*")
            if _is_url(root):
                files = self._probe(root)
            else:
                files = sorted(glob.glob(os.path.join(glob.escape(root), name)))
            if not files:
                raise FileNotFoundError(
                    f"no sharded-state files {name!r} in {root!r}: write them with vLLM's "
                    f"save_sharded_state (with the same tensor/pipeline parallel sizes), or use "
                    f"load_format={LOAD_FORMAT!r} for an ordinary checkpoint"
                )
            return files

        def _probe(self, root: str) -> list[str]:
            """This rank's objects under a URL prefix: parts 0, 1, ... as save_model numbers them
            (no listing, and no other rank's object is touched)."""
            import fastload

            options = self.options.stream_kwargs.get("storage_options")
            files: list[str] = []
            while True:
                uri = (
                    root.rstrip("/") + "/" + _render_pattern(self.options.pattern, part=len(files))
                )
                if files and uri == files[-1]:
                    return files  # a pattern without {part}: one file per rank
                try:
                    fastload.inspect(uri, storage_options=options)
                except FileNotFoundError:
                    return files
                files.append(uri)

        def load_weights(self, model: Any, model_config: Any) -> None:
            from vllm.model_executor.model_loader import (  # type: ignore[import-not-found]
                sharded_state_loader,
            )

            device = _device(self._load_device, model)
            files = self._files(self._location(model_config, index=False))
            filter_subtensors = sharded_state_loader.ShardedStateLoader._filter_subtensors
            state_dict = filter_subtensors(model.state_dict())
            meter = _Meter()
            # Each rank reads its own files: nothing to share over the group.
            own = replace(self.options, distributed=False)
            with _released():
                for key, tensor in meter.count(_stream(files, device, own)):
                    param = state_dict.pop(key, None)
                    if param is None:
                        raise ValueError(f"{key!r} in {files} is not a parameter of this model")
                    _copy_into(param, tensor, key)
            meter.log()
            if state_dict:
                raise ValueError(f"Missing keys {tuple(state_dict)} in loaded state!")

    loaders: dict[str, type] = {}
    for cls in (FastloadModelLoader, FastloadShardedStateLoader):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
        loaders[cls.__name__] = cls
    return loaders


def _copy_into(param: Any, tensor: Any, key: str) -> None:
    """As vLLM's sharded_state loader: LoRA may pad a parameter, so copy into a narrowed view."""
    if param.dtype != tensor.dtype:
        logger.warning(
            "loading weight %s with dtype %s into a parameter of dtype %s",
            key,
            tensor.dtype,
            param.dtype,
        )
    data = param.data
    for dim, size in enumerate(tensor.shape):
        if size < data.shape[dim]:
            data = data.narrow(dim, 0, size)
    if tensor.shape != param.shape:
        logger.warning(
            "loading tensor of shape %s into parameter %r of shape %s",
            tuple(tensor.shape),
            key,
            tuple(param.shape),
        )
    data.copy_(tensor)


def _render_pattern(pattern: str | None, part: str | int) -> str:
    """This worker's file name, the way vLLM's ShardedStateLoader renders it."""
    from vllm.distributed import get_pp_group, get_tp_group  # type: ignore[import-not-found]

    from . import ConfigError

    tp, pp = get_tp_group(), get_pp_group()
    if pattern is None:
        pattern = PP_AND_TP_PATTERN if pp.world_size > 1 else TP_ONLY_PATTERN
    fields = {f for _, f, _, _ in string.Formatter().parse(pattern) if f is not None}
    if pp.world_size > 1 and "pp_rank" not in fields:
        raise ConfigError(
            f"pattern {pattern!r} needs {{pp_rank}} with pipeline parallelism", option="pattern"
        )
    if tp.world_size > 1 and not fields & {"rank", "tp_rank"}:
        raise ConfigError(
            f"pattern {pattern!r} needs {{rank}} with tensor parallelism", option="pattern"
        )
    return pattern.format(
        rank=tp.rank_in_group, tp_rank=tp.rank_in_group, pp_rank=pp.rank_in_group, part=part
    )
