"""Writing safetensors files: :func:`save_file` (one file, the bytes safetensors' ``save_file``
writes) and :func:`save` (Hugging Face-style shards and their index), to a local path or an object
store. The checks on the tensors and the sharding are here; the header, the order of the bytes and
the writing itself are the native module's (``_fastload.FileWriter``): local files appear by
rename, objects by completing a multipart upload, so a failed or interrupted write leaves nothing
at the destination."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from . import _fastload
from ._errors import ConfigError, DestinationExistsError
from ._options import path_str
from ._publish import SINGLE_FILE, Staged, checkpoint_files, join
from ._torch import DTYPES

# torch dtype -> the safetensors name the header uses.
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
_F4 = getattr(torch, "float4_e2m1fn_x2", None)


def _destination(uri: object) -> str:
    uri = path_str(uri, "(str or os.PathLike)")
    if not uri.strip():
        raise ConfigError("invalid option uri: empty", option="uri")
    return uri


def _metadata(metadata: object) -> list[tuple[str, str]] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict of str to str, got {type(metadata).__name__}")
    out = []
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(
                f"metadata must be a dict of str to str: entry {k!r}: {v!r} is "
                f"{type(k).__name__} to {type(v).__name__}"
            )
        out.append((k, v))
    return out


def _storage_key(t: torch.Tensor) -> tuple[Any, int, int] | None:
    if t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    if storage.data_ptr() == 0 or storage.nbytes() == 0:
        return None
    return (t.device, storage.data_ptr(), storage.nbytes())


def _end(t: torch.Tensor) -> int:
    return t.data_ptr() + (t.nelement() * t.element_size() if t.nelement() else 0)


def shared_groups(tensors: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names whose tensors overlap in memory, as safetensors finds them (same storage, byte ranges
    that overlap); each group in the mapping's order, groups of two or more only."""
    by_storage: dict[tuple[Any, int, int], list[str]] = {}
    for name, t in tensors.items():
        key = _storage_key(t)
        if key is not None:
            by_storage.setdefault(key, []).append(name)
    position = {name: i for i, name in enumerate(tensors)}
    groups: list[list[str]] = []
    for names in by_storage.values():
        if len(names) < 2:
            continue
        areas = sorted((tensors[n].data_ptr(), _end(tensors[n]), n) for n in names)
        current = [areas[0][2]]
        last_stop = areas[0][1]
        for start, stop, name in areas[1:]:
            if start >= last_stop:
                if len(current) > 1:
                    groups.append(current)
                current = [name]
            else:
                current.append(name)
            last_stop = stop
        if len(current) > 1:
            groups.append(current)
    return [sorted(g, key=position.__getitem__) for g in groups]


class _MetaTensorError(ConfigError, NotImplementedError):
    """A tensor on the meta device: a ``ConfigError`` (``option="tensors"``) that is also the
    ``NotImplementedError`` (a ``RuntimeError``) safetensors' ``save_file`` lets torch raise."""


def check_tensors(tensors: object) -> dict[str, torch.Tensor]:
    """The tensors as a dict, or the error safetensors' ``save_file`` raises for them, checked in
    its order (the mapping, each value, sparse tensors, shared memory, each tensor's layout,
    device and dtype, the names) with its exception types and, where its tests pin them, its
    messages; fastload's are subclasses (``ConfigError`` is a ``ValueError``) so that both kinds
    of ``except`` hold."""
    if not isinstance(tensors, Mapping):
        raise ConfigError(
            f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}",
            option="tensors",
        )
    sparse = []
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ConfigError(
                f"Key `{name}` is invalid, expected torch.Tensor but received {type(t)}",
                option="tensors",
            )
        if t.layout != torch.strided:
            sparse.append(name)
    if sparse:
        raise ConfigError(
            f"You are trying to save a sparse tensors: `{sparse}` which this library does not "
            f"support. You can make it a dense tensor before saving with `.to_dense()` but be "
            f"aware this might make a much larger file than needed.",
            option="tensors",
        )
    out: dict[str, torch.Tensor] = dict(tensors)
    shared = shared_groups(out)
    if shared:
        # safetensors' save_file refuses these with a RuntimeError; so does fastload.
        raise RuntimeError(
            f"Some tensors share memory, this would write the same bytes twice and lose the "
            f"sharing on load: {shared}. Save one name per group (fastload.save drops tied "
            f"duplicates), or .clone() the tensors that must stay separate."
        )
    for name, t in out.items():
        _check_tensor(name, t)
    # Names last, as safetensors' native writer checks them once the tensors passed.
    for name in out:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str: {name!r} is {type(name).__name__}")
    return out


