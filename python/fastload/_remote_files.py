"""Where a checkpoint lives, for the transformers and diffusers integrations and the serving
engines: a local folder, a Hugging Face repo (``ORG/REPO``, ``hf://ORG/REPO[@REV][/SUB]``) or an
object-store prefix (``s3://``, ``gs://``, ``az://``, ``http(s)://``).

The weights are never written to disk: :class:`Checkpoint` names each weight file as a URI that
fastload streams. The small files beside them (``config.json``, an index, generation and
tokenizer files, remote code) are what the libraries read from a folder, so they are put in one,
each fetched by name, only those the library asks for (never the whole repository):

- a local folder is used as it is;
- a Hub repo: ``huggingface_hub.snapshot_download`` of exactly the names asked for, into the
  Hugging Face cache as ``huggingface_hub`` would, every fetch at the commit the first one
  resolved (the weights are streamed from ``hf://ORG/REPO@<commit>``);
- an object store: :func:`fetch_small_files` reads the files by name (a store need not list)
  into a temporary folder ``fastload-small-files-*`` (under ``tempfile.gettempdir()``), removed
  when the :class:`Checkpoint` is closed, or else when the process that made it exits.

Names that come from data (object keys, ``auto_map`` modules, component folders) pass
``_fastload.check_inside`` before anything is read or written. The copies are the Rust cache's
(``_fastload.fetch_small_file``): written only through real directories inside the destination
(never through a symbolic link), each under a unique temporary name renamed into place, so that
processes filling one folder at once all succeed; a reused destination is revalidated, each file
kept only while the store says its ETag is the one it was fetched at (``If-None-Match``; the
cache's record ``.cache/fastload/NAME.json`` holds the object's URI, size, ETag and sha256), else
fetched again.
"""

from __future__ import annotations

import atexit
import fnmatch
import glob
import logging
import os
import re
import shutil
import tempfile
import threading
import urllib.parse
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _fastload
from ._errors import ConfigError, NotFoundError, StorageError

__all__ = [
    "ENGINE_PATTERNS",
    "WEIGHT_PATTERNS",
    "Checkpoint",
    "fetch_small_files",
    "open_checkpoint",
    "select_small_files",
]

logger = logging.getLogger(__name__)

# Files that are weights (or other large binaries): never fetched as small files.
WEIGHT_PATTERNS: tuple[str, ...] = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.h5",
    "*.msgpack",
    "*.onnx",
    "*.onnx_data",
    "*.gguf",
    "*.tflite",
    "*.ot",
    "*.npz",
    "*.pb",
    "*.mlmodel",
    "*.nemo",
    "*.pkl",
    "*.tensors",
)

# What a tokenizer or processor may read (transformers' tokenizer and processor file names).
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)

# What a serving engine reads beside the weights, at the model's root (config, generation
# config, tokenizer and processor files, chat templates, remote code): vLLM's own object-store
# pull takes *.json, *.py and *.model; vocabularies, merges, templates and tiktoken files too.
ENGINE_PATTERNS: tuple[str, ...] = ("*.json", "*.py", "*.model", "*.txt", "*.jinja", "*.tiktoken")

# The most bytes one small file may have (tokenizer.json of large vocabularies is ~30 MB).
MAX_SMALL_FILE = 64 << 20

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_weight(name: str) -> bool:
    """Whether ``name`` is a weight file (or another large binary), by :data:`WEIGHT_PATTERNS`."""
    base = name.rsplit("/", 1)[-1].lower()
    return any(fnmatch.fnmatchcase(base, p) for p in WEIGHT_PATTERNS)


def select_small_files(
    listing: Mapping[str, int],
    *,
    source: str,
    required: Collection[str] = (),
    patterns: Sequence[str] = ENGINE_PATTERNS,
    max_size: int = MAX_SMALL_FILE,
    log: logging.Logger = logger,
) -> list[str]:
    """The names of ``listing`` (name -> size, as listed under ``source``) to pull: those
    directly under it that match ``patterns`` and are not weights, sorted. A name outside the
    folder raises ``ConfigError``; a file over ``max_size`` bytes is an error when ``required``,
    else skipped with a log line."""
    chosen = []
    for name, size in sorted(listing.items()):
        if "/" in name or is_weight(name):
            continue
        if not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            continue
        _fastload.check_inside(name, source)
        if size > max_size:
            _skip_too_large(source, name, size, max_size, required, log)
            continue
        chosen.append(name)
    return chosen


def _skip_too_large(
    base: str,
    name: str,
    size: int,
    limit: int,
    required: Collection[str],
    log: logging.Logger,
) -> None:
    """A small file of ``size`` bytes, over ``limit``: an error when ``required``, else skipped
    with a log line."""
    if name in required:
        raise StorageError(
            f"{base}{name}: {size} bytes, more than the {limit}-byte limit on small files"
        )
    log.warning(
        "fastload: skipped %s%s: %d bytes, over the %d-byte limit on small files "
        "(nothing requires it)",
        base,
        name,
        size,
        limit,
    )


