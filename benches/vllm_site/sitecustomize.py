"""Imported at start-up by every Python process of benches/tp_bench.py's vLLM rows (the bench
puts this folder first on their PYTHONPATH): what tests/vllm_site/sitecustomize.py does (AMX
permission), and a timer around vLLM's ``BaseModelLoader.load_model`` in every worker, which
prints ``tp_bench: rank R load_model took S s`` (the model built, its weights loaded and
processed, whatever the loader), once vLLM's loader module is imported. With
``TP_BENCH_PROFILE=DIR`` in the environment each worker's ``load_model`` also runs under cProfile,
its stats written to ``DIR/rank<R>-<pid>.prof`` (``python -m pstats``), to see where a row's time
goes (vLLM's own ``gc.collect`` calls, reads waited for, collectives).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time
from pathlib import Path

_TESTS_SITE = Path(__file__).resolve().parents[2] / "tests" / "vllm_site" / "sitecustomize.py"
_MODULE = "vllm.model_executor.model_loader.base_loader"


def _amx() -> None:
    spec = importlib.util.spec_from_file_location("_fastload_tests_site", _TESTS_SITE)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _wrap(module) -> None:
    cls = module.BaseModelLoader
    load_model = cls.load_model

    def timed(self, *args, **kwargs):
        import torch.distributed as dist

        profile_dir = os.environ.get("TP_BENCH_PROFILE")
        profiler = None
        if profile_dir:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        start = time.perf_counter()
        model = load_model(self, *args, **kwargs)
        took = time.perf_counter() - start
        rank = dist.get_rank() if dist.is_initialized() else 0
        if profiler is not None:
            profiler.disable()
            os.makedirs(profile_dir, exist_ok=True)
            profiler.dump_stats(os.path.join(profile_dir, f"rank{rank}-{os.getpid()}.prof"))
        print(f"tp_bench: rank {rank} load_model took {took:.3f} s", flush=True)
        return model

    cls.load_model = timed


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader module's class once it is executed."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            _wrap(module)

        spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec


if _TESTS_SITE.exists():
    _amx()
if os.environ.get("TP_BENCH_TIME_LOADS"):
    sys.meta_path.insert(0, _Finder())
