"""Summaries of run.py's records: results.md (also printed), results.json, results.png."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

RAW_NOTES = {
    "disk O_DIRECT": "fastload bench --limits-only: O_DIRECT reads, `concurrency` x 8 MiB in flight"
    " (cold by nature)",
    "disk buffered x8": "fastload bench --limits-only: 8 readers on 8 regions, 8 MiB preads through"
    " the page cache (readahead), after eviction",
    "page-cache read": "fastload bench --limits-only: 8 MiB preads of the cached files, one reader"
    " per core",
}
# The cold limit is the faster of these two, per case (see limits.py for why both).
COLD_LIMITS = ["disk O_DIRECT", "disk buffered x8"]


def summarize(records: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["case"], r["cache"], r["label"], r["workload"])].append(r)
    out = []
    for (case, cache, label, workload), rs in groups.items():
        ok = [r for r in rs if "gb_per_s" in r]
        s = {
            "case": case,
            "cache": cache,
            "label": label,
            "workload": workload,
            "runs": len(rs),
            "ok": len(ok),
        }
        if ok:
            rates = [r["gb_per_s"] for r in ok]
            s.update(
                gb_per_s_median=statistics.median(rates),
                gb_per_s_min=min(rates),
                gb_per_s_max=max(rates),
                seconds_median=statistics.median(r["seconds"] for r in ok),
            )
            firsts = [r["first_tensor_s"] for r in ok if r.get("first_tensor_s") is not None]
            if firsts:
                s["first_tensor_s_median"] = statistics.median(firsts)
            rss = [r["rss_growth_bytes"] for r in ok if r.get("rss_growth_bytes") is not None]
            if rss:
                s["rss_growth_bytes_max"] = max(rss)
            touches = [r["touch_s"] for r in ok if r.get("touch_s") is not None]
            if touches:
                s["touch_s_median"] = statistics.median(touches)
            if any(r.get("checksum_mismatch") for r in ok):
                s["checksum_mismatch"] = True
            if any(r.get("count_mismatch") for r in ok):
                s["count_mismatch"] = next(
                    r["count_mismatch"] for r in ok if r.get("count_mismatch")
                )
        for key in ("skipped", "error"):
            msgs = [r[key] for r in rs if r.get(key)]
            if msgs:
                s[key] = msgs[0]
        out.append(s)
    return out


def _cell(s: dict | None) -> str:
    if not s:
        return "-"
    if "gb_per_s_median" not in s:
        return "skipped" if s.get("skipped") else "failed"
    txt = (
        f"**{s['gb_per_s_median']:.2f}** ({s['gb_per_s_min']:.2f}-{s['gb_per_s_max']:.2f})"
        f" {_secs(s['seconds_median'])}"
    )
    if s["ok"] < s["runs"]:
        txt += f" {s['ok']}/{s['runs']} ok"
    if s.get("checksum_mismatch") or s.get("count_mismatch"):
        txt += " WRONG DATA"
    return txt


def _secs(x: float) -> str:
    return f"{x:.2f} s" if x >= 0.1 else f"{x * 1e3:.0f} ms"


def _best(summary, case, cache, workload, labels) -> dict | None:
    cands = [
        s
        for s in summary
        if s["case"] == case
        and s["cache"] == cache
        and s["workload"] == workload
        and s["label"] in labels
        and "gb_per_s_median" in s
        and not s.get("checksum_mismatch")
    ]
    return max(cands, key=lambda s: s["gb_per_s_median"], default=None)


def ratios(summary: list[dict], labels: list[str]) -> list[dict]:
    fl = [x for x in labels if x.startswith("fastload")]
    peers = [x for x in labels if not x.startswith("fastload")]
    out = []
    for case in dict.fromkeys(s["case"] for s in summary):
        for workload in ("load", "stream"):
            for cache in ("cold", "warm"):
                a = _best(summary, case, cache, workload, fl)
                b = _best(summary, case, cache, workload, peers)
                raw = _best(
                    summary,
                    case,
                    cache,
                    "raw",
                    COLD_LIMITS if cache == "cold" else ["page-cache read"],
                )
                if not (a or b):
                    continue
                out.append(
                    {
                        "case": case,
                        "workload": workload,
                        "cache": cache,
                        "fastload": a and a["label"],
                        "fastload_gb_per_s": a and a["gb_per_s_median"],
                        "best_peer": b and b["label"],
                        "peer_gb_per_s": b and b["gb_per_s_median"],
                        "ratio": (a["gb_per_s_median"] / b["gb_per_s_median"]) if a and b else None,
                        "raw": raw and raw["label"],
                        "raw_gb_per_s": raw and raw["gb_per_s_median"],
                    }
                )
    return out


def markdown(meta: dict, summary: list[dict], labels: list[str], rat: list[dict]) -> str:
    mc = meta.get("memcpy", {})
    v = meta.get("versions", {})
    gib = (meta.get("mem_bytes") or 0) / 2**30
    machine = (
        f"{meta.get('date')}; {meta.get('cpus')} CPUs, {gib:.0f} GiB RAM,"
        f" kernel {meta.get('kernel')}, Python {meta.get('python')}; "
        + ", ".join(f"{k} {x}" for k, x in v.items() if x)
    )
    lines = [
        "# fastload benchmark",
        "",
        machine,
        "",
        f"Repetitions: {meta['args']['reps']} per cell, interleaved; cells are GB/s (1e9 bytes of"
        " tensor data per second): **median** (min-max) and the median time. Every measurement"
        " is a fresh process.",
    ]
    if "numpy_1thread_gb_per_s" in mc:
        lines.append(
            f"memcpy between pre-faulted 1 GiB buffers: {mc['numpy_1thread_gb_per_s']:.1f} GB/s"
            f" (1 thread), {mc['torch_gb_per_s']:.1f} GB/s (torch, {mc['torch_threads']} threads);"
            f" filling a fresh 1 GiB allocation: {mc['fresh_fill_gb_per_s']:.2f} GB/s."
        )
    for case, info in meta["cases"].items():
        lines += [
            "",
            f"## {case}",
            "",
            f"{info['bytes'] / 1e9:.3f} GB of tensors, {info['tensors']} tensors,"
            f" {info['files']} file(s)",
            "",
            "| loader | cache | load GB/s | stream GB/s | stream: first tensor ms |"
            " peak RSS growth load / stream GiB |",
            "|---|---|---|---|---|---|",
        ]
        for cache in ("cold", "warm"):
            for label in labels:
                cells = {w: _find(summary, case, cache, label, w) for w in ("load", "stream")}
                if not any(cells.values()):
                    continue
                st = cells["stream"] or {}
                first = st.get("first_tensor_s_median")
                rss = "/".join(
                    f"{c['rss_growth_bytes_max'] / 2**30:.2f}"
                    if c and "rss_growth_bytes_max" in c
                    else "-"
                    for c in (cells["load"], cells["stream"])
                )
                first_txt = f"{first * 1e3:.0f}" if first is not None else "-"
                lines.append(
                    f"| {label} | {cache} | {_cell(cells['load'])} |"
                    f" {_cell(cells['stream'])} | {first_txt} | {rss} |"
                )
        lines += [
            "",
            "Raw limits, measured in the same rounds:",
            "",
            "| limit | cache | GB/s | how |",
            "|---|---|---|---|",
        ]
        for s in summary:
            if s["case"] == case and s["workload"] == "raw":
                lines.append(
                    f"| {s['label']} | {s['cache']} | {_cell(s)} |"
                    f" {RAW_NOTES.get(s['label'], '')} |"
                )
        touch = [
            s["touch_s_median"] for s in summary if s["case"] == case and "touch_s_median" in s
        ]
        if touch:
            lines += [
                "",
                f"The page touch itself (load column, timed) costs about"
                f" {statistics.median(touch) * 1e3:.0f} ms on resident memory.",
            ]
        notes = [s for s in summary if s["case"] == case and (s.get("error") or s.get("skipped"))]
        seen = set()
        for s in notes:
            msg = s.get("error") or s.get("skipped")
            if (s["label"], s["workload"], msg) in seen:
                continue
            seen.add((s["label"], s["workload"], msg))
            kind = "failed" if s.get("error") else "skipped"
            lines.append(f"- {s['label']} {s['workload']} {kind}: {msg}")
        for s in summary:
            if s["case"] == case and (s.get("checksum_mismatch") or s.get("count_mismatch")):
                lines.append(
                    f"- {s['label']} {s['workload']} {s['cache']}: data differs from "
                    f"safetensors.torch.load_file ({s.get('count_mismatch') or 'checksum'})"
                )
    lines += [
        "",
        "## fastload against the best peer (medians)",
        "",
        "| case | workload | cache | fastload GB/s | best peer GB/s | ratio | raw limit GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rat:
        fl = f"{r['fastload_gb_per_s']:.2f} ({r['fastload']})" if r["fastload"] else "-"
        pe = f"{r['peer_gb_per_s']:.2f} ({r['best_peer']})" if r["best_peer"] else "-"
        ra = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        raw = f"{r['raw_gb_per_s']:.2f} ({r['raw']})" if r["raw"] else "-"
        lines.append(
            f"| {r['case']} | {r['workload']} | {r['cache']} | {fl} | {pe} | {ra} | {raw} |"
        )
    lines += ["", "Rows:", ""]
    lines += [f"- **{k}**: {note}" for k, note in meta.get("rows", {}).items() if note]
    return "\n".join(lines) + "\n"


def _find(summary, case, cache, label, workload):
    for s in summary:
        if (s["case"], s["cache"], s["label"], s["workload"]) == (case, cache, label, workload):
            return s
    return None


def chart(path: Path, meta: dict, summary: list[dict], labels: list[str]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no chart: {e}"
    cases = list(meta["cases"])
    caches = [c for c in ("cold", "warm") if any(s["cache"] == c for s in summary)]
    fig, axes = plt.subplots(
        len(cases), len(caches), figsize=(6.5 * len(caches), 4.2 * len(cases)), squeeze=False
    )
    colors = plt.get_cmap("tab10")
    width = 0.8 / max(1, len(labels))
    workloads = ("load", "stream")
    # One panel per (case, cache): cold and warm rates differ by 10x, so each gets its own scale.
    for r, case in enumerate(cases):
        for c, cache in enumerate(caches):
            ax = axes[r, c]
            for i, label in enumerate(labels):
                xs, ys, lo, hi = [], [], [], []
                for g, w in enumerate(workloads):
                    s = _find(summary, case, cache, label, w)
                    if s and "gb_per_s_median" in s:
                        xs.append(g + (i - (len(labels) - 1) / 2) * width)
                        ys.append(s["gb_per_s_median"])
                        lo.append(s["gb_per_s_median"] - s["gb_per_s_min"])
                        hi.append(s["gb_per_s_max"] - s["gb_per_s_median"])
                if xs:
                    ax.bar(
                        xs, ys, width, yerr=[lo, hi], capsize=2, label=label, color=colors(i % 10)
                    )
            tallest = max((b.get_height() for b in ax.patches), default=0)
            for kind in COLD_LIMITS if cache == "cold" else ("page-cache read",):
                raw = _find(summary, case, cache, kind, "raw")
                # A limit far above every bar (the tiny case) would only flatten them.
                if raw and "gb_per_s_median" in raw and raw["gb_per_s_median"] < 3 * tallest:
                    ax.axhline(
                        raw["gb_per_s_median"],
                        color="black",
                        linewidth=0.8,
                        linestyle="dashed" if kind != "disk buffered x8" else "dotted",
                    )
                    ax.annotate(
                        f"{kind} {raw['gb_per_s_median']:.2f}",
                        (-0.45, raw["gb_per_s_median"]),
                        fontsize=7,
                        va="bottom",
                    )
            ax.set_xticks(range(len(workloads)), workloads)
            ax.set_ylabel("GB/s (median, min-max)")
            ax.set_title(f"{case} - {cache}", fontsize=9)
            ax.grid(axis="y", alpha=0.3)
    # One legend for the figure: a row can be absent from a panel (runai is cold-only by default).
    from matplotlib.patches import Patch

    handles = [Patch(color=colors(i % 10), label=label) for i, label in enumerate(labels)]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(labels), 7), fontsize=8)
    fig.tight_layout(rect=(0, 0.06 / len(cases), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write(out: Path, meta: dict, records: list[dict], labels: list[str]) -> None:
    summary = summarize(records)
    rat = ratios(summary, labels)
    md = markdown(meta, summary, labels, rat)
    (out / "results.md").write_text(md)
    (out / "results.json").write_text(
        json.dumps(
            {"meta": meta, "summary": summary, "fastload_vs_best_peer": rat, "runs": records},
            indent=1,
            default=str,
        )
    )
    problem = chart(out / "results.png", meta, summary, labels)
    print()
    print(md)
    if problem:
        print(problem)