def _check_tensor(name: object, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ConfigError(
            f"tensor {name!r} is not contiguous: call .contiguous() on it before saving "
            f"(a view of another tensor: save the full tensor and slice it after loading)",
            option="tensors",
        )
    if t.device.type == "meta":
        # The words of torch's error, which safetensors' save_file raises (and tests match).
        raise _MetaTensorError(
            f"Cannot copy out of meta tensor; no data! Tensor {name!r} is on the meta device "
            f"and has no bytes to write",
            option="tensors",
        )
    if t.dtype not in _NAMES:
        raise ConfigError(
            f"tensor {name!r}: dtype {t.dtype} has no safetensors equivalent",
            option="tensors",
        )


def _spec(name: str, t: torch.Tensor) -> tuple[str, str, list[int]]:
    shape = list(t.shape)
    if t.dtype == _F4:
        # Two 4-bit values per element of torch's float4_e2m1fn_x2: safetensors counts values.
        if not shape:
            raise ConfigError(
                f"tensor {name!r}: a 0-dim float4_e2m1fn_x2 tensor has no safetensors shape",
                option="tensors",
            )
        shape[-1] *= 2
    return (name, _NAMES[t.dtype], shape)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor with its conjugate and negative bits resolved (the bytes it stands for)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def _cuda_stream(device: torch.device) -> int:
    """The handle of torch's current stream on ``device``: the copies out of a GPU tensor wait
    for the work queued on it (the kernels that produce the tensor)."""
    return int(torch.cuda.current_stream(device).cuda_stream)


def _write_tensor(writer: Any, t: torch.Tensor) -> None:
    """Gives ``t``'s bytes to ``writer``: a CPU tensor's memory as it is (no copy); a CUDA
    tensor's copied out by the native module in blocks through page-locked memory (within
    ``memory_limit``) while earlier blocks are written, after the work queued on torch's current
    stream, and held until every copy from it is done; any other device's through a host copy."""
    t = _plain(t)
    # ROCm builds of torch call their GPUs "cuda" too, without NVIDIA's driver: a host copy there.
    if t.device.type == "cuda" and getattr(torch.version, "hip", None) is None:
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        writer.write_device(t.data_ptr(), t.nbytes, index, _cuda_stream(t.device), t)
        return
    if t.device.type != "cpu":
        # One tensor at a time; the host copy lives until its bytes are written or uploaded.
        t = t.to("cpu")
    writer.write(t)


def save_file(
    tensors: Mapping[str, torch.Tensor],
    uri: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
    *,
    overwrite: bool = True,
    storage_options: Mapping[str, object] | None = None,
    memory_limit: int | str | None = None,
    part_size: int | str | None = None,
    keyset: str | os.PathLike[str] | None = None,
    associated_data: bytes | str | None = None,
) -> None:
    """Writes ``tensors`` as one safetensors file at ``uri`` (a path, ``file://``, ``s3://``,
    ``gs://`` or ``az://``): the same bytes ``safetensors.torch.save_file`` writes.

    The file appears whole or not at all: a local file is written under a temporary name beside
    the destination and renamed into place; an object is uploaded in parts in parallel and
    completed last (a failure or Ctrl-C aborts the upload). An existing destination is replaced,
    as safetensors replaces it, but only once the new file is complete (by that rename, which
    leaves a reader holding the old file open its old bytes, or by completing the upload); with
    ``overwrite=False`` it raises
    :class:`fastload.DestinationExistsError` instead and nothing is written. Invalid tensors raise
    what safetensors' ``save_file`` raises (see :func:`check_tensors`). ``memory_limit`` bounds
    the bytes of upload parts in flight, ``part_size`` the bytes per part (16 MiB by default, at
    least 5 MiB, raised to keep a file within 9,000 parts). CPU tensors are written from their
    own memory; CUDA tensors are copied out in blocks through page-locked memory (at most
    ``memory_limit`` of it, with an upload part and two blocks at the least) while earlier blocks
    are written or uploaded, after the work queued on torch's current stream.

    With ``keyset`` (a Tink cleartext JSON keyset, or the path of a file holding it) the file is
    encrypted whole with the keyset's primary key, as Tink's streaming AEAD encrypts
    (``AesGcmHkdfStreaming``), with ``associated_data`` (empty by default): Tink decrypts it, and
    ``fastload.load(..., keyset=...)`` reads it. ``FASTLOAD_KEYSET`` never makes a write
    encrypted. See docs/encryption.md."""
    checked = check_tensors(tensors)
    if not isinstance(overwrite, bool):
        raise ConfigError(
            f"invalid option overwrite: expected a bool, got {type(overwrite).__name__}",
            option="overwrite",
        )
    _writer(
        checked,
        _destination(uri),
        _metadata(metadata),
        publish=True,
        overwrite=overwrite,
        storage_options=storage_options,
        memory_limit=memory_limit,
        part_size=part_size,
        keyset=keyset,
        associated_data=associated_data,
    )


def _writer(
    checked: dict[str, torch.Tensor],
    uri: str,
    metadata: list[tuple[str, str]] | None,
    *,
    publish: bool,
    **options: Any,
) -> Any:
    """A ``FileWriter`` for ``uri`` given every tensor's bytes, then finished: the file
    published, or with ``publish=False`` complete and durable but not visible (its owner publishes
    it with ``finish()``). Aborted on any failure, Ctrl-C included."""
    names = list(checked)
    writer = _fastload.FileWriter(uri, [_spec(n, checked[n]) for n in names], metadata, **options)
    try:
        for i in writer.order:
            _write_tensor(writer, checked[names[i]])
        writer.finish(publish=publish)
    except BaseException:
        writer.abort()
        raise
    return writer


def _shard_size(max_shard_size: int | str) -> int:
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, (int, str)):
        raise ConfigError(
            f'invalid option max_shard_size: expected an int or a size like "5GB", got '
            f"{type(max_shard_size).__name__}",
            option="max_shard_size",
        )
    size = (
        max_shard_size if isinstance(max_shard_size, int) else _fastload.parse_size(max_shard_size)
    )
    if size <= 0:
        raise ConfigError(
            f"invalid option max_shard_size: {max_shard_size!r} must be more than 0",
            option="max_shard_size",
        )
    return size


