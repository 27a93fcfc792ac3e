"""The PNG of ``fp8dist bench``: throughput, memory and communication bars per cell, loss panels per model size, and
the fp8dist / hand-wired step-time ratio. Needs matplotlib (``fp8dist[bench]``); :func:`loss_panels` does not."""

from __future__ import annotations

from typing import Any

from ..config.text import plural
from ..fp8 import BACKENDS, NO_FP8
from ..memory_levels import STANDARD
from ..strategies import STRATEGIES
from .cell import describe_job, non_default_variants, variant_label, variants_of, versions_line
from .comm import SHOWN_TYPES as COMM_TYPES

__all__ = ["plot_results", "loss_panels"]

_PALETTE = {"blue": "#4c72b0", "orange": "#dd8452", "green": "#55a868", "red": "#c44e52", "purple": "#8172b3",
            "brown": "#937860"}
_PAIR_COLORS = tuple(_PALETTE.values())
_COMM_COLORS = {**dict(zip(COMM_TYPES, _PAIR_COLORS)), "other": _PALETTE["brown"]}
_UNKNOWN = "#999999"  # a strategy or backend this process has not registered (a document written elsewhere)


def _color(name: Any, names: list[Any]) -> str:
    return _PAIR_COLORS[names.index(name) % len(_PAIR_COLORS)] if name in names else _UNKNOWN


def _fp8_color(fp8: str | None) -> str:
    return _color(fp8 or NO_FP8.name, [NO_FP8.name, *BACKENDS])


