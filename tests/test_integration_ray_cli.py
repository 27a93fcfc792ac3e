"""``fp8dist train --launcher ray`` and examples/ray_train.py: the reference job and the example on Ray Train
workers, each on a Ray cluster its command starts and stops; the command's refusals. (Apart from
tests/test_integration_ray.py so that the two slow modules run side by side.)"""

from __future__ import annotations

import json
import re
import sys

import pytest
from cli_helpers import ROOT, run

from fp8dist.cli import main

NO_RAY = "Ray Train is not installed: pip install 'fp8dist[ray]'"
RAY_ENV = {"OMP_NUM_THREADS": "1", "RAY_ADDRESS": "local"}
"""One thread per rank under either launch; a Ray cluster of the command's own, never one `ray start` left here."""


@pytest.mark.slow
def test_fp8dist_train_on_ray_workers_matches_the_local_launch(tmp_path):
    """``fp8dist train --launcher ray``: the reference job's 2 ranks as Ray Train workers (on a Ray cluster the
    command starts and stops), every step's loss == the same command's own local launch (one thread per rank in
    both)."""
    pytest.importorskip("ray.train.torch", reason=NO_RAY)
    job = ["fp8dist", "train", "--steps", "3", "--nproc", "2", "--strategy", "fsdp", "--fp8", "torchao"]
    env = RAY_ENV
    figures = {}
    for name, flags in (("local", []), ("ray", ["--launcher", "ray"])):
        proc = run([*job, *flags, "--metrics-file", str(tmp_path / f"{name}.jsonl")], env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        figures[name] = [json.loads(line)["loss"] for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    assert "starting 2 Ray Train workers" in proc.stdout
    assert len(figures["ray"]) == 3 and figures["ray"] == figures["local"]


def test_fp8dist_train_launcher_ray_without_ray_names_the_extra(monkeypatch, capsys):
    for name in ("ray", "ray.train", "ray.train.torch"):
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["train", "--launcher", "ray", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp8dist train: error: launcher='ray' needs Ray Train, which cannot be imported here (")
    assert err.rstrip().endswith("pip install 'fp8dist[ray]' (or leave --launcher out: the local launch needs "
                                 "nothing).")


def test_fp8dist_train_launcher_ray_inside_a_launched_rank_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert main(["train", "--launcher", "ray", "--steps", "1"]) == 2
    assert ("fp8dist train: error: launcher='ray' starts the ranks as Ray Train workers, but this process is already "
            "one rank of a job ('env' launch") in capsys.readouterr().err


def test_the_readme_shows_the_ray_example_as_it_is():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Ray Train"):]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    assert block == (ROOT / "examples" / "ray_train.py").read_text()


@pytest.mark.slow
def test_the_ray_example_trains_and_reports_ray_checkpoints(tmp_path):
    """examples/ray_train.py as its docstring runs it: 4 steps with a checkpoint every 2, each reported to Ray (a
    restarted worker group resuming from Ray's checkpoint is test_integration_ray.py's; one Ray start here, not two:
    the second run cost ~50 s of CI)."""
    pytest.importorskip("ray.train.torch", reason=NO_RAY)
    script = ROOT / "examples" / "ray_train.py"
    assert "python examples/ray_train.py --num-workers 2 --fp8 torchao" in script.read_text()
    proc = run(["python", str(script), "--num-workers", "2", "--steps", "4", "--save-every", "2",
                "--storage", str(tmp_path / "storage")], env=RAY_ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = sorted({int(s) for s in re.findall(r"step +(\d+) loss \d+\.\d+$", proc.stdout, flags=re.M)})
    assert steps == [0, 1, 2, 3] and "(step 4, loss " in proc.stdout
    reported = [p for p in (tmp_path / "storage").rglob("checkpoint_*") if p.is_dir()]
    assert len(reported) == 2, reported  # steps 2 and 4, each an fp8dist checkpoint Ray keeps
