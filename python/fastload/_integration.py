"""What the serving-engine loaders (``fastload.vllm``, ``fastload.sglang``) share: the options of
``model_loader_extra_config``, where the weights are (local path, URL, ``hf://`` for a Hub repo
id), the device to stream to, the stream itself (shared over a process group with
``distributed``), the load's log line and the memory given back after it; whether a load reads
lazily, the tensor-parallel group's exchange of row-parallel weights, one load's reads
(:class:`Reads`), and the engine-neutral half of the loader classes (:class:`Loader`), which
each engine module puts on its engine's ``BaseModelLoader`` (:func:`on_base`).

Imports neither engine nor torch at module level: the engine modules import this one at their
own import, which must stay cheap.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import time
import types
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

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

    return uri[:5].lower() == "file:" or _fastload.is_remote_uri(uri)


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

    from . import _fastload, _remote_files

    ignore = ignore_patterns or []
    ignore = [ignore] if isinstance(ignore, str) else list(ignore)
    # The cache the environment names now, which fastload's hf:// reads the weights through.
    cache_dir = cache_dir or _fastload.hub_cache_dir()
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

    def log(self, stacklevel: int = 2) -> None:
        seconds = time.perf_counter() - self.start
        rate = self.bytes / seconds / 1e9 if seconds > 0 else float("inf")
        # Attributed to the caller (``stacklevel``: 2, the function that calls this one) in the
        # engine's loader module, as engines' log lines name it.
        self.logger.info(
            "Loading weights took %.2f seconds (%.2f GB/s)", seconds, rate, stacklevel=stacklevel
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


# --------------------------------------------------------------------- the loaders' shared half

_T = TypeVar("_T")


def sliced(options: Options, split: Callable[[], bool]) -> bool:
    """Whether a load reads lazily, each worker only what it keeps: ``slices`` as given, else
    where the engine splits the model over workers (``split()``: tensor or pipeline parallel, or
    experts spread) and ``distributed`` is off (with it, whole tensors are read once and shared,
    as before). A worker that keeps every tensor whole streams them instead: the stream reads
    ahead in parallel, where lazy tensors are read one after the other as the model asks."""
    if options.slices is not None:
        return options.slices
    if options.distributed:
        return False
    return split()


def is_expert_weight(name: str) -> bool:
    return ".experts." in name


def column_exchange(tp: Any, experts_spread: bool, share: bool) -> Any:
    """The exchange of row-parallel weights over an engine's tensor-parallel group coordinator
    ``tp`` (vLLM's and SGLang's have the same shape; ``fastload._exchange``: each rank reads a
    block of rows and gets its columns of the others' over the group's gloo group), or None at
    TP 1 or where no gloo group was built. Every rank of a TP group is on one pipeline stage and
    runs the same weight loaders in the same order, which the exchange needs; expert weights are
    left out where experts are spread (``experts_spread``: ranks load different ones).
    ``share`` (``distributed: true``): tensors read whole are read once by the group and
    broadcast too."""
    from ._exchange import ColumnExchange

    if tp.world_size <= 1 or tp.cpu_group is None:
        return None
    skip = is_expert_weight if experts_spread else None
    return ColumnExchange(tp.cpu_group, tp.rank_in_group, tp.world_size, skip, share)


def rank_name(tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> str:
    """A worker as the sliced-reads log line names it."""
    return f"tp rank {tp_rank}/{tp_size}, pp rank {pp_rank}/{pp_size}"


class Reads:
    """One load's weights from its ``sources`` (``(uri, prefix)`` pairs) as the engine's
    ``load_weights`` takes them (:meth:`weights`): lazy tensors (:meth:`lazily`; each read when a
    weight loader copies it, only the part it narrowed it to: ``fastload._lazy``), or whole
    tensors streamed (:meth:`whole`). :meth:`run` runs the load and logs it."""

    def __init__(
        self, sources: list[tuple[Any, str]], options: Options, logger: logging.Logger
    ) -> None:
        self.sources, self.options, self.logger = sources, options, logger
        self.meter = Meter(logger)
        self.exchange: Any = None
        # What the load read (Stats.as_dict()) once it is over; None for whole tensors.
        self.stats: dict[str, Any] | None = None
        self._lazy: Any = None  # a sliced load's _lazy.Stats
        self._every_layer = False
        self._rank: Callable[[], str] = str
        self._device: Any = None
        self._group: Any = None

    def lazily(self, exchange: Any, every_layer: bool, rank: Callable[[], str]) -> Reads:
        """Lazy tensors. ``exchange`` (:func:`column_exchange`'s, or None): row-parallel weights
        are read once over the group and exchanged. ``every_layer``: the worker loads every
        layer (no pipeline stage), so the read-ahead reads the next layer with the one the
        model is at. ``rank()``: the worker's name for the log line."""
        from . import _lazy

        self._lazy = _lazy.Stats()
        self.exchange, self._every_layer, self._rank = exchange, every_layer, rank
        return self

    def whole(self, device: Any, group: Any) -> Reads:
        """Whole tensors streamed to ``device``, shared over ``group`` where one is given
        (:func:`stream`)."""
        self._device, self._group = device, group
        return self

    def _tensors(self, uri: Any) -> Iterator[tuple[str, Any]]:
        if self._lazy is None:
            return self.meter.count(stream(uri, self._device, self.options, self._group))
        from . import _lazy

        kwargs = self.options.stream_kwargs
        checkpoint = _lazy.Checkpoint(
            uri, self._lazy, self.exchange, all_layers=self._every_layer, **kwargs
        )
        return iter(checkpoint)

    def weights(
        self, per_source: Callable[[Iterator[tuple[str, Any]], str], Iterator[Any]] | None = None
    ) -> Iterator[tuple[str, Any]]:
        """``(prefix + name, tensor)`` for the tensors of each source in turn; where given,
        ``per_source(tensors, prefix)`` makes a source's pairs instead (SGLang's MTP drafts)."""
        for uri, prefix in self.sources:
            tensors = self._tensors(uri)
            if per_source is not None:
                yield from per_source(tensors, prefix)
            else:
                yield from ((prefix + name, tensor) for name, tensor in tensors)

    def close(self) -> None:
        """The weights are in (or the load failed): answers a rank still waiting for an
        exchange, then turns it off (``ColumnExchange.close``; again is a no-op)."""
        if self.exchange is not None:
            self.exchange.close()

    def run(self, load: Callable[[], _T]) -> _T:
        """``load()`` (which feeds :meth:`weights` to the model), then the memory fastload keeps
        given back (:func:`released`) and the exchange closed; once it succeeded, the load's
        log lines, attributed to the engine's code that called this, and :attr:`stats`."""
        try:
            with released(self.logger):
                result = load()
        finally:
            self.close()
        if self._lazy is not None:
            self.meter.bytes = self._lazy.read_bytes
        self.meter.log(stacklevel=3)
        if self._lazy is not None:
            self.logger.info(
                "fastload sliced reads on %s: %s", self._rank(), self._lazy.line(), stacklevel=2
            )
            self.stats = self._lazy.as_dict()
        return result


class Loader:
    """The engine-neutral half of an engine's loader class: its checked options, where its
    weights are, the Hub's small files and the sources of a load. Written without the engine's
    ``BaseModelLoader``, which only a process that loads weights may import: an engine module's
    loader classes derive from this one at module level, and :func:`on_base` puts each on the
    engine's base class when the engine asks for it (``super()`` here is then that base)."""

    # The model config's attribute that names the model ("model", "model_path").
    model_attr: ClassVar[str]
    # The engine's variable that selects ModelScope, whose repos fastload does not stream.
    modelscope_env: ClassVar[str]
    # Repo ids become hf:// URIs streamed from the Hub (else: downloaded with the engine's
    # helper, :meth:`_download`).
    stream_hub: ClassVar[bool] = True
    # Where none of the patterns a model names its weight files by matches: the folder's files
    # are loaded (False), or the load fails (True).
    overrides_required: ClassVar[bool] = False

    load_config: Any  # set by the engine's base class

    def __init__(self, load_config: Any) -> None:
        # The engine's BaseModelLoader.__init__: next in the MRO of the class on_base makes.
        super().__init__(load_config)  # type: ignore[call-arg]
        self.options = self._parse(load_config)
        if self.options.slices is not False:
            # The lazy tensors' machinery, imported with the loader as the stream's is with
            # fastload, not inside the first load (about 10 ms).
            from . import _lazy  # noqa: F401
        # What the last sliced load read (Stats.as_dict()), None after a whole-tensor one.
        self.stats: dict[str, Any] | None = None

    def _parse(self, load_config: Any) -> Options:
        """``load_config``'s extra config, checked."""
        raise NotImplementedError

    def _weight_utils(self) -> Any:
        """The engine's ``weight_utils`` module (SGLang's is a fork of vLLM's: the download
        helpers :meth:`_download` uses have the same names and arguments)."""
        raise NotImplementedError

    def _secondary(self, extra: Any) -> tuple[Any, str]:
        """``(uri, prefix)`` for secondary weights the model asks for (``secondary_weights``)."""
        raise NotImplementedError

    def _download(self, repo: str, revision: str | None, index: bool) -> str:
        """A repo's safetensors (with ``index``, its index file too), downloaded with the
        engine's helpers; returns the local folder."""
        weight_utils, config = self._weight_utils(), self.load_config
        folder = weight_utils.download_weights_from_hf(
            repo,
            config.download_dir,
            ["*.safetensors"],
            revision,
            ignore_patterns=config.ignore_patterns,
        )
        if index:
            # Repos that hold both sharded and consolidated files: the index says which to load.
            weight_utils.download_safetensors_index_file_from_hf(
                repo, "model.safetensors.index.json", config.download_dir, revision=revision
            )
        return str(folder)

    def _overridden(self, patterns: Any, root: str) -> Any:
        """The files of the folder ``root`` that match the first of ``patterns`` (a model's
        ``allow_patterns_overrides``: it names its weight files itself) that matches any;
        ``root`` where none is given or none matches (an error where ``overrides_required``)."""
        if not patterns or not os.path.isdir(root):
            return root
        import glob

        for pattern in patterns:
            files = sorted(glob.glob(os.path.join(glob.escape(root), pattern)))
            if files:
                return files
        if self.overrides_required:
            raise FileNotFoundError(f"no weight files {list(patterns)} in {root!r}")
        return root

    def _weights_location(self, model_config: Any) -> str:
        """Where the weights are: ``weights_uri``, else ``model_weights`` (the original
        object-store URI when the engine reads the config from a local copy), else the model."""
        return str(
            self.options.weights_uri
            or getattr(model_config, "model_weights", None)
            or getattr(model_config, self.model_attr)
        )

    def _revision(self, where: str, model_config: Any) -> str | None:
        """The config's revision where ``where`` is the model it names."""
        return model_config.revision if where == getattr(model_config, self.model_attr) else None

    def _resolve(self, where: str, revision: str | None, index: bool = True) -> str:
        """A local path or URL fastload reads: repo ids stream from the Hub (``hf://``) where
        they can, else are downloaded first."""
        if is_url(where) or os.path.exists(where):
            return where
        hub = hub_uri(where, revision, self.modelscope_env) if self.stream_hub else None
        return hub or self._download(where, revision, index)

    def _location(self, model_config: Any, index: bool = True) -> str:
        where = self._weights_location(model_config)
        return self._resolve(where, self._revision(where, model_config), index)

    def download_model(self, model_config: Any) -> None:
        location = self._location(model_config)
        from . import _fastload

        if _fastload.parse_hub_uri(location) is not None:
            # The small files; the load streams the weights from the Hub.
            where = self._weights_location(model_config)
            config = self.load_config
            revision = self._revision(where, model_config)
            download_small_files(where, revision, config.download_dir, config.ignore_patterns)

    def _sources(self, model: Any, model_config: Any) -> list[tuple[Any, str]]:
        """(uri, prefix) for the checkpoint and any secondary weights the model asks for."""
        patterns = getattr(model, "allow_patterns_overrides", None)
        sources = [(self._overridden(patterns, self._location(model_config)), "")]
        sources += [self._secondary(extra) for extra in getattr(model, "secondary_weights", ())]
        return sources


def on_base(cls: type, base: type, name: str) -> type:
    """``cls`` (a loader class on :class:`Loader`) on the engine's ``base`` class, named
    ``name`` in ``cls``'s module: the class the engine module hands out and registers, and
    which pickles by that name (the module's ``__getattr__`` gives it)."""
    namespace = {"__module__": cls.__module__, "__qualname__": name, "__doc__": cls.__doc__}
    return types.new_class(name, (cls, base), exec_body=lambda ns: ns.update(namespace))