def prune(dest: str | os.PathLike[str], keep: Collection[str]) -> None:
    """Removes the files fastload fetched directly into ``dest`` that are not in ``keep`` (their
    objects are gone, or no longer pulled); files of others stay."""
    _fastload.prune_small_files(os.fspath(dest), list(keep))


def fetch_small_files(
    prefix: str,
    names: Iterable[str],
    dest: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, object] | None = None,
    max_size: int = MAX_SMALL_FILE,
    required: Collection[str] = (),
) -> list[str]:
    """Copies the objects ``prefix + name`` (``name`` relative, ``/``-separated) into ``dest``,
    several at a time; returns the names now there. Every name is checked (``check_inside``)
    before anything is read. A file kept from an earlier fetch stays while the store says it is
    unchanged; a missing object is skipped (the caller asks for files that may or may not exist,
    as the libraries do) and a copy fastload left of it removed; an object over ``max_size`` is
    an error when ``required``, else skipped with a log line; any other failure raises."""
    base = prefix if prefix.endswith("/") else prefix + "/"
    wanted = [_fastload.check_inside(n, base) for n in dict.fromkeys(names) if n]
    root = Path(dest)

    def one(name: str) -> str | None:
        what, size = _fastload.fetch_small_file(
            base + name, os.fspath(root), name, max_size, storage_options=storage_options
        )
        if what == "missing":
            return None
        if what == "too_large":
            _skip_too_large(base, name, size, max_size, required, logger)
            return None
        return name

    if not wanted:
        return []
    root.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=min(16, len(wanted))) as pool:
        return [n for n in pool.map(one, wanted) if n is not None]


# --------------------------------------------------------------------- temporary folders


_temporary: dict[str, int] = {}  # folder -> the process that made it
_temporary_lock = threading.Lock()


def temporary_folder() -> Path:
    """A new ``fastload-small-files-*`` folder, removed when this process exits unless
    :func:`remove_temporary` removed it first. A forked child never removes its parent's."""
    path = tempfile.mkdtemp(prefix="fastload-small-files-")
    with _temporary_lock:
        _temporary[path] = os.getpid()
    return Path(path)


def remove_temporary(path: str | os.PathLike[str]) -> None:
    with _temporary_lock:
        _temporary.pop(os.fspath(path), None)
    shutil.rmtree(path, ignore_errors=True)


@atexit.register
def _remove_temporaries() -> None:
    pid = os.getpid()
    with _temporary_lock:
        mine = [p for p, owner in _temporary.items() if owner == pid]
    for path in mine:
        remove_temporary(path)


# ------------------------------------------------------------------------------ checkpoints


@dataclass
class _HubRepo:
    """A Hub repo whose small files are fetched by name; ``revision`` becomes the commit the
    first fetch resolved, so that every later fetch (and the weights) reads that commit."""

    repo_id: str
    revision: str | None
    sub: str
    token: str | bool | None
    cache_dir: str | None
    local_files_only: bool
    folder: Path | None = None

    def fetch(self, rels: Sequence[str]) -> Path:
        import huggingface_hub

        folder = huggingface_hub.snapshot_download(
            self.repo_id,
            revision=self.revision,
            endpoint=os.environ.get("HF_ENDPOINT") or None,
            cache_dir=self.cache_dir,
            token=self.token,
            local_files_only=self.local_files_only,
            # Exactly these files (an empty list matches none): a name is a pattern to fnmatch.
            allow_patterns=[glob.escape(r) for r in rels],
        )
        if self.folder is None:
            self.folder = Path(folder)  # snapshots/<commit>
            self.revision = self.folder.name
            self.folder.mkdir(parents=True, exist_ok=True)
        return self.folder


