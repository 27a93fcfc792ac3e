"""TE's GEMM-level rows (runs.csv's te_gemm_b300 / te_gemm_h200) taken apart: the per-GEMM model's GEMM and cast
seconds for TE's benchmark of one 5B layer (runs.te_benchmark_gemms: 12 GEMMs, each a quantized Linear's forward)
beside what TE's GEMM profiling tutorial printed per layer, autocast (GEMM and quantization) and pre-quantized (the
GEMM kernels alone), so the miss splits into GEMM rate and casts. Writes the table in README.md between its markers.

    PYTHONPATH=. python benchmarks/step_model/te_gemm.py     # ~5 s

The casts are priced at their ideal traffic (the TE block-cast slowdown at 1, as the fold holding TE out fits it)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from runs import te_benchmark_gemms  # noqa: E402

from fp8dist.plan.speed.model import forward_seconds  # noqa: E402
from fp8dist.plan.speed.recipes import recipe_named  # noqa: E402
from fp8dist.runtime.gpus import gpu_by_key  # noqa: E402

README = Path(__file__).with_name("README.md")
BEGIN, END = "<!-- TE layer table: te_gemm.py writes it -->", "<!-- end of the TE layer table -->"
TOKENS = 31 * 512
"""TE's tutorial's micro-batch 31 x sequence 512 (M = 15,872)."""
SOURCE = ("https://github.com/NVIDIA/TransformerEngine/blob/1609c890ee7da24393ce62a2680e0ebb0b4eb5f6/docs/examples/"
          "gemm_profiling/gemm_profiling.rst")
"""TE's GEMM profiling tutorial (PR #2863), whose "Per-Layer GEMM Time" blocks the figures below are read from."""
LAYER_MS = {
    "b300": {"bf16": (12.758, 13.102), "te_current": (9.147, 6.812), "te_delayed": (7.802, None),
             "te_mxfp8": (8.984, 7.161), "te_nvfp4": (6.453, 3.764)},
    "h200": {"bf16": (32.014, 31.968), "te_current": (20.285, 16.785), "te_delayed": (18.978, None),
             "te_blockwise": (22.882, None)},
}
"""Per-layer ms (Fprop + Dgrad + Wgrad, one 5B layer), (autocast, pre-quantized), as the tutorial prints them: B300
SXM6 AC, H200 NVL. None: not timed pre-quantized (DelayedScaling needs its amax history; Hopper's cuBLAS takes no
pre-quantized 2D-by-2D block-scaled operands); their GEMM is taken as current scaling's per-tensor FP8 kernel."""


def rows() -> list[dict[str, float | str]]:
    """Per GPU and recipe: the model's bf16, FP8 GEMM and cast ms per layer, TE's, and the autocast speedups (the
    model's; its casts on TE's own GEMM times; TE's)."""
    out = []
    for key, measured in LAYER_MS.items():
        spec = gpu_by_key(key)
        gpu = dataclasses.replace(spec, calibration=dataclasses.replace(spec.calibration,
                                                                        block_cast_slowdown=(1.0, 1.0)))
        bf16_auto, bf16_pre = measured["bf16"]
        for recipe, (auto, pre) in measured.items():
            if recipe == "bf16":
                continue
            parts = [forward_seconds(*gemm, gpu, recipe_named(recipe), False) for gemm in te_benchmark_gemms(TOKENS)]
            bf16, gemm, casts = (1e3 * sum(p[i] for p in parts) for i in range(3))
            te_gemm = pre if pre is not None else measured["te_current"][1]
            out.append(dict(gpu=key, recipe=recipe, model_gemm_ratio=bf16 / gemm, te_gemm_ratio=bf16_pre / te_gemm,
                            model_casts_ms=casts, te_casts_ms=auto - te_gemm, model=bf16 / (gemm + casts),
                            model_casts_on_te_gemms=bf16_auto / (te_gemm + casts), te=bf16_auto / auto,
                            gemm_timed=pre is not None))
    return out


def render() -> str:
    """The README's section: one line per GPU and recipe."""
    lines = [BEGIN, "", "| GPU | recipe | GEMMs over bf16: model / TE pre-quantized | casts ms per layer: model / TE "
             "(autocast - pre-quantized) | autocast speedup: model / model's casts on TE's GEMMs / TE |",
             "|---|---|---|---|---|"]
    for r in rows():
        timed = "" if r["gemm_timed"] else " (current scaling's GEMMs)"
        lines.append(f"| {r['gpu']} | {r['recipe']} | {r['model_gemm_ratio']:.2f}x / {r['te_gemm_ratio']:.2f}x{timed} "
                     f"| {r['model_casts_ms']:.2f} / {r['te_casts_ms']:.2f} | {r['model']:.3f} / "
                     f"{r['model_casts_on_te_gemms']:.3f} / {r['te']:.3f} |")
    return "\n".join(lines + ["", END])


def main() -> None:
    text, section = README.read_text(), render()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    README.write_text(text[:start] + section + text[end:])
    print(section)


if __name__ == "__main__":
    main()