def _titled(ax, title: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.invert_yaxis()
    ax.tick_params(labelsize=8)


def _bars(ax, cells: list[dict[str, Any]], values: list[float], title: str, fmt: str) -> None:
    ax.barh(range(len(cells)), values, color=[_fp8_color(c["fp8"]) for c in cells])
    for i, v in enumerate(values):
        ax.text(v, i, " " + format(v, fmt), va="center", fontsize=7)
    ax.set_xlim(0, max(values, default=1) * 1.25 or 1)
    _titled(ax, title)


def _comm_bars(ax, cells: list[dict[str, Any]]) -> None:
    left = [0.0] * len(cells)
    for kind in (*COMM_TYPES, "other"):
        widths = [sum(v["bytes"] for k, v in c["comm"].items() if (k if k in COMM_TYPES else "other") == kind) / 2**20
                  for c in cells]
        if any(widths):
            ax.barh(range(len(cells)), widths, left=left, color=_COMM_COLORS[kind], label=kind.replace("_", "-"))
            left = [a + b for a, b in zip(left, widths)]
    for i, total in enumerate(left):
        ax.text(total, i, f" {total:.2f}", va="center", fontsize=7)
    ax.set_xlim(0, max(left, default=1) * 1.25 or 1)
    ax.legend(fontsize=7, loc="lower right")
    _titled(ax, "bytes communicated per step and rank (MiB)")


def _line_color(cell: dict[str, Any]) -> str:
    """Its strategy's color, or that of its last non-default variant value (torchao's rowwise: a color of its own)."""
    fp8, more = cell["fp8"], cell.get("more_variants") or {}
    values = non_default_variants(fp8, cell.get("variant"), more)
    names = [c for option in (None, *more) for c in variants_of(fp8, option)]
    return _color(values[-1], names) if values else _color(cell["strategy"], list(STRATEGIES))


def _label(cell: dict[str, Any]) -> str:
    """``fsdp torchao``, ``fsdp torchao-rowwise``, ``fsdp torchao-weight_wrapper``, ``fsdp bf16``."""
    suffix = variant_label(cell["fp8"], cell.get("variant"), cell.get("more_variants") or {})
    return f"{cell['strategy']} {cell['fp8'] or 'bf16'}{suffix}"


def _curve(cell: str, losses: list[float], label: str, dashed: bool, color: str | None,
           steps: list[int] | None = None) -> dict[str, Any]:
    return {"cell": cell, "label": label, "losses": losses, "dashed": dashed, "color": color,
            **({"steps": steps} if steps is not None else {})}


def _fp8_panel(cells: list[dict[str, Any]], size: str) -> dict[str, Any]:
    """One size's curves, FP8 (dashed) against bf16 (solid), and their difference; standard-memory cells where any."""
    mine = [c for c in cells if c["size"] == size]
    mine = [c for c in mine if c.get("memory", STANDARD.name) == STANDARD.name] or mine
    curves, deltas = [], []
    for c in mine:
        color, level = _line_color(c), c.get("memory", STANDARD.name)
        label = f"{_label(c)}{f' {level}' if level != STANDARD.name else ''}"
        if "vs_bf16" in c:
            label += f" (max |Δ| {c['vs_bf16']['max_abs_delta_loss']:.4f})"
            delta = [a - b for a, b in zip(c["losses"], c["vs_bf16"]["bf16_losses"])]
            deltas.append(_curve(c["name"], delta, label, True, color))
        curves.append(_curve(c["name"], c["losses"], label, c["fp8"] is not None, color))
    return {"title": f"loss, llama-{size}: FP8 (dashed) vs bf16 (solid), same seed and batches", "curves": curves,
            "deltas": deltas, "delta_title": "FP8 - bf16"}


def _lean_panel(cells: list[dict[str, Any]], size: str) -> dict[str, Any]:
    """One size's lean cells (dashed), each beside its fp32-master twin (solid, same color), and their difference."""
    curves, deltas = [], []
    mine = [c for c in cells if c["size"] == size and "vs_standard" in c]
    for i, c in enumerate(mine):
        v = c["vs_standard"]
        color = _PAIR_COLORS[i % len(_PAIR_COLORS)]
        base = STANDARD.name
        means = v["tail_mean_loss"]
        name = _label(c)
        last = f"last {v['tail_steps']}"
        curves.append(_curve(c["name"], v["standard_losses"], f"{name} {base} ({last}: {means[base]:.4f})", False,
                             color))
        curves.append(_curve(c["name"], c["losses"], f"{name} {c['memory']} ({last}: {means[c['memory']]:.4f}, "
                                                     f"{100 * v['tail_relative_gap']:+.2f}%)", True, color))
        delta = [a - b for a, b in zip(c["losses"], v["standard_losses"])]
        deltas.append(_curve(c["name"], delta, name, True, color))
    levels = "/".join(dict.fromkeys(c["memory"] for c in mine))
    return {"title": f"loss, llama-{size}: memory {levels} (dashed) vs standard fp32 master (solid)",
            "curves": curves, "deltas": deltas, "delta_title": f"{levels} - {STANDARD.name}"}


def _held_out_panel(doc: dict[str, Any], size: str) -> dict[str, Any]:
    """One size's held-out loss per configuration over the seeds (FP8 dashed), its gap to bf16 in the inset."""
    curves, deltas = [], []
    for i, entry in enumerate(e for e in doc["convergence"] if e["size"] == size):
        color, mean = _PAIR_COLORS[i % len(_PAIR_COLORS)], [h["mean"] for h in entry["held_out"]]
        last, gap = entry["held_out"][-1], (entry["gap_vs_bf16"] or [None])[-1]
        label = f"{entry['config']}: {last['mean']:.4f}" + (f" ± {last['std']:.4f}" if last["std"] is not None else "")
        if gap is not None:
            label += f", vs bf16 {gap['mean']:+.4f}" + (f" ± {gap['std']:.4f}" if gap["std"] is not None else "")
            deltas.append(_curve(entry["config"], [g["mean"] for g in entry["gap_vs_bf16"]], entry["config"], True,
                                 color, entry["steps"]))
        curves.append(_curve(entry["config"], mean, label, entry["fp8"] is not None, color, entry["steps"]))
    seeds = len(doc["convergence"][0]["seeds"]) if doc["convergence"] else 0
    return {"title": f"held-out loss, llama-{size}: mean over {plural(seeds, 'seed')} (± sample std at the last step)",
            "curves": curves, "deltas": deltas, "delta_title": "minus bf16 (paired by seed)"}


def loss_panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """What each loss panel draws: per size FP8 vs bf16, then lean vs standard (the first seed's cells), then the
    held-out loss. A panel is ``{"title", "curves", "deltas", "delta_title"}``, a curve ``{"cell", "label", "losses",
    "dashed", "color"}`` and ``"steps"`` where its points are not every step (deltas: drawn in the inset)."""
    plain = [c for c in doc["cells"] if "error" not in c and c["wiring"] == "fp8dist"]
    plain = [c for c in plain if c["seed"] == plain[0]["seed"]] if plain else plain
    sizes = list(dict.fromkeys(c["size"] for c in plain))
    lean_sizes = [s for s in sizes if any("vs_standard" in c and c["size"] == s for c in plain)]
    held = list(dict.fromkeys(e["size"] for e in doc.get("convergence") or []))
    return ([_fp8_panel(plain, s) for s in sizes] + [_lean_panel(plain, s) for s in lean_sizes]
            + [_held_out_panel(doc, s) for s in held])


def _loss_panel(ax, panel: dict[str, Any]) -> None:
    delta = ax.inset_axes([0.45, 0.3, 0.52, 0.3])  # under the legend, above where long runs end
    for d in panel["deltas"]:
        delta.plot(d.get("steps") or range(1, len(d["losses"]) + 1), d["losses"], "--", color=d["color"],
                   linewidth=1)
    for c in panel["curves"]:
        ax.plot(c.get("steps") or range(1, len(c["losses"]) + 1), c["losses"], "--" if c["dashed"] else "-",
                color=c["color"], label=c["label"], linewidth=1.2, marker="." if c.get("steps") else None)
    delta.axhline(0.0, color="black", linewidth=0.6)
    delta.set_title(panel["delta_title"], fontsize=7)
    delta.tick_params(labelsize=6)
    ax.set_title(panel["title"], fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.legend(fontsize=7, loc="upper right")
    ax.tick_params(labelsize=8)


def _overhead_panel(ax, cells: list[dict[str, Any]]) -> None:
    pairs = [c for c in cells if "overhead" in c]
    names = [c["name"].removesuffix("/vs-raw") for c in pairs]
    ratios = [c["overhead"]["step_time_ratio"] for c in pairs]
    ax.barh(range(len(pairs)), ratios, color=[_fp8_color(c["fp8"]) for c in pairs])
    for i, (r, c) in enumerate(zip(ratios, pairs)):
        same = "losses identical" if c["overhead"]["losses_identical"] else "losses differ"
        ax.text(r, i, f" {r:.3f} ({same})", va="center", fontsize=7)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(pairs)), names, fontsize=8)
    ax.set_xlim(min([0.8, *ratios]) * 0.95, max([1.2, *ratios]) * 1.15)  # a ratio under 0.8 still shows a bar
    _titled(ax, "step time fp8dist / hand-wired FSDP2 (same processes, alternating)")


