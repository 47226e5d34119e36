"""The table scripts/compare_old_new.sh prints last: the old library's benchmark against the new
one's, per model and decode mode, from the JSON documents the two benchmarks wrote.

    python3 scripts/compare_old_new.py DIR [MODEL ...]

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
Where both documents of a model hold a context sweep (`--contexts`, this layout on both sides),
a second table: per context and mode, each engine's ms a token (old, new) and the ratio of
their means.
Then, for each pair old-upper-PRESET.json / new-upper-PRESET.json in DIR (`python -m
bench.speculative --upper-bound`, this layout on both sides), the verify path's ceiling per k:
a verify step's time in plain steps and the speedup over plain decoding, old and new, and
whether each side's output was plain decoding's.
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


def context_rows(old: dict, new: dict, model: str) -> list[list[str]]:
    """Rows of the context table: the int8-KV bf16 sweep records both documents hold, per
    (runtime, context), each engine's ms a token and new mean / old mean."""
    def sweep(doc):
        return {(r["runtime"], r["context"]): r for r in doc.get("context_sweep", [])
                if r.get("kv") == "int8" and r.get("weights") == "bf16" and r.get("ms_per_token")}
    old_s, new_s = sweep(old), sweep(new)
    rows = []
    for key in sorted(old_s.keys() & new_s.keys(), key=lambda k: (k[0], k[1])):
        o, n = old_s[key], new_s[key]
        o_ms = o.get("ms_per_token_engines") or [o["ms_per_token"]]
        n_ms = n.get("ms_per_token_engines") or [n["ms_per_token"]]
        ratio = (sum(n_ms) / len(n_ms)) / (sum(o_ms) / len(o_ms))
        rows.append([model, key[0].replace("onegraph-", ""), str(key[1]), ", ".join(f"{v:.3f}" for v in o_ms),
                     ", ".join(f"{v:.3f}" for v in n_ms), f"{ratio:.3f}"])
    return rows


def format_table(rows: list[list[str]]) -> str:
    header = ["model", "mode", "old tok/s", "new tok/s", "new/old", "old engines", "new engines",
              "tokens"]
    return format_rows(header, rows, (0, 1, 7))


def upper_bound_rows(old: dict, new: dict, preset: str) -> tuple[list[list[str]], list[str]]:
    """(table rows, failed checks) of one preset's upper-bound documents, per k both hold."""
    rows, failed = [], []
    new_rows = {r["k"]: r for r in new["rows"]}
    for o in old["rows"]:
        n = new_rows.get(o["k"])
        if n is None:
            continue
        for side, r in (("old", o), ("new", n)):
            if not r["identical"]:
                failed.append(f"{preset} k={r['k']}: {side} output differs from plain decoding")
        rows.append([preset, str(o["k"]), f"{o['verify_per_plain_step']:.2f}", f"{n['verify_per_plain_step']:.2f}",
                     f"{o['ratio']:.2f}", f"{n['ratio']:.2f}",
                     "yes" if o["identical"] and n["identical"] else "NO"])
    return rows, failed


def format_rows(header: list[str], rows: list[list[str]], left: tuple[int, ...]) -> str:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) if i in left else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(r, widths))).rstrip() for r in [header] + rows)


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    folder, models = argv[0], argv[1:]
    rows, failed, contexts = [], [], []
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
            contexts += context_rows(docs["old"], docs["new"], model)
    if rows:
        print(format_table(rows))
    if contexts:
        print()
        print(format_rows(["model", "mode", "context", "old ms (engines)", "new ms (engines)", "new/old"],
                          contexts, (0, 1, 3, 4)))
    upper = []
    for name in sorted(os.listdir(folder)):
        if not (name.startswith("old-upper-") and name.endswith(".json")):
            continue
        preset = name[len("old-upper-"):-len(".json")]
        try:
            with open(os.path.join(folder, name)) as f_old, open(os.path.join(folder, f"new-upper-{preset}.json")) as f_new:
                r, f = upper_bound_rows(json.load(f_old), json.load(f_new), preset)
        except (OSError, ValueError, KeyError) as e:
            failed.append(f"{preset} upper bound: {e}")
            continue
        upper += r
        failed += f
    if upper:
        if rows:
            print()
        print(format_rows(["preset", "k", "old verify/plain", "new verify/plain", "old speedup", "new speedup",
                           "same as plain"], upper, (0,)))
    for line in failed:
        print(f"FAILED: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