class Checkpoint:
    """A checkpoint's local folder of small files (``local``) and the URIs of its weights."""

    def __init__(
        self,
        uri: str,
        local: Path | None,
        weights_base: str,
        *,
        storage_options: Mapping[str, object] | None = None,
        remote_prefix: str | None = None,
        temporary: bool = False,
        hub: _HubRepo | None = None,
    ) -> None:
        self.uri = uri
        self._local = local
        self._weights_base = weights_base.rstrip("/")
        self.storage_options = storage_options
        self._remote_prefix = remote_prefix
        self._temporary = temporary
        self._hub = hub

    @property
    def local(self) -> Path:
        if self._hub is not None:
            folder = self._hub.folder or self._hub.fetch([])
            return folder / self._hub.sub if self._hub.sub else folder
        assert self._local is not None
        return self._local

    @property
    def weights_base(self) -> str:
        if self._hub is not None:
            self.local  # noqa: B018 (resolves the commit)
            sub = f"/{self._hub.sub}" if self._hub.sub else ""
            return f"hf://{self._hub.repo_id}@{self._hub.revision}{sub}"
        return self._weights_base

    def folder(self, subfolder: str = "") -> Path:
        return self.local / subfolder if subfolder else self.local

    def weight_uri(self, rel: str) -> str:
        """The URI fastload reads the weight file ``rel`` (relative to the checkpoint) from."""
        base = self.weights_base
        if self._remote_prefix is None and self._hub is None and "://" not in base:
            return str(Path(base) / rel)
        return f"{base}/{rel}"

    def fetch(
        self, names: Iterable[str], subfolder: str = "", required: Collection[str] = ()
    ) -> None:
        """Makes the small files ``names`` (of ``subfolder``) local, where they exist, and only
        those: a local folder has them; a Hub repo's are downloaded into the Hugging Face cache;
        an object store's are fetched (:func:`fetch_small_files`). ``required``: names that
        must not be skipped for their size."""
        rel = [f"{subfolder}/{n}" if subfolder else n for n in names]
        source = self.weights_base + "/" if self._hub is None else f"hf://{self._hub.repo_id}/"
        for r in rel:
            _fastload.check_inside(r, source)
        if self._hub is not None:
            sub = self._hub.sub
            self._hub.fetch([f"{sub}/{r}" if sub else r for r in rel])
            return
        if self._remote_prefix is None:
            return
        need = {f"{subfolder}/{n}" if subfolder else n for n in required}
        fetch_small_files(
            self._remote_prefix,
            rel,
            self.local,
            storage_options=self.storage_options,
            required=need,
        )

    def close(self) -> None:
        if self._temporary:
            remove_temporary(self.local)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_checkpoint_for(
    uri: str | os.PathLike[str],
    kwargs: dict[str, Any],
    storage_options: Mapping[str, object] | None,
    ignored: Sequence[str],
) -> Checkpoint:
    """:func:`open_checkpoint` with the Hub arguments of a library's ``from_pretrained``, taken
    out of ``kwargs`` (``revision``, ``token``, ``cache_dir``, ``local_files_only``), and the
    download-only ones that mean nothing to a stream (``ignored``) dropped."""
    revision = kwargs.pop("revision", None)
    token = kwargs.pop("token", None)
    cache_dir = kwargs.pop("cache_dir", None)
    local_files_only = bool(kwargs.pop("local_files_only", False))
    for key in ignored:
        kwargs.pop(key, None)
    return open_checkpoint(
        uri,
        revision=revision,
        token=token,
        cache_dir=cache_dir,
        local_files_only=local_files_only,
        storage_options=storage_options,
    )


def open_checkpoint(
    uri: str | os.PathLike[str],
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool = False,
    storage_options: Mapping[str, object] | None = None,
) -> Checkpoint:
    """Where the checkpoint ``uri`` names lives; see the module's docstring. Nothing is fetched
    yet: :meth:`Checkpoint.fetch` fetches the names a library asks for."""
    text = os.fspath(uri)
    if text.startswith("file://"):
        text = urllib.parse.unquote(urllib.parse.urlparse(text).path)
    if "://" not in text and os.path.isdir(text):
        return Checkpoint(text, Path(text), text, storage_options=storage_options)
    # hf:// as a load reads it (any case of the scheme, refs/pr and refs/convert revisions).
    parsed = _fastload.parse_hub_uri(text)
    if parsed is not None or ("://" not in text and _REPO_ID.match(text)):
        if parsed is not None:
            repo_id, rev, sub = parsed
            if rev is not None and revision is not None and rev != revision:
                raise ConfigError(
                    f"{text}: names revision {rev!r} but revision={revision!r} was passed",
                    option="revision",
                )
            revision = rev or revision
        else:
            repo_id, sub = text, ""
        if sub:
            _fastload.check_inside(sub, f"hf://{repo_id}/")
        options: dict[str, Any] = dict(storage_options or {})
        if isinstance(token, str):
            options.setdefault("token", token)
        # The cache the environment names now (huggingface_hub read it at its import), as
        # fastload's hf:// reads it for the weights: the same cache for both.
        if cache_dir is None:
            cache_dir = _fastload.hub_cache_dir()
        hub = _HubRepo(
            repo_id,
            revision,
            sub,
            token,
            None if cache_dir is None else os.fspath(cache_dir),
            local_files_only,
        )
        return Checkpoint(text, None, "", storage_options=options or None, hub=hub)
    if _fastload.is_remote_uri(text):
        prefix = text if text.endswith("/") else text + "/"
        return Checkpoint(
            text,
            temporary_folder(),
            prefix,
            storage_options=storage_options,
            remote_prefix=prefix,
            temporary=True,
        )
    raise NotFoundError(
        f"{text}: not a local folder, a Hub repo id (ORG/REPO), hf://, or an object-store prefix"
    )
