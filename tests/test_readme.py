"""The README's promises: its API example runs as written, CI runs the README's test command."""

from __future__ import annotations

import re

from cli_helpers import ROOT, torchrun


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_readme_api_example_runs_under_torchrun(tmp_path):
    readme = _readme()
    marker = readme.index("<!-- tests/test_readme.py runs the next block")
    block = re.search(r"```python\n(.*?)```", readme[marker:], flags=re.S).group(1)
    script = tmp_path / "train.py"
    script.write_text(block)
    proc = torchrun(script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("DTensor Shard(dim=0)") == 2  # both ranks print their sharding
    assert "compute in bf16, gradients reduced in fp32" in proc.stdout


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```bash\n(.*?)\n```", _readme(), flags=re.S)
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()
    assert any(c.endswith("fp8dist train") for c in commands), "the main-job command is in the README"
