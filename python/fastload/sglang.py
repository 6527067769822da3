"""SGLang integration: ``load_format=FastloadModelLoader`` and ``--load-format fastload``.

The loader class needs no plugin::

    import sglang as sgl
    from fastload.sglang import FastloadModelLoader

    engine = sgl.Engine(model_path=MODEL, load_format=FastloadModelLoader)

(SGLang's ``get_model_loader`` instantiates a ``load_format`` that is a class.) The string form,
``python -m sglang.launch_server --model-path MODEL --load-format fastload``, goes through
fastload's ``sglang.srt.plugins`` entry point (:func:`register`, which SGLang's
``load_plugins()`` runs in every process; ``SGLANG_PLUGINS``, when set, must name ``fastload``).

``MODEL`` is a local folder, a Hugging Face repo id (config and tokenizer come through SGLang's
usual Hub download, the weights stream from the Hub as ``hf://ORG/REPO@REVISION`` without being
written to disk) or an object-store URI (``s3://``, ``gs://``, ``az://``: config, tokenizer and the
other small files come through fastload's object-store client into SGLang's cache folder for
object-store models, the weights stream). ``--model-loader-extra-config`` takes ``concurrency``,
``block_size``, ``memory_limit``, ``copy_streams``, ``storage_options``, ``cache``, ``verify``,
``keyset``, ``associated_data``, ``peers`` and ``peer_token`` as ``fastload.load`` does, plus
``weights_uri`` (weights kept apart from the config), ``distributed`` (every worker of
SGLang's tensor-parallel group reads 1/N of the bytes and gets the rest from the others) and
``slices``.

Where the model is split over workers (tensor or pipeline parallel, experts spread), the loader
hands ``model.load_weights`` lazy tensors (``fastload._lazy``), as ``fastload.vllm`` does: SGLang's
weight loaders narrow each to the rank's rows or columns before they copy it, and only those
bytes are read; anything else reads the region it asks for, whole at worst. Row-parallel weights
(each rank keeps a block of columns) are read once over the tensor-parallel group: each rank reads
a block of whole rows and one ``all_to_all`` over the group's gloo group hands each its columns
(``fastload._exchange``). ``slices: false``
streams whole tensors instead (as ``distributed: true`` does, which shares them over the group);
``slices: true`` reads lazily on a lone worker too.

Importing this module imports neither sglang nor torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import cache
from typing import Any

from . import _integration

__all__ = ["LOAD_FORMAT", "register"]

LOAD_FORMAT = "fastload"

# A child of SGLang's "sglang" logger, so the lines come out through SGLang's handler.
logger = logging.getLogger("sglang.fastload")

# What the plugin hooks, by the names SGLang 0.5.23 gives them (tests/test_sglang.py pins them).
VERIFY_TARGET = "sglang.srt.configs.load_config.LoadConfig._verify_load_format"
CHOICES_MODULE = "sglang.srt.arg_groups.choices"
RESOLUTION_STEPS = ("handle_model_source_paths", "handle_load_format")
# SGLang's object-store schemes (sglang.srt.utils.runai_utils.SUPPORTED_SCHEMES): a model path
# with one of them gets its config from SGLang's cache folder for object-store models.
OBJECT_STORE_SCHEMES = ("s3://", "gs://", "az://")
# The widths of SGLang's parallel context (``sglang.srt.runtime_context.get_parallel()``) that
# split a model's weights over workers: sliced reads default on where one is above 1.
PARALLEL_WIDTHS = ("tp_size", "pp_size", "moe_ep_size")

# The extra config keys: fastload.load's, weights_uri, distributed, and slices (sliced reads).
KEYS = _integration.KEYS | {"slices"}

_state = {"registered": False}


def __getattr__(name: str) -> Any:
    """``FastloadModelLoader``, built on first use (it subclasses SGLang's ``BaseModelLoader``)."""
    if name == "FastloadModelLoader":
        return _loader_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------- the plugin


def register() -> None:
    """Makes ``load_format="fastload"`` (and ``--load-format fastload``) mean
    :class:`FastloadModelLoader`, and lets it take object-store model paths.

    SGLang calls this through the ``sglang.srt.plugins`` entry point; its ``load_plugins()`` then
    applies the hook registered here. Idempotent. Where this SGLang lacks a hook point, raises one
    ``RuntimeError`` that says so and names the class form, which needs no plugin.
    """
    if _state["registered"]:
        return
    try:
        import importlib

        choices = importlib.import_module(CHOICES_MODULE)
        from sglang.srt.arg_groups.resolution_hooks import (
            register_resolution_hook,
        )
        from sglang.srt.plugins.hook_registry import (
            HookRegistry,
            HookType,
        )

        if LOAD_FORMAT not in choices.LOAD_FORMAT_CHOICES:
            choices.add_load_format_choices([LOAD_FORMAT])
        register_resolution_hook("handle_model_source_paths")(_model_source_paths)
        register_resolution_hook("handle_load_format")(_keep_load_format)
    except (ImportError, AttributeError, ValueError) as e:
        raise RuntimeError(
            f"fastload cannot register load format {LOAD_FORMAT!r} with this SGLang: {e}. "
            "Pass the loader class instead, which needs no plugin: "
            "sgl.Engine(..., load_format=fastload.sglang.FastloadModelLoader)"
        ) from e
    HookRegistry.register(VERIFY_TARGET, _verify_load_format, HookType.AROUND)
    _state["registered"] = True


def _verify_load_format(original: Any, load_config: Any, *args: Any, **kwargs: Any) -> Any:
    """Around ``LoadConfig._verify_load_format``, which turns a string into SGLang's
    ``LoadFormat`` enum (and refuses one it lacks): "fastload" becomes our loader class, which
    ``get_model_loader`` instantiates. The extra config is checked here, when the config is
    built (a bad key raises ``ConfigError`` naming it)."""
    if _is_ours(load_config.load_format):
        _integration.Options.parse(LOAD_FORMAT, load_config.model_loader_extra_config, KEYS)
        load_config.load_format = _loader_class()
        return None
    return original(load_config, *args, **kwargs)


def _is_ours(load_format: Any) -> bool:
    if isinstance(load_format, type):
        return load_format is _loader_class() or issubclass(load_format, _loader_class())
    return isinstance(load_format, str) and load_format.lower() == LOAD_FORMAT


def _is_object_store(path: Any) -> bool:
    return isinstance(path, str) and path.lower().startswith(OBJECT_STORE_SCHEMES)


def _model_source_paths(server_args: Any, previous: Any) -> None:
    """SGLang's ``handle_model_source_paths`` step pulls the config of an object-store model
    with runai-model-streamer; with our load format, fastload's object-store client does it."""
    from sglang.srt.arg_groups.overrides import (
        resolving_view,
    )

    cfg = resolving_view(server_args)
    if not _is_ours(cfg.load_format):
        previous(server_args)
        return
    paths = (cfg.model_path, cfg.tokenizer_path, cfg.speculative_draft_model_path)
    remote = [p for p in dict.fromkeys(paths) if _is_object_store(p)]
    if not remote:
        previous(server_args)
        return
    options = _integration.Options.parse(
        LOAD_FORMAT, _extra_config(cfg.model_loader_extra_config), KEYS
    )
    storage_options = options.stream_kwargs.get("storage_options")
    for path in remote:
        _pull_config(path, storage_options, config=path == cfg.model_path)


def _keep_load_format(server_args: Any, previous: Any) -> None:
    """SGLang's ``handle_load_format`` step sets ``runai_streamer`` for every object-store model
    path; a fastload load format stays as the user gave it."""
    from sglang.srt.arg_groups.overrides import (
        declare_resolution,
        resolving_view,
    )

    asked = resolving_view(server_args).load_format
    previous(server_args)
    if _is_ours(asked) and resolving_view(server_args).load_format is not asked:
        declare_resolution(server_args, "fastload", load_format=asked)


def _extra_config(extra: Any) -> Any:
    if isinstance(extra, str):
        import json

        return json.loads(extra) if extra.strip() else {}
    return extra


def _pull_config(uri: str, storage_options: Any, config: bool) -> str:
    """The small files of an object-store model into the folder SGLang reads its config from
    (``ObjectStorageModel.get_path``)."""
    from sglang.srt.utils.runai_utils import (
        ObjectStorageModel,
    )

    folder = str(ObjectStorageModel.get_path(uri))
    return _integration.pull_small_files(uri, storage_options, folder, config, logger)


# ---------------------------------------------------------------------------------- the loader


def _sliced(options: _integration.Options) -> bool:
    """Whether a load reads lazily (``_integration.sliced``): by default where SGLang splits the
    model over workers (its tensor, pipeline or expert parallel width above 1)."""
    return _integration.sliced(options, _split)


def _split() -> bool:
    # SGLang's parallel context: the widths its layers partition their weights by
    # (tests/test_sglang_slices.py pins the names).
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return any(getattr(parallel, width) > 1 for width in PARALLEL_WIDTHS)


def _column_exchange(share: bool = False) -> Any:
    """The exchange of row-parallel weights over SGLang's tensor-parallel group
    (``_integration.column_exchange``), or None where no process group was built; expert
    weights are left out where experts are spread. Weights partitioned by a narrower group
    (attention under DP attention, experts by their MoE TP group) narrow to other column blocks,
    which the exchange leaves to each rank."""
    from sglang.srt.distributed import get_tp_group
    from sglang.srt.runtime_context import get_parallel

    return _integration.column_exchange(get_tp_group(), get_parallel().moe_ep_size > 1, share)


def _rank_name() -> str:
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    return _integration.rank_name(p.tp_rank, p.tp_size, p.pp_rank, p.pp_size)


@cache
def _loader_class() -> type:
    """``FastloadModelLoader``: the loader on SGLang's ``BaseModelLoader``."""
    from sglang.srt.model_loader import loader

    return _integration.on_base(_FastloadModelLoader, loader.BaseModelLoader, "FastloadModelLoader")


class _FastloadModelLoader(_integration.Loader):
    """SGLang loader: a safetensors checkpoint streamed by fastload into ``model.load_weights``,
    then SGLang's own post-processing (quantization methods' ``process_weights_after_loading``),
    as ``DefaultModelLoader`` does."""

    model_attr = "model_path"
    modelscope_env = "SGLANG_USE_MODELSCOPE"
    overrides_required = True

    def _parse(self, load_config: Any) -> _integration.Options:
        extra = load_config.model_loader_extra_config
        return _integration.Options.parse(LOAD_FORMAT, extra, KEYS)

    def _weight_utils(self) -> Any:
        from sglang.srt.model_loader import weight_utils

        return weight_utils

    def _secondary(self, extra: Any) -> tuple[Any, str]:
        where = self._resolve(extra.model_or_path, extra.revision)
        patterns = getattr(extra, "allow_patterns_overrides", None)
        return self._overridden(patterns, where), extra.prefix

    def load_model(self, *, model_config: Any, device_config: Any) -> Any:
        import torch
        from sglang.srt.model_loader import loader
        from sglang.srt.model_loader.utils import set_default_torch_dtype

        from . import ConfigError

        if getattr(model_config, "modelopt_quant", None):
            raise ConfigError(
                f"load format {LOAD_FORMAT!r} does not run ModelOpt quantization "
                "(modelopt_quant); use SGLang's own load format for it"
            )
        target = torch.device(device_config.device)
        quant_config = loader._get_quantization_config(model_config, self.load_config)
        with set_default_torch_dtype(model_config.dtype):
            with target:
                model = loader._initialize_model(model_config, self.load_config, quant_config)
            self.load_weights(model, model_config, target)
        return model.eval()

    def load_weights(self, model: Any, model_config: Any, target: Any) -> None:
        """Streams the weights into ``model.load_weights`` (see ``_reads``) and post-processes
        them as ``DefaultModelLoader.load_weights_and_postprocess`` does."""
        from sglang.srt.model_loader.loader import DefaultModelLoader as default

        reads = self._reads(model, model_config, target)
        draft = self.load_config.draft_model_idx

        def mtp_draft(tensors: Iterator[tuple[str, Any]], prefix: str) -> Iterator[Any]:
            # Multi-layer MTP drafts: only this draft's layer, renamed to layer 0.
            return default._filter_mtp_weights(tensors, prefix, draft)

        def weights() -> Iterator[tuple[str, Any]]:
            yield from reads.weights(mtp_draft if draft is not None else None)
            # The weights are in: answers a rank still waiting for an exchange before the
            # post-processing (which may use the group) starts.
            reads.close()

        reads.run(lambda: default.load_weights_and_postprocess(model, weights(), target))
        self.stats = reads.stats

    def _reads(self, model: Any, model_config: Any, target: Any) -> _integration.Reads:
        """Lazy tensors where the load is sliced (``_sliced``), each read when a weight loader
        copies it, only the part it narrowed it to (row-parallel weights: read once over the
        group and exchanged); else whole tensors streamed (shared over SGLang's tensor-parallel
        group with ``distributed``: its workers load the same checkpoint)."""
        from sglang.srt.distributed import get_tp_group
        from sglang.srt.runtime_context import get_parallel

        reads = _integration.Reads(self._sources(model, model_config), self.options, logger)
        if _sliced(self.options):
            exchange = _column_exchange(self.options.distributed)
            # A pipeline stage reads its own layers only; else each worker reads every layer.
            return reads.lazily(exchange, get_parallel().pp_size == 1, _rank_name)
        device = _integration.target_device(target, model)
        distributed = self.options.distributed
        group = _integration.group_for(get_tp_group(), device) if distributed else None
        return reads.whole(device, group)
