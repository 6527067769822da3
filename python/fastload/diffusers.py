"""diffusers models and pipelines whose weights fastload streams: from a local folder, the Hugging
Face Hub or an object store, never written to disk.

>>> from diffusers import AutoencoderKL, StableDiffusionPipeline
>>> import fastload.diffusers
>>> vae = fastload.diffusers.from_pretrained(AutoencoderKL, "s3://bucket/sd/", subfolder="vae")
>>> pipe = fastload.diffusers.from_pretrained(StableDiffusionPipeline, "hf://org/sd")

diffusers builds everything itself (``cls.from_pretrained`` on a folder holding the small files:
configs, indexes, scheduler and tokenizer files), so ``torch_dtype``, ``device_map``,
``_keep_in_fp32_modules``, key fixes and sharded indexes behave as in a load from files. Only
where diffusers opens a weight file does fastload step in: while a load runs, diffusers' private
``_get_model_file``, ``_get_checkpoint_shard_files`` and ``load_state_dict`` (in
``diffusers.models.modeling_utils`` and ``model_loading_utils``) are wrapped so that, for that
folder only, weight files are named by their fastload URI and read by fastload (each shard in
parallel blocks). Any other caller goes through unchanged. tests/test_diffusers.py pins those
names and fails loudly when diffusers changes them.

A pipeline's transformers components (text encoders) are loaded by
:func:`fastload.transformers.from_pretrained` with the arguments diffusers would pass and handed
to the pipeline, which loads its tokenizers and schedulers itself from the small files.

This module imports diffusers when called, never at import.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _fastload, _remote_files
from . import transformers as _transformers
from ._errors import ConfigError, _scrub

if TYPE_CHECKING:
    from ._options import Options

__all__ = ["from_pretrained"]

MODEL_INDEX = "model_index.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
# The small files a pipeline component's folder may hold.
COMPONENT_FILES: tuple[str, ...] = (
    "config.json",
    "scheduler_config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    *_remote_files.TOKENIZER_FILES,
)

# Folders being loaded: resolved root -> (checkpoint, fastload options). Guarded by _lock.
_roots: dict[Path, tuple[_remote_files.Checkpoint, dict[str, Any]]] = {}
# URIs handed to diffusers as weight "files" -> their options.
_uris: dict[str, dict[str, Any]] = {}
_lock = threading.RLock()
_saved: dict[tuple[Any, str], Any] = {}
_users = 0


def _variant(name: str, variant: str | None) -> str:
    return _transformers._variant(name, variant)


def _locate(path: Any, *rel: str | None) -> tuple[str, dict[str, Any]] | None:
    """The fastload URI of ``path/rel...`` and its options, when it lies in a folder being
    loaded (``..`` in ``rel`` resolved first: nothing outside the folder is ever its URI)."""
    try:
        joined = Path(os.fspath(path)).resolve().joinpath(*[r for r in rel if r])
    except TypeError:
        return None
    full = Path(os.path.normpath(joined))
    with _lock:
        for root, (ckpt, options) in _roots.items():
            if full == root or root in full.parents:
                return ckpt.weight_uri(full.relative_to(root).as_posix()), options
    return None


def _ours(path: Any, *rel: str | None) -> tuple[str, dict[str, Any]] | None:
    """:func:`_locate`, the URI then read by fastload when diffusers loads it."""
    found = _locate(path, *rel)
    if found is not None:
        with _lock:
            _uris[found[0]] = found[1]
    return found


def _wrap_model_file(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _get_model_file(pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        name = kwargs.get("weights_name", "")
        if isinstance(name, str) and name.endswith(".safetensors") and not args:
            found = _ours(pretrained_model_name_or_path, kwargs.get("subfolder"), name)
            if found is not None:
                return found[0]
        return orig(pretrained_model_name_or_path, *args, **kwargs)

    return _get_model_file


def _wrap_shard_files(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _get_checkpoint_shard_files(
        pretrained_model_name_or_path: Any, index_filename: Any, *args: Any, **kwargs: Any
    ) -> Any:
        subfolder = kwargs.get("subfolder") or ""
        if _ours(pretrained_model_name_or_path, subfolder) is None or args:
            return orig(pretrained_model_name_or_path, index_filename, *args, **kwargs)
        data = Path(index_filename).read_bytes()
        # (The file itself may be a link into the Hub cache's blobs: its folder is resolved.)
        located = _locate(Path(index_filename).parent, Path(index_filename).name)
        # Every entry checked before any is read, as a load of the index checks them.
        shards = _fastload.index_files(located[0] if located else str(index_filename), data)
        index = json.loads(data)
        metadata = dict(index.get("metadata") or {})
        metadata["all_checkpoint_keys"] = list(index["weight_map"].keys())
        metadata["weight_map"] = dict(index["weight_map"])
        uris = []
        for shard in shards:
            found = _ours(pretrained_model_name_or_path, subfolder, shard)
            assert found is not None
            uris.append(found[0])
        return uris, metadata

    return _get_checkpoint_shard_files


def _wrap_load_state_dict(orig: Callable[..., Any]) -> Callable[..., Any]:
    def load_state_dict(checkpoint_file: Any, *args: Any, **kwargs: Any) -> Any:
        with _lock:
            options = _uris.get(checkpoint_file) if isinstance(checkpoint_file, str) else None
        if options is None:
            return orig(checkpoint_file, *args, **kwargs)
        import fastload

        location = kwargs.get("map_location", args[1] if len(args) > 1 else "cpu")
        device = "cpu" if str(location) in ("cpu", "meta") else location
        return fastload.load(checkpoint_file, **{"device": device, **options})

    return load_state_dict


def _targets() -> list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
    from diffusers.models import model_loading_utils, modeling_utils

    return [
        (modeling_utils, "_get_model_file", _wrap_model_file),
        (modeling_utils, "_get_checkpoint_shard_files", _wrap_shard_files),
        (modeling_utils, "load_state_dict", _wrap_load_state_dict),
        (model_loading_utils, "load_state_dict", _wrap_load_state_dict),
    ]


@contextlib.contextmanager
def _streaming(ckpt: _remote_files.Checkpoint, options: dict[str, Any]) -> Iterator[None]:
    """diffusers reads the weights under ``ckpt.local`` through fastload while this is entered."""
    global _users
    root = ckpt.local.resolve()
    with _lock:
        if _users == 0:
            for module, name, wrap in _targets():
                orig = getattr(module, name)
                _saved[(module, name)] = orig
                setattr(module, name, wrap(orig))
        _users += 1
        _roots[root] = (ckpt, options)
    try:
        yield
    finally:
        with _lock:
            _roots.pop(root, None)
            _users -= 1
            if _users == 0:
                for (module, name), orig in _saved.items():
                    setattr(module, name, orig)
                _saved.clear()
                _uris.clear()


def _component_dtype(dtype: Any, name: str) -> Any:
    """The dtype diffusers' pipeline loader passes to component ``name``."""
    if isinstance(dtype, Mapping):
        import torch

        return dtype.get(name, dtype.get("default", torch.float32))
    return dtype


