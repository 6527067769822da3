"""Type stubs for the native module (checked against it by `mypy.stubtest` in CI).

Option inputs, as the native module converts them (``src/python/args.rs``); ``None`` always means
"not given" (then ``FASTLOAD_*``, then the default applies):

- ``concurrency``: reads in flight, an ``int`` >= 1 (at most 4096); not ``bool``. Default 16, 64
  when any URI is an object store.
- ``block_size``: bytes per read, an ``int`` or a ``str`` such as ``"8MiB"`` (B, KB, MB, GB, TB,
  KiB, MiB, GiB, TiB); 4 KiB to 1 GiB. Default 8 MiB.
- ``memory_limit``: host buffer bytes a load may hold, as ``block_size``; at least 1 MiB.
  Default 1 GiB.
- ``names``: any iterable of ``str`` (a bare ``str`` is its characters), duplicates dropped.
  Default: every tensor.
- ``method``: ``"auto"`` (default), ``"mmap"``, ``"read"`` (or ``"pread"``), ``"direct"``, any
  case.
- ``copy_streams``: copy queues (CUDA streams) of a staged load, an ``int`` >= 1 (at most 16);
  not ``bool``. Default 1.
- ``storage_options``: a mapping with ``str`` keys; values are converted with ``str()``, ``bool`` as
  ``"true"``/``"false"``. Default: none (the environment configures object stores).
- ``cache``: ``True`` (the default directory), ``False`` (off), a ``str`` or ``os.PathLike`` (that
  directory). Default ``FASTLOAD_CACHE`` (``0``/``1`` or a directory), else off.
- ``verify``: ``True`` or ``False``: check sha256s where the store gives them (Hub LFS files)
  and S3/GCS/Azure objects against their stores' whole-object checksums.
  Default ``FASTLOAD_VERIFY`` (``0``/``1``), else off.
- ``keyset``: a Tink cleartext JSON keyset (a ``str`` starting with ``{``) or the path of one
  (``str`` or ``os.PathLike``): the files are Tink streaming-AEAD ciphertext, read as their
  plaintext. Default ``FASTLOAD_KEYSET``, else none.
- ``associated_data``: ``bytes`` or ``str`` (its UTF-8): what the files were encrypted with.
  Default empty.
- ``peers``: a ``str`` (comma-separated) or an iterable of ``str``, each ``"host:port"`` or
  ``"https://host:port"``: serves read before the origin. Default ``FASTLOAD_PEERS``, else none.
- ``peer_token``: a ``str``, the peers' bearer token (never shown). Default
  ``FASTLOAD_PEER_TOKEN``, else none.

A value that cannot be used raises ``fastload.ConfigError`` with ``option`` set.
"""

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypedDict, final

__all__ = [
    "DLPACK_DTYPES",
    "DTYPES",
    "INDEX_FILE",
    "LOCAL_READ_COST",
    "MAPPED_READ_COST",
    "OPTIONS",
    "REMOTE_READ_COST",
    "SCHEMES",
    "UNANSWERED",
    "FileWriter",
    "Item",
    "OptionDef",
    "PendingRead",
    "RankPlan",
    "Reader",
    "Region",
    "ResolvedOptions",
    "Stats",
    "Stream",
    "__version__",
    "cache_stats",
    "cached_memory",
    "check_inside",
    "checkpoint_tensors",
    "cli_main",
    "copy",
    "cuda_device_count",
    "fetch_small_file",
    "hub_cache_dir",
    "index_files",
    "index_json",
    "inspect_json",
    "is_remote_uri",
    "list_objects",
    "merge_runs",
    "parse_hub_uri",
    "parse_size",
    "plan_ranks",
    "plan_region",
    "prune_small_files",
    "release_memory",
    "remove",
    "resolve_options",
    "scrub",
    "write_bytes",
]

