"""Turn the JSON results of the benches into bench/results/REPORT.md and PNG plots.

Reads whichever of these exist in --results (a missing one becomes a note saying how to make it):
  acceptance.json  bench/eval_acceptance.py or `spd-fast eval --out bench/results/acceptance`
  bench.json       `spd-fast bench --out bench/results/bench.json` (AR vs SPD tokens/s per n)
  cycle.json       bench/bench_cycle.py (per-cycle time split)
  ar_vs_hf.json    bench/bench_ar.py (our AR runtime vs HF transformers)

    .venv/bin/python bench/report.py                      # bench/results -> bench/results/REPORT.md
    .venv/bin/python bench/report.py --results DIR --out DIR
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

SOURCES = {
    "acceptance": ("acceptance.json",
                   "python bench/eval_acceptance.py (or spd-fast eval --out bench/results/acceptance)"),
    "bench": ("bench.json", "spd-fast bench --out bench/results/bench.json"),
    "cycle": ("cycle.json", "python bench/bench_cycle.py"),
    "ar_vs_hf": ("ar_vs_hf.json", "python bench/bench_ar.py"),
}
CYCLE_PARTS = [("stages_ms", "stages"), ("pdm_ms", "PDM draft"), ("verify_ms", "verify"), ("overhead_ms", "overhead")]


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def _f(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def load_results(results: Path) -> tuple[dict[str, Any], list[str]]:
    found, notes = {}, []
    for key, (name, how) in SOURCES.items():
        path = results / name
        if not path.is_file():
            notes.append(f"- `{name}` not found: skipped (make it with `{how}`)")
            continue
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, OSError) as e:
            notes.append(f"- `{name}` unreadable ({e}): skipped")
            continue
        problem = _shape_problem(key, data)
        if problem:  # e.g. another bench's JSON saved under this name
            notes.append(f"- `{name}` is not what `{how}` writes ({problem}): skipped")
            continue
        found[key] = data
    return found, notes


# the row fields each section reads (rows: a list of objects); ar_vs_hf reads results.{hf,ours}
ROW_KEYS = {"acceptance": ("n", "temperature", "category", "acceptance_rate", "equivalent_accept_length"),
            "bench": ("method", "tokens_per_s"),
            "cycle": ("n", "cycle_ms", "tokens_per_cycle", "ar_step_ms")}


def _shape_problem(key: str, data: Any) -> str | None:
    """What keeps `data` from being read as the `key` results, or None."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    if key == "ar_vs_hf":
        res = data.get("results", {})
        if not isinstance(res, dict) or any(not isinstance(res[k], dict) or "ms_per_token_median" not in res[k]
                                            for k in ("hf", "ours") if k in res):
            return "its results.hf / results.ours lack ms_per_token_median"
        return None
    rows = data.get("rows", [])
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return "its rows are not a list of objects"
    for i, r in enumerate(rows):
        need = ROW_KEYS[key] if key != "bench" or r.get("method") != "spd" else ROW_KEYS[key] + ("n",)
        missing = [k for k in need if k not in r]
        if missing:
            return f"row {i} lacks {', '.join(missing)}"
    return None


