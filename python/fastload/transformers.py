"""transformers models whose weights fastload streams: from a local folder, the Hugging Face Hub
or an object store, never written to disk.

>>> from transformers import AutoModelForCausalLM
>>> import fastload.transformers
>>> model = fastload.transformers.from_pretrained(AutoModelForCausalLM, "s3://bucket/llama/",
...                                                dtype="auto")

The model is built by transformers itself: ``model_class.from_pretrained(None, config=...,
state_dict=...)`` (its public way to load given weights), which applies ``dtype``, tied weights,
``device_map``, key renaming and missing-weight initialisation as a load from files does, so the
result is the model ``model_class.from_pretrained(uri)`` gives. fastload supplies the config
folder (see ``fastload._remote_files``) and the state dict, read from every shard the index names
at once. Auto classes (``AutoModel...``) are resolved to the concrete class from the config as
transformers does, remote code included when ``trust_remote_code=True``.

This module imports transformers when called, never at import.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _fastload, _remote_files
from ._errors import ConfigError, _scrub
from ._regions import ReadStats
from ._transformers_slices import _File

if TYPE_CHECKING:
    from ._options import Options
    from ._regions import RegionSource

__all__ = ["from_pretrained", "small_files"]

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

# What PreTrainedModel.from_pretrained takes for itself (its named parameters and the kwargs it
# pops, in 5.x and 4.57); the rest of kwargs it hands to the generation config (5.x:
# adjust_generation_fn), as this module then does.
_OWN_KWARGS = frozenset(
    """state_dict proxies tqdm_class output_loading_info _from_pipeline _from_auto dtype
    torch_dtype device_map max_memory offload_folder offload_buffers quantization_config
    subfolder _commit_hash variant adapter_kwargs adapter_name generation_config gguf_file
    distributed_config device_mesh tp_plan tp_size trust_remote_code allow_all_kernels
    use_kernels kernel_config kernels_mode key_mapping mirror _fast_init low_cpu_mem_usage
    from_tf from_flax offload_state_dict attn_implementation experts_implementation config cache_dir
    ignore_mismatched_sizes force_download local_files_only token revision use_safetensors
    weights_only fusion_config disable_mmap use_auth_token load_in_8bit load_in_4bit
    resume_download _adapter_model_path""".split()
)

# Hub arguments of from_pretrained: used to find the checkpoint, then dropped (transformers reads
# the local folder fastload hands it).
_HUB_KWARGS = ("force_download", "proxies", "resume_download", "_commit_hash", "code_revision")


def _variant(name: str, variant: str | None) -> str:
    """transformers' ``_add_variant``: ``model.safetensors`` -> ``model.<variant>.safetensors``."""
    if not variant:
        return name
    parts = name.split(".")
    return ".".join([*parts[:-1], variant, parts[-1]])


def weight_files(folder: Path, variant: str | None = None, source: str | None = None) -> list[str]:
    """The weight files transformers would read from ``folder``: those its index names, else
    ``model.safetensors`` (with ``variant``). An index entry outside the folder raises
    ``ConfigError`` naming the index (``source``: its URI, else its path) and the entry, before
    anything is read, as a load of the index does (``_fastload.index_files``)."""
    index = folder / _variant(WEIGHTS_INDEX_NAME, variant)
    if index.is_file():
        name = source or str(index)
        files = _fastload.index_files(name, index.read_bytes())
        if not files:
            raise ConfigError(f"{name}: no weight_map", option="uri")
        return files
    return [_variant(WEIGHTS_NAME, variant)]