def _storage_size(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def _storage_id(t: torch.Tensor) -> tuple[Any, int, int] | None:
    """huggingface_hub's ``get_torch_storage_id``: the device, address and size of the tensor's
    storage (every empty tensor's storage is at address 0: they count as one); none on meta."""
    if t.device.type == "meta":
        return None
    return (t.device, t.untyped_storage().data_ptr(), _storage_size(t))


def split_shards(
    tensors: Mapping[str, torch.Tensor], max_shard_size: int
) -> list[dict[str, torch.Tensor]]:
    """huggingface_hub's rule (``split_torch_state_dict_into_shards``): tensors in the mapping's
    order, each storage sized whole by its first tensor; a shard is closed when the next storage
    would take it past ``max_shard_size``; a storage larger than that gets a shard of its own.
    The later tensors of a storage (a fused qkv's thirds, a flat parameter's pieces) add nothing
    and go into their first tensor's shard, so a storage is never split across files."""
    shards: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    current_size = 0
    first: dict[tuple[Any, int, int], str] = {}  # storage -> its first tensor's name
    later: list[tuple[str, str]] = []  # (a later tensor of a storage, that storage's first)
    for name, t in tensors.items():
        storage = _storage_id(t)
        if storage is not None:
            if storage in first:
                later.append((name, first[storage]))
                continue
            first[storage] = name
        size = _storage_size(t)
        if size > max_shard_size:
            shards.append({name: t})
            continue
        if current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = {}, 0
        current[name] = t
        current_size += size
    if current:
        shards.append(current)
    shard_of = {n: shard for shard in shards for n in shard}
    for name, head in later:
        shard_of[head][name] = tensors[name]
    return shards


def total_size(tensors: Mapping[str, torch.Tensor]) -> int:
    """The index's ``total_size`` as huggingface_hub counts it: each storage once, whole."""
    storages: dict[tuple[Any, int, int], int] = {}
    loose = 0
    for t in tensors.values():
        storage = _storage_id(t)
        if storage is None:
            loose += _storage_size(t)
        else:
            storages[storage] = storage[2]
    return loose + sum(storages.values())


def _drop_tied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One name per group of tensors that are the same memory (tied weights), as transformers
    saves them: the first name in the state dict's order stays. Tensors that overlap without
    being the same view cannot be saved as such."""
    drop: set[str] = set()
    for group in shared_groups(tensors):
        first = tensors[group[0]]
        same = all(
            t.data_ptr() == first.data_ptr()
            and t.dtype == first.dtype
            and t.shape == first.shape
            and t.stride() == first.stride()
            for t in (tensors[n] for n in group[1:])
        )
        if not same:
            raise RuntimeError(
                f"tensors {group} share memory without being the same tensor: .clone() the "
                f"ones to save separately"
            )
        drop.update(group[1:])
    if drop:
        warnings.warn(
            f"fastload.save: tensors {sorted(drop)} share memory with another tensor (tied "
            f"weights) and are not written, as transformers does",
            stacklevel=3,
        )
    return {n: t for n, t in tensors.items() if n not in drop}


def _exists_error(uri: str) -> DestinationExistsError:
    import errno

    return DestinationExistsError(
        errno.EEXIST, f"{uri}: already exists (pass overwrite=True to replace it)", uri
    )


# boilerplate: the write options of save_file again (public signatures, each spelled out)
def save(
    state_dict: Mapping[str, torch.Tensor],
    uri: str | os.PathLike[str],
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    *,
    overwrite: bool = True,
    storage_options: Mapping[str, object] | None = None,
    memory_limit: int | str | None = None,
    part_size: int | str | None = None,
    keyset: str | os.PathLike[str] | None = None,
    associated_data: bytes | str | None = None,
) -> list[str]:
    """Writes ``state_dict`` into the folder (or prefix) ``uri`` as transformers'
    ``save_pretrained`` does: ``model.safetensors`` when it fits in one shard, else
    ``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json``. No file is
    published before every shard is written whole (a synced temporary file, or an upload whose
    parts are all stored); then the shards and the index (first where no earlier checkpoint is
    left to load, else last: docs/writing.md). A failure or Ctrl-C removes what the
    save published, so a reader finds the earlier checkpoint or the new one, whole, or an error
    (docs/writing.md, "When a write fails"). Shards are split by huggingface_hub's rule
    (:func:`split_shards`).
    An earlier checkpoint under ``uri`` is replaced, as ``save_pretrained`` replaces it; with
    ``overwrite=False`` it raises :class:`fastload.DestinationExistsError` before anything is
    written. Tied weights (tensors that are the same memory) are written once,
    under their first name. Each file carries ``{"format": "pt"}`` and ``metadata`` in its
    header. With ``keyset`` every shard is encrypted as :func:`save_file` encrypts; the index
    stays in the clear (loaders read it so): it lists the tensor names, not their shapes or
    bytes. Returns the names of the files written, the index last."""
    folder = _destination(uri)
    tensors = _drop_tied(check_tensors_for_save(state_dict))
    limit = _shard_size(max_shard_size)
    header = {"format": "pt", **dict(_metadata(metadata) or [])}
    shards = split_shards(tensors, limit)
    if len(shards) <= 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    # An earlier save's files under `uri`: without overwrite any of them is refused (a stale index
    # would send readers to the old shards); with it, those the new save does not replace go
    # once every new file is written.
    earlier = checkpoint_files(folder, storage_options)
    if earlier and not overwrite:
        raise _exists_error(join(folder, earlier[0]))
    if not shards:
        shards = [{}]
    options = {
        "overwrite": overwrite,
        "storage_options": storage_options,
        "memory_limit": memory_limit,
        "part_size": part_size,
        "keyset": keyset,
        "associated_data": associated_data,
    }
    # Every shard complete before any is published; see _publish.
    pairs = _metadata(header)
    with Staged(folder, earlier, overwrite=overwrite, storage_options=storage_options) as staged:
        for name, shard in zip(names, shards):
            dest = join(folder, name)
            staged.add(name, _writer(shard, dest, pairs, publish=False, **options))
        if len(shards) == 1:
            return staged.publish()
        return staged.publish(_index(tensors, names, shards))


def _index(
    tensors: dict[str, torch.Tensor], names: list[str], shards: list[dict[str, torch.Tensor]]
) -> bytes:
    """The index file's bytes, as transformers writes them (by the crate that reads them)."""
    pairs = [(t, name) for name, shard in zip(names, shards) for t in shard]
    return _fastload.index_json(pairs, total_size(tensors))


def check_tensors_for_save(state_dict: object) -> dict[str, torch.Tensor]:
    """:func:`check_tensors` without the shared-memory refusal (``save`` drops tied copies)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a dict of str to torch.Tensor, got {type(state_dict).__name__}"
        )
    # Each tensor alone passes the per-tensor checks; sharing is decided by _drop_tied.
    for name, t in state_dict.items():
        check_tensors({name: t})
    return dict(state_dict)
