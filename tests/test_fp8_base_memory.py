"""Peak memory of ``fp8dist train --pretrained DIR --lora-rank 4`` on an FP8 checkpoint against the same weights'
bf16 checkpoint (issue 55), each job in a fresh process, its peak RSS over the tiny preset's job: the FP8 base is
held at 1 byte per weight plus its scales, the bf16 base as fp32 parameters (4 bytes), each plus the checkpoint's
bytes, which the load memory-maps. The measurement is benchmarks/checkpoint/fp8_base_memory.py's (its docstring
says why the jobs run with glibc's fixed mmap threshold); its results file has both allocator settings."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("torchao", reason="a base held in FP8 runs under torchao")
pytest.importorskip("peft", reason="--lora-rank needs peft")

ROOT = Path(__file__).resolve().parent.parent


def _benchmark():
    spec = importlib.util.spec_from_file_location("fp8_base_memory", ROOT / "benchmarks" / "checkpoint" /
                                                  "fp8_base_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _e4m3_weights(file: Path) -> tuple[int, int]:
    """How many e4m3 tensors the safetensors ``file`` holds, and their elements (the Linears written in FP8)."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        shapes = [f.get_slice(n).get_shape() for n in f.keys() if f.get_slice(n).get_dtype() == "F8_E4M3"]
    return len(shapes), sum(math.prod(shape) for shape in shapes)


@pytest.mark.slow
def test_a_lora_job_on_an_fp8_checkpoint_peaks_at_its_bytes_not_at_an_fp32_copy_of_the_base(tmp_path):
    """13 s on the idle 2-core machine, up to 38 s beside other runs (measured 2026-12-02): two exports, three jobs
    of 2 steps at once."""
    bench = _benchmark()
    paths = bench.export("medium", tmp_path)  # 25.4M parameters, 24.6M of them written in e4m3
    m = bench.measure(paths, bench.export(bench.BASELINE, tmp_path)["fp8"])
    layers, weights = _e4m3_weights(paths["fp8"] / "model.safetensors")  # 53 Linears, 24,641,536 weights (2026-12-02)
    assert f"the frozen base came in FP8 from the checkpoint: {layers} Linears ({weights:,} weights)" in m["log fp8"]
    # expected 50.3 MiB: 23.5 MiB of e4m3 bits, 53 scales, 2.9 MiB of fp32 embeddings, norms and the four Linears
    # written bf16 (the head, layer 0's q/k/v: the fused-group rule), 24.8 MiB of file mapped while it loads, less the
    # tiny job's; measured 46.2-50.6 (2026-12-02, the low one beside another job). An fp32 copy of the FP8 weights
    # adds 95 MiB: with FP8 health telemetry dequantizing the whole base at once (its first step) the peak was
    # +136-142 MiB.
    assert m["fp8"] == pytest.approx(m["fp8 expected"], abs=5), m
    # expected 144.4 MiB: 97.0 MiB of fp32 parameters (4 bytes each) and 48.5 MiB of mapped bf16 file, less the tiny
    # job's; measured 139.1-146.6
    assert m["bf16"] == pytest.approx(m["bf16 expected"], abs=8), m
    assert m["fp8"] < 0.4 * m["bf16"], m  # measured 0.341-0.355


def _plain_high_precision_shapes(run) -> set[tuple[int, ...]]:
    """The shapes of the plain 2-byte-or-wider floating tensors torch ops create while ``run()`` runs (torchao's
    Float8TrainingTensor, a wrapper of 1-byte data that reports its compute dtype, left out: its ops run inside)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    shapes = set()

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_floating_point() and t.element_size() > 1:
                    shapes.add(tuple(t.shape))
            return out

    with Mode():
        run()
    return shapes


def test_the_first_forward_of_a_base_held_in_fp8_makes_no_high_precision_copy_of_its_weights(tmp_path):
    """Each layer's held FP8 operand (its bits, torchao's scale of them) reads the amax from the bits: no fp32 copy
    of the weight, which glibc's heap kept after the forward (the medium job's peak RSS with the default allocator,
    measured 2026-12-02: 550-572 MiB with an fp32 copy per layer, 499-525 without)."""
    import torch

    import fp8dist
    from test_fp8_checkpoints import _lora_on, _wrapped

    fp8dist.save_pretrained(_wrapped(), tmp_path / "fp8", dtype="fp8")
    _, model, _ = _lora_on(tmp_path / "fp8", held=True)
    with pytest.warns(UserWarning, match="the frozen base came in FP8 from the checkpoint: 11 Linears"):
        wrapped = fp8dist.wrap_model(model, strategy="none", fp8="torchao")
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    made = _plain_high_precision_shapes(lambda: wrapped(input_ids=ids, labels=ids).loss.backward())
    # the MLP weights' shapes (only they have these); the tensorwise file's bits are the tensorwise recipe's own
    assert not {(384, 128), (128, 384)} & made, made