def _remote_code_files(folder: Path, source: str) -> list[str]:
    """The modules ``config.json``'s ``auto_map`` names (``"modeling_x.MyModel"`` ->
    ``modeling_x.py``), fetched for ``trust_remote_code``; a module outside the folder raises
    ``ConfigError`` naming the config (``source``: its URI) and the module."""
    try:
        config = json.loads((folder / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return []
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    refs: list[str] = []
    for value in (auto_map if isinstance(auto_map, dict) else {}).values():
        refs.extend(value if isinstance(value, list) else [value])
    names = {f"{ref.split('--')[-1].rsplit('.', 1)[0]}.py" for ref in refs if isinstance(ref, str)}
    where = f"{source}: auto_map"
    return sorted(_fastload.check_inside(n, where) for n in names)


def _fetch_remote_code(
    ckpt: _remote_files.Checkpoint, subfolder: str, names: list[str] | None = None
) -> None:
    """The modules ``names`` (by default those ``auto_map`` names), and the modules they import
    relatively (as transformers copies them: ``get_relative_imports``), only those."""
    folder = ckpt.folder(subfolder)
    source = ckpt.weight_uri(f"{subfolder}/{CONFIG_NAME}" if subfolder else CONFIG_NAME)
    if names is None:
        names = _remote_code_files(folder, source)
    if not names:
        return  # (without importing transformers, which small_files need not)
    from transformers.dynamic_module_utils import get_relative_imports

    seen: set[str] = set()
    while names:
        ckpt.fetch(names, subfolder)
        seen.update(names)
        found: set[str] = set()
        for name in names:
            if (folder / name).is_file():
                # `from .x import y` in a/b.py is a/x.py.
                here = posixpath.dirname(name)
                imports = get_relative_imports(str(folder / name))
                found.update(posixpath.join(here, f"{m}.py") for m in imports)
        where = f"{source}: auto_map (a module's relative import)"
        names = sorted(_fastload.check_inside(n, where) for n in found - seen)


def small_files(
    uri: str | os.PathLike[str],
    *,
    tokenizer: bool = True,
    revision: str | None = None,
    subfolder: str = "",
    storage_options: Mapping[str, object] | None = None,
    dest: str | os.PathLike[str] | None = None,
) -> Path:
    """A local folder with the checkpoint's small files (config, generation config, index,
    remote code, and tokenizer files when ``tokenizer``), for ``AutoTokenizer.from_pretrained``
    and friends. Hub repos: the Hugging Face cache's snapshot folder (holding those files);
    object stores: ``dest`` (by default a new temporary folder ``fastload-small-files-*``,
    removed when this process exits); local folders: themselves."""
    ckpt = _remote_files.open_checkpoint(uri, revision=revision, storage_options=storage_options)
    if dest is not None and ckpt._remote_prefix is not None:
        ckpt.close()
        Path(dest).mkdir(parents=True, exist_ok=True)
        ckpt = _remote_files.Checkpoint(
            ckpt.uri,
            Path(dest),
            ckpt.weights_base,
            storage_options=storage_options,
            remote_prefix=ckpt._remote_prefix,
        )
    names = [CONFIG_NAME, GENERATION_CONFIG_NAME, WEIGHTS_INDEX_NAME]
    if tokenizer:
        names += list(_remote_files.TOKENIZER_FILES)
    try:
        ckpt.fetch(names, subfolder, required=(CONFIG_NAME, WEIGHTS_INDEX_NAME))
        _fetch_remote_code(ckpt, subfolder)
    except BaseException:
        ckpt.close()
        raise
    return ckpt.folder(subfolder)


def _major() -> int:
    """transformers' major version (4 or 5: both are supported)."""
    import transformers

    return int(transformers.__version__.split(".")[0])


def _is_auto_class(model_class: Any) -> bool:
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    return isinstance(model_class, type) and issubclass(model_class, _BaseAutoModelClass)


def _class_and_config(
    model_class: Any, folder: Path, kwargs: dict[str, Any]
) -> tuple[Any, Any, dict[str, Any]]:
    """The class ``from_pretrained(None, ...)`` is called on, its ``config`` (``kwargs``' own, or
    the folder's) and the rest of ``kwargs``: an auto class resolved as ``AutoModel...`` does it
    (:func:`_resolve_auto`)."""
    config = kwargs.pop("config", None)
    if _is_auto_class(model_class):
        cls, config, kwargs = _resolve_auto(model_class, folder, config, kwargs)
        kwargs["_from_auto"] = True
    else:
        cls = model_class
        if config is None:
            config = str(folder)
    return cls, config, kwargs


def _resolve_auto(
    model_class: Any, folder: Path, config: Any, kwargs: dict[str, Any]
) -> tuple[Any, Any, dict[str, Any]]:
    """What ``AutoModel....from_pretrained`` does before it calls the concrete class: the config
    (with ``kwargs`` that are config attributes applied), the class, the rest of ``kwargs``."""
    from transformers import AutoConfig
    from transformers import PretrainedConfig as PreTrainedConfig  # both names in 5.x
    from transformers.dynamic_module_utils import get_class_from_dynamic_module
    from transformers.models.auto import auto_factory

    trust_remote_code = kwargs.get("trust_remote_code")
    if not isinstance(config, PreTrainedConfig):
        given = dict(kwargs)
        for key in ("torch_dtype", "dtype"):
            if kwargs.get(key) == "auto":
                kwargs.pop(key)
        if kwargs.get("quantization_config") is not None:
            kwargs.pop("quantization_config")
        config, kwargs = AutoConfig.from_pretrained(
            str(config) if config is not None else str(folder),
            return_unused_kwargs=True,
            **kwargs,
        )
        # As transformers does: 5.x passes on a concrete dtype the config absorbed explicitly,
        # 4.x only "auto".
        for key in ("torch_dtype", "dtype", "quantization_config"):
            if given.get(key) is not None and (
                _major() >= 5 or key == "quantization_config" or given[key] == "auto"
            ):
                kwargs[key] = given[key]
    name = model_class.__name__
    mapping = model_class._model_mapping
    has_remote_code = hasattr(config, "auto_map") and name in config.auto_map
    has_local_code = type(config) in mapping
    kwargs["trust_remote_code"] = trust_remote_code
    if has_remote_code and trust_remote_code:
        cls: Any = get_class_from_dynamic_module(config.auto_map[name], str(folder))
        if not has_local_code:
            model_class.register(config.__class__, cls, exist_ok=True)
        cls.register_for_auto_class(auto_class=model_class)
        cls = auto_factory.add_generation_mixin_to_remote_model(cls)
        return cls, config, kwargs
    if has_remote_code and not has_local_code:
        raise ValueError(
            f"{folder}: the model's code is in the repo (auto_map); pass trust_remote_code=True "
            "to run it"
        )
    if has_local_code:
        cls = auto_factory._get_model_class(config, mapping)
        text_config_class = config.sub_configs.get("text_config", None)
        if text_config_class is not None and getattr(cls, "config_class", None) == (
            text_config_class
        ):
            parent_quant = getattr(config, "quantization_config", None)
            config = config.get_text_config()
            if parent_quant is not None and _major() >= 5:
                config.quantization_config = parent_quant
        return cls, config, kwargs
    raise ValueError(
        f"Unrecognized configuration class {config.__class__} for this kind of AutoModel: {name}."
    )


def _single_device(device_map: Any) -> str | None:
    """The device a ``device_map`` puts the whole model on, when it names one CUDA device (the
    weights then stream straight there); else ``None`` (loaded to the CPU, placed by
    transformers)."""
    import torch

    target = device_map
    if isinstance(device_map, dict) and set(device_map) == {""}:
        target = device_map[""]
    if isinstance(target, int) and not isinstance(target, bool):
        target = f"cuda:{target}"
    if isinstance(target, (str, torch.device)):
        try:
            dev = torch.device(target)
        except (RuntimeError, TypeError):
            return None
        if dev.type == "cuda":
            return str(dev)
    return None


def _names_disk(device_map: Any) -> bool:
    return isinstance(device_map, Mapping) and "disk" in device_map.values()


def _no_disk_offload(device_map: Any) -> ConfigError:
    import transformers

    return ConfigError(
        f"device_map={device_map!r} offloads to 'disk', which transformers "
        f"{transformers.__version__} cannot do for weights it is given (a state dict, as fastload "
        "gives them; transformers 5 can): leave 'disk' out (or give max_memory room for every "
        "weight), or use transformers>=5",
        option="device_map",
    )


def _in_load_pretrained(e: BaseException) -> bool:
    """Whether ``e`` was raised in transformers' ``_load_pretrained_model`` itself (or a
    comprehension in it: its own frame before Python 3.12)."""
    names = []
    tb = e.__traceback__
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return "_load_pretrained_model" in names[-2:] and "NoneType" in str(e)


def _commit_of(folder: Path) -> str:
    """The Hub commit of a snapshot folder (``.../snapshots/<commit>/...``), as transformers'
    ``extract_commit_hash`` finds it; ``""`` for any other folder."""
    parts = folder.resolve().parts
    if "snapshots" in parts[:-1]:
        return parts[parts.index("snapshots") + 1]
    return ""


def _load_generation_config(model: Any, folder: Path, kwargs: dict[str, Any]) -> None:
    """What ``from_pretrained`` does last when given a folder and no ``generation_config`` (with
    ``None``, as here, it has no folder to read): the generation config from ``folder`` (and, in
    4.x, the folder's custom ``generate``)."""
    rest = {k: v for k, v in kwargs.items() if k not in _OWN_KWARGS}
    from_auto = bool(kwargs.get("_from_auto"))
    repo_kwargs: dict[str, Any] = {
        "cache_dir": None,
        "force_download": False,
        "proxies": None,
        "local_files_only": True,
        "token": None,
        "revision": None,
        "subfolder": "",
    }
    if hasattr(model, "adjust_generation_fn"):  # 5.x
        model.adjust_generation_fn(
            None,
            from_auto,
            None,
            str(folder),
            **repo_kwargs,
            trust_remote_code=kwargs.get("trust_remote_code"),
            **rest,
        )
        return
    if not model.can_generate():  # 4.x: inline in from_pretrained
        return
    import functools

    from transformers import GenerationConfig

    repo_kwargs.update(rest)
    try:
        model.generation_config = GenerationConfig.from_pretrained(
            str(folder), _from_auto=from_auto, _from_pipeline=None, **repo_kwargs
        )
    except OSError:
        pass  # no generation_config.json: the one made from the model's config stays
    if hasattr(model, "load_custom_generate"):
        try:
            custom_generate = model.load_custom_generate(
                str(folder), trust_remote_code=kwargs.get("trust_remote_code"), **repo_kwargs
            )
        except OSError:  # no custom generate function
            return
        model.generate = functools.partial(custom_generate, model=model)


def from_pretrained(
    model_class: Any,
    uri: str | os.PathLike[str],
    *model_args: Any,
    storage_options: Mapping[str, object] | None = None,
    load_options: Options | None = None,
    **kwargs: Any,
) -> Any:
    """``model_class.from_pretrained(uri, *model_args, **kwargs)`` with the weights streamed by
    fastload.

    ``uri``: a local folder, a Hub repo id ``ORG/REPO`` (``revision=`` as usual) or
    ``hf://ORG/REPO[@REVISION][/FOLDER]``, or an object-store prefix (``s3://bucket/model/``,
    ``gs://``, ``az://``, ``http(s)://``; configured by the environment or ``storage_options``).
    Only safetensors checkpoints (``model.safetensors`` or an index and its shards).

    ``kwargs`` are transformers' (``dtype``/``torch_dtype``, ``device_map``, ``config``,
    ``trust_remote_code``, ``subfolder``, ``variant``, ``revision``, ``token``, config
    overrides, ...). ``load_options``: fastload's (``concurrency``, ``block_size``,
    ``memory_limit``, ``cache``, ...; see :class:`fastload.Options`). A ``device_map`` naming one
    CUDA device streams the weights straight to it.
    """
    if "state_dict" in kwargs:
        raise ConfigError("state_dict: fastload reads the weights; do not pass them", option="uri")
    if kwargs.get("use_safetensors") is False:
        raise ConfigError("use_safetensors=False: fastload reads safetensors only", option="uri")
    kwargs.pop("use_safetensors", None)
    if kwargs.get("gguf_file") is not None:
        raise ConfigError("gguf_file: fastload reads safetensors only", option="uri")
    subfolder = kwargs.pop("subfolder", "") or ""
    variant = kwargs.pop("variant", None)
    options: dict[str, Any] = dict(load_options or {})

    with _remote_files.open_checkpoint_for(uri, kwargs, storage_options, _HUB_KWARGS) as ckpt:
        model = _from_checkpoint(model_class, ckpt, subfolder, variant, model_args, options, kwargs)
    # Saved with the model (config.json's _name_or_path) and shown in its repr: no credentials.
    model.config.name_or_path = _scrub(os.fspath(uri))
    return model


# transformers' arguments that shard the model over a device mesh as it loads (tensor
# parallelism): each rank then indexes the checkpoint's tensors for its shard.
_TP_KWARGS = ("tp_plan", "tp_size", "device_mesh", "distributed_config")


def _tensor_parallel(kwargs: Mapping[str, Any]) -> bool:
    return any(kwargs.get(k) is not None for k in _TP_KWARGS)


# transformers 5.x reads a load's tensors in a pool of threads unless this is set (read when the
# load starts): the row-block exchange needs every rank to read them in one order.
_SERIAL_LOAD_ENV = "HF_DEACTIVATE_ASYNC_LOAD"


class _Exchange:
    """The column exchange (``fastload._exchange``) of a tensor-parallel load over the default
    torch.distributed group's ranks, where they are the tensor-parallel group: bound at the
    first read, as transformers initialises torch.distributed inside ``from_pretrained``. The
    exchange moves host bytes: over the default group where it has gloo, else (NCCL, on GPUs)
    over a gloo group of the same ranks built for the load (``new_group`` is collective: every
    rank binds at the same read, the loads being serial) and destroyed after it. Reads go
    through it one at a time (a lock), so that ranks that read in threads still pair their
    collectives (they then disagree on the order, and the exchange turns itself off)."""

    def __init__(self, tp_size: int | None) -> None:
        self._tp_size = tp_size
        self._lock = threading.Lock()
        self._bound = False
        self.exchange: Any = None
        # The gloo group built for the load where the default group has no gloo (else None).
        self.own_group: Any = None

    def _bind(self) -> Any:
        if not self._bound:
            self._bound = True
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                world = dist.get_world_size()
                if world > 1 and self._tp_size in (None, world):
                    from ._exchange import ColumnExchange

                    if "gloo" not in _default_backend():
                        self.own_group = dist.new_group(backend="gloo")
                    self.exchange = ColumnExchange(self.own_group, dist.get_rank(), world)
        return self.exchange

    def read(self, source: RegionSource, index: Any) -> Any:
        """``source[index]`` exchanged over the group, or None (the caller reads it)."""
        with self._lock:
            exchange = self._bind()
            if exchange is None or not exchange.enabled:
                return None
            return exchange.read(source, index)

    def close(self) -> None:
        with self._lock:
            if self.exchange is not None:
                self.exchange.close()
            if self.own_group is not None:
                import torch.distributed as dist

                group, self.own_group = self.own_group, None
                dist.destroy_process_group(group)


def _default_backend() -> str:
    """The default torch.distributed group's backend, lowercased: ``gloo``, ``nccl``, or one
    per device type (``cpu:gloo,cuda:nccl``)."""
    import torch.distributed as dist

    return str(dist.get_backend()).lower()


def _exchangeable(kwargs: Mapping[str, Any]) -> bool:
    """Whether a tensor-parallel load with these arguments may exchange row blocks: transformers
    shards over one mesh dim spanning every rank (no ``device_mesh``, or a 1-D one; no
    ``distributed_config``), and gloo is there to carry the host bytes (the default group's, or
    a group built for the load beside NCCL)."""
    mesh = kwargs.get("device_mesh")
    if kwargs.get("distributed_config") is not None or (mesh is not None and mesh.ndim != 1):
        return False
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_gloo_available())


def _from_slices(
    cls_args: tuple[Any, Path, tuple[Any, ...]],
    uris: list[str],
    options: dict[str, Any],
    kwargs: dict[str, Any],
) -> Any:
    """A tensor-parallel load: transformers builds the sharded model and indexes each checkpoint
    tensor for this rank's shard (its shard-on-read, which indexes ``safetensors``' slices in a
    load from files); the state dict it is given holds fastload slices (:class:`_Slice`), so each
    rank reads only the bytes of its shards (and the replicated tensors whole)."""
    import logging

    model_class, folder, model_args = cls_args
    counts = ReadStats()
    exchange = _Exchange(kwargs.get("tp_size")) if _exchangeable(kwargs) else None
    files = [_File(u, options, counts, i, exchange) for i, u in enumerate(uris)]
    try:
        state_dict: dict[str, Any] = {}
        for f in files:
            state_dict.update(f.slices())
        cls, config, kwargs = _class_and_config(model_class, folder, kwargs)
        with _serial_load(exchange is not None):
            model = cls.from_pretrained(
                None, *model_args, config=config, state_dict=state_dict, **kwargs
            )
    finally:
        if exchange is not None:
            exchange.close()
        for f in files:
            f.close()
    del state_dict
    logging.getLogger("fastload").info(
        "fastload: read %d bytes as parts of %d tensors (%d bytes whole), %d tensors whole "
        "(%d bytes), and %d bytes as row blocks of %d tensors exchanged over the group",
        counts.sliced_bytes,
        counts.sliced_tensors,
        counts.sliced_tensor_bytes,
        counts.whole_tensors,
        counts.whole_bytes,
        counts.exchanged_bytes,
        counts.exchanged_tensors,
    )
    model._fastload_stats = counts.part_counts()
    if kwargs.get("generation_config") is None:
        _load_generation_config(model, folder, kwargs)
    return model


@contextlib.contextmanager
def _serial_load(on: bool) -> Iterator[None]:
    """transformers reading the load's tensors one after the other, in its order (the state
    dict's keys sorted), the same on every rank: what the exchange needs."""
    if not on or os.environ.get(_SERIAL_LOAD_ENV) is not None:
        yield
        return
    os.environ[_SERIAL_LOAD_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(_SERIAL_LOAD_ENV, None)


class _Prefetch:
    """``fastload.load(uris, **options)`` in a thread: the stream opens here (so that bad options
    raise here, and a CUDA stream's memory belongs to the caller's current stream), its tensors
    are collected in the background until :meth:`result`. Leaving the ``with`` block closes the
    stream (cancelling its reads if the caller failed before taking the result)."""

    def __init__(self, uris: list[str], **options: Any) -> None:
        import fastload

        self._stream = fastload.stream(uris, **options)
        self._tensors: dict[str, Any] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fastload-weights", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for name, tensor in self._stream:
                self._tensors[name] = tensor
        except BaseException as e:  # handed to the caller by result()
            self._error = e

    def result(self) -> dict[str, Any]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._tensors

    def __enter__(self) -> _Prefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stream.close()
        self._thread.join()
        self._tensors = {}


def _from_checkpoint(
    model_class: Any,
    ckpt: _remote_files.Checkpoint,
    subfolder: str,
    variant: str | None,
    model_args: tuple[Any, ...],
    options: dict[str, Any],
    kwargs: dict[str, Any],
) -> Any:
    """The model in ``subfolder`` of ``ckpt``: see :func:`from_pretrained`."""
    index_name = _variant(WEIGHTS_INDEX_NAME, variant)
    ckpt.fetch(
        [CONFIG_NAME, GENERATION_CONFIG_NAME, index_name],
        subfolder,
        required=(CONFIG_NAME, index_name),
    )
    folder = ckpt.folder(subfolder)
    if kwargs.get("trust_remote_code"):
        _fetch_remote_code(ckpt, subfolder)
        # A custom generate function, which transformers loads for trusted remote code.
        ckpt.fetch(["custom_generate/requirements.txt"], subfolder)
        _fetch_remote_code(ckpt, subfolder, ["custom_generate/generate.py"])
    rel = f"{subfolder}/" if subfolder else ""
    files = weight_files(folder, variant, source=ckpt.weight_uri(rel + index_name))
    uris = [ckpt.weight_uri(rel + f) for f in files]
    if _major() < 5 and _names_disk(kwargs.get("device_map")):
        raise _no_disk_offload(kwargs["device_map"])
    device = options.pop("device", None) or _single_device(kwargs.get("device_map"))
    if ckpt.storage_options is not None:
        options.setdefault("storage_options", ckpt.storage_options)
    if _tensor_parallel(kwargs):
        return _from_slices(
            cls_args=(model_class, folder, model_args), uris=uris, options=options, kwargs=kwargs
        )
    # The weights stream in while transformers reads the config and imports the model's code
    # (seconds of Python for a first load in a process).
    with _Prefetch(uris, device=device or "cpu", **options) as weights:
        cls, config, kwargs = _class_and_config(model_class, folder, kwargs)
        state_dict = weights.result()
    if _major() < 5:
        # 4.x first asks the Hub for `pretrained_model_name_or_path`'s config.json (here None:
        # a request for "None/config.json", retried for a minute offline) unless it has the
        # commit hash, which from_pretrained(None, ...) then uses for nothing else.
        kwargs["_commit_hash"] = _commit_of(folder)
    try:
        model = cls.from_pretrained(
            None, *model_args, config=config, state_dict=state_dict, **kwargs
        )
    except TypeError as e:
        # 4.x: a state dict with "disk" in the device map it computed (its disk-offload path
        # reads weights from checkpoint files, of which a state dict has none).
        if _major() < 5 and kwargs.get("device_map") is not None and _in_load_pretrained(e):
            raise _no_disk_offload(kwargs["device_map"]) from e
        raise
    del state_dict
    if kwargs.get("generation_config") is None:
        _load_generation_config(model, folder, kwargs)
    return model
