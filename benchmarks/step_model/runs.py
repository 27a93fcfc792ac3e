"""The published end-to-end runs (``runs.csv``, each with its source) and the step model's prediction of each: read
by ``fit.py`` (which fits the two constants on the rows marked ``fit``) and by ``tests/test_step_model.py``."""

from __future__ import annotations

import csv
import dataclasses
import functools
from pathlib import Path
from typing import Any

from fp8dist.plan.speed.step_time import STEP_CONSTANTS, StepConstants, predict_step

RUNS = Path(__file__).with_name("runs.csv")

# Published dimensions (Meta's config.json of Llama-3-8B; Llama-3.1-8B differs only in RoPE scaling and context,
# which change no shape): built as a transformers LlamaConfig, nothing downloaded.
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)
MODELS = {"llama3_8b": LLAMA3_8B, "llama3.1_8b": {**LLAMA3_8B, "max_position_embeddings": 131072}}


def read_runs() -> list[dict[str, Any]]:
    rows = list(csv.DictReader(RUNS.open()))
    for row in rows:
        row.update(world_size=int(row["world_size"]), micro_batch_size=int(row["micro_batch_size"]),
                   seq_len=int(row["seq_len"]), compile=row["compile"] == "true",
                   tokens_per_s=float(row["tokens_per_s"]), recipe=row["recipe"] or None)
    return rows


def config_of(name: str) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**MODELS[name])


@functools.cache
def _meta_model(name: str) -> Any:
    """The model on the meta device, built once per name (predict_step takes it as it takes the config)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config_of(name))


def predict(row: dict[str, Any], constants: StepConstants = STEP_CONSTANTS) -> Any:
    """The step model's prediction for a published row (its recipe, or tensorwise for a bf16 row: the bf16 side
    does not depend on the recipe)."""
    return predict_step(_meta_model(row["model"]), target=row["gpu"], world_size=row["world_size"],
                        micro_batch_size=row["micro_batch_size"], seq_len=row["seq_len"],
                        recipe=row["recipe"] or "tensorwise", compile=row["compile"],
                        activation_checkpointing=row["activation_checkpointing"], constants=constants)


def compare(rows: list[dict[str, Any]], constants: StepConstants = STEP_CONSTANTS) -> list[dict[str, Any]]:
    """Per row: published and predicted tokens/s (bf16 or FP8 as the row is), and for an FP8 row the published
    and predicted speedup over its table's compiled bf16 row, in percent."""
    base = {(r["table"], r["compile"]): r["tokens_per_s"] for r in rows if r["recipe"] is None}
    out = []
    for row in rows:
        step = predict(row, constants)
        predicted = step.bf16_tokens_per_s if row["recipe"] is None else step.tokens_per_s
        entry = dict(table=row["table"], gpu=row["gpu"], recipe=row["recipe"] or "bf16", compile=row["compile"],
                     world_size=row["world_size"], role=row["role"], published=row["tokens_per_s"],
                     predicted=round(predicted, 1), error_pct=round(100 * (predicted / row["tokens_per_s"] - 1), 1),
                     calibrated=step.calibrated, source=row["source"])
        if row["recipe"] is not None:
            entry["published_speedup_pct"] = round(100 * (row["tokens_per_s"] / base[row["table"], True] - 1), 1)
            entry["predicted_speedup_pct"] = round(100 * (step.speedup - 1), 1)
            entry["speedup_miss_pp"] = round(entry["predicted_speedup_pct"] - entry["published_speedup_pct"], 1)
        out.append(entry)
    return out


def with_constants(**values: float) -> StepConstants:
    return dataclasses.replace(STEP_CONSTANTS, **values)