def plot_results(doc: dict[str, Any], path: str) -> None:
    """Draw ``doc`` (:func:`fp8dist.bench.results.results_document`) into a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in doc["cells"] if "error" not in c]
    plain = [c for c in cells if c["wiring"] == "fp8dist"]
    panels = loss_panels(doc)
    bottom = len(panels) + (1 if any("overhead" in c for c in cells) else 0)
    ncols = max(3, bottom)
    fig = plt.figure(figsize=(6 * ncols, 4 + 0.28 * len(plain) + 4.5), constrained_layout=True)
    grid = fig.add_gridspec(2, ncols, height_ratios=[1 + 0.07 * len(plain), 1])
    names = [c["name"] for c in plain]
    top = [fig.add_subplot(grid[0, i]) for i in range(3)]
    _bars(top[0], plain, [c["tokens_per_s"] for c in plain], "throughput (tokens/s, global)", ",.0f")
    memory = "peak RSS per rank (MiB)" if doc["device"]["type"] == "cpu" else "peak CUDA memory per rank (MiB)"
    _bars(top[1], plain, [max(c["peak_memory_mib"]) for c in plain], memory, ",.0f")
    _comm_bars(top[2], plain)
    for ax in top:
        ax.set_yticks(range(len(plain)), names if ax is top[0] else [""] * len(plain), fontsize=8)
    for i, panel in enumerate(panels):
        _loss_panel(fig.add_subplot(grid[1, i]), panel)
    if bottom > len(panels):
        _overhead_panel(fig.add_subplot(grid[1, len(panels)]), cells)
    device, colors = doc["device"], {v: k for k, v in _PALETTE.items()}
    key = ", ".join(f"{colors.get(_fp8_color(f), 'grey')} {f or 'bf16'}"
                    for f in dict.fromkeys(c["fp8"] for c in plain))
    fig.suptitle(f"fp8dist bench: {device['name']} x {device['nproc']} ({device['backend']}), {doc['date'][:10]}; "
                 f"{versions_line(doc['versions'])}; bars colored by FP8 backend ({key})\n"
                 f"{describe_job(doc['settings'])}", fontsize=11)
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