def _load_pipeline(
    cls: Any,
    ckpt: _remote_files.Checkpoint,
    options: dict[str, Any],
    load_options: Options | None,
    kwargs: dict[str, Any],
) -> Any:
    from transformers import PreTrainedModel

    ckpt.fetch([MODEL_INDEX], required=[MODEL_INDEX])
    index_path = ckpt.local / MODEL_INDEX
    if not index_path.is_file():
        raise ConfigError(f"{ckpt.uri}: no {MODEL_INDEX}: not a diffusers pipeline", option="uri")
    index = json.loads(index_path.read_text())
    components = {
        name: spec
        for name, spec in index.items()
        if not name.startswith("_") and isinstance(spec, list) and len(spec) == 2 and spec[0]
    }
    # Each component is a folder of the checkpoint: its name must be one, checked before any
    # of them is fetched.
    where = f"{ckpt.weight_uri(MODEL_INDEX)}: component"
    for name in components:
        _fastload.check_inside(name, where)
    variant = kwargs.get("variant")
    for name in components:
        index_name = _variant(WEIGHTS_INDEX_NAME, variant)
        ckpt.fetch([*COMPONENT_FILES, index_name], name, required=["config.json", index_name])
    dtype = kwargs.get("dtype")
    if dtype is None:
        dtype = kwargs.get("torch_dtype")
    if kwargs.get("device_map") is not None:
        raise ConfigError(
            "device_map: a pipeline's device_map is not supported; load it and call .to()",
            option="device_map",
        )
    for name, (library, class_name) in components.items():
        if name in kwargs or library != "transformers":
            continue
        import transformers

        component_cls = getattr(transformers, class_name, None)
        if not (isinstance(component_cls, type) and issubclass(component_cls, PreTrainedModel)):
            continue
        component_kwargs: dict[str, Any] = {"dtype": _component_dtype(dtype, name)}
        kwargs[name] = _transformers._from_checkpoint(
            component_cls, ckpt, name, variant, (), dict(load_options or {}), component_kwargs
        )
        kwargs[name].config.name_or_path = str(ckpt.local / name)
    with _streaming(ckpt, options):
        return cls.from_pretrained(str(ckpt.local), **kwargs)


