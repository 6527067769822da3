"""fastload beside its peers, on the same files, in one run: cold and warm page cache.

    python benches/run.py                        # 2 GiB llama-like checkpoint, 3 repetitions
    python benches/run.py --quick                # 256 MiB, 1 repetition: a smoke test
    python benches/run.py --size 8GiB --cases single,sharded,tiny --reps 5

Every measurement runs in a fresh process (benches/loaders.py). Cold runs evict the files from the
page cache first; warm runs follow one untimed read of the files. Repetitions are interleaved (each
round runs every row once, in a rotated order) so drift in the virtual disk's speed, which is large
here, lands on every loader alike. The raw limits (disk O_DIRECT, buffered disk reads, page-cache
read) are rows of the same rounds. Writes results.md, results.json and results.png under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import limits  # noqa: E402
import report  # noqa: E402
from make_checkpoint import parse_size  # noqa: E402

WORKLOADS = ("load", "stream")


@dataclass
class Row:
    label: str
    loader: str  # key of loaders.LOADERS, or "raw:<kind>"
    workloads: tuple[str, ...] = WORKLOADS
    caches: tuple[str, ...] = ("cold", "warm")
    options: dict = field(default_factory=dict)  # fastload keyword arguments
    env: dict = field(default_factory=dict)  # environment for the peer (runai)
    note: str = ""


def probe_fastload(python: str) -> dict:
    """Is fastload importable in the benchmark interpreter, and does it take method=?"""
    code = (
        "import inspect, json, fastload\n"
        "p = inspect.signature(fastload.load).parameters\n"
        "print(json.dumps({'ok': True, 'method': 'method' in p,"
        " 'version': getattr(fastload, '__version__', '?')}))"
    )
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    if r.returncode:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        return {"ok": False, "why": f"import fastload failed: {tail}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def build_rows(fl: dict, wanted: list[str] | None, full: bool) -> list[Row]:
    rows: list[Row] = []
    if fl.get("ok") and fl.get("method"):
        # The local read strategy is selectable: both are rows, so the faster one per case shows.
        rows += [
            Row("fastload[mmap]", "fastload", options={"method": "mmap"}),
            Row("fastload[read]", "fastload", options={"method": "read"}),
        ]
    else:
        rows.append(Row("fastload", "fastload", note="" if fl.get("ok") else fl.get("why", "")))
    rows += [
        Row("safetensors", "safetensors", note="load_file / safe_open+get_tensor (mmap)"),
        # runai's default reads bypass the page cache (O_DIRECT), so warm is cold for it; its
        # buffered strategy is the one that can use a warm cache. Each runs where it means something
        # unless --full asks for both everywhere (it saves ~2 min of the default run).
        Row(
            "runai",
            "runai-model-streamer",
            caches=("cold", "warm") if full else ("cold",),
            note="0.17 defaults: io_uring O_DIRECT, 8 MiB chunks; bypasses the page cache, so"
            " measured cold only unless --full",
        ),
        Row(
            "runai[buffered]",
            "runai-model-streamer",
            caches=("cold", "warm") if full else ("warm",),
            env={"RUNAI_STREAMER_FS_STRATEGY": "io_uring_buffered"},
            note="RUNAI_STREAMER_FS_STRATEGY=io_uring_buffered: its page-cache mode, measured warm"
            " only unless --full",
        ),
        Row(
            "tensorizer",
            "tensorizer",
            ("load",),
            note="TensorDeserializer(device='cpu') on a converted copy; load only (no streaming)",
        ),
        Row(
            "fastsafetensors",
            "fastsafetensors",
            ("load",),
            note="fastsafe_open(nogds=True): pread into its own buffer, no GDS; load only",
        ),
    ]
    if wanted:
        rows = [r for r in rows if any(r.label == w or r.label.startswith(w + "[") for w in wanted)]
    return rows


class Runner:
    def __init__(self, args: argparse.Namespace, out: Path):
        self.args = args
        self.out = out
        self.log = open(out / "run.log", "a")
        self.records: list[dict] = []
        self.shm_paths: set[str] = set()

    def worker(self, job: dict) -> dict:
        cmd = [self.args.python, str(HERE / "loaders.py"), json.dumps(job)]
        # One torch/OpenMP thread: on this 2-vCPU VM the OpenMP pool's spin-waiting made the same
        # copy_ loop 3-4x slower and erratic, and it competes with the loaders' own I/O threads.
        env = {**os.environ, "OMP_NUM_THREADS": str(self.args.torch_threads)}
        t0 = time.perf_counter()
        try:
            r = subprocess.run(
                cmd, capture_output=True, text=True, timeout=self.args.timeout, env=env
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {self.args.timeout} s"}
        self.log.write(
            f"--- {job['loader']} {job['workload']} ({time.perf_counter() - t0:.1f} s)\n"
        )
        self.log.write(r.stderr[-20000:])
        self.log.flush()
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            tail = " | ".join(r.stderr.strip().splitlines()[-3:])
            return {"error": f"exit {r.returncode}, no result: {tail[-500:]}"}
        return json.loads(lines[-1])

    def case(self, name: str, stamp: dict, rows: list[Row]) -> None:
        files = [os.path.join(stamp["dir"], f) for f in sorted(stamp["files"])]
        uri = files[0] if len(files) == 1 else stamp["dir"]
        tz = stamp.get("tensorizer_file")
        everything = files + ([tz] if tz else [])
        base = {
            "files": files,
            "uri": uri,
            "tensorizer_file": tz,
            "tensorizer_error": stamp.get("tensorizer_error"),
            "memory_limit": self.args.memory_limit,
            "dst_shm": self.dst_shm(stamp),
        }

        ref = self.worker({**base, "loader": "safetensors", "workload": "load"})
        reference = ref.get("checksum")

        for cache in self.args.cache:
            jobs = [(r, w) for r in rows for w in r.workloads if cache in r.caches]
            if cache == "warm":
                limits.warm(*everything)  # the untimed warm-up read
            for rep in range(self.args.reps):
                k = rep % max(1, len(jobs))
                order = jobs[k:] + jobs[:k]
                # The limits of the same files, by `fastload bench --limits-only` (it evicts for
                # the cold ones itself).
                for kind, res in limits.storage(files, cache).items():
                    self._record(name, cache, rep, kind, "raw", res, reference, stamp)
                for row, workload in order:
                    if row.loader == "fastload" and row.note:  # not importable: one note, no runs
                        res = {"skipped": row.note}
                    else:
                        self._prepare_cache(cache, everything)
                        job = {
                            **base,
                            "loader": row.loader,
                            "workload": workload,
                            "options": row.options,
                            "env": row.env,
                        }
                        res = self.worker(job)
                    self._record(name, cache, rep, row.label, workload, res, reference, stamp)
                print(f"  {name} {cache} round {rep + 1}/{self.args.reps} done", flush=True)

    def dst_shm(self, stamp: dict) -> str | None:
        """A tmpfs file for the stream workload's destination, if it fits comfortably in RAM."""
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if self.args.no_shm or not os.path.isdir("/dev/shm") or stamp["tensor_bytes"] > mem // 4:
            return None
        path = f"/dev/shm/fastload-bench-{os.getpid()}.dst"
        self.shm_paths.add(path)
        return path

    def cleanup(self) -> None:
        for p in self.shm_paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def _prepare_cache(self, cache: str, paths: list[str]) -> None:
        if cache == "cold":
            limits.evict(*paths)
            left = limits.resident_bytes(*paths)
            if left:
                self.log.write(f"warning: {left} bytes still cached after eviction\n")
        else:
            total = sum(os.path.getsize(p) for p in paths)
            resident = limits.resident_bytes(*paths)
            if resident is not None and resident < total:
                limits.warm(*paths)

    def _record(self, case, cache, rep, label, workload, res, reference, stamp):
        rec = {
            "case": case,
            "cache": cache,
            "rep": rep,
            "label": label,
            "workload": workload,
            **res,
        }
        if res.get("seconds"):
            # Loaders: the checkpoint's tensor bytes over the time; raw rows: what they read.
            nbytes = res["bytes"] if workload == "raw" else stamp["tensor_bytes"]
            rec["gb_per_s"] = nbytes / res["seconds"] / 1e9
            if workload != "raw":
                if reference is not None and res.get("checksum") != reference:
                    rec["checksum_mismatch"] = True
                if res.get("tensors") != stamp["tensors"]:
                    rec["count_mismatch"] = f"{res.get('tensors')} of {stamp['tensors']}"
        self.records.append(rec)
        self._print(rec)

    def _print(self, rec: dict) -> None:
        if "gb_per_s" in rec:
            msg = f"{rec['gb_per_s']:.2f} GB/s ({rec.get('seconds', 0):.2f} s)"
            if rec.get("checksum_mismatch"):
                msg += " CHECKSUM MISMATCH"
        else:
            msg = rec.get("skipped") or rec.get("error") or "?"
        print(f"    {rec['cache']:4} {rec['label']:18} {rec['workload']:6} {msg}", flush=True)


