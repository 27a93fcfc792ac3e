"""Every example runs the way its docstring says to launch it."""

from __future__ import annotations

import re

import pytest
from cli_helpers import ROOT, run, torchrun


STEPS = 6  # the loss falls by more than a nat within 6 steps; torchao's FP8 GEMMs on CPU cost ~7 s a step here


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step +\d+ loss (\d+\.\d+)$", stdout, flags=re.M)]


# each example once, with FP8 (the run without it is the same script with one call less; wrap_model's plain paths
# are tested against the hand-wired engines in tests/test_parity.py): the suite must fit CI's 10 minutes
@pytest.mark.parametrize("fp8", ["torchao"])
@pytest.mark.parametrize("name,layout", [("ddp", "replicated"), ("fsdp", "DTensor Shard(dim=0)"),
                                         ("fsdp1", "FlatParameter shards")])
def test_distributed_example_under_torchrun(name, layout, fp8):
    script = ROOT / "examples" / f"{name}.py"
    assert f"torchrun --standalone --nproc-per-node 2 examples/{name}.py" in script.read_text()
    proc = torchrun(script, "--steps", str(STEPS), "--fp8", fp8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = _losses(proc.stdout)
    assert len(losses) == STEPS and losses[-1] < losses[0] - 1.0
    assert layout in proc.stdout and "over 2 rank(s)" in proc.stdout
    if name != "ddp":
        assert "full state dict on rank 0: 459,392 elements" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("fp8", ["torchao"])
def test_single_device_example_with_plain_python(fp8):
    proc = run(["python", str(ROOT / "examples" / "single_device.py"), "--steps", str(STEPS), "--fp8", fp8])
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = _losses(proc.stdout)
    assert len(losses) == STEPS and losses[-1] < losses[0] - 1.0
    assert "not distributed" in proc.stdout and "compute in bf16" in proc.stdout
    assert re.search(r"^sample: The cat ", proc.stdout, flags=re.M), "the trained model generates from a prompt"
