"""What the serving-engine loaders (``fastload.vllm``, ``fastload.sglang``) share: the options of
``model_loader_extra_config``, where the weights are (local path, URL, ``hf://`` for a Hub repo
id), the device to stream to, the stream itself (shared over a process group with
``distributed``), the load's log line and the memory given back after it.

Imports neither engine nor torch at module level: the engine modules import this one at their
own import, which must stay cheap.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from . import _options
from ._errors import _scrub

if TYPE_CHECKING:
    import torch

# The keys passed on to fastload.stream as given (the options src/options.rs marks
# Taker::ExtraConfig), and the keys every loader takes: those and the loaders' own.
LOAD_KEYS: tuple[str, ...] = _options.taken_by("extra_config")
KEYS = frozenset({*LOAD_KEYS, "weights_uri", "distributed"})

_O = TypeVar("_O", bound="Options")


@dataclass(frozen=True)
class Options:
    """``model_loader_extra_config``, checked."""

    load_format: str
    weights_uri: str | None = None
    pattern: str | None = None
    # Out of repr: it may hold a keyset (``keyset``), which no log line may show.
    stream_kwargs: dict[str, Any] = field(default_factory=dict, repr=False)
    distributed: bool = False
    # Sliced reads (lazy tensors, each worker reading what it keeps): None lets the loader
    # decide (on where the model is split, off with ``distributed``); only loaders that list the
    # key "slices" take it.
    slices: bool | None = None

    @classmethod
    def parse(cls: type[_O], load_format: str, extra: Any, allowed: frozenset[str]) -> _O:
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
            hints = cls.unknown_key_hints(load_format)
            hint = "".join(f" ({hints[k]})" for k in unknown if k in hints)
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

        slices = extra.get("slices")
        if slices is not None and not isinstance(slices, bool):
            raise ConfigError(f"slices must be true or false, got {slices!r}", option="slices")

        stream_kwargs = {k: extra[k] for k in LOAD_KEYS if extra.get(k) is not None}
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
        return cls(load_format, weights_uri, pattern, stream_kwargs, distributed, slices)

    @classmethod
    def unknown_key_hints(cls, load_format: str) -> Mapping[str, str]:
        """For an unknown key of ``load_format``, a note to add (where it belongs instead)."""
        return {}


def is_url(uri: str) -> bool:
    """Whether fastload reads ``uri`` itself (no download): a ``file:`` URL, which fastload's
    local path resolution takes, or an object-store URI, whose schemes the native module owns
    (``_fastload.SCHEMES``)."""
    from . import _fastload

    return uri.startswith("file:") or _fastload.is_remote_uri(uri)


def hub_uri(repo: str, revision: str | None, modelscope_env: str) -> str | None:
    """``hf://ORG/REPO[@REVISION]`` for a Hugging Face repo id, which fastload streams from the
    Hub; None where the engine's download must be used instead (ModelScope, selected by the
    engine's ``modelscope_env`` variable, or a name without an org)."""
    if os.environ.get(modelscope_env, "").strip().lower() in ("1", "true"):
        return None
    org, _, name = repo.partition("/")
    if not org or not name or "/" in name or org in (".", ".."):
        return None
    at = f"@{urllib.parse.quote(revision, safe='')}" if revision else ""
    return f"hf://{repo}{at}"


def download_small_files(
    repo: str, revision: str | None, cache_dir: str | None, ignore_patterns: Any
) -> str:
    """A Hub repo's small files an engine reads (the files at its root that match
    ``_remote_files.ENGINE_PATTERNS``, none a weight, none over :data:`SMALL_FILE_LIMIT` but
    ``config.json``; ``ignore_patterns`` left out), into ``cache_dir`` (None: the Hugging Face
    cache): one listing of the root, then those files, never the whole repo. Offline, the cached
    snapshot. Returns the snapshot folder."""
    import glob

    import huggingface_hub

    from . import _remote_files

    ignore = ignore_patterns or []
    ignore = [ignore] if isinstance(ignore, str) else list(ignore)
    endpoint = os.environ.get("HF_ENDPOINT") or None
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return str(
            huggingface_hub.snapshot_download(
                repo,
                revision=revision,
                cache_dir=cache_dir,
                allow_patterns=["config.json"],
                local_files_only=True,
            )
        )
    api = huggingface_hub.HfApi(endpoint=endpoint)
    commit = api.model_info(repo, revision=revision).sha
    listing = {
        f.path: f.size
        for f in api.list_repo_tree(repo, revision=commit, recursive=False)
        if isinstance(f, huggingface_hub.hf_api.RepoFile)
    }
    source = f"hf://{repo}@{commit}/"
    names = _remote_files.select_small_files(
        listing, source=source, required=("config.json",), max_size=SMALL_FILE_LIMIT
    )
    names = [n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in ignore)]
    return str(
        huggingface_hub.snapshot_download(
            repo,
            revision=commit,
            cache_dir=cache_dir,
            endpoint=endpoint,
            # Exactly these files (an empty list matches none).
            allow_patterns=[glob.escape(n) for n in names],
        )
    )


