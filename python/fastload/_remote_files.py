"""Where a checkpoint lives, for the transformers and diffusers integrations: a local folder, a
Hugging Face repo (``ORG/REPO``, ``hf://ORG/REPO[@REV][/SUB]``) or an object-store prefix
(``s3://``, ``gs://``, ``az://``, ``http(s)://``).

The weights are never written to disk: :class:`Checkpoint` names each weight file as a URI that
fastload streams. The small files beside them (``config.json``, an index, generation and
tokenizer files, remote code) are what the libraries read from a folder, so they are put in one:

- a local folder is used as it is;
- a Hub repo: ``huggingface_hub.snapshot_download`` of everything but weight files, into the
  Hugging Face cache as ``huggingface_hub`` would (the weights are streamed from
  ``hf://ORG/REPO@<commit>``, the commit that snapshot resolved);
- an object store: :func:`fetch_small_files` reads the files by name (a store need not list)
  into a temporary folder, removed when the :class:`Checkpoint` is closed.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import _fastload
from ._errors import ConfigError, NotFoundError

__all__ = ["WEIGHT_PATTERNS", "Checkpoint", "fetch_small_files", "open_checkpoint"]

# Files that are weights (or other large binaries) and never fetched as small files.
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

# The most bytes one small file may have (tokenizer.json of large vocabularies is ~30 MB).
MAX_SMALL_FILE = 64 << 20

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def fetch_small_files(
    prefix: str,
    names: Iterable[str],
    dest: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, object] | None = None,
    max_size: int = MAX_SMALL_FILE,
) -> list[str]:
    """Copies the objects ``prefix + name`` (``name`` relative, ``/``-separated) into ``dest``,
    several at a time; returns the names fetched. A missing object is skipped (the caller asks
    for files that may or may not exist, as the libraries do); any other failure raises."""
    base = prefix if prefix.endswith("/") else prefix + "/"
    wanted = [n for n in dict.fromkeys(names) if n and not (Path(dest) / n).is_file()]

    def one(name: str) -> str | None:
        try:
            data = _fastload.read_object(base + name, max_size, storage_options=storage_options)
        except NotFoundError:
            return None
        target = Path(dest) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".part")
        tmp.write_bytes(data)
        tmp.replace(target)
        return name

    if not wanted:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(wanted))) as pool:
        return [n for n in pool.map(one, wanted) if n is not None]


class Checkpoint:
    """A checkpoint's local folder of small files (``local``) and the URIs of its weights."""

    def __init__(
        self,
        uri: str,
        local: Path,
        weights_base: str,
        *,
        storage_options: Mapping[str, object] | None = None,
        remote_prefix: str | None = None,
        temporary: bool = False,
    ) -> None:
        self.uri = uri
        self.local = local
        self.weights_base = weights_base.rstrip("/")
        self.storage_options = storage_options
        self._remote_prefix = remote_prefix
        self._temporary = temporary

    def folder(self, subfolder: str = "") -> Path:
        return self.local / subfolder if subfolder else self.local

    def weight_uri(self, rel: str) -> str:
        """The URI fastload reads the weight file ``rel`` (relative to the checkpoint) from."""
        if self._remote_prefix is None and "://" not in self.weights_base:
            return str(Path(self.weights_base) / rel)
        return f"{self.weights_base}/{rel}"

    def fetch(self, names: Iterable[str], subfolder: str = "") -> None:
        """Makes the small files ``names`` (of ``subfolder``) local, where they exist. Only an
        object store fetches anything: a local folder has them, a Hub snapshot fetched every
        small file at once."""
        if self._remote_prefix is None:
            return
        rel = [f"{subfolder}/{n}" if subfolder else n for n in names]
        fetch_small_files(
            self._remote_prefix, rel, self.local, storage_options=self.storage_options
        )

    def close(self) -> None:
        if self._temporary:
            shutil.rmtree(self.local, ignore_errors=True)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _hf_parts(uri: str) -> tuple[str, str | None, str]:
    """``(repo_id, revision, subfolder)`` of ``hf://ORG/REPO[@REV][/SUB]``."""
    rest = uri[len("hf://") :].strip("/")
    parts = rest.split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise ConfigError(f"{uri}: expected hf://ORG/REPO[@REVISION][/FOLDER]", option="uri")
    repo, revision = parts[1], None
    if "@" in repo:
        repo, revision = repo.split("@", 1)
        revision = urllib.parse.unquote(revision)
        # refs/pr/N may be written as is: its '/' then splits the path.
        if revision == "refs" and len(parts) >= 4 and parts[2] == "pr":
            revision = f"refs/pr/{parts[3]}"
            parts = parts[:2] + parts[4:]
    return f"{parts[0]}/{repo}", revision, "/".join(parts[2:])


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
    """Where the checkpoint ``uri`` names lives; see the module's docstring."""
    text = os.fspath(uri)
    if text.startswith("file://"):
        text = urllib.parse.unquote(urllib.parse.urlparse(text).path)
    if "://" not in text and os.path.isdir(text):
        return Checkpoint(text, Path(text), text, storage_options=storage_options)
    if text.startswith("hf://") or ("://" not in text and _REPO_ID.match(text)):
        if text.startswith("hf://"):
            repo_id, rev, sub = _hf_parts(text)
            if rev is not None and revision is not None and rev != revision:
                raise ConfigError(
                    f"{text}: names revision {rev!r} but revision={revision!r} was passed",
                    option="revision",
                )
            revision = rev or revision
        else:
            repo_id, sub = text, ""
        import huggingface_hub

        options: dict[str, Any] = dict(storage_options or {})
        if isinstance(token, str):
            options.setdefault("token", token)
        # The environment as it is now (huggingface_hub read it at its import), as fastload's
        # hf:// reads it for the weights: the same endpoint and cache for both.
        if cache_dir is None and os.environ.get("HF_HUB_CACHE"):
            cache_dir = os.environ["HF_HUB_CACHE"]
        elif cache_dir is None and os.environ.get("HF_HOME"):
            cache_dir = os.path.join(os.environ["HF_HOME"], "hub")
        folder = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            endpoint=os.environ.get("HF_ENDPOINT") or None,
            cache_dir=None if cache_dir is None else os.fspath(cache_dir),
            token=token,
            local_files_only=local_files_only,
            ignore_patterns=list(WEIGHT_PATTERNS),
        )
        commit = Path(folder).name  # snapshots/<commit>
        local = Path(folder) / sub if sub else Path(folder)
        base = f"hf://{repo_id}@{commit}" + (f"/{sub}" if sub else "")
        return Checkpoint(text, local, base, storage_options=options or None)
    if _fastload.is_remote_uri(text):
        prefix = text if text.endswith("/") else text + "/"
        local = Path(tempfile.mkdtemp(prefix="fastload-small-files-"))
        return Checkpoint(
            text,
            local,
            prefix,
            storage_options=storage_options,
            remote_prefix=prefix,
            temporary=True,
        )
    raise NotFoundError(
        f"{text}: not a local folder, a Hub repo id (ORG/REPO), hf://, or an object-store prefix"
    )
