"""Every example trains: the single-device one as its docstring launches it, the distributed ones on two ranks."""

from __future__ import annotations

import re

import pytest
from cli_helpers import ROOT, run
from dist_harness import run_ranks


STEPS = 6  # the loss falls by more than a nat within 6 steps; torchao's FP8 GEMMs on CPU cost ~7 s a step here


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step +\d+ loss (\d+\.\d+)$", stdout, flags=re.M)]


def _run_example(rank: int, world: int, script: str, argv: list[str]) -> str:
    """The script as its launcher would run it, in a rank of the test harness (the process group is up, as
    torchrun's or the deepspeed launcher's environment would let the script bring it up): its printed lines."""
    import contextlib
    import io
    import runpy
    import sys

    sys.argv = [script, *argv]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(script, run_name="__main__")
    return out.getvalue()


# Each example once, with FP8, on 2 ranks forked by the test harness rather than under its launcher: each launch
# costs three fresh interpreters' imports (~25 CPU-s), and the launchers run for real elsewhere — torchrun on the
# README's API example (tests/test_readme.py), on restarts (tests/test_checkpoint_crash.py) and across two SLURM
# nodes, the deepspeed launcher across two SLURM nodes (tests/test_launch.py). The run without FP8 is the same
# script with one call less; wrap_model's plain paths are tested against the hand-wired engines (tests/test_parity.py)
@pytest.mark.parametrize("fp8", ["torchao"])
@pytest.mark.parametrize("name,layout", [("ddp", "replicated"), ("fsdp", "DTensor Shard(dim=0)"),
                                         ("fsdp1", "FlatParameter shards")])
def test_distributed_example_trains_on_two_ranks(name, layout, fp8):
    script = ROOT / "examples" / f"{name}.py"
    assert f"torchrun --standalone --nproc-per-node 2 examples/{name}.py" in script.read_text()
    out, _ = run_ranks(_run_example, str(script), ["--steps", str(STEPS), "--fp8", fp8])
    losses = _losses(out)
    assert len(losses) == STEPS and losses[-1] < losses[0] - 1.0
    assert layout in out and "over 2 ranks" in out
    if name != "ddp":
        assert "full state dict on rank 0: 459,392 elements" in out


def test_deepspeed_example_trains_zero3_with_fp8_from_its_json():
    """The example with its committed ZeRO-3 config (tests/test_deepspeed.py checks it is what `fp8dist ds-config`
    writes) and torchao, given the --local_rank the deepspeed launcher appends to a script's arguments."""
    script = ROOT / "examples" / "deepspeed" / "train.py"
    config = "examples/deepspeed/ds_zero3.json"
    assert f"deepspeed --num_accelerators 2 examples/deepspeed/train.py --deepspeed_config {config}" \
        in script.read_text()
    out, _ = run_ranks(_run_example, str(script), ["--deepspeed_config", str(ROOT / config), "--fp8", "torchao",
                                                   "--steps", str(STEPS), "--local_rank=0"])
    losses = _losses(out)
    assert len(losses) == STEPS and losses[-1] < losses[0] - 1.0
    assert "DeepSpeed ZeRO-3: 21/21 tensors sharded over 2 ranks" in out


@pytest.mark.slow
@pytest.mark.parametrize("fp8", ["torchao"])
def test_single_device_example_with_plain_python(fp8):
    proc = run(["python", str(ROOT / "examples" / "single_device.py"), "--steps", str(STEPS), "--fp8", fp8])
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = _losses(proc.stdout)
    assert len(losses) == STEPS and losses[-1] < losses[0] - 1.0
    assert "not distributed" in proc.stdout and "compute in bf16" in proc.stdout
    assert re.search(r"^sample: The cat ", proc.stdout, flags=re.M), "the trained model generates from a prompt"
