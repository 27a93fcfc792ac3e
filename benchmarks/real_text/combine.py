"""Merge `fp8dist bench` result files of one convergence study into one: the same data, model size, steps and batch,
run as several matrices (say bf16 + torchao recipes in one, the lean memory level in another, so that lean runs for
bf16 alone instead of for every FP8 backend; or more seeds of some configurations, run later; or one seed a run, so
that a long study keeps every finished seed). The cells are compared again over the union — each lean or FP8 cell
against the bf16 cell of its seed, whichever file holds it — and the JSON, PNG and tables written as `fp8dist bench`
writes them.

    python benchmarks/real_text/combine.py A.json B.json --out benchmarks/results --name convergence_python-docs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fp8dist.fp8 import get_backend
from fp8dist.bench.results import _compare, convergence, markdown_table

SAME = ("text", "strategies", "sizes", "steps", "batch_size", "seq_len", "nproc", "lr", "lr_schedule", "compile",
        "activation_checkpointing")
"""Settings every merged file must share: otherwise the curves are not of one study. Seeds may differ: each
configuration is summarized over the seeds it ran, each gap paired with the bf16 cell of the same seed."""


def combine(docs: list[dict]) -> dict:
    """One result document of ``docs``: the first one's header, every cell (each cell name once), compared anew."""
    first = docs[0]
    for doc in docs[1:]:
        differ = [k for k in SAME if doc["settings"].get(k) != first["settings"].get(k)]
        if differ:
            raise ValueError(f"the files differ in {', '.join(differ)}: they are not one study; merge runs made "
                             "with the same --data, --sizes, --steps, --batch-size, --seq-len, ... only.")
    cells, names = [], set()
    for doc in docs:
        for cell in doc["cells"]:
            cell = {k: v for k, v in cell.items() if k not in ("vs_bf16", "vs_standard", "overhead")}
            if "torchao_recipe" in cell:  # written before the bench named a backend's variant "variant"
                cell["variant"] = cell.pop("torchao_recipe")
            if not cell.get("label_seed"):  # a one-seed run's names lack the seed: label them as a matrix's are
                cell.update(name=f"{cell['name']}/seed{cell['seed']}", label_seed=True)
            if cell["name"] in names:
                raise ValueError(f"cell {cell['name']} is in two files: run each configuration and seed once.")
            names.add(cell["name"])
            cells.append(cell)
    _compare(cells)
    variants: dict[str, set[str]] = {}  # per backend variant option (torchao_recipe), the values run
    for c in cells:
        if c["variant"]:
            variants.setdefault(get_backend(c["fp8"]).variant_option, set()).add(c["variant"])
    merged = dict(first, cells=cells, convergence=convergence(cells))
    merged["commands"] = [doc["command"] for doc in docs]
    merged["runs"] = [{"date": d["date"], "wall_s": d["wall_s"], "load_average": d["load_average"]} for d in docs]
    merged["settings"] = dict(first["settings"], seeds=sorted({c["seed"] for c in cells}),
                              fp8=sorted({c["fp8"] or "none" for c in cells}),
                              variants={option: sorted(values) for option, values in variants.items()},
                              memory=sorted({c["memory"] for c in cells}))
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="fp8dist bench JSON files of one study")
    parser.add_argument("--out", type=Path, required=True, help="directory for the merged JSON and PNG")
    parser.add_argument("--name", required=True, help="file stem of the merged JSON and PNG")
    args = parser.parse_args(argv)
    try:
        doc = combine([json.loads(path.read_text()) for path in args.files])
    except (OSError, ValueError, KeyError) as err:
        print(f"combine: error: {err}", file=sys.stderr)
        return 2
    from fp8dist.runtime.files import atomic_write
    from fp8dist.bench.plot import plot_results

    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / args.name
    atomic_write(stem.with_suffix(".json"), lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=1) + "\n"))
    atomic_write(stem.with_suffix(".png"), lambda tmp: plot_results(doc, tmp))
    print(markdown_table(doc))  # the convergence table included
    print(f"wrote {stem.with_suffix('.json')}, {stem.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
