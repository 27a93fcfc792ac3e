"""``fp8dist train --launcher ray``'s refusals and the README's Ray example as it is (the command and the example
training on Ray Train workers are tests/test_integration_ray.py's, on the one Ray cluster of that module)."""

from __future__ import annotations

import re
import sys

from cli_helpers import ROOT

from fp8dist.cli import main


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
