"""Calibrate the numerics probe's thresholds (fp8dist/numerics/thresholds.py) on healthy models.

Every FP8-eligible GEMM (first and last Linear included) of Llama, GPT-2, Mixtral and Qwen3 (small configs over the
byte vocabulary, no download) is measured by ``fp8dist.measure_fp8_numerics`` under torchao tensorwise and rowwise
and Transformer Engine's delayed, current and MXFP8 recipes (emulated), at initialization and after training in
fp32 on the built-in corpus (AdamW, fp8dist train's learning rate and cosine schedule). A planted outlier channel
(1e5 in one input channel of one Linear) shows what an unhealthy layer looks like. Writes calibration.json (every
layer's numbers) and results.md (the worst healthy value per family, stage and recipe) beside this file.

    OMP_NUM_THREADS=1 python benchmarks/numerics/calibrate.py            # ~10 min on one CPU core
    python benchmarks/numerics/calibrate.py --steps 20 --families llama  # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import fp8dist
from fp8dist.train.data import Batches
from fp8dist.runtime.packages import package_version
from fp8dist.train.models import llama_config
from fp8dist.train.schedule import lr_schedule, set_lr

HERE = Path(__file__).parent

RECIPES = {  # name: (backend, options, target: the GPU whose plan is measured)
    "torchao tensorwise": ("torchao", {"torchao_recipe": "tensorwise"}, "h100"),
    "torchao rowwise": ("torchao", {"torchao_recipe": "rowwise"}, "h100"),
    "te delayed": ("te", {"te_recipe": "delayed"}, "h100"),
    "te current": ("te", {"te_recipe": "current"}, "h100"),
    "te mxfp8": ("te", {"te_recipe": "mxfp8"}, "b200"),
}
"""torchao's MoE experts run fp8_rowwise on an H100 and MXFP8 on a B200 (torchao_moe_recipe auto)."""


def build(family: str, seed: int):
    """A small model of ``family`` over the byte vocabulary, from its own initialization under ``seed``."""
    import transformers as tf

    configs = {
        "llama": lambda: llama_config("small"),
        "gpt2": lambda: tf.GPT2Config(vocab_size=256, n_embd=256, n_layer=4, n_head=8, n_positions=128),
        "mixtral": lambda: tf.MixtralConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                            num_attention_heads=8, num_key_value_heads=4, num_local_experts=4,
                                            num_experts_per_tok=2, tie_word_embeddings=False),
        "qwen3": lambda: tf.Qwen3Config(vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                        tie_word_embeddings=False),
    }
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(configs[family](), dtype=torch.float32)