def generate(args, spec_args: dict) -> dict:
    cmd = [
        args.python,
        str(HERE / "make_checkpoint.py"),
        "--json",
        "--tensorizer",
        "--out",
        args.ckpt_dir,
    ]
    for k, v in spec_args.items():
        cmd += [f"--{k}", str(v)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        # tensorizer missing or broken: still benchmark the others
        cmd.remove("--tensorizer")
        sys.stderr.write(r.stderr[-2000:])
        r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def machine_info(python: str) -> dict:
    from importlib import metadata

    versions = {}
    code = (
        "import json; from importlib import metadata as m\n"
        "out = {}\n"
        "for p in ['fastload', 'torch', 'safetensors', 'runai-model-streamer', 'tensorizer',"
        " 'fastsafetensors', 'numpy']:\n"
        "    try: out[p] = m.version(p)\n"
        "    except Exception: out[p] = None\n"
        "print(json.dumps(out))"
    )
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
        versions = json.loads(r.stdout)
    except (subprocess.SubprocessError, ValueError):
        pass
    del metadata
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    fio = None
    try:
        fio = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "mem_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "fio": fio,
        "versions": versions,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--size", default=None, help="checkpoint size (default 2GiB; 256MiB with --quick)"
    )
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument(
        "--cases",
        default="single",
        help="comma list of: single (one file), sharded (--shards files + index),"
        " tiny (--tiny-count tiny tensors). Default: single",
    )
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--tiny-count", type=int, default=30000)
    ap.add_argument(
        "--reps", type=int, default=None, help="repetitions (default 3; 1 with --quick)"
    )
    ap.add_argument("--cache", default="cold,warm", help="cold,warm (default both)")
    ap.add_argument("--workloads", default="load,stream")
    ap.add_argument(
        "--loaders",
        default=None,
        help="comma list of row labels, e.g. fastload,safetensors,runai (default all)",
    )
    ap.add_argument(
        "--memory-limit",
        default=None,
        help="host-buffer limit for the stream workload, given to fastload"
        " (memory_limit=) and runai (RUNAI_STREAMER_MEMORY_LIMIT); default: theirs",
    )
    ap.add_argument("--quick", action="store_true", help="256 MiB, 1 repetition")
    ap.add_argument(
        "--full",
        action="store_true",
        help="run runai and runai[buffered] both cold and warm (default: runai cold,"
        " runai[buffered] warm)",
    )
    ap.add_argument(
        "--no-shm",
        action="store_true",
        help="allocate the stream destination in each process instead of /dev/shm",
    )
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS for the measurement processes (default 1)",
    )
    ap.add_argument("--timeout", type=int, default=300, help="seconds per measurement")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the measurements")
    ap.add_argument("--out", default=str(HERE / "out"), help="results directory")
    ap.add_argument(
        "--ckpt-dir",
        default=str(HERE / "out" / "ckpt"),
        help="where generated checkpoints are kept and reused (default benches/out/ckpt)",
    )
    args = ap.parse_args(argv)
    args.size = args.size or ("256MiB" if args.quick else "2GiB")
    args.reps = args.reps or (1 if args.quick else 3)
    args.cache = [c for c in args.cache.split(",") if c]
    args.workloads = tuple(w for w in args.workloads.split(",") if w)
    args.memory_limit = parse_size(args.memory_limit) if args.memory_limit else None
    parse_size(args.size)  # fail on a bad size before any work
    return args


