"""Run only some cells of an `fp8dist bench` matrix: those whose name matches ``--only`` (a regular expression),
and write the JSON and PNG as `fp8dist bench` does. For a study whose matrix has cells it does not need — the
bench pairs every FP8 cell with its bf16 cell, so `--fp8 torchao --memory lean` also runs `bf16+lean` —, merged
afterwards with the other runs by combine.py.

    python benchmarks/real_text/run_cells.py --only 'torchao\\+lean' -- --data corpus.jsonl --tokenizer tok \\
        --strategies fsdp --sizes small --fp8 torchao --memory lean --seed 0,1 --out results/lean
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", required=True, help="regular expression a cell's name must match (re.search)")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- then fp8dist bench's flags")
    args = parser.parse_args(argv)
    flags = args.bench[1:] if args.bench[:1] == ["--"] else args.bench

    import torch

    from fp8dist.bench.results import cell_line, markdown_table, results_document, write_results
    from fp8dist.bench.runner import check_cells, check_text, plan_cells, resolve_settings, run_cells
    from fp8dist.cli import bench

    sub = argparse.ArgumentParser(prog="fp8dist")
    bench.add_parser(sub.add_subparsers())
    options = sub.parse_args(["bench", *flags])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    settings = resolve_settings(options, device)
    cells = [c for c in plan_cells(settings) if re.search(args.only, c.name)]
    if not cells:
        names = ", ".join(c.name for c in plan_cells(settings))
        print(f"run_cells: error: --only {args.only!r} matches none of the cells: {names}", file=sys.stderr)
        return 2
    check_cells(cells, settings, device)
    print(check_text(settings))
    load = [os.getloadavg()]
    start = time.perf_counter()
    results = run_cells(cells, settings, cell_line)
    load.append(os.getloadavg())
    command = f"python benchmarks/real_text/run_cells.py --only {shlex.quote(args.only)} -- {shlex.join(flags)}"
    doc = results_document(results, settings, device, command=command, load_average=load,
                           wall_s=time.perf_counter() - start)
    Path(options.out).mkdir(parents=True, exist_ok=True)
    paths = write_results(doc, Path(options.out), plot=True)
    print(markdown_table(doc))  # with the convergence table where there is one
    print("wrote " + ", ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