__version__: str
# Remote URI schemes, lower case: object stores (``s3``, ``gs``, ``az``, ``http``, ...) and
# ``hf`` (the Hugging Face Hub).
SCHEMES: tuple[str, ...]
# Every safetensors dtype name the parser knows (``"F32"``, ``"BF16"``, ``"F8_E4M3"``, ...).
DTYPES: tuple[str, ...]
# The dtypes whose capsules carry the dtype itself; the others carry flat uint8 bytes.
DLPACK_DTYPES: tuple[str, ...]
# The index file of a sharded checkpoint, read by loads and written by ``save``.
INDEX_FILE: str
# Set (True) on a KeyboardInterrupt raised by a call whose exchanges with other ranks were cut
# short: the caller must run no further collective of the group's.
UNANSWERED: str

# What one more request costs a reader of chosen ranges, in bytes it could read instead
# (``Source::read_cost``): a file's pread, an object store's round trip, a mapping (no request).
LOCAL_READ_COST: int
REMOTE_READ_COST: int
MAPPED_READ_COST: int

_Size = int | str
_Cache = bool | str | os.PathLike[str]

@final
class OptionDef:
    """One load option, as ``OPTIONS`` in src/options.rs (the one list of them) defines it."""

    @property
    def name(self) -> str: ...
    @property
    def type(self) -> str:
        """Its annotation in ``fastload.Options``, as written there."""
    @property
    def signature_default(self) -> str | None:
        """The default a Python signature shows; ``None``: not given."""
    @property
    def default(self) -> str:
        """What applies when it is neither given nor set in ``env``, in README's words."""
    @property
    def env(self) -> str | None:
        """The ``FASTLOAD_*`` variable read when it is not given."""
    @property
    def help(self) -> str:
        """What it does, in README's words."""
    @property
    def takes(self) -> tuple[str, ...]:
        """``"native"`` (``Stream``, ``resolve_options``), ``"reader"`` (``Reader``),
        ``"safe_open"``, ``"extra_config"`` (the vLLM and SGLang loaders'
        ``model_loader_extra_config``); every option is taken by ``fastload.load``, ``stream``,
        ``Stream`` and ``fastload.distributed``."""

# The load options, in signature order.
OPTIONS: tuple[OptionDef, ...]

class _CacheStats(TypedDict):
    hits: int
    filled_bytes: int
    published: int
    disabled_reason: str | None

# What a staged load's allocator returns: the CUDA stream handle the memory was taken on (or
# None), and per tensor an object owning the memory and its address.
_Allocate = Callable[[list[int]], tuple[int | None, Sequence[tuple[object, int]]]]

@final
class Item:
    """One delivered tensor, or a piece of one when the load reads ``parts``."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str:
        """The safetensors dtype (``"U8"`` for a piece)."""
    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape (``(len,)`` for a piece)."""
    @property
    def data(self) -> object:
        """A ``dltensor`` capsule (the tensor as its dtype when in ``DLPACK_DTYPES``, else flat
        uint8 bytes), or for a staged load with ``allocate`` the owner object it returned."""
    @property
    def begin(self) -> int | None:
        """The piece's first byte within its tensor; ``None`` for a whole tensor."""