def run_case(runner: Runner, meta: dict, c: str, stamp: dict, rows: list[Row]) -> None:
    label = f"{c}: {os.path.basename(stamp['dir'])}"
    meta["cases"][label] = {
        "bytes": stamp["tensor_bytes"],
        "tensors": stamp["tensors"],
        "files": len(stamp["files"]),
        "dir": stamp["dir"],
        "tensorizer": bool(stamp.get("tensorizer_file")),
    }
    print(
        f"== {label}: {stamp['tensor_bytes'] / 1e9:.2f} GB, {stamp['tensors']} tensors, "
        f"{len(stamp['files'])} file(s)",
        flush=True,
    )
    runner.case(label, stamp, rows)


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    fl = probe_fastload(args.python)
    print("fastload:", fl if fl.get("ok") else fl.get("why"), flush=True)
    rows = build_rows(fl, args.loaders.split(",") if args.loaders else None, args.full)
    for r in rows:
        r.workloads = tuple(w for w in r.workloads if w in args.workloads)

    runner = Runner(args, out)
    meta = machine_info(args.python)
    meta["args"] = {k: v for k, v in vars(args).items() if k != "python"}
    meta["fastload"] = fl
    meta["rows"] = {r.label: r.note for r in rows}

    print("memcpy ...", flush=True)
    r = subprocess.run(
        [args.python, str(HERE / "limits.py"), "memcpy"], capture_output=True, text=True
    )
    meta["memcpy"] = json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-500:]}

    cases = []
    for c in (x for x in args.cases.split(",") if x):
        if c == "single":
            spec = {"size": args.size, "dtype": args.dtype, "shards": 1}
        elif c == "sharded":
            spec = {"size": args.size, "dtype": args.dtype, "shards": args.shards}
        elif c == "tiny":
            spec = {"tiny": args.tiny_count, "dtype": args.dtype}
        else:
            raise SystemExit(f"unknown case {c!r}; use single, sharded, tiny")
        print(f"checkpoint for {c} ...", flush=True)
        stamp = generate(args, spec)
        cases.append((c, stamp))

    meta["cases"] = {}
    try:
        for c, stamp in cases:
            run_case(runner, meta, c, stamp, rows)
    except KeyboardInterrupt:
        print("\ninterrupted: reporting what was measured", flush=True)
        meta["interrupted"] = True
    finally:
        runner.cleanup()

    meta["total_seconds"] = time.perf_counter() - t_start
    report.write(out, meta, runner.records, [r.label for r in rows])
    print(
        f"\nwrote {out / 'results.md'}, results.json, results.png "
        f"({meta['total_seconds'] / 60:.1f} min)"
    )


if __name__ == "__main__":
    main()