def target_device(recorded: Any, model: Any) -> torch.device:
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
        # A device fastload does not write to (XPU, TPU, ...): stream to host memory, as the
        # engines' own loaders do; the weight loaders copy into the parameters on the device.
        device = torch.device("cpu")
    return device


def group_for(coordinator: Any, device: Any) -> Any:
    """The torch process group of an engine's group coordinator (vLLM's and SGLang's have the
    same shape) for a shared read, or None for a lone worker: host tensors travel over its gloo
    group, device tensors over its device (NCCL) group."""
    if coordinator.world_size <= 1:
        return None
    return coordinator.cpu_group if str(device).startswith("cpu") else coordinator.device_group


def stream(
    uri: Any, device: Any, options: Options, group: Any = None, prefix: str = ""
) -> Iterator[Any]:
    """``(prefix + name, tensor)`` for each tensor of ``uri``; with a ``group``, every worker of
    it reads 1/N of the bytes and gets the rest from the others (``fastload.distributed``)."""
    import fastload

    kwargs = dict(options.stream_kwargs)
    if group is not None:
        kwargs["process_group"] = group
    with fastload.stream(uri, device=device, **kwargs) as tensors:
        for name, tensor in tensors:
            yield prefix + name, tensor


class Meter:
    """Bytes delivered, and the log line engine users look for."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.bytes = 0
        self.start = time.perf_counter()

    def count(self, items: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in items:
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def log(self) -> None:
        seconds = time.perf_counter() - self.start
        rate = self.bytes / seconds / 1e9 if seconds > 0 else float("inf")
        # Attributed to the caller (the engine's loader module), as engines' log lines name it.
        self.logger.info(
            "Loading weights took %.2f seconds (%.2f GB/s)", seconds, rate, stacklevel=2
        )


@contextmanager
def released(logger: logging.Logger) -> Iterator[None]:
    """Runs a load, then gives back the host memory fastload keeps for a next load (the pinned
    staging ring of GPU loads, freed host buffers, and the page-locked chunks torch caches after
    sliced reads' copies into GPU memory): an engine worker loads its weights once, and that
    memory would otherwise stay with it while it serves."""
    import fastload

    from . import _lazy

    try:
        yield
    finally:
        _lazy.release_staging()  # sliced loads' page-locked chunks (torch's cache)
        freed = fastload.release_memory()
        logger.debug("fastload gave back %s bytes of cached host memory", freed)


# The most bytes a small file an engine reads may have; a larger one that nothing requires is
# skipped with a log line (an unexpected 300 MiB file beside the config does not fail the pull).
SMALL_FILE_LIMIT = 256 << 20


def pull_small_files(
    uri: str, storage_options: Any, folder: str, config: bool, logger: logging.Logger
) -> str:
    """The small files an engine reads from directly under ``uri`` (``_remote_files``'
    ``ENGINE_PATTERNS``: config, generation config, tokenizer files, chat templates, code; never
    weights or other binaries), into ``folder``, through fastload's object-store client (its
    credentials and endpoint rules, ``storage_options`` first). With ``config``, a missing
    ``config.json`` is an error. A reused ``folder`` is revalidated (``fetch_small_files``), and
    files fastload put there whose objects are gone are removed. Returns ``folder``."""
    from . import NotFoundError, _fastload, _remote_files

    started = time.perf_counter()
    prefix = uri.rstrip("/") + "/"
    listed = _fastload.list_objects(prefix, storage_options=storage_options)
    names = {found[len(prefix) :]: size for found, size in listed if found.startswith(prefix)}
    if not names:
        raise NotFoundError(f"{prefix}: no objects under this prefix (no model there)")
    if config and "config.json" not in names:
        raise NotFoundError(
            f"{prefix}config.json: no such object; the engine needs the model's config.json "
            f"beside its weights (found: {', '.join(sorted(names)[:20])}). Where config and "
            "weights are kept apart, give the config's local folder as the model and the "
            f"weights as model_loader_extra_config={{'weights_uri': {uri!r}}}"
        )
    required = ("config.json",) if config else ()
    small = _remote_files.select_small_files(
        names, source=prefix, required=required, max_size=SMALL_FILE_LIMIT, log=logger
    )
    os.makedirs(folder, exist_ok=True)
    pulled = _remote_files.fetch_small_files(
        prefix,
        small,
        folder,
        storage_options=storage_options,
        max_size=SMALL_FILE_LIMIT,
        required=required,
    )
    _remote_files.prune(folder, pulled)
    logger.info(
        "fastload pulled %d files (%s) from %s to %s in %.2f s; the weights stream from there",
        len(pulled),
        ", ".join(pulled[:8]) + (", ..." if len(pulled) > 8 else ""),
        _scrub(prefix),
        folder,
        time.perf_counter() - started,
    )
    return folder
