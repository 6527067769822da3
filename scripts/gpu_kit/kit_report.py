"""The kit's report: JSON (everything) and Markdown (a summary, a table of checks, and the
"Storage → GPU" table docs/benchmarks.md's table is filled from)."""

from __future__ import annotations

import json
from pathlib import Path

STATUSES = ("pass", "fail", "not-run")

# The rows of the Storage → GPU table, as docs/benchmarks.md's table lists them.
_BENCH_ROWS = {
    "fastload": "fastload `load(device=...)` (benches/gpu_bench.py)",
    "safetensors": "safetensors `load_file(device=...)`",
    "runai": "runai-model-streamer, each tensor `.to(device)`",
    "fastsafetensors": "fastsafetensors (`nogds=True`)",
    "leg:read": "read leg alone (fastload to host, `method='read'`)",
    "leg:copy": "copy leg alone (one pinned buffer of the checkpoint's size)",
}


def storage_to_gpu(checks: dict[str, dict]) -> list[dict]:
    """One row per measured path: GB/s and its fraction of the page-locked copy rate."""
    rows = []
    pinned = checks.get("pinned_h2d", {})
    rate = pinned.get("numbers", {}).get("gb_per_s") if pinned.get("status") == "pass" else None
    if rate:
        rows.append(
            {"row": "page-locked host→device copy, 1 GiB (torch, CUDA events)", "cache": "-",
             "gb_per_s": rate}
        )  # fmt: skip
    cli = checks.get("cli_bench_cuda", {})
    if cli.get("status") == "pass" and "best_gb_per_s" in cli.get("numbers", {}):
        size = cli["numbers"].get("file_bytes", 0)
        size_text = f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"
        rows.append(
            {"row": f"`fastload bench --device cuda` ({size_text}, driver memory)",
             "cache": "warm", "gb_per_s": cli["numbers"]["best_gb_per_s"]}
        )  # fmt: skip
    bench = checks.get("gpu_bench", {})
    for r in bench.get("numbers", {}).get("rows", []):
        label = _BENCH_ROWS.get(r["row"], r["row"])
        rows.append({"row": label, "cache": r["cache"], "gb_per_s": r["gb_per_s"]})
    cold = checks.get("cold_start", {}).get("numbers", {})
    size = f"{cold.get('bytes', 0) / 1e9:.1f} GB in {cold.get('files')} files"
    for key, gbps in cold.get("rates", {}).items():
        if gbps is None:
            continue
        if key == "copy" or key.startswith("disk"):  # the hardware's rates
            cache, row = ("-" if key == "copy" else "cold"), key
        else:
            cache, _, row = key.partition(" ")
        rows.append({"row": f"{row} (benches/gpu_cold_start.py, Llama-3-8B shapes, {size})",
                     "cache": cache, "gb_per_s": gbps})  # fmt: skip
    rate = rate or cold.get("rates", {}).get("copy")
    for r in rows:
        r["of_pinned_copy"] = r["gb_per_s"] / rate if rate else None
    return rows


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    text = json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v)
    return text if len(text) <= 160 else text[:157] + "..."


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(report: dict) -> str:
    env = report.get("environment", {})
    torch = env.get("torch", {})
    kit = report.get("kit") or {}
    s = report["summary"]
    lines = [
        "# fastload GPU verification kit: report",
        "",
        f"- mode: **{report['mode']}**; {s['pass']} passed, {s['fail']} failed, {s['not-run']} "
        f"not run; {report['seconds']} s from {report['started']}"
        + ("" if report.get("complete") else " (**incomplete**: the run was stopped during it)"),
        f"- kit: commit {kit.get('commit', '?')} built {kit.get('built', '?')}; wheel "
        f"{kit.get('wheel', '?')}",
        f"- machine: {env.get('nvidia_smi') or 'no nvidia-smi'}; Python {env.get('python')}; "
        f"torch {torch.get('version', torch.get('error'))} (CUDA {torch.get('cuda')}, "
        f"devices {torch.get('devices', [])})",
        f"- fastload: {env.get('fastload', {}).get('file')}; driver: {env.get('driver')}",
        "",
        "| check | status | details | s |",
        "|---|---|---|---|",
    ]
    for c in report["checks"]:
        status = {"pass": "pass", "fail": "**FAIL**", "not-run": "not run"}[c["status"]]
        lines.append(
            f"| `{c['name']}`: {_cell(c['title'])} | {status} | {_cell(c['details'][:600])} | "
            f"{c['seconds']} |"
        )
    lines += ["", "## Storage → GPU", ""]
    rows = report["storage_to_gpu"]
    if rows:
        if report["mode"] == "sim":
            where = "the simulated driver (copies by a CPU thread: not a GPU measurement)"
        else:
            where = ", ".join(torch.get("devices") or ["?"]) + f" ({env.get('nvidia_smi')})"
        lines += [
            f"On {where}, torch {torch.get('version')}; GB/s of tensor data (10^9 bytes/s), "
            "best of the runs.",
            "",
            "| path | page cache | GB/s | of the page-locked copy rate |",
            "|---|---|---|---|",
        ]
        for r in rows:
            frac = f"{r['of_pinned_copy']:.2f}" if r["of_pinned_copy"] is not None else "-"
            lines.append(f"| {r['row']} | {r['cache']} | {r['gb_per_s']:.2f} | {frac} |")
    else:
        lines.append("Not measured in this run (no GPU).")
    lines += ["", "## Numbers", ""]
    for c in report["checks"]:
        if c.get("numbers"):
            nums = ", ".join(f"{k}={_fmt(v)}" for k, v in c["numbers"].items())
            lines.append(f"- `{c['name']}`: {_cell(nums)}")
    return "\n".join(lines) + "\n"


def write_report(report: dict, base: Path) -> None:
    """Adds the summary and the Storage → GPU rows, writes ``base``.json and ``base``.md."""
    report["summary"] = {k: sum(c["status"] == k for c in report["checks"]) for k in STATUSES}
    report["storage_to_gpu"] = storage_to_gpu({c["name"]: c for c in report["checks"]})
    base.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    base.with_suffix(".md").write_text(markdown(report))
