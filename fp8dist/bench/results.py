"""What ``fp8dist bench`` writes: the results document (cells, comparisons, device, versions, date), the JSON and
PNG files (atomically), the Markdown table and the one-line summary of a cell."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..config.axis import engine_packages
from ..config.text import byte_size, plural
from ..memory_levels import STANDARD
from ..runtime.files import atomic_write
from .cell import describe_job, versions_line
from .comm import SHOWN_TYPES as COMM_TYPES

__all__ = ["device_record", "versions", "results_document", "write_results", "markdown_table", "cell_line",
           "convergence", "convergence_table", "config_name"]

SCHEMA = 1
COMM_DEFINITION = ("bytes per rank in the counted step, by collective type, each collective counted at its full "
                   "buffer size (nccl-tests' message size: the gathered output of an all-gather, the input of a "
                   "reduce-scatter, the tensor of an all-reduce or broadcast)")


def device_record(device_type: str, nproc: int) -> dict[str, Any]:
    """A results document's device: name, count, capability (CUDA) and processes."""
    import torch

    if device_type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(),
                "nproc": nproc, "backend": "nccl", "capability": "sm_%d%d" % torch.cuda.get_device_capability(0)}
    return {"type": "cpu", "name": _cpu_name(), "count": os.cpu_count(), "nproc": nproc, "backend": "gloo",
            "threads_per_process": max(1, (os.cpu_count() or 1) // nproc)}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict[str, str | None]:
    """Python, fp8dist and every engine package's version (None: not installed)."""
    from ..runtime.packages import __version__
    from ..runtime.packages import package_version

    return {"python": platform.python_version(), "fp8dist": __version__,
            **{n: package_version(n) for n in engine_packages()}}


TAIL_STEPS = 20
"""A memory level's comparison with the standard one also compares the mean loss of the last 20 steps."""


def _counterpart(cells: list[dict[str, Any]], cell: dict[str, Any], **change: Any) -> dict[str, Any] | None:
    keys = ("strategy", "fp8", "variant", "more_variants", "size", "wiring", "compile", "activation_checkpointing",
            "memory", "seed")
    def value(c: dict[str, Any], key: str) -> Any:  # results written before more_variants existed hold none
        return c.get(key) or {} if key == "more_variants" else c.get(key)

    want = {**{k: value(cell, k) for k in keys}, **change}
    return next((c for c in cells if all(value(c, k) == want[k] for k in keys) and "error" not in c), None)


def _deltas(a: list[float], b: list[float]) -> dict[str, float]:
    return {"max_abs_delta_loss": max(abs(x - y) for x, y in zip(a, b)), "final_delta_loss": a[-1] - b[-1]}


def _compare(cells: list[dict[str, Any]]) -> None:
    """Each FP8 cell against its bf16 twin, each lean cell against its standard twin, each vs-raw cell's overhead."""
    for cell in cells:
        if "error" in cell:
            continue
        bf16 = _counterpart(cells, cell, fp8=None, variant=None, more_variants={}) if cell["fp8"] else None
        if bf16 is not None:
            cell["vs_bf16"] = {"bf16_cell": bf16["name"], **_deltas(cell["losses"], bf16["losses"]),
                               "bf16_losses": bf16["losses"]}
            if cell.get("eval_losses") and bf16.get("eval_losses"):
                cell["vs_bf16"]["held_out_delta"] = [[s, a - b] for (s, a), (_, b) in zip(cell["eval_losses"],
                                                                                          bf16["eval_losses"])]
        other = cell.get("memory", STANDARD.name) != STANDARD.name
        standard = _counterpart(cells, cell, memory=STANDARD.name) if other else None
        if standard is not None:
            cell["vs_standard"] = _vs_standard(cell, standard)
        if cell["wiring"] == "vs-raw":
            cell["overhead"] = _overhead(cell, cell["raw"])


def _vs_standard(cell: dict[str, Any], standard: dict[str, Any]) -> dict[str, Any]:
    """A (lean) cell's losses against its fp32-master twin's, with the means of the last TAIL_STEPS steps."""
    tail = min(TAIL_STEPS, len(cell["losses"]))
    mine, theirs = statistics.fmean(cell["losses"][-tail:]), statistics.fmean(standard["losses"][-tail:])
    return {"standard_cell": standard["name"], "standard_losses": standard["losses"],
            **_deltas(cell["losses"], standard["losses"]), "tail_steps": tail,
            "tail_mean_loss": {cell["memory"]: mine, standard["memory"]: theirs},
            "tail_relative_gap": (mine - theirs) / theirs}


def _overhead(cell: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """fp8dist against the hand-wired run beside it: the median per-step time ratio (each pair ran back to back, so
    machine load hits both alike), and the losses."""
    first, last = cell["timed_steps"]
    pairs = [a / b for a, b in zip(cell["step_times_s"][first:last + 1], raw["step_times_s"][first:last + 1])]
    return {"fp8dist_median_step_s": cell["median_step_s"], "raw_median_step_s": raw["median_step_s"],
            "step_time_ratio": statistics.median(pairs), "ratio_of_medians": cell["median_step_s"]
            / raw["median_step_s"], "step_time_ratios": pairs,
            "step_time_ratio_quartiles": statistics.quantiles(pairs, n=4) if len(pairs) > 1 else pairs * 3,
            "losses_identical": cell["losses"] == raw["losses"],
            "max_abs_delta_loss": _deltas(cell["losses"], raw["losses"])["max_abs_delta_loss"]}


def config_name(cell: dict[str, Any]) -> str:
    """A cell's name without its seed: the configuration it runs."""
    return cell["name"].rsplit("/seed", 1)[0] if cell.get("label_seed") else cell["name"]


def _spread(values: list[float]) -> dict[str, Any]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "values": values}


def late_spread(per_step: list[dict[str, Any]]) -> dict[str, Any]:
    """Each seed's mean over the second half of the evaluations (per-step spreads), spread over the seeds: less
    noisy than the last evaluation alone."""
    late = per_step[len(per_step) // 2:]
    return _spread([statistics.fmean(s["values"][k] for s in late) for k in range(len(late[0]["values"]))])


def convergence(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration, over its seeds: the held-out loss at each evaluated step (mean, sample std, each seed's)
    and its gap to the standard bf16 cell (paired by seed: same initialization and batches); [] without held-out
    losses."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for cell in cells:
        if "error" not in cell and cell["wiring"] == "fp8dist" and cell.get("eval_losses"):
            groups.setdefault(config_name(cell), []).append(cell)
    out = []
    for name, group in groups.items():
        steps = [s for s, _ in group[0]["eval_losses"]]
        base = [_counterpart(cells, c, fp8=None, variant=None, more_variants={}, memory=STANDARD.name) for c in group]
        paired = [(c, b) for c, b in zip(group, base) if b is not None and b is not c and b.get("eval_losses")]
        entry = {"config": name, "fp8": group[0]["fp8"], "variant": group[0].get("variant"),
                 "memory": group[0]["memory"], "size": group[0]["size"], "seeds": [c["seed"] for c in group],
                 "steps": steps, "held_out": [_spread([c["eval_losses"][i][1] for c in group])
                                              for i in range(len(steps))],
                 "bf16_config": config_name(paired[0][1]) if paired else None, "gap_vs_bf16": None}
        if paired:
            entry["gap_vs_bf16"] = [_spread([c["eval_losses"][i][1] - b["eval_losses"][i][1] for c, b in paired])
                                    for i in range(len(steps))]
        out.append(entry)
    return out


def results_document(results: list[dict[str, Any]], settings: Any, device_type: str, *, command: str,
                     load_average: list[Any], wall_s: float) -> dict[str, Any]:
    """The JSON written by ``fp8dist bench``: what ran where, when, with which versions, and every cell."""
    cells = [dict(r) for r in results]
    _compare(cells)
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"fp8dist_bench": SCHEMA, "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "device": device_record(device_type, settings.nproc), "versions": versions(), "command": command,
            "settings": {**asdict(settings), "timing": "median step time over the timed steps, each step as slow "
                                                        "as its slowest rank"},
            "comm_bytes": COMM_DEFINITION, "load_average": {"start": list(load_average[0]),
                                                            "end": list(load_average[1])},
            "wall_s": wall_s, "cells": cells, "convergence": convergence(cells)}


def results_stem(doc: dict[str, Any]) -> str:
    """``bench_<date>_<device>-x<processes>``, e.g. bench_2026-01-31_cpu-x2."""
    device = doc["device"]
    name = "cpu" if device["type"] == "cpu" else re.sub(r"[^a-z0-9]+", "-", device["name"].lower()).strip("-")
    return f"bench_{doc['date'][:10]}_{name}-x{device['nproc']}"


def write_results(doc: dict[str, Any], out: Path, *, plot: bool) -> list[Path]:
    """Write ``<stem>.json`` (and ``<stem>.png`` with ``plot``) into ``out``; returns the paths."""
    stem = out / results_stem(doc)
    paths = [stem.with_suffix(".json")]
    atomic_write(paths[0], lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=1) + "\n"))
    if plot:
        from .plot import plot_results

        paths.append(stem.with_suffix(".png"))
        atomic_write(paths[1], lambda tmp: plot_results(doc, tmp))
    return paths


def _comm(cell: dict[str, Any], kind: str) -> str:
    entry = cell["comm"].get(kind)
    return byte_size(entry["bytes"]) if entry else "-"


def _state(cell: dict[str, Any]) -> str:
    state = cell.get("model_state")
    return f"{state['bytes_per_param']['total']:.2f}" if state else "-"


def _memory(cell: dict[str, Any]) -> str:
    return f"{max(cell['peak_memory_mib']):,.0f}" if cell.get("peak_memory_mib") else "-"


def cell_line(cell: dict[str, Any]) -> str:
    """One line per finished cell, for the progress output."""
    if "error" in cell:
        return f"{cell['name']:<28} FAILED: {cell['error'].strip().splitlines()[-1][:200]}"
    comm = ", ".join(f"{k} {byte_size(v['bytes'])}" for k, v in cell["comm"].items()) or "none"
    line = (f"{cell['name']:<28} {cell['tokens_per_s']:>10,.0f} tok/s  step {1000 * cell['median_step_s']:7.1f} ms"
            f"  peak {_memory(cell)} MiB  state {_state(cell)} B/param  comm/step: {comm}")
    if cell.get("eval_losses"):
        step, loss = cell["eval_losses"][-1]
        line += f"  held-out loss {loss:.4f} (step {step})"
    if cell["wiring"] == "vs-raw":
        ratio = _overhead(cell, cell["raw"])["step_time_ratio"]
        line += f"  | raw step {1000 * cell['raw']['median_step_s']:.1f} ms, ratio {ratio:.3f}"
    return line


def markdown_table(doc: dict[str, Any]) -> str:
    """The figures as Markdown tables (README), headed by device, date and versions."""
    device, versions = doc["device"], doc["versions"]
    memory = "peak RSS" if device["type"] == "cpu" else "peak CUDA allocated"
    head = (f"{device['name']} ({device['type']}), {plural(device['nproc'], 'process')} per cell, {doc['date'][:10]}; "
            f"{versions_line(versions)}; {describe_job(doc['settings'])}")
    cols = ["cell", "tokens/s", "step (ms)", f"{memory} (MiB)", "model state (B/param)",
            *[f"{k.replace('_', '-')} /step" for k in COMM_TYPES], "max \\|Δloss\\| vs bf16"]
    rows = []
    for c in doc["cells"]:
        if "error" in c:
            rows.append([c["name"], "failed", *["-"] * (len(cols) - 2)])
        elif c["wiring"] == "fp8dist":
            delta = f"{c['vs_bf16']['max_abs_delta_loss']:.4f}" if "vs_bf16" in c else "-"
            rows.append([c["name"], f"{c['tokens_per_s']:,.0f}", f"{1000 * c['median_step_s']:.1f}", _memory(c),
                         _state(c), *[_comm(c, k) for k in COMM_TYPES], delta])
    lines = [head, "", _md(cols, rows)]
    other_levels = [c for c in doc["cells"] if "vs_standard" in c]
    if other_levels:
        lcols = ["cell (memory level)", "standard (fp32 master) cell", "max \\|Δloss\\|", "final Δloss",
                 "mean loss of the last steps: cell / standard (gap)", "model state (B/param): cell / standard"]
        lines += ["", _md(lcols, [_level_row(c, doc["cells"]) for c in other_levels])]
    if doc.get("convergence"):
        lines += ["", convergence_table(doc)]
    overhead = [c for c in doc["cells"] if "overhead" in c]
    if overhead:
        ocols = ["FSDP2 cell", "fp8dist step (ms)", "hand-wired step (ms)",
                 "fp8dist / raw: median of per-step ratios (quartiles)", "all-gather /step fp8dist / raw",
                 "losses identical"]
        lines += ["", _md(ocols, [_overhead_row(c) for c in overhead])]
    return "\n".join(lines)


def _pm(spread: dict[str, Any] | None, sign: str = "") -> str:
    if spread is None:
        return "-"
    sd = f" ± {spread['std']:.4f}" if spread["std"] is not None else ""
    return f"{spread['mean']:{sign}.4f}{sd}"


def convergence_table(doc: dict[str, Any]) -> str:
    """The held-out loss per configuration at its last evaluation (mean ± sample std over the seeds), and the gap to
    bf16 (paired by seed) there and over the second half of the evaluations."""
    rows = []
    for entry in doc["convergence"]:
        gaps = entry["gap_vs_bf16"]
        late = late_spread(gaps) if gaps else None
        rows.append([entry["config"], str(len(entry["seeds"])), _pm(entry["held_out"][-1]),
                     _pm(gaps[-1], "+") if gaps else "-", _pm(late, "+")])
    last = doc["convergence"][0]["steps"]
    cols = ["configuration", "seeds", f"held-out loss at step {last[-1]}", f"gap vs bf16 at step {last[-1]}",
            f"gap vs bf16, mean of steps {last[len(last) // 2]}-{last[-1]}"]
    return _md(cols, rows)


def _overhead_row(cell: dict[str, Any]) -> list[str]:
    o = cell["overhead"]
    q1, _, q3 = o["step_time_ratio_quartiles"]
    gathered = [_comm(c, "all_gather") for c in (cell, cell["raw"])]
    return [cell["name"].removesuffix("/vs-raw"), f"{1000 * o['fp8dist_median_step_s']:.1f}",
            f"{1000 * o['raw_median_step_s']:.1f}", f"{o['step_time_ratio']:.3f} ({q1:.2f}-{q3:.2f})",
            " / ".join(gathered), "yes" if o["losses_identical"] else "no"]


def _level_row(cell: dict[str, Any], cells: list[dict[str, Any]]) -> list[str]:
    v = cell["vs_standard"]
    standard = next(c for c in cells if c["name"] == v["standard_cell"])
    means = v["tail_mean_loss"]
    return [cell["name"], v["standard_cell"], f"{v['max_abs_delta_loss']:.4f}", f"{v['final_delta_loss']:+.4f}",
            f"{means[cell['memory']]:.4f} / {means[standard['memory']]:.4f} over {v['tail_steps']} "
            f"({100 * v['tail_relative_gap']:+.2f}%)", f"{_state(cell)} / {_state(standard)}"]


def _md(cols: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                     + ["| " + " | ".join(r) + " |" for r in rows])
