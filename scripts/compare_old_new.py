"""The table scripts/compare_old_new.sh prints last: the old library's benchmark against the new
one's, per model and decode mode, from the JSON documents the two benchmarks wrote.

    python3 scripts/compare_old_new.py DIR MODEL [MODEL ...]

DIR holds, per model, these documents (int8 KV, bf16 weights, E engines each):
  old-MODEL.json          the old tree's benchmark. From `python -m runtime.bench` (2a59be2's
                          layout, --pipeline on) its "onegraph-graph" record is the graph
                          pipelined, as generate runs it; from `python -m bench` (this layout) it
                          reads as new-MODEL.json does
  old-stepped-MODEL.json  runtime.bench only: the same with --pipeline off, its "onegraph-graph"
                          the graph stepped one token at a time (alternating with the non-graph
                          path)
  new-MODEL.json          `python -m bench`: "onegraph-graph" (stepped), "onegraph-graph-pipelined"
                          and "onegraph-nongraph"
  new-stepped-MODEL.json  with old-stepped only: `python -m bench --pipeline off`, the same two
                          modes in turn as old-stepped's, so that the stepped and non-graph rows
                          compare runs of the same modes (a mode's rate can move a few percent
                          with the modes it alternates with)
Each row: the median engine's tok/s (old, new), new / old, each side's spread over its engines
(min-max tok/s), and the token checks: graph == non-graph within each run, old == new (the same
seed gives the same weights and prompt, so an unchanged computation gives the same tokens).
Exit status 1 when a document is missing or a token check fails.
"""
from __future__ import annotations

import json
import os
import sys

# (row label, (old document, old runtime), (new document, new runtime)): an old tree of
# 2a59be2's layout, and one of this layout
MODES = [("non-graph", ("old-stepped", "onegraph-nongraph"), ("new-stepped", "onegraph-nongraph")),
         ("graph, stepped", ("old-stepped", "onegraph-graph"), ("new-stepped", "onegraph-graph")),
         ("graph, pipelined", ("old", "onegraph-graph"), ("new", "onegraph-graph-pipelined"))]
SAME_LAYOUT_MODES = [(label, ("old", runtime), ("new", runtime))
                     for label, runtime in (("non-graph", "onegraph-nongraph"), ("graph, stepped", "onegraph-graph"),
                                            ("graph, pipelined", "onegraph-graph-pipelined"))]


def record(doc: dict, runtime: str) -> dict | None:
    """The int8-KV bf16 record of this runtime (the bench's median engine), or None."""
    return next((r for r in doc["results"] if r["runtime"] == runtime and r["kv"] == "int8"
                 and r["weights"] == "bf16" and r["status"] == "ok"), None)


def spread(r: dict) -> str:
    values = [v for v in (r.get("tokens_per_s_engines") or [r["tokens_per_s"]]) if v]
    return f"{min(values):.1f}-{max(values):.1f}" if values else "-"


def compare(docs: dict[str, dict], model: str) -> tuple[list[list[str]], list[str]]:
    """(table rows, failed checks) for one model; docs maps "old", "new" and, for an old tree of
    2a59be2's layout, "old-stepped" and "new-stepped" to documents."""
    rows, failed = [], []
    modes = MODES if "old-stepped" in docs else SAME_LAYOUT_MODES
    for label, (old_doc, old_runtime), (new_doc, new_runtime) in modes:
        old, new = record(docs[old_doc], old_runtime), record(docs[new_doc], new_runtime)
        if old is None or new is None:
            failed.append(f"{model} {label}: no record (old {old is not None}, new {new is not None})")
            continue
        checks = []
        for side, r in (("old", old), ("new", new)):
            if r.get("same_tokens_as_nongraph") is not None:   # the non-graph row holds None
                checks.append(f"{side} graph=non-graph {'yes' if r['same_tokens_as_nongraph'] else 'NO'}")
                if not r["same_tokens_as_nongraph"]:
                    failed.append(f"{model} {label}: {side} graph and non-graph tokens differ")
        same = old["tokens"] == new["tokens"]
        checks.append(f"old=new {'yes' if same else 'NO'}")
        if not same:
            failed.append(f"{model} {label}: old and new tokens differ")
        rows.append([model, label, f"{old['tokens_per_s']:.1f}", f"{new['tokens_per_s']:.1f}",
                     f"{new['tokens_per_s'] / old['tokens_per_s']:.3f}", spread(old), spread(new),
                     "; ".join(checks)])
    return rows, failed


def format_table(rows: list[list[str]]) -> str:
    header = ["model", "mode", "old tok/s", "new tok/s", "new/old", "old engines", "new engines",
              "tokens"]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i in (0, 1, 7) else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(r, widths))).rstrip() for r in [header] + rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    folder, models = argv[0], argv[1:]
    rows, failed = [], []
    for model in models:
        docs = {}
        stepped = os.path.join(folder, f"old-stepped-{model}.json")
        kinds = ("old", "old-stepped", "new", "new-stepped") if os.path.exists(stepped) else ("old", "new")
        for kind in kinds:
            path = os.path.join(folder, f"{kind}-{model}.json")
            try:
                with open(path) as f:
                    docs[kind] = json.load(f)
            except (OSError, ValueError) as e:
                failed.append(f"{model}: {path}: {e}")
        if len(docs) == len(kinds):
            r, f = compare(docs, model)
            rows += r
            failed += f
    if rows:
        print(format_table(rows))
    for line in failed:
        print(f"FAILED: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