def train(model, steps: int, lr: float, seed: int) -> list[float]:
    """fp32 AdamW on the built-in corpus with fp8dist train's schedule; the losses."""
    batches = Batches(batch_size=8, seq_len=128, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    factor = lr_schedule("cosine", steps)
    losses = []
    for step in range(steps):
        set_lr(optimizer, lr * factor(step))
        ids = batches[step]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _compact(report: dict) -> dict:
    """What calibration.json keeps of a report: per layer, per operand the worst of its casts (rounded)."""
    def number(v):
        return float(f"{v:.6g}") if isinstance(v, float) else v

    layers = []
    for layer in report["layers"]:
        row = {k: number(layer[k]) if k.endswith("_db") else layer[k]
               for k in ("name", "gemm", "output_sqnr_db", "grad_input_sqnr_db", "grad_weight_sqnr_db")}
        for c in layer["casts"]:
            old = row.get(c["role"], {})
            shares = {k: max(old.get(k, 0.0), number(c[k])) for k in ("flushed_share", "saturated_share")}
            rest = min(old.get("rest_sqnr_db") or math.inf, c["rest_sqnr_db"] or math.inf)
            if not old or (c["sqnr_db"] or math.inf) < (old["sqnr_db"] or math.inf):
                old = {"cast": c["cast"], "sqnr_db": number(c["sqnr_db"]), "amax": number(c["amax"])}
            row[c["role"]] = {**old, **shares, "rest_sqnr_db": number(rest) if math.isfinite(rest) else None}
        layers.append(row)
    return {**{k: v for k, v in report.items() if k != "layers"}, "layers": layers}


def probe_all(model, batches, recipes=tuple(RECIPES)) -> dict:
    out = {}
    for name in recipes:
        backend, options, target = RECIPES[name]
        report = fp8dist.measure_fp8_numerics(model, batches, fp8=backend, target=target,
                                              keep_first_last_linear=False, **options)
        out[name] = _compact(report.to_dict())
    return out


def plant_outlier(model, value: float = 1e5):
    """1e5 in input channel 5 of the first MLP's down projection (an SwiGLU outlier, amplified)."""
    layer = next(m for n, m in model.named_modules() if n.endswith("mlp.down_proj"))
    name = next(n for n, m in model.named_modules() if m is layer)

    def hook(module, args):
        x = args[0].clone()
        x[..., 5] = value
        return (x,)

    return name, layer.register_forward_pre_hook(hook)


def _worst(layers: list[dict], skip: set[str] = frozenset()) -> dict:
    """The worst value of each statistic over ``layers`` (compact rows, by role), leaving out the names in
    ``skip``."""
    w = {"output_sqnr_db": math.inf}
    for layer in layers:
        if layer["name"] in skip or layer["output_sqnr_db"] is None:
            continue
        for gemm in ("output", "grad_input", "grad_weight"):
            w[f"{gemm}_sqnr_db"] = min(w.get(f"{gemm}_sqnr_db", math.inf), layer.get(f"{gemm}_sqnr_db") or math.inf)
        for role in ("input", "weight", "grad_output"):
            c = layer.get(role)
            if c is None:
                continue
            w[f"{role}_sqnr_db"] = min(w.get(f"{role}_sqnr_db", math.inf), c["sqnr_db"] or math.inf)
            w["rest_sqnr_db"] = min(w.get("rest_sqnr_db", math.inf), c.get("rest_sqnr_db") or math.inf)
            w[f"{role}_flushed"] = max(w.get(f"{role}_flushed", 0.0), c["flushed_share"])
            w["saturated"] = max(w.get("saturated", 0.0), c["saturated_share"])
    return w


def markdown(results: dict, meta: dict) -> str:
    cols = ["output_sqnr_db", "grad_input_sqnr_db", "grad_weight_sqnr_db", "input_sqnr_db", "weight_sqnr_db",
            "grad_output_sqnr_db", "rest_sqnr_db", "input_flushed", "weight_flushed", "grad_output_flushed", "saturated"]
    heads = ["out SQNR", "dgrad SQNR", "wgrad SQNR", "in SQNR", "w SQNR", "grad SQNR", "rest SQNR", "in flush",
             "w flush", "grad flush", "sat"]
    lines = ["# Numerics probe calibration", "", f"Date (UTC): {meta['date']}. Command: `{meta['command']}`.",
             f"Versions: torch {meta['torch']}, torchao {meta['torchao']}, transformers {meta['transformers']}, "
             f"Python {meta['python']}; {meta['machine']}. Took {meta['wall_s']:.0f} s.", "",
             "Worst value over every FP8-eligible GEMM of each model (first and last Linear included; SQNR: lowest, "
             "shares: highest). Probe batches: 4 x 8 x 128 tokens of the corpus under seed 1 (training used seed "
             f"0). Trained: {meta['steps']} steps, AdamW lr {meta['lr']} cosine, fp32.", ""]
    lines += ["| model | stage | recipe | " + " | ".join(heads) + " |", "|" + "---|" * (len(heads) + 3)]
    for (family, stage), by_recipe in results.items():
        for recipe, report in by_recipe["reports"].items():
            w = _worst(report["layers"])
            cells = [f"{w.get(c, math.nan):.1f}" if "sqnr" in c else f"{100 * w.get(c, 0.0):.2f}%" for c in cols]
            lines.append(f"| {family} | {stage} | {recipe} | " + " | ".join(cells) + " |")
    lines += ["", *_summary(results), "", "Losses (trained stage): " + "; ".join(
        f"{family} {v['losses'][0]:.2f} -> {v['losses'][-1]:.2f}" for (family, stage), v in results.items()
        if stage == "trained")]
    return "\n".join(lines) + "\n"


def _summary(results: dict) -> list[str]:
    """The worst healthy value of each statistic over every model, stage and recipe, where it was, and the
    thresholds in use beside it."""
    from fp8dist.numerics import DEFAULT_THRESHOLDS as t

    healthy = [(f"{family} {stage} {recipe}", report) for (family, stage), v in results.items()
               if "planted" not in family for recipe, report in v["reports"].items()]
    first_last = {n for _, r in healthy for n in (r["layers"][0]["name"], r["layers"][-1]["name"])}

    def worst(key: str, skip: set[str]) -> tuple[float, str]:
        values = [(_worst([layer], skip).get(key), f"{where}, {layer['name']}") for where, r in healthy
                  for layer in r["layers"]]
        values = [(v, w) for v, w in values if v is not None and not (isinstance(v, float) and math.isinf(v))]
        if not values:  # a calibration.json older than the statistic
            return math.nan, "not measured"
        return min(values) if "sqnr" in key else max(values)

    rows = [("output SQNR >= (dB)", "output_sqnr_db", t.min_output_sqnr_db, 1),
            ("dgrad SQNR >= (dB)", "grad_input_sqnr_db", t.min_grad_sqnr_db, 1),
            ("wgrad SQNR >= (dB)", "grad_weight_sqnr_db", t.min_grad_sqnr_db, 1),
            ("rest SQNR >= (dB)", "rest_sqnr_db", t.min_rest_sqnr_db, 1),
            ("input flushed <=", "input_flushed", t.max_flushed_share, 100),
            ("weight flushed <=", "weight_flushed", t.max_flushed_share, 100),
            ("grad out flushed <=", "grad_output_flushed", t.max_grad_flushed_share, 100),
            ("saturated <=", "saturated", t.max_saturated_share, 100)]
    lines = ["## Thresholds against the healthy layers", "",
             "| threshold | value | worst healthy layer, all | where | worst, first/last Linear left out | where |",
             "|---|---|---|---|---|---|"]
    for name, key, value, scale in rows:
        unit = "" if scale == 1 else "%"
        everything, rest = worst(key, set()), worst(key, first_last)
        lines.append(f"| {name} | {scale * value:g}{unit} | {scale * everything[0]:.2f}{unit} | {everything[1]} | "
                     f"{scale * rest[0]:.2f}{unit} | {rest[1]} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="llama,gpt2,mixtral,qwen3")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--from-json", action="store_true", help="rewrite results.md from calibration.json only")
    args = parser.parse_args()
    out = Path(args.out)
    if args.from_json:
        data = json.loads((out / "calibration.json").read_text())
        results = {(r["model"], r["stage"]): r for r in data["results"]}
        (out / "results.md").write_text(markdown(results, data["meta"]))
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    start = time.time()
    probe_batches = [Batches(batch_size=8, seq_len=128, seed=1)[i] for i in range(4)]
    results: dict = {}
    for family in args.families.split(","):
        model = build(family, seed=0)
        results[(family, "init")] = {"reports": probe_all(model, probe_batches)}
        losses = train(model, args.steps, args.lr, seed=0)
        results[(family, "trained")] = {"reports": probe_all(model, probe_batches), "losses": losses}
        if family == "llama":
            name, handle = plant_outlier(model)
            results[("llama + planted outlier (" + name + ")", "trained")] = {
                "reports": probe_all(model, probe_batches, ("torchao tensorwise", "torchao rowwise")),
                "losses": losses}
            handle.remove()
        print(f"{family}: done at {time.time() - start:.0f}s", flush=True)
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
            "torch": torch.__version__, "torchao": package_version("torchao"),
            "transformers": package_version("transformers"), "python": platform.python_version(),
            "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} thread(s)", "wall_s": time.time() - start,
            "steps": args.steps, "lr": args.lr}
    (out / "calibration.json").write_text(json.dumps(
        {"meta": meta, "results": [{"model": f, "stage": s, **v} for (f, s), v in results.items()]}) + "\n")
    (out / "results.md").write_text(markdown(results, meta))
    print(markdown(results, meta))


if __name__ == "__main__":
    main()
