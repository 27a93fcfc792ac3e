"""Leave one source out: for each source of runs.csv, fit the step model's four constants (runs.THETA) on every
other source, predict the held-out one, and score it against the goals (speedup within runs.SPEEDUP_GOAL_PP points,
tokens/s within runs.TOKENS_GOAL_PCT percent, the recipe order of each run group right). Writes agree.json and
regenerates the agreement table in README.md between its markers; a held-out row outside a goal is a miss, and
misses.csv gives each one's measured reason (a miss without one shows as **unexplained**).

    PYTHONPATH=. python benchmarks/step_model/agree.py     # ~3 min on one CPU core"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from runs import (SPEEDUP_GOAL_PP, THETA, TOKENS_GOAL_PCT, fit, modelled, read_misses, read_runs,  # noqa: E402
                  row_model)

HERE = Path(__file__).parent
OUT = HERE / "agree.json"
README = HERE / "README.md"
BEGIN, END = "<!-- agreement table: agree.py writes it -->", "<!-- end of the agreement table -->"


def held_out(models: list[Any]) -> dict[str, Any]:
    """Per source: the constants fitted without it and its rows' predictions under them."""
    sources = list(dict.fromkeys(m.row["source"] for m in models))
    folds = {}
    for source in sources:
        theta = fit([m for m in models if m.row["source"] != source])
        rows = []
        for model in (m for m in models if m.row["source"] == source):
            tokens, speedup = model.predicted(theta)
            row = model.row
            rows.append(dict(table=row["table"], gpu=row["gpu"], world_size=row["world_size"],
                             recipe=row["recipe"] or "bf16", published_tokens_per_s=row["tokens_per_s"],
                             predicted_tokens_per_s=None if tokens is None else round(tokens, 1),
                             published_speedup=None if row["speedup"] is None else round(row["speedup"], 4),
                             predicted_speedup=None if speedup is None else round(speedup, 4)))
        folds[source] = {"constants": dict(zip(THETA, theta)), "rows": rows}
    return folds


def classify(row: dict[str, Any]) -> list[str]:
    """The goals a held-out row misses: "tokens", "speedup"."""
    missed = []
    if row["predicted_tokens_per_s"] is not None and row["published_tokens_per_s"]:
        if abs(100 * (row["predicted_tokens_per_s"] / row["published_tokens_per_s"] - 1)) > TOKENS_GOAL_PCT:
            missed.append("tokens")
    if row["predicted_speedup"] is not None and row["published_speedup"]:
        if abs(100 * (row["predicted_speedup"] - row["published_speedup"])) > SPEEDUP_GOAL_PP:
            missed.append("speedup")
    return missed


def orders(folds: dict[str, Any]) -> list[dict[str, Any]]:
    """Per run group (a table: one model on one GPU, one setting) with two or more rows: the recipes fastest first,
    published and predicted (tokens/s; a GEMM-level table by its speedups)."""
    out = []
    for fold in folds.values():
        tables = dict.fromkeys(r["table"] for r in fold["rows"])
        for table in tables:
            rows = [r for r in fold["rows"] if r["table"] == table]
            key = "tokens_per_s" if rows[0]["published_tokens_per_s"] else "speedup"
            if len(rows) < 2:
                continue
            ranked = [[r["recipe"] for r in sorted(rows, key=lambda r: -r[f"{side}_{key}"])]
                      for side in ("published", "predicted")]
            out.append(dict(table=table, published=ranked[0], predicted=ranked[1], right=ranked[0] == ranked[1]))
    return out


def _pct(predicted: float | None, published: float | None) -> str:
    return "-" if predicted is None or not published else f"{100 * (predicted / published - 1):+.1f}%"


def render(agree: dict[str, Any], misses: dict[tuple[str, str], str]) -> str:
    """The README's agreement section (between the markers) from agree.json's content and misses.csv: the tables
    name each miss's reason by number, and the reasons follow them, wrapped."""
    reasons: list[str] = []

    def cite(key: tuple[str, str]) -> str:
        if key not in misses:
            return "**unexplained**"
        if misses[key] not in reasons:
            reasons.append(misses[key])
        return f"[{reasons.index(misses[key]) + 1}]"

    lines = [BEGIN, "", "| held out | run | GPUs | recipe | published tok/s | predicted tok/s | "
             "speedup published / predicted | miss |", "|---|---|---|---|---|---|---|---|"]
    for source, fold in agree["folds"].items():
        for r in fold["rows"]:
            predicted, published = r["predicted_tokens_per_s"], r["published_tokens_per_s"]
            tokens = f"{predicted:,.0f} ({_pct(predicted, published)})" if predicted is not None else "-"
            speedup = "-"
            if r["predicted_speedup"] is not None:
                shown = f"{r['published_speedup']:.3f}" if r["published_speedup"] else "n/a"
                delta = (f" ({100 * (r['predicted_speedup'] - r['published_speedup']):+.1f} pp)"
                         if r["published_speedup"] else "")
                speedup = f"{shown} / {r['predicted_speedup']:.3f}{delta}"
            missed = classify(r)
            miss = f"{', '.join(missed)} {cite((r['table'], r['recipe']))}" if missed else ""
            lines.append(f"| {source} | {r['table']} | {r['world_size']} | {r['recipe']} | "
                         f"{f'{published:,.0f}' if published else '-'} | {tokens} | {speedup} | {miss} |")
    lines += ["", "Recipe order per run group (fastest first; held out as above):", "",
              "| run | published | predicted | right |", "|---|---|---|---|"]
    for o in agree["orders"]:
        right = "yes" if o["right"] else f"no {cite((o['table'], 'order'))}"
        lines.append(f"| {o['table']} | {' > '.join(o['published'])} | {' > '.join(o['predicted'])} | {right} |")
    lines += ["", "What was measured about each miss (misses.csv):", ""]
    lines += [textwrap.fill(reason, 116, initial_indent=f"{i}. ", subsequent_indent="   ")
              for i, reason in enumerate(reasons, 1)]
    lines += ["", "Constants fitted without each source (all sources: fit.json, what fp8dist ships):", "",
              "| held out | " + " | ".join(THETA) + " |", "|---|" + "---|" * len(THETA)]
    for source, fold in agree["folds"].items():
        lines.append(f"| {source} | " + " | ".join(f"{fold['constants'][k]:g}" for k in THETA) + " |")
    return "\n".join(lines + ["", END])


def write_readme(section: str) -> None:
    text = README.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    README.write_text(text[:start] + section + text[end:])


def main() -> None:
    rows = read_runs()
    models = [row_model(r) for r in modelled(rows)]
    folds = held_out(models)
    agree = {"folds": folds, "orders": orders(folds),
             "excluded": [dict(table=r["table"], recipe=r["recipe"] or "bf16", reason=r["excluded"])
                          for r in rows if r["excluded"]],
             "prediction": "every predicted figure is the step model's, fitted without the row's source"}
    OUT.write_text(json.dumps(agree, indent=1) + "\n")
    write_readme(render(agree, read_misses()))
    print(render(agree, read_misses()))


if __name__ == "__main__":
    main()
