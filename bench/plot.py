"""The benchmark chart from an `onegraph bench` JSON document (bench/benchmark.py).

Left: tok/s per model, one bar per runtime (onegraph graph / non-graph per KV format, page
and weight format; the peers), a linear axis from zero, with each bar's own bandwidth floor
(its weight format's bytes) drawn as a black tick above it.
Right (when --contexts ran): decode ms/token against the context length, one line per
model, KV format and mode, the floor of each as a dotted line.

    python -m bench.plot bench.json bench.png
"""
from __future__ import annotations

import json
import sys

MODE_STYLE = {"onegraph-graph": "-", "onegraph-graph-pipelined": ":", "onegraph-nongraph": "--",
              "onegraph-cpu": "-."}


def plot(doc: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sweep = doc.get("context_sweep") or []
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(18 if sweep else 9, 6.5), squeeze=False,
                             gridspec_kw={"width_ratios": [1, 1.25]} if sweep else None)
    _bars(axes[0][0], [r for r in doc["results"] if r["status"] == "ok"])
    if sweep:
        _context_lines(axes[0][1], sweep)
    where = doc.get("gpu") or doc["settings"]["device"]
    s = doc["settings"]
    fig.suptitle(f"onegraph bench, {where}, {doc['date']}: batch 1, prompt {s['prompt']}, decode {s['n']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _series_name(r: dict) -> str:
    if r["runtime"].startswith("hf-"):
        return r["runtime"]
    weights = r.get("weights") or "bf16"
    return f"{r['runtime']} ({r['kv']} KV{_page_label(r)}" + ("" if weights == "bf16" else f", {weights}") + ")"


def _page_label(r: dict) -> str:
    page = r.get("kv_page_size")
    return f", page {page}" if page and page <= 4096 else (", contiguous" if page else "")


def _unique(items) -> list:
    return list(dict.fromkeys(items))


def _bars(ax, results: list[dict]) -> None:
    models = _unique(r["model"] for r in results)
    series = _unique(_series_name(r) for r in results)  # colour and legend order
    present = {m: [r for name in series for r in results if r["model"] == m and _series_name(r) == name]
               for m in models}
    width = 0.8 / max(len(rs) for rs in present.values())
    labelled = set()
    for i, model in enumerate(models):
        rs = present[model]  # this model's bars side by side, centred on its tick
        last_floor_label = None  # equal floors side by side get one number, not a run of them
        for k, r in enumerate(rs):
            name = _series_name(r)
            x = i - len(rs) * width / 2 + (k + 0.5) * width
            ax.bar(x, r["tokens_per_s"], width, color=f"C{series.index(name)}",
                   label=name if name not in labelled else None)
            labelled.add(name)
            ax.annotate(f"{r['tokens_per_s']:.0f}", (x, r["tokens_per_s"]), ha="center", va="bottom", fontsize=7)
            floor = r.get("floor_tokens_per_s")
            if floor:  # this bar's own floor (the bytes of its weight format and KV)
                ax.hlines(floor, x - width / 2, x + width / 2, colors="black", linewidth=2,
                          label="bandwidth floor (each bar's own)" if "floor" not in labelled else None)
                labelled.add("floor")
                if last_floor_label is None or abs(floor - last_floor_label) > 0.005 * floor:
                    ax.annotate(f"{floor:.0f}", (x, floor), ha="center", va="bottom", fontsize=6)
                    last_floor_label = floor
    layers = {r["model"]: r["layers"] for r in results}
    ax.set_xticks(range(len(models)), [f"{m}\n{layers[m]} layers" for m in models])
    # Linear from zero: bar heights compare as ratios (a log axis made 1.08x look like 2x).
    ax.set_ylim(bottom=0)
    ax.set_ylabel("decode tokens/s (higher is better)")
    ax.set_title("decode throughput per model")
    ax.legend(fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)


def _context_lines(ax, sweep: list[dict]) -> None:
    groups = _unique((r["model"], r["kv"], _page_label(r)) for r in sweep)
    for k, (model, kv, page) in enumerate(groups):
        rows = [r for r in sweep if (r["model"], r["kv"], _page_label(r)) == (model, kv, page)]
        for runtime in _unique(r["runtime"] for r in rows):
            pts = sorted((r["context"], r["ms_per_token"]) for r in rows if r["runtime"] == runtime)
            ax.plot(*zip(*pts), MODE_STYLE.get(runtime, "-"), marker="o", color=f"C{k}",
                    label=f"{model} {kv} KV{page} {runtime.removeprefix('onegraph-')}")
        floor = sorted({(r["context"], r["floor_ms"]) for r in rows if r["floor_ms"]})
        if floor:
            ax.plot(*zip(*floor), ":", color=f"C{k}", label=f"{model} {kv} KV{page} floor")
    contexts = sorted({r["context"] for r in sweep})
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [f"{c // 1024}k" if c >= 1024 and c % 1024 == 0 else str(c) for c in contexts])
    ax.minorticks_off()
    ax.set_yscale("log")
    _plain_numbers(ax.yaxis)
    ax.set_xlabel("context length (KV rows read per step)")
    ax.set_ylabel("ms per decoded token (lower is better)")
    ax.set_title("decode time vs context length (solid: graph, dashed: non-graph, dotted: floor)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(which="both", alpha=0.3)


def _plain_numbers(axis) -> None:
    """Log-axis ticks at 1, 2, 5 × powers of ten, written 0.5, 2, 300."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m bench.plot BENCH.json OUT.png")
    with open(sys.argv[1]) as f:
        plot(json.load(f), sys.argv[2])