# ---- acceptance ----------------------------------------------------------------------------------
def acceptance_section(data: dict[str, Any], out: Path) -> list[str]:
    rows = data.get("rows", [])
    if not rows:
        return ["_acceptance.json has no rows_"]
    plt = _plt()
    temps = sorted({r["temperature"] for r in rows})
    cats = list(dict.fromkeys(r["category"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for t, style in zip(temps, ["-", "--", ":", "-."] * 4):
        for cat in cats:
            sel = sorted((r for r in rows if r["temperature"] == t and r["category"] == cat), key=lambda r: r["n"])
            label = cat + (f" T={t}" if len(temps) > 1 else "")
            kw = dict(linestyle=style, marker="o", label=label)
            if cat == "overall":
                kw.update(color="black", linewidth=2)
            axes[0].plot([r["n"] for r in sel], [r["acceptance_rate"] for r in sel], **kw)
            axes[1].plot([r["n"] for r in sel], [r["equivalent_accept_length"] for r in sel], **kw)
    for ax, title in zip(axes, ["acceptance rate", "equivalent accept length (n x tokens/cycle)"]):
        ax.set_xlabel("stages n")
        ax.set_title(title)
        ax.set_xticks(sorted({r["n"] for r in rows}))
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "plot_acceptance.png", dpi=110)
    plt.close(fig)
    meta = data.get("meta", {})
    about = [f"draft `{meta['draft']}`" if "draft" in meta else "",
             f"{meta['limit']} prompts per category" if "limit" in meta else "",
             f"{meta['max_new_tokens']} new tokens" if "max_new_tokens" in meta else "",
             f"{meta['threads']} threads" if "threads" in meta else "", meta.get("date", "")]
    lines = [", ".join(x for x in about if x) or "(no metadata)", "", "![acceptance vs n](plot_acceptance.png)", "",
             "| n | temp | category | acceptance | tokens/cycle | equiv. accept length | SPD tok/s | AR tok/s "
             "| SPD/AR |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['temperature']} | {r['category']} | {r['acceptance_rate']:.3f} | "
                     f"{r['tokens_per_cycle']:.3f} | {r['equivalent_accept_length']:.2f} | "
                     f"{_f(r.get('spd_tokens_per_s'), '.1f')} | {_f(r.get('ar_tokens_per_s'), '.1f')} | "
                     f"{_f(r.get('speedup_vs_ar'))} |")
    return lines


# ---- tokens/s ------------------------------------------------------------------------------------
def speed_points(found: dict[str, Any]) -> tuple[str, float | None, list[tuple[int, float]]] | None:
    """(source, AR tokens/s, [(n, SPD tokens/s)]) from the best source present."""
    if "bench" in found:
        rows = found["bench"].get("rows", [])
        ar = next((r["tokens_per_s"] for r in rows if r.get("method") == "ar"), None)
        spd = sorted((r["n"], r["tokens_per_s"]) for r in rows if r.get("method") == "spd")
        if spd:
            return "bench.json (spd-fast bench)", ar, spd
    if "acceptance" in found:
        rows = [r for r in found["acceptance"].get("rows", []) if r["category"] == "overall"]
        if rows:
            t0 = min(r["temperature"] for r in rows)
            rows = [r for r in rows if r["temperature"] == t0]
            ar = next((r["ar_tokens_per_s"] for r in rows if "ar_tokens_per_s" in r), None)
            return f"acceptance.json (overall, T={t0})", ar, sorted((r["n"], r["spd_tokens_per_s"]) for r in rows)
    if "cycle" in found:
        rows = found["cycle"].get("rows", [])
        if rows:
            ar = sorted(1e3 / r["ar_step_ms"] for r in rows)[len(rows) // 2]
            spd = sorted((r["n"], 1e3 * r["tokens_per_cycle"] / r["cycle_ms"]) for r in rows)
            return "cycle.json (tokens/cycle / cycle time)", ar, spd
    return None


def speed_section(found: dict[str, Any], out: Path) -> list[str]:
    pts = speed_points(found)
    if pts is None:
        return ["_no speed results (bench.json, acceptance.json or cycle.json) found_"]
    source, ar, spd = pts
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([n for n, _ in spd], [v for _, v in spd], marker="o", label="SPD")
    if ar is not None:
        ax.axhline(ar, color="gray", linestyle="--", label="AR baseline (same run)")
    ax.set_xlabel("stages n")
    ax.set_ylabel("decode tokens/s")
    ax.set_xticks([n for n, _ in spd])
    ax.set_ylim(0, 1.15 * max([v for _, v in spd] + ([ar] if ar is not None else [])))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("decode speed: AR vs SPD")
    fig.tight_layout()
    fig.savefig(out / "plot_tokens_per_s.png", dpi=110)
    plt.close(fig)
    lines = [f"Source: {source}.", "", "![tokens/s vs n](plot_tokens_per_s.png)", "",
             "| method | n | tokens/s | vs AR |", "|---|---|---|---|"]
    if ar is not None:
        lines.append(f"| AR | - | {ar:.1f} | 1.00x |")
    # bench.json's own ratio, the median of its back-to-back AR/SPD pairs (older files have none: pooled rates)
    paired = {r["n"]: r["speedup_vs_ar"] for r in found.get("bench", {}).get("rows", [])
              if r.get("method") == "spd" and "pairs" in r} if source.startswith("bench.json") else {}
    for n, v in spd:
        if n in paired:
            cell = "-" if paired[n] is None else f"{paired[n]:.2f}x"
        else:
            cell = f"{v / ar:.2f}x" if ar else "no AR in this run"
        lines.append(f"| SPD | {n} | {v:.1f} | {cell} |")
    return lines


# ---- per-cycle breakdown -------------------------------------------------------------------------
def cycle_section(data: dict[str, Any], out: Path) -> list[str]:
    rows = sorted(data.get("rows", []), key=lambda r: r["n"])
    if not rows:
        return ["_cycle.json has no rows_"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4))
    xs = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for key, label in CYCLE_PARTS:
        vals = [r.get(key, r.get("draft_ms", 0.0) if key == "pdm_ms" else 0.0) for r in rows]
        ax.bar(xs, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    # reference marks across each bar: one AR step, and the slowest stage (the cycle time a parallel
    # executor with hidden drafting would approach)
    for key, label, style in [("ar_step_ms", "one AR step", dict(colors="black")),
                              ("slowest_stage_ms", "slowest stage", dict(colors="white", linestyles="dashed"))]:
        if all(key in r for r in rows):
            ax.hlines([r[key] for r in rows], [x - 0.4 for x in xs], [x + 0.4 for x in xs], linewidth=2,
                      label=label, **style)
    ax.set_xticks(xs, [f"n={r['n']}" for r in rows])
    ax.set_ylabel("ms per cycle (median, full pipeline)")
    ax.set_title("per-cycle time split")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), facecolor="lightgray")
    fig.tight_layout()
    fig.savefig(out / "plot_cycle_breakdown.png", dpi=110)
    plt.close(fig)
    lines = ["![per-cycle breakdown](plot_cycle_breakdown.png)", "",
             "| n | AR step ms | cycle ms | stages ms | slowest stage ms | PDM ms | verify ms | overhead ms | "
             "tokens/cycle | equiv. accept length |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {_f(r.get('ar_step_ms'), '.1f')} | {_f(r.get('cycle_ms'), '.1f')} | "
                     f"{_f(r.get('stages_ms'), '.1f')} | {_f(r.get('slowest_stage_ms'), '.1f')} | "
                     f"{_f(r.get('pdm_ms', r.get('draft_ms')))} | {_f(r.get('verify_ms'))} | "
                     f"{_f(r.get('overhead_ms'))} | {_f(r.get('tokens_per_cycle'), '.3f')} | "
                     f"{_f(r.get('equivalent_accept_length'))} |")
    return lines


def ar_vs_hf_section(data: dict[str, Any]) -> list[str]:
    res = data.get("results", {})
    meta = data.get("meta", {})
    lines = [f"{meta.get('dtype', '?')}, {meta.get('threads', '?')} threads, {meta.get('new_tokens', '?')} new tokens.",
             "", "| impl | ms/token (median) | tokens/s | peak RSS MiB |", "|---|---|---|---|"]
    for k in ("hf", "ours"):
        if k in res:
            r = res[k]
            lines.append(f"| {k} | {r['ms_per_token_median']:.1f} | {1e3 / r['ms_per_token_median']:.1f} | "
                         f"{_f(r.get('peak_rss_mib'), '.0f')} |")
    if "speedup" in data:
        lines += ["", f"spd_fast AR is {data['speedup']:.2f}x HF transformers `generate`."]
    return lines


def write_report(results: str | Path, out: str | Path | None = None) -> Path:
    """Build REPORT.md and the plots from the JSON files in `results`; return the report's path."""
    results = Path(results)
    out = Path(out) if out is not None else results
    out.mkdir(parents=True, exist_ok=True)
    found, notes = load_results(results)
    md = ["# spd_fast benchmark report", "",
          f"Generated {time.strftime('%Y-%m-%d %H:%M')} by `bench/report.py` from `{results}`.", ""]
    if notes:
        md += ["Missing inputs:", *notes, ""]
    if "acceptance" in found:
        md += ["## Acceptance vs n per category", "", *acceptance_section(found["acceptance"], out), ""]
    if any(k in found for k in ("bench", "acceptance", "cycle")):
        md += ["## Decode speed: AR vs SPD", "", *speed_section(found, out), ""]
    if "cycle" in found:
        md += ["## Per-cycle time breakdown", "", *cycle_section(found["cycle"], out), ""]
    if "ar_vs_hf" in found:
        md += ["## AR baseline vs Hugging Face transformers", "", *ar_vs_hf_section(found["ar_vs_hf"]), ""]
    if not found:
        md += ["No results found; run the benches above first.", ""]
    path = out / "REPORT.md"
    path.write_text("\n".join(md))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default="bench/results", help="directory with the JSON results")
    p.add_argument("--out", help="where REPORT.md and the PNGs go (default: --results)")
    a = p.parse_args(argv)
    if not Path(a.results).is_dir():
        print(f"report: error: {a.results} is not a directory; pass --results DIR with the JSON results",
              file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("report: error: matplotlib is not installed; install it with `pip install matplotlib` "
              "(or `pip install -e '.[dev]'`)", file=sys.stderr)
        return 2
    path = write_report(a.results, a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
