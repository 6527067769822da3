"""vLLM integration: ``--load-format fastload`` and ``--load-format fastload_sharded``.

Installing fastload is enough: its ``vllm.general_plugins`` entry point makes every vLLM process
call :func:`register`, which adds two load formats through vLLM's ``register_model_loader``::

    vllm serve MODEL --load-format fastload
    LLM(MODEL, load_format="fastload", model_loader_extra_config={"concurrency": 32})

``model_loader_extra_config`` takes ``concurrency``, ``block_size``, ``memory_limit``,
``copy_streams`` (copy queues to the GPU), ``storage_options``, ``cache`` (a local copy of
remote weights, written while they stream: ``True`` or a directory; see ``fastload.Options``),
``verify``, ``keyset`` and
``associated_data`` (a Tink-encrypted checkpoint: docs/encryption.md), ``peers`` and
``peer_token`` (serves holding the same checkpoint: docs/peers.md) as ``fastload.load`` does,
plus ``weights_uri``, ``distributed`` and ``slices``.

Where the model is split over workers (tensor or pipeline parallel, experts spread), ``fastload``
hands ``model.load_weights`` lazy tensors (``fastload._lazy``): vLLM's weight loaders narrow each
to the rank's rows or columns before they copy it, and only those bytes are read; tensors of
layers on other pipeline stages, or of other ranks' experts, are never read; row-parallel
weights (a column block per rank) are read once over the tensor-parallel group, each rank a block
of rows, and exchanged (``fastload._exchange``); anything else (a weight loader that transforms
a tensor first) reads the region it asks for, whole at worst.
``slices: false`` streams whole tensors instead (as ``distributed: true`` alone does, which
shares them over the group); ``slices: true`` reads lazily on a lone worker too, and with
``distributed: true`` the tensors a worker reads whole (norms, KV heads every worker keeps) are
read once by the tensor-parallel group and broadcast, slices still each worker's own.

``fastload`` streams the checkpoint (a local directory, a Hugging Face repo id streamed from the
Hub as ``hf://ORG/REPO@REVISION`` without writing the weights to disk, an object-store model path
``s3://``/``gs://``/``az://``, or an object-store URI given as ``weights_uri``) into
``model.load_weights``; vLLM still fetches config and tokenizer files from the Hub as usual, and
for an object-store model path the plugin pulls them with fastload's own client first (see
``_hook_engine_args``). ``fastload_sharded`` reads the per-rank files vLLM's
``save_sharded_state`` writes (``model-rank-{rank}-part-{part}.safetensors``), each worker only its
own, and copies them straight into the model's state dict, as vLLM's ``sharded_state`` does.

This is the only fastload module that imports vllm, and it does so inside functions: importing it
imports neither vllm nor torch, and ``register()`` may run any number of times in any process
(it registers when vLLM imports its loader registry, which only weight-loading processes do).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib.abc
import importlib.util
import logging
import os
import string
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from . import _integration
from ._integration import KEYS as _LOAD_KEYS
from ._integration import is_url as _is_url

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

# ``slices`` is the plain format's (sliced reads, see _sliced); ``pattern`` the sharded one's.
_KEYS = _LOAD_KEYS | {"slices"}
_SHARDED_KEYS = _LOAD_KEYS | {"pattern"}

# vLLM's loader registry. Importing it costs about 2 s and 700 modules, which the processes that
# never load weights (API server, engine core) would otherwise pay for the plugin alone.
_LOADER_MODULE = "vllm.model_executor.model_loader"
_state: dict[str, Any] = {
    "registered": False,
    "hooked": False,
    "args_hooked": False,
    # "installed" or "missing" once vLLM's EngineArgs module has been seen.
    "object_store_hook": None,
}


def register() -> None:
    """Registers the ``fastload`` and ``fastload_sharded`` load formats with vLLM, and lets them
    take object-store model paths (``s3://``, ``gs://``, ``az://``: see :func:`_hook_engine_args`).

    vLLM calls this through the ``vllm.general_plugins`` entry point in every process it starts.
    Idempotent and cheap: when vLLM's loader registry (or its ``EngineArgs`` module) is not
    imported yet, the work waits until vLLM imports it (the processes that load weights import
    the registry before they look a format up; those that build the config, ``EngineArgs``).
    """
    if not _state["args_hooked"]:
        _state["args_hooked"] = True
        if _ARGS_MODULE in sys.modules:
            _hook_engine_args(sys.modules[_ARGS_MODULE])
        else:
            sys.meta_path.insert(0, _RunOnImport(_ARGS_MODULE, _hook_engine_args))
    if _state["registered"] or _state["hooked"]:
        return
    if _LOADER_MODULE in sys.modules:
        _register_now()
    else:
        _state["hooked"] = True
        sys.meta_path.insert(0, _RunOnImport(_LOADER_MODULE, lambda _: _register_now()))


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


class _RunOnImport(importlib.abc.MetaPathFinder):
    """One-shot import hook: calls ``then(module)`` right after the module ``name`` has run."""

    def __init__(self, name: str, then: Callable[[Any], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the real one, from the other finders
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module
        then = self.then

        def exec_then_run(module: Any) -> None:
            exec_module(module)
            then(module)

        spec.loader.exec_module = exec_then_run  # type: ignore[method-assign]
        return spec


# ---------------------------------------------------------------- object-store model paths
#
# vLLM (0.32, 0.33) takes `s3://`, `gs://` and `az://` model paths for its allow-listed load
# formats only: ModelConfig.__post_init__ pulls config and tokenizer files with
# runai-model-streamer (vllm.transformers_utils.runai_utils.ObjectStorageModel) into a local
# folder and sets `model_weights` to the URI; VllmConfig.__post_init__ then refuses any load
# format but 'runai_streamer', 'runai_streamer_sharded' and 'modelexpress'. Both run inside
# EngineArgs.create_engine_config, which LLM() and `vllm serve` call in the process that builds
# the config. Wrapped, it pulls those files with fastload's own object-store client into a local
# folder first, so vLLM never sees the URI as its model path, and sets `model_weights` to the URI
# once the config is built: the loaders stream the weights from there
# (`_integration.Loader._weights_location`).

_ARGS_MODULE = "vllm.engine.arg_utils"
_HOOK_NAME = "EngineArgs.create_engine_config"
_FORMATS = (LOAD_FORMAT, SHARDED_LOAD_FORMAT)
_WEIGHTS_URI_ATTR = "_fastload_model_weights"


def _is_object_store(path: Any) -> bool:
    """A model path fastload pulls config files from: an object-store URI it can list (not the
    Hub's hf://, which vLLM's Hub code handles, nor plain http(s)://, which cannot list)."""
    from . import _fastload

    if not isinstance(path, str) or not _fastload.is_remote_uri(path):
        return False
    return path.split("://", 1)[0].lower() not in ("hf", "http", "https")


def _hook_engine_args(module: Any) -> None:
    """Wraps ``EngineArgs.create_engine_config`` (see the comment above); where this vLLM has
    none, object-store model paths with our formats get one clear error instead."""
    engine_args = getattr(module, "EngineArgs", None)
    original = getattr(engine_args, "create_engine_config", None)
    if not callable(original):
        _state["object_store_hook"] = "missing"
        _refuse_without_hook(engine_args)
        return
    if getattr(original, "_fastload_hook", False):
        return

    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        uri = _pull_object_store_model(self)
        config = original(self, *args, **kwargs)
        if uri:
            # After VllmConfig checked its allow-list: the loaders read the weights from here.
            config.model_config.model_weights = uri
        return config

    create_engine_config._fastload_hook = True  # type: ignore[attr-defined]
    assert engine_args is not None
    engine_args.create_engine_config = create_engine_config
    _state["object_store_hook"] = "installed"


def _no_hook_error(path: str) -> Exception:
    from . import ConfigError

    return ConfigError(
        f"model {path!r}: this vLLM has no {_HOOK_NAME} (in {_ARGS_MODULE}), through which "
        f"fastload takes object-store model paths, so load formats {LOAD_FORMAT!r} and "
        f"{SHARDED_LOAD_FORMAT!r} cannot read config and tokenizer from there. Keep them in a "
        f"local folder (or a Hugging Face repo) given as the model, and name the weights "
        f"with model_loader_extra_config={{'weights_uri': {path!r}}}",
        option="model",
    )


def _refuse(args: Any) -> None:
    if getattr(args, "load_format", None) not in _FORMATS:
        return
    for path in (getattr(args, "model", None), getattr(args, "tokenizer", None)):
        if _is_object_store(path):
            raise _no_hook_error(str(path))


def _refuse_without_hook(engine_args: Any) -> None:
    """The error for a vLLM without the hook: for the EngineArgs being built now (register() runs
    inside its __post_init__ when LLM() starts) and every later one."""
    if engine_args is None:
        return
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, engine_args):
            _refuse(candidate)
        frame = frame.f_back  # type: ignore[assignment]
    post_init = getattr(engine_args, "__post_init__", None)
    if callable(post_init):

        @functools.wraps(post_init)
        def checked_post_init(self: Any, *args: Any, **kwargs: Any) -> Any:
            _refuse(self)
            return post_init(self, *args, **kwargs)

        engine_args.__post_init__ = checked_post_init


def _pull_object_store_model(args: Any) -> str | None:
    """For our load formats: pulls the model's (and tokenizer's) small files from the object
    store to local folders and points ``args`` there. Returns the model's URI (the weights), or
    None where there is nothing to do."""
    if args.load_format not in _FORMATS:
        return None
    model, tokenizer = args.model, args.tokenizer
    if not _is_object_store(model):
        # A second create_engine_config of the same args: model is the local folder by now.
        uri = getattr(args, _WEIGHTS_URI_ATTR, None)
        if _is_object_store(tokenizer):
            args.tokenizer = _pull_small_files(tokenizer, _storage_options(args), config=False)
        return uri
    storage_options = _storage_options(args)
    local = _pull_small_files(model, storage_options, config=True)
    if not args.served_model_name:
        args.served_model_name = model  # the API answers to the URI, as with runai_streamer
    args.model = local
    if tokenizer is None or tokenizer == model:
        args.tokenizer = local
    elif _is_object_store(tokenizer):
        args.tokenizer = _pull_small_files(tokenizer, storage_options, config=False)
    setattr(args, _WEIGHTS_URI_ATTR, model)
    return str(model)


def _storage_options(args: Any) -> Any:
    """``storage_options`` of the extra config, the whole extra config checked first."""
    allowed = _SHARDED_KEYS if args.load_format == SHARDED_LOAD_FORMAT else _KEYS
    options = _Options.parse(args.load_format, args.model_loader_extra_config, allowed)
    return options.stream_kwargs.get("storage_options")


def _pull_small_files(uri: str, storage_options: Any, config: bool) -> str:
    """The small files directly under ``uri`` that the engine reads (config, tokenizer, chat
    template, code; never weights), into a local folder named by the URI (under vLLM's assets
    cache, as vLLM does for runai_streamer), revalidated when reused; returns the folder."""
    return _integration.pull_small_files(
        uri, storage_options, _local_folder(uri), config=config, logger=logger
    )


def _local_folder(uri: str) -> str:
    from vllm.assets.base import get_cache_dir  # type: ignore[import-not-found]

    digest = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    folder = os.path.join(get_cache_dir(), "fastload_models", digest)
    os.makedirs(folder, exist_ok=True)
    return folder


def __getattr__(name: str) -> Any:
    """``FastloadModelLoader`` and ``FastloadShardedStateLoader``, built on first use."""
    if name in ("FastloadModelLoader", "FastloadShardedStateLoader"):
        return _loader_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class _Options(_integration.Options):
    """``model_loader_extra_config``, checked (``pattern`` too, for ``fastload_sharded``)."""

    @classmethod
    def unknown_key_hints(cls, load_format: str) -> Mapping[str, str]:
        if load_format == LOAD_FORMAT:
            return {"pattern": f"'pattern' belongs to load format {SHARDED_LOAD_FORMAT!r}"}
        return {
            "slices": f"'slices' belongs to load format {LOAD_FORMAT!r}: each worker of "
            f"{SHARDED_LOAD_FORMAT!r} reads only its own files anyway"
        }

    def __post_init__(self) -> None:
        # The last check (parse builds the options once every other key passed it), in the
        # __init__ that @dataclass writes for this class.
        if self.pattern is not None:
            _check_pattern(self.pattern)


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


def _world_group(device: Any) -> Any:
    """vLLM's world group for a shared read (fastload.distributed), or None for a lone worker."""
    from vllm.distributed import get_world_group  # type: ignore[import-not-found]

    return _integration.group_for(get_world_group(), device)


def _stream(
    uri: Any, device: Any, options: _integration.Options, prefix: str = ""
) -> Iterator[Any]:
    group = _world_group(device) if options.distributed else None
    return _integration.stream(uri, device, options, group, prefix)


def _sliced(options: _integration.Options, parallel_config: Any) -> bool:
    """Whether a load reads lazily (``_integration.sliced``): by default where vLLM splits the
    model over workers (tensor or pipeline parallel, or experts spread)."""
    return _integration.sliced(options, functools.partial(_split, parallel_config))


def _split(parallel_config: Any) -> bool:
    from vllm.distributed import (  # type: ignore[import-not-found]
        get_pp_group,
        get_tensor_model_parallel_world_size,
    )

    split = get_tensor_model_parallel_world_size() > 1 or get_pp_group().world_size > 1
    return split or bool(getattr(parallel_config, "enable_expert_parallel", False))


def _column_exchange(parallel_config: Any, share: bool = False) -> Any:
    """The exchange of row-parallel weights over vLLM's tensor-parallel group
    (``_integration.column_exchange``), expert weights left out where experts are spread."""
    from vllm.distributed import get_tp_group  # type: ignore[import-not-found]

    experts = bool(getattr(parallel_config, "enable_expert_parallel", False))
    return _integration.column_exchange(get_tp_group(), experts, share)


def _rank_name() -> str:
    from vllm.distributed import get_pp_group, get_tp_group  # type: ignore[import-not-found]

    tp, pp = get_tp_group(), get_pp_group()
    return _integration.rank_name(tp.rank_in_group, tp.world_size, pp.rank_in_group, pp.world_size)


def _released() -> AbstractContextManager[None]:
    return _integration.released(logger)


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
    """The loader classes on vLLM's ``BaseModelLoader``, by their public names."""
    from vllm.model_executor.model_loader.base_loader import (  # type: ignore[import-not-found]
        BaseModelLoader,
    )

    classes = (
        ("FastloadModelLoader", _FastloadModelLoader),
        ("FastloadShardedStateLoader", _FastloadShardedStateLoader),
    )
    return {name: _integration.on_base(cls, BaseModelLoader, name) for name, cls in classes}


class _Loader(_integration.Loader):
    """What both load formats' loaders do on vLLM (each is put on vLLM's ``BaseModelLoader`` by
    ``_loader_classes``)."""

    model_attr = "model"
    modelscope_env = "VLLM_USE_MODELSCOPE"
    stream_hub = False
    _allowed = _KEYS

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        self._load_device: Any = None
        self._parallel_config: Any = None

    def _parse(self, load_config: Any) -> _Options:
        extra = load_config.model_loader_extra_config
        return _Options.parse(load_config.load_format, extra, self._allowed)

    def load_model(self, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        # load_weights() is not told the device; vLLM builds the model on this one.
        load_device = getattr(vllm_config.load_config, "device", None)
        self._load_device = load_device or vllm_config.device_config.device
        self._parallel_config = getattr(vllm_config, "parallel_config", None)
        # BaseModelLoader's (next in the MRO of the class on_base makes).
        return super().load_model(vllm_config, *args, **kwargs)  # type: ignore[misc]

    def _weight_utils(self) -> Any:
        from vllm.model_executor.model_loader import (  # type: ignore[import-not-found]
            weight_utils,
        )

        return weight_utils

    def _download(self, repo: str, revision: str | None, index: bool) -> str:
        """A Hugging Face (or ModelScope) repo's safetensors, fetched with vLLM's own helpers."""
        modelscope = getattr(self._weight_utils(), "maybe_download_from_modelscope", None)
        if modelscope is not None:
            local = modelscope(repo, revision)
            if local:
                return str(local)
        return super()._download(repo, revision, index)


class _FastloadModelLoader(_Loader):
    """``load_format="fastload"``: a safetensors checkpoint streamed into
    ``model.load_weights``."""

    stream_hub = True

    def _secondary(self, extra: Any) -> tuple[Any, str]:
        where = self._resolve(extra.model_or_path, extra.revision)
        if getattr(extra, "subfolder", None):
            where = where.rstrip("/") + "/" + extra.subfolder
        return where, getattr(extra, "prefix", "")

    def get_all_weights(self, model_config: Any, model: Any) -> Iterator[tuple[str, Any]]:
        """vLLM's weight iterator (``DefaultModelLoader.get_all_weights``), which its in-place
        reload from disk (``reload_weights``) feeds to ``model.load_weights`` and refuses a
        loader without: whole tensors, streamed to the model's device."""
        device = _integration.target_device(self._load_device, model)
        for uri, prefix in self._sources(model, model_config):
            yield from _stream(uri, device, self.options, prefix)

    def load_weights(self, model: Any, model_config: Any) -> None:
        reads = self._reads(model, model_config)
        loaded = reads.run(lambda: model.load_weights(reads.weights()))
        self.stats = reads.stats
        _check_all_loaded(model, model_config, loaded)

    def _reads(self, model: Any, model_config: Any) -> _integration.Reads:
        """Lazy tensors where the load is sliced (``_sliced``), each read when a weight loader
        copies it, only the part it narrowed it to; else whole tensors streamed to the model's
        device (shared over vLLM's world group with ``distributed``)."""
        parallel = self._parallel_config
        reads = _integration.Reads(self._sources(model, model_config), self.options, logger)
        if _sliced(self.options, parallel):
            exchange = _column_exchange(parallel, self.options.distributed)
            # A pipeline stage reads its own layers only; else each worker reads every layer.
            every_layer = getattr(parallel, "pipeline_parallel_size", 1) == 1
            return reads.lazily(exchange, every_layer, _rank_name)
        device = _integration.target_device(self._load_device, model)
        return reads.whole(device, _world_group(device) if self.options.distributed else None)


class _FastloadShardedStateLoader(_Loader):
    """``load_format="fastload_sharded"``: the files vLLM's ``save_sharded_state`` wrote, each
    worker reading only its own and copying them into its state dict."""

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
            uri = root.rstrip("/") + "/" + _render_pattern(self.options.pattern, part=len(files))
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

        device = _integration.target_device(self._load_device, model)
        files = self._files(self._location(model_config, index=False))
        filter_subtensors = sharded_state_loader.ShardedStateLoader._filter_subtensors
        state_dict = filter_subtensors(model.state_dict())
        meter = _integration.Meter(logger)
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
