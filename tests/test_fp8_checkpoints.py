"""FP8 checkpoints out and in (issue 55): ``save_pretrained(dtype="fp8")`` writes the Linears the plan ran in FP8 as
e4m3 weights with scales that transformers loads on a CPU (logits as the bf16 export's, at ~0.6x the bytes, the
quantization_config accepted by compressed-tensors' and transformers' own config classes, the bits those training
multiplied with), and ``pretrained=`` reads such checkpoints, refusing the quantized kinds it cannot read. One
process, strategy "none" (the gather under FSDP2 runs in test_fp8_checkpoint_job)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

import fp8dist
from fp8dist.checkpoint.fp8_export import fp8_summary
from fp8dist.train.models import build_llama

pytest.importorskip("torchao", reason="FP8 exports need a model trained in FP8 (torchao)")

IDS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
FIRST, LAST = "model.layers.0.self_attn.q_proj", "lm_head"  # what keep_first_last_linear keeps out of FP8
K0, V0 = "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"  # FIRST's fused group (vLLM's qkv_proj)
KEPT = [LAST, K0, FIRST, V0]  # the Linears an export of a tiny Llama writes in bf16
FUSED = [(f"model.layers.{i}.self_attn.", ("q_proj", "k_proj", "v_proj")) for i in (0, 1)] + \
    [(f"model.layers.{i}.mlp.", ("gate_proj", "up_proj")) for i in (0, 1)]  # the Linears vLLM's Llama fuses


def _wrapped(**options):
    torch.set_num_threads(1)
    return fp8dist.wrap_model(build_llama("tiny", seed=1), strategy="none", fp8="torchao", **options)


def _logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers: "FP8 needs a GPU, dequantizing to bf16"
        model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        return model(IDS).logits.float().flatten()


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _torchao_bits(model, name: str) -> torch.Tensor:
    """The e4m3 bits torchao's Float8Linear multiplies with for layer ``name``: its own weight cast, as its forward
    makes it (the transposed weight, scaled along dim 0)."""
    from torchao.float8.float8_linear import LinearMMConfig
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    layer = fp8dist.strategies.unwrap_model(model).get_submodule(name)
    cast = layer.config.cast_config_weight
    fp8 = hp_tensor_to_float8_dynamic(layer.weight.detach().t(), cast.target_dtype, LinearMMConfig(),
                                      gemm_input_role=GemmInputRole.WEIGHT,
                                      scaling_granularity=cast.scaling_granularity,
                                      axiswise_dim=get_maybe_axiswise_dim(0, cast.scaling_granularity),
                                      round_scales_to_power_of_2=layer.config.round_scales_to_power_of_2)
    return fp8._data.t()


def test_fp8_exports_load_in_transformers_on_a_cpu_like_the_bf16_export_at_under_065x_the_bytes(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file
    from transformers import FineGrainedFP8Config

    tensorwise, rowwise = _wrapped(), _wrapped(torchao_recipe="rowwise")
    exports = {"bf16": (tensorwise, {}), "ct": (tensorwise, {"dtype": "fp8"}),
               "blocks": (tensorwise, {"dtype": "fp8", "fp8_format": "fine-grained"}),
               "ct rowwise": (rowwise, {"dtype": "fp8"}), "bf16 rowwise": (rowwise, {})}
    for key, (model, options) in exports.items():
        fp8dist.save_pretrained(model, tmp_path / key, **options)
    for key, reference in (("ct", "bf16"), ("blocks", "bf16"), ("ct rowwise", "bf16 rowwise")):
        # measured 2026-12-02: 0.9987 (per tensor), 0.9991 (128x128 blocks), 0.9987 (per channel)
        assert _cosine(_logits(tmp_path / key), _logits(tmp_path / reference)) >= 0.995, key
        assert _bytes(tmp_path / key) <= 0.65 * _bytes(tmp_path / reference), key  # measured 0.610, 0.610, 0.620
        config = json.loads((tmp_path / key / "config.json").read_text())["quantization_config"]
        record = json.loads((tmp_path / key / "fp8_export.json").read_text())
        # the plan kept FIRST (q_proj) and LAST; k_proj and v_proj ran FP8 and are written bf16 with it, as vLLM
        # serves q/k/v as one layer in one scheme
        assert record["kept_bf16"] == KEPT and len(record["layers"]) == 11
        assert {n: (f["group"], f["kept_by_plan"]) for n, f in record["fused_bf16"].items()} == {
            K0: ("model.layers.0.self_attn.qkv_proj", [FIRST]), V0: ("model.layers.0.self_attn.qkv_proj", [FIRST])}
        _assert_one_scheme_per_fused_group(tmp_path / key, config.get("ignore", config.get("modules_to_not_convert")))
        if key == "blocks":
            assert FineGrainedFP8Config(**config).weight_block_size == [128, 128]
            assert config["modules_to_not_convert"] == KEPT
            continue
        parsed = QuantizationConfig.model_validate(config)  # compressed-tensors' own validation
        assert parsed.ignore == KEPT and parsed.format == "float-quantized"
        strategy, cast = ("channel", "training's rowwise cast (power-of-2 scales)") if "rowwise" in key else \
            ("tensor", "training's tensorwise cast")
        assert [g.weights.strategy for g in parsed.config_groups.values()] == [strategy]
        assert {layer["cast"] for layer in record["layers"].values()} == {cast}
        tensors = load_file(tmp_path / key / "model.safetensors")
        model = rowwise if "rowwise" in key else tensorwise
        for name in record["layers"]:  # the served weights are the bits training multiplied with
            assert torch.equal(tensors[f"{name}.weight"].view(torch.uint8), _torchao_bits(model, name).view(
                torch.uint8)), name
        assert tensors[f"{FIRST}.weight"].dtype == tensors["model.norm.weight"].dtype == torch.bfloat16
    assert fp8_summary(tmp_path / "ct") == ("fp8 compressed-tensors: 11 Linears e4m3 (11 training's tensorwise cast), "
                                            "4 kept bf16 (2 of them ran FP8, written bf16 as their fused group is: "
                                            "vLLM serves one scheme per group)")


def _assert_one_scheme_per_fused_group(path: Path, ignore: list[str]) -> None:
    """Each group vLLM fuses is written in one scheme (all bf16, or all e4m3 with scales of one kind), and the config's
    list of Linears not converted is exactly those written in bf16."""
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        shape = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtype = {k: f.get_slice(k).get_dtype() for k in f.keys()}

    def scheme(weight: str) -> tuple[str, str | None]:
        scale = shape.get(weight + "_scale", shape.get(weight + "_scale_inv"))
        kind = None if scale is None else "tensor" if scale == (1,) else "channel" if scale == (shape[weight][0], 1) \
            else "block"
        return dtype[weight], kind

    linears = [k.removesuffix(".weight") for k in shape if k.endswith("_proj.weight") or k == f"{LAST}.weight"]
    assert sorted(n for n in linears if scheme(f"{n}.weight") == ("BF16", None)) == sorted(ignore)
    for parent, members in FUSED:
        assert len({scheme(f"{parent}{m}.weight") for m in members}) == 1, parent


def test_a_fused_group_whose_casts_differ_per_tensor_and_per_channel_is_written_per_channel_with_trainings_bits(
        tmp_path, monkeypatch):
    """torchao_recipe="auto" planned for an H100 at 8,192 tokens picks tensorwise for q_proj (2048 x 2048) and
    rowwise_with_gw_hp for k_proj and v_proj (512 x 2048): vLLM takes a fused layer's scheme from its first member,
    so the group is written per channel, q_proj with training's tensorwise bits and its one scale on every row."""
    import fp8dist.plan.selection as selection
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from fp8dist.runtime.hardware import find_gpu, parse_target
    from fp8dist.train.models import llama_config

    h100 = find_gpu(parse_target("h100"))
    monkeypatch.setattr(selection, "find_gpu", lambda hardware: h100)  # plan as a GPU run would, here on a CPU
    config = llama_config("tiny")
    config.update(dict(hidden_size=2048, intermediate_size=256, num_hidden_layers=1, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=64))
    torch.manual_seed(0)
    model = fp8dist.wrap_model(LlamaForCausalLM(config), strategy="none", fp8="torchao", torchao_recipe="auto",
                               param_dtype="fp32", micro_batch_size=1, seq_len=8192, keep_first_last_linear=False)
    attn = "model.layers.0.self_attn."
    assert {n: e.recipe for n in ("q_proj", "k_proj", "v_proj") for e in [fp8dist.get_plan(model).by_name(attn + n)]} \
        == {"q_proj": "tensorwise", "k_proj": "rowwise_with_gw_hp", "v_proj": "rowwise_with_gw_hp"}
    fp8dist.save_pretrained(model, tmp_path / "ct", dtype="fp8")
    quantization = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(quantization)  # compressed-tensors' own validation
    per_channel = [g["targets"] for g in quantization["config_groups"].values()
                   if g["weights"]["strategy"] == "channel"]
    assert {attn + n for n in ("q_proj", "k_proj", "v_proj")} <= set(per_channel[0])
    layer = json.loads((tmp_path / "ct" / "fp8_export.json").read_text())["layers"][attn + "q_proj"]
    assert (layer["granularity"], layer["cast_granularity"]) == ("channel", "tensor")
    assert layer["cast"] == "training's tensorwise cast, its one scale written on every row (its fused group is " \
                           "per channel)"
    assert "1 training's tensorwise cast, its one scale written on every row" in fp8_summary(tmp_path / "ct")
    tensors = load_file(tmp_path / "ct" / "model.safetensors")
    assert torch.equal(tensors[attn + "q_proj.weight"].view(torch.uint8),
                       _torchao_bits(model, attn + "q_proj").view(torch.uint8)), "the bits training multiplied with"
    scale = tensors[attn + "q_proj.weight_scale"]
    assert scale.shape == (2048, 1) and torch.equal(scale, scale[:1].expand(2048, 1)), "its one scale on every row"