def from_pretrained(
    cls: Any,
    uri: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, object] | None = None,
    load_options: Options | None = None,
    **kwargs: Any,
) -> Any:
    """``cls.from_pretrained(uri, **kwargs)`` with the weights streamed by fastload, for a
    diffusers model class (``AutoencoderKL``, ``UNet2DConditionModel``, a transformer such as
    ``DiTTransformer2DModel``; ``subfolder=`` as usual) or a pipeline class
    (``DiffusionPipeline`` or a concrete one: each component from its subfolder).

    ``uri``: a local folder, a Hub repo id ``ORG/REPO`` or ``hf://ORG/REPO[@REVISION][/FOLDER]``,
    or an object-store prefix (``s3://bucket/model/``, ``gs://``, ``az://``, ``http(s)://``).
    ``kwargs`` are diffusers' (``torch_dtype``, ``device_map`` for models, ``variant``, ...);
    ``load_options`` fastload's (see :class:`fastload.Options`)."""
    from diffusers import DiffusionPipeline, ModelMixin

    if kwargs.get("use_safetensors") is False:
        raise ConfigError("use_safetensors=False: fastload reads safetensors only", option="uri")
    options: dict[str, Any] = dict(load_options or {})
    download_only = ("force_download", "proxies", "resume_download")
    with _remote_files.open_checkpoint_for(uri, kwargs, storage_options, download_only) as ckpt:
        if ckpt.storage_options is not None:
            options.setdefault("storage_options", ckpt.storage_options)
        if isinstance(cls, type) and issubclass(cls, DiffusionPipeline):
            pipe = _load_pipeline(cls, ckpt, options, load_options, kwargs)
            pipe.register_to_config(_name_or_path=_scrub(os.fspath(uri)))
            return pipe
        if not (isinstance(cls, type) and issubclass(cls, ModelMixin)):
            raise ConfigError(
                f"{cls!r} is neither a diffusers model (ModelMixin) nor a pipeline class",
                option="cls",
            )
        subfolder = kwargs.get("subfolder") or ""
        variant = kwargs.get("variant")
        index_name = _variant(WEIGHTS_INDEX_NAME, variant)
        ckpt.fetch(["config.json", index_name], subfolder, required=["config.json", index_name])
        with _streaming(ckpt, options):
            model = cls.from_pretrained(str(ckpt.local), **kwargs)
        model.register_to_config(_name_or_path=_scrub(os.fspath(uri)))
        return model