@final
class Stats:
    """A load's counters at one moment, with the method and options in force."""

    @property
    def total_bytes(self) -> int:
        """Bytes the load delivers (tensors, or pieces)."""
    @property
    def tensor_count(self) -> int:
        """Tensors (or pieces) the load delivers."""
    @property
    def files(self) -> int: ...
    @property
    def bytes_read(self) -> int:
        """Bytes read from storage, or faulted in from a file mapping."""
    @property
    def bytes_delivered(self) -> int: ...
    @property
    def tensors_delivered(self) -> int: ...
    @property
    def first_segment_ms(self) -> float | None:
        """Milliseconds from the start to the first completed segment; ``None`` before it."""
    @property
    def method(self) -> str:
        """``"mmap"``, ``"read"`` or ``"direct"``: the method that ran."""
    @property
    def method_reason(self) -> str:
        """Why that method ran (asked for, or what ``"auto"`` saw: a local or network filesystem,
        an object store, a staged load)."""
    @property
    def concurrency(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def memory_limit(self) -> int: ...
    @property
    def target(self) -> str | None:
        """``"cuda:N"`` or ``"host"`` for a staged load, else ``None``."""
    @property
    def copy_streams(self) -> int | None:
        """Staged loads: the copy queues (CUDA streams) blocks were copied on in turn; ``None``
        for a load that copies nothing."""
    @property
    def bytes_copied(self) -> int:
        """Staged loads: bytes copied into destinations."""
    @property
    def staging_peak_bytes(self) -> int:
        """Staged loads: the most staging memory held at once."""
    @property
    def pinned_bytes(self) -> int:
        """GPU loads: page-locked staging memory this load allocated (``cuMemHostAlloc``), i.e.
        what the buffers cached by earlier loads of the process did not cover."""
    @property
    def pinned_ms(self) -> float:
        """GPU loads: wall-clock milliseconds during which some of those allocations ran."""
    @property
    def bytes_cached(self) -> int:
        """mmap loads: bytes whose pages were all in the page cache already, so they were mapped
        and left to fault in on first access instead of being populated (counted in
        ``bytes_read`` too)."""
    @property
    def lent_bytes(self) -> int:
        """GPU loads with ``method="mmap"``: bytes the device copied from the files' mapped
        pages where they are (page-locked in place, read-only: no copy out of the page cache)."""
    @property
    def lend_refused(self) -> str | None:
        """GPU loads with ``method="mmap"``: why the load stopped lending the files' pages to
        the device (a source that is not a plain local file, a driver that cannot page-lock
        read-only memory), the rest having been read into staging buffers; ``None`` if it never
        did."""
    @property
    def direct_bytes(self) -> int:
        """Loads with ``method="direct"``: bytes read around the page cache (``O_DIRECT``)
        straight into page-locked staging buffers, or to CPU pooled buffers (blocks not in the
        page cache)."""
    @property
    def direct_refused(self) -> str | None:
        """Loads with ``method="direct"``: why the load stopped reading around the page
        cache (a source that is not a local file, a filesystem that refuses ``O_DIRECT``), the
        rest having been read through it; ``None`` if it never did."""
    @property
    def phases_ms(self) -> dict[str, float]:
        """Where the load's time went, in milliseconds: ``consumer_wait`` (the consumer waiting
        for a segment) for every load; staged loads also ``read`` and ``staging_wait`` (reads,
        and reads waiting for a staging buffer: pinning one, or one coming back; added up over
        the reads in flight), ``ring_wait`` (no ring slot free: blocks waiting for their
        copies), ``alloc`` (the allocator: torch's, from Python), ``copy`` (enqueueing copies),
        ``copy_idle`` (the copy thread waiting for a read), ``fence_wait`` (waiting for the
        copies to finish on the device), ``lend`` (``method="mmap"``: mapping blocks and
        page-locking their pages, added up over the reads in flight) and ``unlend`` (giving them
        back, added up over the threads that do)."""
    def as_dict(self) -> dict[str, int | float | str | dict[str, float] | None]:
        """Every counter above, by name."""

@final
class ResolvedOptions:
    """Options with every value decided (argument, else ``FASTLOAD_*``, else default)."""

    @property
    def concurrency(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def memory_limit(self) -> int: ...
    @property
    def method(self) -> str:
        """``"auto"``, ``"mmap"``, ``"read"`` or ``"direct"``."""
    @property
    def copy_streams(self) -> int: ...
    @property
    def names(self) -> list[str] | None:
        """Deduplicated, in the order given; ``None`` for every tensor."""

@final
class RankPlan:
    """Who reads what in a distributed load; the same on every rank. A piece is
    ``(tensor, begin, end)``: bytes of ``tensors[tensor]``."""

    @property
    def tensors(self) -> tuple[tuple[str, str, tuple[int, ...], int], ...]:
        """The rows of the table some rank wants, in file order."""
    @property
    def total(self) -> int:
        """Bytes of those tensors, end to end."""
    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """Per rank: its ``(begin, end)`` of that total."""
    @property
    def rounds(self) -> int:
        """Rounds of the exchange."""
    @property
    def pieces(self) -> tuple[tuple[tuple[tuple[int, int, int], ...], ...], ...]:
        """``pieces[rank][round]``: the pieces that rank reads for that round."""
    @property
    def counts(self) -> tuple[int, ...]:
        """Per wanted tensor: the pieces it is cut into."""
    @property
    def chunk(self) -> int:
        """Bytes a rank moves per round at most."""
    def wants(self, rank: int, tensor: int) -> bool: ...
    def parts(self, rank: int) -> list[tuple[str, int, int]]:
        """``(name, begin, end)`` byte ranges ``rank`` reads, for ``Stream(parts=...)``."""

@final
class Stream:
    """A running load; each ``next()`` returns the items of one completed segment.

    ``parts``: read only these ``(name, begin, end)`` byte ranges within tensors (not with
    ``names``). ``target`` (``"cuda"``, ``"cuda:N"`` or ``"host"``): the staged pipeline; with
    ``allocate`` it copies into the memory ``allocate`` hands out (items' ``data`` are its owner
    objects), without it into memory fastload allocates per tensor (``cuMemAlloc`` for a GPU;
    items' ``data`` are ``dltensor`` capsules, kDLCUDA or kDLCPU, that own it). ``reader``: load
    the files a :class:`Reader` opened, each read pinned to the version it saw (``uris`` are not
    opened again).

    Waits release the GIL and honour Ctrl-C (KeyboardInterrupt, the load cancelled). ``stats()``
    and ``close()`` never wait for a ``next()`` running on another thread; a stream closed before
    it finished raises ``StreamClosedError`` from ``next()``."""

    def __new__(
        cls,
        uris: list[str],
        *,
        concurrency: int | None = None,
        block_size: _Size | None = None,
        memory_limit: _Size | None = None,
        names: Iterable[str] | None = None,
        method: str | None = None,
        copy_streams: int | None = None,
        storage_options: Mapping[str, object] | None = None,
        cache: _Cache | None = None,
        verify: bool | None = None,
        keyset: str | os.PathLike[str] | None = None,
        associated_data: bytes | str | None = None,
        peers: Sequence[str] | str | None = None,
        peer_token: str | None = None,
        parts: Sequence[tuple[str, int, int] | tuple[str, Region]] | None = None,
        target: str | None = None,
        allocate: _Allocate | None = None,
        reader: Reader | None = None,
    ) -> Stream: ...
    def __iter__(self) -> Stream: ...
    def __next__(self) -> list[Item]: ...
    def close(self) -> None:
        """Stops reading and frees buffers that no tensor uses (from any thread)."""
    def stats(self) -> Stats:
        """The counters so far; once closed, as they were when it closed."""

class _Header(TypedDict):
    file: str
    size: int
    data_start: int
    tensors: list[tuple[str, str, tuple[int, ...], int, int]]
    # None when the header has no __metadata__ (or null); {} when it is empty (as safetensors).
    metadata: dict[str, str] | None
    # The version opened (validators, digest, or size and mtime); None where the source has none.
    version: str | None
    # What one more request to the file costs (``Source::read_cost``), in bytes.
    read_cost: int

@final
class Reader:
    """Files opened once (sources and validated headers); ``read`` reads chosen byte ranges of
    one of them into a new buffer, in parallel blocks, nothing outside the ranges. With
    ``verify``, each file whose store gives a digest is checked whole (a cached copy hashed, a
    remote file read whole once) before anything is read from it."""

    def __new__(
        cls,
        uris: list[str],
        *,
        concurrency: int | None = None,
        block_size: _Size | None = None,
        storage_options: Mapping[str, object] | None = None,
        cache: _Cache | None = None,
        verify: bool | None = None,
        keyset: str | os.PathLike[str] | None = None,
        associated_data: bytes | str | None = None,
        peers: Sequence[str] | str | None = None,
        peer_token: str | None = None,
    ) -> Reader: ...
    @property
    def concurrency(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def bytes_read(self) -> int:
        """Bytes read by every ``read`` so far."""
    @property
    def reads(self) -> int:
        """Reads issued (requests, for object stores) by every ``read`` so far."""
    def headers(self) -> list[_Header]:
        """Each file's header, as ``inspect`` gives it, plus ``data_start`` and ``version``
        (the version opened); ``metadata`` is ``None`` when the header has no
        ``__metadata__``."""
    def read(self, shard: int, ranges: list[tuple[int, int]]) -> object:
        """``ranges`` (``(file offset, len)``) of file ``shard``, one after the other, as a flat
        uint8 ``dltensor`` capsule."""
    def read_later(self, shard: int, ranges: list[tuple[int, int]]) -> PendingRead:
        """``read``, started now on a thread of its own (which never takes the GIL);
        ``PendingRead.wait()`` gives the capsule."""
    def map(self, shard: int, offset: int, len: int) -> object | None:
        """``len`` bytes at ``offset`` of file ``shard`` as a private mapping (its pages faulted
        in, the file checked unchanged), a flat uint8 ``dltensor`` capsule; ``None`` where the
        file cannot be mapped (object stores, encrypted files)."""

@final
class PendingRead:
    """A read started by ``Reader.read_later``."""

    def wait(self) -> object:
        """The bytes read (a flat uint8 ``dltensor`` capsule), or the read's error; once."""

@final
class FileWriter:
    """One safetensors file being written (see ``fastload.save_file``)."""

    def __new__(
        cls,
        uri: str,
        tensors: list[tuple[str, str, list[int]]],
        metadata: list[tuple[str, str]] | None = None,
        *,
        overwrite: bool = False,
        storage_options: Mapping[str, object] | None = None,
        memory_limit: int | str | None = None,
        part_size: _Size | None = None,
        keyset: str | os.PathLike[str] | None = None,
        associated_data: bytes | str | None = None,
    ) -> FileWriter: ...
    @property
    def order(self) -> list[int]:
        """Indices of the tensors, in the order their bytes are written."""
    @property
    def uri(self) -> str: ...
    def write(self, data: Any) -> None:
        """The bytes of the next tensor in ``order``: a contiguous CPU torch tensor."""
    def write_device(
        self, ptr: int, nbytes: int, device: int, stream: int | None, owner: object
    ) -> None:
        """The bytes of the next tensor in ``order`` from CUDA device ``device``'s memory at
        ``ptr``, copied out in page-locked blocks after the work queued on ``stream``; ``owner``
        is held until every copy from it is done."""
    @property
    def device_block_size(self) -> int:
        """Bytes per device-to-host copy of ``write_device``."""
    def finish(self, *, publish: bool = True) -> None:
        """Publishes the file; with ``publish=False`` only makes it complete and durable (not
        visible), for a later ``finish()`` to publish."""
    @property
    def published(self) -> bool:
        """Whether ``finish()`` put the file in place."""
    def abort(self) -> None: ...

def write_bytes(
    uri: str,
    data: bytes,
    *,
    overwrite: bool = False,
    storage_options: Mapping[str, object] | None = None,
) -> None: ...
def remove(uri: str, *, storage_options: Mapping[str, object] | None = None) -> None: ...
def copy(
    src: str,
    dst: str,
    *,
    overwrite: bool = False,
    storage_options: Mapping[str, object] | None = None,
    verify: bool = True,
    concurrency: int | None = None,
    block_size: _Size | None = None,
    memory_limit: _Size | None = None,
    part_size: _Size | None = None,
    rank: int = 0,
    world: int = 1,
    progress: bool = True,
    keyset: str | os.PathLike[str] | None = None,
    associated_data: bytes | str | None = None,
    exchange: Callable[[str], list[str]] | None = None,
) -> dict[str, Any]: ...
def resolve_options(
    uris: list[str] = ...,
    *,
    concurrency: int | None = None,
    block_size: _Size | None = None,
    memory_limit: _Size | None = None,
    names: Iterable[str] | None = None,
    method: str | None = None,
    copy_streams: int | None = None,
    storage_options: Mapping[str, object] | None = None,
    cache: _Cache | None = None,
    verify: bool | None = None,
    keyset: str | os.PathLike[str] | None = None,
    associated_data: bytes | str | None = None,
    peers: Sequence[str] | str | None = None,
    peer_token: str | None = None,
) -> ResolvedOptions:
    """Resolves and checks options as a load of ``uris`` would (``uris`` only say whether an
    object store is read; default: none); raises ``ConfigError``."""

def checkpoint_tensors(
    uris: list[str],
    *,
    names: Iterable[str] | None = None,
    storage_options: Mapping[str, object] | None = None,
    keyset: str | os.PathLike[str] | None = None,
    associated_data: bytes | str | None = None,
    peers: Sequence[str] | str | None = None,
    peer_token: str | None = None,
) -> list[tuple[str, str, tuple[int, ...], int]]:
    """``(name, dtype, shape, bytes)`` of every tensor, in file order, checked as a load checks
    them (``names`` must exist, names must be unique across files); reads headers only, from
    the ``peers`` (else ``FASTLOAD_PEERS``) that hold the same files."""

def plan_ranks(
    tensors: list[tuple[str, str, tuple[int, ...], int]],
    needs: list[list[str] | None],
    memory_limits: list[int],
) -> RankPlan:
    """Plans a distributed load: ``needs`` per rank (``None``: every tensor); rounds move a
    quarter of the smallest memory limit (256 KiB to 64 MiB) per rank."""

def is_remote_uri(uri: str) -> bool:
    """Whether ``uri``'s scheme is one of ``SCHEMES`` (read from an object store)."""

def index_files(index: str, data: bytes) -> list[str]:
    """The shard files the index ``index`` (its bytes ``data``) names, sorted, each once, as a
    load resolves them: an entry outside the index's folder raises ``ConfigError`` naming the
    index and the entry, a malformed index ``FormatError``."""

def check_inside(name: str, source: str) -> str:
    """``name`` when it names a file inside the folder it is joined to under every reading (a
    local path, an object key, a relative URL): ``/``-separated segments, none empty, ``.`` or
    ``..``, none starting or ending with white space, without ``\\``, ``%``, ``:``, ``?``,
    ``#`` or control characters. Else ``ConfigError`` naming ``source`` (where the name came
    from) and the name."""

def index_json(weight_map: Sequence[tuple[str, str]], total_size: int) -> bytes:
    """The bytes of ``model.safetensors.index.json``: ``weight_map`` pairs of (tensor name,
    shard file) and ``total_size``, written as transformers and ``huggingface_hub`` write it
    (``json.dumps(index, indent=2, sort_keys=True)`` and a newline)."""

def parse_hub_uri(uri: str) -> tuple[str, str | None, str] | None:
    """``(repo_id, revision, path)`` of ``hf://ORG/REPO[@REVISION][/path]`` (scheme in any case;
    ``refs/pr/N`` and ``refs/convert/NAME`` as written or URL-encoded), as a load reads it; None
    when ``uri`` is not an ``hf://`` URI; ``ConfigError`` for one that names no repo."""

def hub_cache_dir() -> str:
    """The Hugging Face cache folder the environment names now, as ``huggingface_hub`` resolves
    it (``HF_HUB_CACHE``, ``HUGGINGFACE_HUB_CACHE``, ``HF_HOME``, ``XDG_CACHE_HOME``)."""

def parse_size(value: str) -> int: ...
def scrub(text: str) -> str:
    """``text`` with every credential fastload knows of, every URL password and every
    credential-bearing query parameter (presigned signatures, session tokens, SAS ``sig``)
    replaced by ``***``."""

def cache_stats() -> _CacheStats:
    """What the local cache did in this process: copies read (``hits``), bytes written while
    streaming, copies published, and why caching was last turned off for a load (a full disk);
    waits for copies still being published first."""

def cli_main(argv: list[str]) -> int: ...
def cuda_device_count() -> int: ...
def inspect_json(
    uris: list[str],
    *,
    storage_options: Mapping[str, object] | None = None,
    keyset: str | os.PathLike[str] | None = None,
    associated_data: bytes | str | None = None,
) -> str:
    """The JSON object of ``fastload inspect --json`` for ``uris``, from their headers alone
    (``keyset``, ``associated_data``: of Tink-encrypted files, as a load takes them)."""

def list_objects(
    uri: str, *, storage_options: Mapping[str, object] | None = None
) -> list[tuple[str, int]]:
    """``(uri, size)`` of every object directly under ``uri`` taken as a folder, in name order
    (an empty list where there is none); the stores, credentials and endpoint rules of a load."""

def fetch_small_file(
    uri: str,
    dest: str,
    name: str,
    max_bytes: int,
    *,
    storage_options: Mapping[str, object] | None = None,
) -> tuple[Literal["kept", "written", "missing", "too_large"], int]:
    """The copy of the object ``uri`` at ``dest/name`` (``name`` checked by ``check_inside``),
    fetched unless the one there is current, with the cache's record of what it copies at
    ``dest/.cache/fastload/NAME.json``: ``("kept", 0)``, ``("written", size)``, ``("missing",
    0)`` (a copy fastload left of it removed) or ``("too_large", size)`` for an object over
    ``max_bytes``, unread. A link in ``dest`` where a folder or the file must be raises
    ``StorageError``."""

def prune_small_files(dest: str, keep: list[str]) -> None:
    """Removes the files ``fetch_small_file`` put directly into ``dest`` whose names are not in
    ``keep``; other files stay."""

def cached_memory() -> dict[str, int]: ...
def release_memory() -> dict[str, int]: ...

# (read_cost, spans, waste, spans_win, span_max): how runs are grouped into reads
# (``crate::regions::Merge``).
_Merge = tuple[int, bool, float, float, int]

@final
class Region:
    """A region of a tensor (``tensor[index]``) as the native planner plans it: ``refused``
    (why the index is not one: ``(kind, item position, dim)``, kind one of ``"item"``,
    ``"step"``, ``"ellipses"``, ``"too_many"``, ``"out_of_range"``), else its ``shape`` and,
    unless it selects nothing (``empty``), its plan."""

    @property
    def refused(self) -> tuple[str, int, int | None] | None: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def empty(self) -> bool: ...
    @property
    def runs(self) -> list[tuple[int, int]]:
        """The runs to read, ``(offset, len)`` in bytes from the tensor's start."""
    def ranges_at(self, at: int) -> list[tuple[int, int]]:
        """The runs as file ranges: ``(at + offset, len)``."""
    @property
    def bytes(self) -> int: ...
    @property
    def run_count(self) -> int: ...
    @property
    def size(self) -> tuple[int, ...]:
        """The box the runs hold, in elements (its strides: ``stride``)."""
    @property
    def stride(self) -> tuple[int, ...]: ...
    @property
    def view(self) -> tuple[Any, ...] | None:
        """What indexes the box into the region; ``None`` where it is the box itself."""
    @property
    def lead(self) -> int:
        """Leading dims of the box that pick the run."""
    @property
    def reads(self) -> list[tuple[int, int]]:
        """The reads, ``(begin, end)`` in bytes from the tensor's start."""
    @property
    def strips(self) -> list[list[tuple[int, int, int, int]]]:
        """Each read's runs as strips: ``(first run, runs, elements between, first element)``."""
    def ranges_named(self, name: str) -> list[tuple[str, int, int]]:
        """The reads as a load's byte ranges of tensor ``name``: ``(name, begin, end)``."""
    @property
    def read_bytes(self) -> int:
        """The bytes the reads hold (the gaps they span included)."""
    @property
    def read_count(self) -> int: ...
    def strips_at(self, begin: int) -> list[tuple[int, int, int, int]]:
        """The strips of the read that begins at ``begin``."""

def plan_region(
    shape: Sequence[int],
    itemsize: int,
    index: Any,
    read_cost: int,
    merge: _Merge | None = None,
    new_axes: bool = True,
) -> Region:
    """``tensor[index]`` of a C-contiguous tensor as a :class:`Region`, its runs planned with
    ``read_cost`` per request and grouped into reads by ``merge`` (``None``: a read per run);
    ``new_axes``: ``None`` in the index adds a dim (else refused). Planned once per region."""

def merge_runs(runs: Sequence[tuple[int, int]], merge: _Merge) -> list[tuple[int, int]]:
    """``(first run, runs)`` groups of ``runs`` read as one (``crate::regions::merge``)."""