def test_an_fp8_export_of_a_lora_model_merges_then_quantizes_recording_each_layers_error(tmp_path):
    peft = pytest.importorskip("peft")
    from fp8dist.checkpoint.lora import save_merged

    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft's call of a transformers API being renamed
        model = peft.get_peft_model(build_llama("tiny", seed=1), peft.LoraConfig(r=4, target_modules=["q_proj",
                                                                                                      "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(2))
    wrapped = fp8dist.wrap_model(model, strategy="none", fp8="torchao")
    save_merged(wrapped, tmp_path / "bf16")
    save_merged(wrapped, tmp_path / "fp8", dtype="fp8")
    assert _cosine(_logits(tmp_path / "fp8"), _logits(tmp_path / "bf16")) >= 0.995  # measured 0.9979
    layers = json.loads((tmp_path / "fp8" / "fp8_export.json").read_text())["layers"]
    errors = {name: layer["merge_error"] for name, layer in layers.items() if layer["merge_error"] is not None}
    # q_proj of layer 0 is the first Linear, kept in bf16, and v_proj with it (their fused group); the other adapted
    # layers are merged, then quantized
    assert sorted(errors) == ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    assert all(0.01 < e < 0.05 for e in errors.values()), errors  # e4m3's ~2^-4 relative step; measured 0.026-0.027


def test_an_fp8_export_without_fp8_layers_writes_bf16_and_says_so_and_bad_arguments_are_refused(tmp_path):
    model = fp8dist.wrap_model(build_llama("tiny", seed=1), strategy="none")
    with pytest.warns(UserWarning, match="the plan ran no layer in FP8 .*written in bf16 with no quantization_config"):
        fp8dist.save_pretrained(model, tmp_path / "out", dtype="fp8")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    assert not (tmp_path / "out" / "fp8_export.json").exists()
    with pytest.raises(ValueError, match="fp8_format='mxfp8' is not an FP8 checkpoint layout; choose one of "
                                         "'compressed-tensors' .*'fine-grained'"):
        fp8dist.save_pretrained(_wrapped(), tmp_path / "x", dtype="fp8", fp8_format="mxfp8")
    with pytest.raises(ValueError, match="LlamaForCausalLM was not returned by fp8dist.wrap_model .*dtype='bf16'"):
        fp8dist.save_pretrained(build_llama("tiny"), tmp_path / "x", dtype="fp8")
    assert not (tmp_path / "x").exists()
    from transformers import LlamaForCausalLM

    odd = LlamaForCausalLM(build_llama("tiny").config.__class__(vocab_size=256, hidden_size=128, intermediate_size=192,
                                                                 num_hidden_layers=2, num_attention_heads=4))
    with pytest.warns(UserWarning, match="model.layers.0.mlp.gate_proj, .* and 3 more have a dim over 128 that is no "
                                         "multiple of 128: transformers' dequantization on a CPU .* reads its blocks "
                                         "wrong .*Use fp8_format='compressed-tensors'"):
        fp8dist.save_pretrained(fp8dist.wrap_model(odd, strategy="none", fp8="torchao"), tmp_path / "odd", dtype="fp8",
                                fp8_format="fine-grained")


def _quantized_dir(tmp_path: Path, name: str, quantization: dict | None, tensors: dict | None = None) -> Path:
    """A model directory whose config.json holds ``quantization`` (None: no quantization_config)."""
    from safetensors.torch import save_file

    path = tmp_path / name
    fp8dist.save_pretrained(build_llama("tiny", seed=1), path)
    config = json.loads((path / "config.json").read_text())
    if quantization is not None:
        config["quantization_config"] = quantization
    (path / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, path / "model.safetensors")
    return path


def _dequantized_by_transformers(path: Path, fmt: str) -> dict[str, torch.Tensor]:
    """The fp32 state dict transformers loads from an FP8 checkpoint with its quantizer's dequantize=True."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    config = CompressedTensorsConfig(dequantize=True) if fmt == "compressed-tensors" else \
        FineGrainedFP8Config(dequantize=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=torch.float32).state_dict()


def test_pretrained_reads_fp8_checkpoints_dequantized_and_refuses_the_kinds_it_cannot_read(tmp_path):
    from fp8dist.pipeline.pretrained import PretrainedError, load_pretrained

    trained = _wrapped()
    for fmt in ("compressed-tensors", "fine-grained"):
        fp8dist.save_pretrained(trained, tmp_path / fmt, dtype="fp8", fp8_format=fmt)
        model = build_llama("tiny", seed=7)
        with pytest.warns(UserWarning, match=f"11 FP8 weights of the {fmt} checkpoint dequantized once .*into the "
                                             "fp32 parameters"):
            report = load_pretrained(model, tmp_path / fmt)
        assert report.dequantized.startswith("11 FP8 weights")
        theirs = _dequantized_by_transformers(tmp_path / fmt, fmt)
        assert all(torch.equal(p, theirs[n]) for n, p in model.state_dict().items()), fmt
    from fp8dist.pipeline.pretrained import SafetensorsDir
    from fp8dist.strategies.local_shards import Region

    source, name = SafetensorsDir(tmp_path / "fine-grained"), "model.layers.1.mlp.down_proj.weight"  # (128, 384)
    whole = source.read(name, Region(box=((0, 128), (0, 384))))  # what a rank of FSDP2 / FSDP1 / ZeRO-3 reads:
    assert torch.equal(source.read(name, Region(box=((64, 64), (0, 384)))), whole[64:])  # rows (dim-0 shard)
    assert torch.equal(source.read(name, Region(flat=(1000, 30000))), whole.reshape(-1)[1000:30000])  # a flat range
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / fmt))  # its quantization_config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_pretrained(model, tmp_path / fmt)
    fp8dist.save_pretrained(model, tmp_path / "again")  # bf16 weights: no quantization_config a loader would apply
    assert "quantization_config" not in json.loads((tmp_path / "again" / "config.json").read_text())
    assert _cosine(_logits(tmp_path / "again"), _logits(tmp_path / fmt)) > 0.999
    reads = "it reads: fp8 \\(transformers' FineGrainedFP8"
    for quantization, said in (
            ({"quant_method": "gptq", "bits": 4}, "quantized as quant_method 'gptq'"),
            ({"quant_method": "awq", "bits": 4}, "quantized as quant_method 'awq'"),
            ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantized as quant_method 'bitsandbytes'"),
            ({"quant_method": "compressed-tensors", "format": "pack-quantized"},
             "quantized as compressed-tensors format 'pack-quantized'"),
            ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {
                "type": "int", "num_bits": 8, "strategy": "channel"}}}}, "weights of type 'int', 8 bits"),
            ({"quant_method": "mystery"}, "quantized as quant_method 'mystery'")):
        path = _quantized_dir(tmp_path, quantization["quant_method"] + str(len(said)), quantization)
        with pytest.raises(PretrainedError, match=f"{said}.*{reads}.*Pass the model's bf16 or fp32 checkpoint"):
            load_pretrained(build_llama("tiny"), path)
    bare = _quantized_dir(tmp_path, "bare", None, {"lm_head.weight": torch.zeros(256, 128, dtype=torch.float8_e4m3fn)})
    with pytest.raises(PretrainedError, match="holds FP8 tensors \\(lm_head.weight\\) but its config.json has no "
                                              "quantization_config"):
        load_pretrained(build_llama("tiny"), bare)


def _base_bytes(model, names: set | None = None) -> tuple[set, set, int]:
    """(The names, the local dtypes, the bytes on this rank) of the weights held in FP8 (those with their scale), or
    of the weights ``names``: their FSDP2 shards, plus each whole scale."""
    from fp8dist.fp8.hf_format import SCALE_ATTR

    base = {n: p for n, p in model.named_parameters() if (hasattr(p, SCALE_ATTR) if names is None else n in names)}
    local = [getattr(p, "_local_tensor", p) for p in base.values()]
    return set(base), {str(t.dtype) for t in local}, sum(
        t.numel() * t.element_size() + getattr(p, SCALE_ATTR, t[:0]).numel() * 4 for t, p in zip(local, base.values()))


def _job(rank: int, world: int, root: str) -> dict:
    """fp8dist train jobs in one spawn: FSDP2 + torchao writes --save-dtype fp8 (each rank gathers its shards); a LoRA
    job on that checkpoint under FSDP2 (train's default) holds its base in FP8 and writes it merged in FP8; the same
    LoRA job with the base dequantized (as FSDP1 and DeepSpeed still do) gives the losses to match; a rowwise LoRA job
    recasts the held base per channel."""
    import fp8dist.train.job as job
    import fp8dist.train.lora as lora_module
    from fp8dist.config.resolve import Config
    from fp8dist.train.job import TrainConfig, run_training

    warnings.simplefilter("ignore")
    lines: list[str] = []
    first = TrainConfig(steps=2, batch_size=4, seq_len=32, save_pretrained=f"{root}/fp8", save_dtype="fp8")
    run_training(Config.from_dict({"strategy": "fsdp", "fp8": "torchao"}), first, log=lines.append)
    models, wrap = [], job.wrap_model

    def keep(*args, **kwargs):
        models.append(wrap(*args, **kwargs))  # (model, optimizer)
        return models[-1]

    job.wrap_model = keep  # the job's wrapped model, to count its shards
    lora = TrainConfig(steps=2, batch_size=4, seq_len=32, lora_rank=4, save_pretrained=f"{root}/merged",
                       merge_lora=True, save_dtype="fp8")
    result = run_training(Config.from_dict({"fp8": "torchao", "pretrained": f"{root}/fp8"}), lora, log=lines.append)
    held = _base_bytes(models[-1][0])
    by_rows = Config.from_dict({"fp8": "torchao", "torchao_recipe": "rowwise", "pretrained": f"{root}/fp8"})
    rowwise = run_training(by_rows, TrainConfig(steps=2, batch_size=4, seq_len=32, lora_rank=4), log=lines.append)
    rows = _base_bytes(models[-1][0])[1:]  # the file's tensorwise bits recast per channel once, before sharding
    lora_module.holds_fp8_base = lambda config, say=False: False  # the base dequantized into fp32 masters
    plain = run_training(Config.from_dict({"fp8": "torchao", "pretrained": f"{root}/fp8"}),
                         TrainConfig(steps=2, batch_size=4, seq_len=32, lora_rank=4), log=lines.append)
    return {"log": "\n".join(lines), "losses": result.losses, "dequantized": plain.losses,
            "plain": _base_bytes(models[-1][0], held[0])[1:], "held": held[1:], "names": len(held[0]),
            "rowwise": (rowwise.losses, rows)}


@pytest.mark.slow
def test_fp8dist_train_exports_fp8_under_fsdp2_and_a_fsdp2_lora_job_trains_on_it_with_the_base_in_fp8(tmp_path):
    """28-40 s on the 2-core machine (measured 2026-12-02): four jobs of 2 steps, 2 ranks, in one spawn."""
    from dist_harness import run_ranks

    results = run_ranks(_job, str(tmp_path))
    log = results[0]["log"]
    assert "save_pretrained: wrote" in log and "fp8 compressed-tensors: 11 Linears e4m3 (11 training's tensorwise " \
                                                 "cast), 4 kept bf16 (2 of them ran FP8" in log, log
    assert "note: the frozen base came in FP8 from the checkpoint: 11 Linears (360,448 weights) hold its e4m3" in log
    assert "LoRA merged, then quantized: relative error per layer up to" in log
    assert results[0]["losses"] == results[1]["losses"] and len(results[0]["losses"]) == 2
    # FSDP2 shards the e4m3 bytes: half the base's 360,448 weights per rank (1 byte each), plus 11 fp32 scales whole;
    # the dequantized base: fp32 masters, 4 bytes a weight
    assert [r["held"] for r in results] == [({"torch.uint8"}, 360_448 // 2 + 11 * 4)] * 2
    assert [r["plain"] for r in results] == [({"torch.float32"}, 360_448 // 2 * 4)] * 2 and results[0]["names"] == 11
    # the all-gathered bits are the bits FSDP2's FP8 all-gather casts the dequantized shards to: the same GEMMs
    assert results[0]["losses"] == results[0]["dequantized"]
    # rowwise: each rank holds its rows' bytes and every row's scale (2,304 fp32); its own recipe, the losses near
    # tensorwise's (measured 2026-12-02: 6.1e-4 and 2.3e-4 apart)
    losses, rows = results[0]["rowwise"]
    assert rows == ({"torch.uint8"}, 360_448 // 2 + 2_304 * 4)
    assert losses == pytest.approx(results[0]["losses"], abs=2e-3)
    for name in ("fp8", "merged"):  # both load in transformers on a CPU
        assert _logits(tmp_path / name).isfinite().all()


class _HighPrecisionShapes:
    """The shapes of the 2-byte-or-wider floating tensors torch ops create while it is entered (a dispatch mode)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        shapes = self.shapes = set()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() > 1 and not t.is_meta:
                        shapes.add(tuple(t.shape))
                return out

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _lora_on(path: Path, held: bool):
    """A tiny Llama LoRA model (rank 4, PEFT's default targets) on the FP8 checkpoint ``path``, its base held in FP8
    (built on the meta device, :func:`load_fp8_base`) or dequantized into fp32 (the base loaded whole), and the shapes
    of the high-precision tensors the load made."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fp8dist.pipeline.fp8_base import load_fp8_base
    from fp8dist.pipeline.pretrained import load_pretrained
    from fp8dist.train.config import TrainConfig
    from fp8dist.train.lora import apply_lora

    torch.set_num_threads(1)
    with torch.device("meta" if held else "cpu"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    with warnings.catch_warnings(), _HighPrecisionShapes() as made:
        warnings.simplefilter("ignore")
        (load_fp8_base if held else load_pretrained)(model, path)
    return model, apply_lora(model, TrainConfig(lora_rank=4)), made.shapes


@pytest.mark.parametrize("recipe, scales", [("tensorwise", 11), ("rowwise", 2_304)])  # rowwise: one per output row
def test_a_lora_base_held_in_fp8_trains_exactly_as_the_dequantized_base_at_a_quarter_of_its_bytes(tmp_path, recipe,
                                                                                                  scales):
    """The base held in FP8 is 1 byte per weight plus a scale per layer, never in high precision while it loads (one
    layer is, once, at its first forward). Measured once beside this test (2026-12-02, CPU, llama "medium", 25.4M
    parameters, compressed-tensors per tensor, VmHWM reset before the load): peak RSS +36 MB held in FP8, +93 MB
    dequantized into fp32; tests/test_fp8_base_memory.py measures it in fresh processes."""
    from helpers import train_losses

    fp8dist.save_pretrained(_wrapped(torchao_recipe=recipe), tmp_path / "fp8", dtype="fp8")
    losses, base_bytes = {}, {}
    for held in (True, False):
        base, model, made = _lora_on(tmp_path / "fp8", held)
        # the MLP weights (only they have these shapes) never exist in high precision while a held base loads
        assert ({(384, 128), (128, 384)} <= made) != held, made
        quantized = [m.weight for m in base.modules() if isinstance(m, torch.nn.Linear) and m.weight.numel() > 0
                     and m.weight.dtype == torch.uint8]
        assert len(quantized) == (11 if held else 0), "each FP8 Linear holds its e4m3 bytes, never an fp32 copy"
        base_bytes[held] = sum(w.numel() * w.element_size() + w.fp8_scale.numel() * 4 for w in quantized) \
            if held else 4 * 360_448
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            wrapped = fp8dist.wrap_model(model, strategy="none", fp8="torchao", torchao_recipe=recipe)
        assert any("the frozen base came in FP8 from the checkpoint: 11 Linears (360,448 weights)" in str(w.message)
                   for w in said) == held
        losses[held] = train_losses(wrapped, 0, 1, steps=3)
    # the kept bits are the bits torchao casts the dequantized weight to: the same GEMMs (rowwise: the backward's
    # weight recast along the other axis from the bits' values, as from the dequantized weight)
    assert losses[True] == losses[False]
    assert base_bytes[True] == 360_448 + scales * 4  # 1 byte per weight and fp32 scales; fp32: 4 bytes a weight


def test_which_lora_jobs_hold_an_fp8_base_and_why_the_others_dequantize_it(tmp_path):
    from fp8dist.config.resolve import Config
    from fp8dist.train.lora import holds_fp8_base

    trained = _wrapped()
    fp8dist.save_pretrained(trained, tmp_path / "fp8", dtype="fp8")
    fp8dist.save_pretrained(trained, tmp_path / "bf16")

    def config(path, **options):
        return Config.from_dict({"fp8": "torchao", "pretrained": str(path), **options})

    assert all(holds_fp8_base(config(tmp_path / "fp8", strategy=strategy)) for strategy in ("none", "ddp", "fsdp"))
    assert not holds_fp8_base(config(tmp_path / "bf16", strategy="none"))
    for options, why in (({"strategy": "fsdp1"}, "strategy='fsdp1' flattens each unit's parameters into one flat "
                                                 r"parameter of one dtype \(the base is held in FP8 under strategy "
                                                 "'none', 'ddp' or 'fsdp'\\)"),
                         ({"strategy": "deepspeed"}, "strategy='deepspeed' casts every parameter to its own dtype"),
                         ({"strategy": "ddp", "torchao_api": "weight_wrapper"},
                          "fp8='torchao' as configured does not multiply with given FP8 bits")):
        with pytest.warns(UserWarning, match=f"is an FP8 checkpoint, and its LoRA base is dequantized into high "
                                             f"precision: {why}"):
            assert not holds_fp8_base(config(tmp_path / "fp8", **options), say=True)


def test_the_cli_flags_of_an_fp8_export_and_their_refusals():
    import argparse

    from fp8dist.cli import train as train_cli
    from fp8dist.train.config import TrainConfig

    parser = argparse.ArgumentParser()
    train_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "--save-pretrained", "out", "--save-dtype", "fp8", "--save-fp8-format",
                              "fine-grained"])
    _, job = train_cli._config_and_job(args)
    assert (job.save_dtype, job.save_fp8_format) == ("fp8", "fine-grained")
    with pytest.raises(ValueError, match="save_fp8_format='fine-grained' with save_dtype='bf16': it is the layout of "
                                         "an FP8 export; pass --save-dtype fp8"):
        TrainConfig(save_pretrained="out", save_dtype="bf16", save_fp8_format="fine-grained")
    with pytest.raises(ValueError, match="save_dtype='fp8' with lora_rank and no merge_lora: .*Pass --merge-lora"):
        TrainConfig(save_pretrained="out", save_dtype="fp8", lora_rank=4)
