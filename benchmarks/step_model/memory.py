"""Peak memory per recipe: torchtitan #3914's measured peaks (Llama3-8B on 4 GB200s, FSDP, local batch 32 x 2,048)
beside ``fp8dist.estimate_memory`` of that run, as torchtitan ran it: its selective checkpointing (which counts only
``aten.mm`` / ``aten.linear`` among the GEMMs: ``selective_gemms``), its chunked loss (8 chunks: ``loss_chunks``),
compiled; and beside the estimate of fp8dist's own run (its selective policy, Hugging Face's loss). Then what a
compiled block keeps for backward per recipe, read from torch's partitioner (block_saves.py). Writes memory.json and
the tables in README.md between its markers; a row off by more than GOAL_PCT is a miss, its reason in README.md.

    PYTHONPATH=. python benchmarks/step_model/memory.py     # ~15 s (the imports, the meta model, 4 compiles)"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from block_saves import BLOCK, KINDS, all_block_saves  # noqa: E402

HERE = Path(__file__).parent
OUT = HERE / "memory.json"
README = HERE / "README.md"
BEGIN, END = "<!-- memory table: memory.py writes it -->", "<!-- end of the memory table -->"
GOAL_PCT = 15.0
SOURCE = "https://github.com/pytorch/torchtitan/pull/3914"

MEASURED_GIB = {"bf16": 174.49, "mxfp8": 179.94, "nvfp4": 103.00, "nvfp4_bf16_tail": 110.95}
"""#3914's peak memory per GPU (torchtitan's max reserved): its Table 1, and nvfp4.md's NVFP4 run with the last 5
decoder layers and the head in bf16 (``llama3_8b_first_85_pct_layers_nvfp4``)."""

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)
RUN = dict(strategy="fsdp", world_size=4, micro_batch_size=32, seq_len=2048, activation_checkpointing="selective",
           compile=True)
TORCHTITAN = dict(loss_chunks=8, selective_gemms=("aten.mm.default", "aten.linear.default"))
"""torchtitan's llama3_8b: ``ChunkedLossWrapper`` (8 chunks) and ``SelectiveAC`` (every other aten.mm / aten.linear
output kept; ``_scaled_mm_v2`` is on neither of its lists)."""
_DECODER = dict(keep_first_last_linear=False, fp8_exclude=["lm_head"], fp8_select="all")
RECIPES: dict[str, dict[str, Any]] = {
    "bf16": dict(fp8=None),
    "mxfp8": dict(fp8="torchao", torchao_recipe="mxfp8", keep_last_blocks_share=0.0, **_DECODER),
    "nvfp4": dict(fp8="torchao", torchao_recipe="nvfp4", keep_last_blocks_share=0.0, **_DECODER),
    "nvfp4_bf16_tail": dict(fp8="torchao", torchao_recipe="nvfp4", keep_last_blocks_share=0.15, **_DECODER),
}
"""Every decoder Linear converted, the head in bf16 (#3914's MXFP8 also converts the head: the same bytes, its
MXFP8 Linear saves the bf16 input as the bf16 head does); the tail run keeps the last 15% of the blocks in bf16."""


def meta_llama3_8b() -> Any:
    """Llama3-8B (Hugging Face's) on the meta device."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**LLAMA3_8B))


def predict(model: Any) -> dict[str, dict[str, float]]:
    """Per recipe: the estimate of torchtitan's run and of fp8dist's own, GiB per GPU (model states + activations)."""
    from fp8dist import estimate_memory
    from fp8dist.accounting.fit import device_bytes

    warnings.simplefilter("ignore")  # the meta model's and the options' warnings: the table says what was estimated
    out = {}
    for name, recipe in RECIPES.items():
        runs = {"torchtitan": estimate_memory(model, **RUN, **TORCHTITAN, **recipe),
                "fp8dist": estimate_memory(model, **RUN, **recipe)}
        out[name] = {run: round(device_bytes(est) / 2**30, 1) for run, est in runs.items()}
    return out


def table(predicted: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Rows: recipe, measured and predicted GiB, the error in percent, whether it is within GOAL_PCT."""
    rows = []
    for name, measured in MEASURED_GIB.items():
        guess = predicted[name]["torchtitan"]
        error = round(100 * (guess / measured - 1), 1)
        rows.append(dict(recipe=name, measured_gib=measured, predicted_gib=guess, error_pct=error,
                         within_goal=abs(error) <= GOAL_PCT, fp8dist_run_gib=predicted[name]["fp8dist"]))
    return rows


def render(rows: list[dict[str, Any]], saves: dict[str, dict[str, dict[str, int]]]) -> str:
    """The README section: the peaks, then what a compiled block keeps (bytes, one block of BLOCK's tokens)."""
    lines = [BEGIN, "", "| recipe | measured GiB | predicted GiB (torchtitan's run) | error | within 15% | "
             "fp8dist's own run GiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['recipe']} | {r['measured_gib']:.1f} | {r['predicted_gib']:.1f} | {r['error_pct']:+.1f}% "
                     f"| {'yes' if r['within_goal'] else 'no (miss)'} | {r['fp8dist_run_gib']:.1f} |")
    lines += ["", f"What a compiled block keeps for backward (block_saves.py: bytes, {BLOCK['batch'] * BLOCK['seq']} "
              f"tokens, h={BLOCK['h']}, intermediate {BLOCK['inter']}; weights left out):", "",
              "| recipe | checkpointing | " + " | ".join(KINDS) + " |", "|---|---|" + "---|" * len(KINDS)]
    for recipe, by_checkpointing in saves.items():
        for checkpointing, kept in by_checkpointing.items():
            policy = "torchtitan's selective" if checkpointing == "selective" else checkpointing
            lines.append(f"| {recipe} | {policy} | " + " | ".join(f"{kept[k]:,}" for k in KINDS) + " |")
    return "\n".join(lines + ["", END])


def main() -> None:
    rows, saves = table(predict(meta_llama3_8b())), all_block_saves()
    OUT.write_text(json.dumps({"source": SOURCE, "run": {**RUN, **TORCHTITAN}, "goal_pct": GOAL_PCT, "rows": rows,
                               "prediction": "fp8dist.estimate_memory, not fitted on these peaks",
                               "compiled_block": {"block": BLOCK, "saved_bytes": saves}}, indent=1) + "\n")
    text = README.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    README.write_text(text[:start] + render(rows, saves) + text[end:])
    print(render(rows, saves))


if __name__ == "__main__":
    main()
