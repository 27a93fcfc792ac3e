"""launch/: the torchrun and deepspeed scripts and the SLURM sbatch templates, run for real.

Static checks (bash -n, shellcheck), the exact commands their dry-run prints, their errors, a real 2-process job
through each script, and real 2-node submissions to a SLURM cluster that the module fixture starts on this
machine (tests/slurm_cluster.py). Missing Debian packages (shellcheck, SLURM, munge) are installed by the tests
when they run as root; elsewhere the tests skip with the reason. CI sets FP8DIST_CI=1: there a missing tool fails
the test instead of skipping it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import shutil
import time

import pytest
from cli_helpers import BIN, ROOT, run
from cli_helpers import train_losses_printed as _losses
from slurm_cluster import SlurmCluster, install_debian_packages, missing_reason

LAUNCH = ROOT / "launch"
SCRIPTS = sorted(p.relative_to(ROOT).as_posix() for p in [*LAUNCH.glob("[!_]*.sh"), *LAUNCH.glob("slurm/*.sbatch")])
IN_CI = os.environ.get("FP8DIST_CI") == "1"


def _need(reason: str | None) -> None:
    if reason is not None:
        if IN_CI:
            pytest.fail(f"CI must run this test: {reason}")
        pytest.skip(reason)


def _ready(stdout: str) -> list[tuple[int, int, int, str]]:
    """(rank, world, node, host) of every rank's start-up line."""
    found = re.findall(r"fp8dist train: rank (\d+)/(\d+) local rank \d+ node (\d+) host (\S+) device", stdout)
    return sorted((int(r), int(w), int(n), h) for r, w, n, h in found)


def _script(name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 60):
    return run(["bash", str(LAUNCH / name), *args], env=env, timeout=timeout)


def test_launch_folder_has_every_script_the_readme_names():
    assert SCRIPTS == ["launch/deepspeed.sh", "launch/slurm/deepspeed.sbatch", "launch/slurm/torchrun.sbatch",
                       "launch/torchrun.sh"]
    readme = (ROOT / "README.md").read_text()
    for script in SCRIPTS:
        assert script in readme, f"README shows no one-line use of {script}"
        assert os.access(ROOT / script, os.X_OK), f"{script} is not executable"


@pytest.mark.parametrize("script", SCRIPTS + ["launch/_common.sh"])
def test_scripts_parse_and_are_shellcheck_clean(script):
    assert run(["bash", "-n", script]).returncode == 0
    if shutil.which("shellcheck") is None:
        install_debian_packages(["shellcheck"])
    _need(None if shutil.which("shellcheck") else "shellcheck is not installed: apt-get install shellcheck")
    proc = run(["shellcheck", "-x", "--severity=style", script])
    assert proc.returncode == 0, proc.stdout
    text = (ROOT / script).read_text()
    if script != "launch/_common.sh":
        assert "set -euo pipefail" in text


def _dry(name: str, *args: str, **env: str) -> list[list[str]]:
    proc = _script(name, "--dry-run", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line) for line in proc.stdout.splitlines()]


TRICKY = ["--run-name", "two words", "--note", "it's $HOME; `x`"]


def test_torchrun_dry_run_prints_the_exact_command_with_every_argument_quoted():
    one = _dry("torchrun.sh", "--strategy", "fsdp", *TRICKY, NPROC_PER_NODE="2")
    assert one == [["torchrun", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "0", "--standalone",
                    "-m", "fp8dist.cli", "train", "--strategy", "fsdp", *TRICKY]]
    multi = _dry("torchrun.sh", "examples/fsdp.py", "--fp8", "torchao", NNODES="2", NPROC_PER_NODE="8",
                 MASTER_ADDR="10.1.2.3", MASTER_PORT="29600", RDZV_ID="job 7", MAX_RESTARTS="1")
    assert multi == [["torchrun", "--nnodes", "2", "--nproc-per-node", "8", "--max-restarts", "1", "--rdzv-backend",
                      "c10d", "--rdzv-endpoint", "10.1.2.3:29600", "--rdzv-id", "job 7", "examples/fsdp.py",
                      "--fp8", "torchao"]]
    module = _dry("torchrun.sh", "-m", "my.train", "x y", NPROC_PER_NODE="1", TORCHRUN="/opt/torch run")
    assert module[0][0] == "/opt/torch run" and module[0][-3:] == ["-m", "my.train", "x y"]
    explicit = _dry("torchrun.sh", "train", "--steps", "3", NPROC_PER_NODE="1")
    assert explicit[0][-5:] == ["-m", "fp8dist.cli", "train", "--steps", "3"]


@pytest.mark.slow
def test_fp8dist_launch_runs_the_packaged_scripts_and_prints_the_sbatch_command(capfd, monkeypatch):
    """fp8dist's main in this process (the console script is fp8dist.cli:main); the scripts it runs are real."""
    from fp8dist.cli import LAUNCH_DIR, main

    assert LAUNCH.resolve() == LAUNCH_DIR, "the repository's launch/ is the package's folder, one copy"
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")  # as run() gives the scripts
    for name in ("torchrun", "deepspeed"):
        env = {"NODELIST": "localhost", "NPROC_PER_NODE": "2"} if name == "deepspeed" else {}
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            assert main(["launch", name, "--dry-run", *TRICKY]) == 0
        via_cli = capfd.readouterr()
        direct = _script(f"{name}.sh", "--dry-run", *TRICKY, env=env)
        assert direct.returncode == 0, direct.stderr
        assert via_cli.out == direct.stdout and TRICKY[-1] in shlex.split(via_cli.out.splitlines()[-1])
    assert main(["launch", "slurm", "deepspeed", "--dry-run", "--nodes=4", "--gpus-per-node=8", "--",
                 "--zero-stage", "3", "--run-name", "two words"]) == 0
    assert shlex.split(capfd.readouterr().out) == [
        f"FP8DIST_LAUNCH_DIR={LAUNCH_DIR}", "sbatch", "--nodes=4", "--gpus-per-node=8",
        str(LAUNCH_DIR / "slurm" / "deepspeed.sbatch"), "--zero-stage", "3", "--run-name", "two words"]
    assert main(["launch", "path"]) == 0
    assert capfd.readouterr().out.strip() == str(LAUNCH_DIR)


def test_torchrun_defaults_to_the_nodes_gpus_from_slurm():
    assert _dry("torchrun.sh", SLURM_GPUS_ON_NODE="4", CUDA_VISIBLE_DEVICES="")[0][4] == "4"
    assert _dry("torchrun.sh", CUDA_VISIBLE_DEVICES="0,1,2")[0][4] == "3"


def test_deepspeed_dry_run_writes_a_hostfile_from_the_node_list_and_runs_one_launcher_per_node():
    lines = _dry("deepspeed.sh", "--zero-stage", "3", *TRICKY, NODELIST="gpu-a, gpu-b", NODE_RANK="1",
                 NPROC_PER_NODE="4", MASTER_PORT="29700", HOSTFILE="/tmp/my hosts")
    assert lines[:4] == [["cat", ">", "/tmp/my hosts", "<<EOF"], ["gpu-a", "slots=4"], ["gpu-b", "slots=4"],
                         ["EOF"]]
    assert lines[4] == ["deepspeed", "--hostfile", "/tmp/my hosts", "--master_addr", "gpu-a", "--no_ssh",
                        "--node_rank", "1", "--master_port", "29700", "--no_local_rank", "--module", "fp8dist.cli",
                        "train", "--strategy", "deepspeed", "--zero-stage", "3", *TRICKY]
    assert not os.path.exists("/tmp/my hosts"), "a dry run writes nothing"
    alone = _dry("deepspeed.sh", "examples/deepspeed/train.py", "--deepspeed_config", "a b.json", NPROC_PER_NODE="2")
    assert alone == [["deepspeed", "--num_accelerators", "2", "--master_addr", "127.0.0.1", "--master_port", "29500",
                      "examples/deepspeed/train.py", "--deepspeed_config", "a b.json"]]
    pdsh = _dry("deepspeed.sh", NODELIST="a,b", SSH="1", MASTER_ADDR="10.0.0.1", NPROC_PER_NODE="1")
    assert "--no_ssh" not in pdsh[-1] and pdsh[-1][3:5] == ["--master_addr", "10.0.0.1"]


@pytest.mark.parametrize("name,args,env,message", [
    ("torchrun.sh", [], {"NNODES": "2"}, "NNODES=2 but MASTER_ADDR is not set"),
    ("torchrun.sh", [], {"NNODES": "two"}, "NNODES='two' must be a node count (2) or a range (1:4)"),
    ("torchrun.sh", [], {"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE='0' must be a positive integer"),
    ("torchrun.sh", [], {"DRY_RUN": "yes"}, "DRY_RUN='yes' must be 0 or 1"),
    ("torchrun.sh", [], {"MASTER_PORT": "70000"}, "MASTER_PORT='70000' must be an integer from 1 to 65535: set it"),
    ("deepspeed.sh", [], {"MASTER_PORT": "0"}, "MASTER_PORT='0' must be an integer from 1 to 65535: set it"),
    ("torchrun.sh", ["no_such_train.py"], {}, "script 'no_such_train.py' not found"),
    ("torchrun.sh", ["-m"], {}, "-m needs a module name"),
    ("torchrun.sh", [], {"TORCHRUN": "no-such-torchrun"}, "'no-such-torchrun' is not on PATH. Activate the"),
    ("deepspeed.sh", [], {"DEEPSPEED": "no-such-ds"}, "'no-such-ds' is not on PATH. Install DeepSpeed"),
    ("deepspeed.sh", [], {"NODELIST": "n[1-2]"}, "is a compressed SLURM list: expand it first"),
    ("deepspeed.sh", [], {"NODELIST": "a,b", "NODE_RANK": "2"}, "NODE_RANK=2 but the host list has 2 hosts (a b)"),
    ("deepspeed.sh", [], {"HOSTFILE": "/no/such/hostfile"}, "HOSTFILE='/no/such/hostfile' not found"),
    ("deepspeed.sh", [], {"SSH": "maybe"}, "SSH='maybe' must be 0"),
    ("slurm/torchrun.sbatch", [], {"SLURM_JOB_ID": ""}, "not inside a SLURM job: submit this file with sbatch"),
    ("slurm/deepspeed.sbatch", [], {"SLURM_JOB_ID": ""}, "not inside a SLURM job: submit this file with sbatch"),
])
def test_bad_input_stops_with_a_clear_message_before_anything_runs(name, args, env, message):
    proc = _script(name, *args, env=env)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert proc.stdout == "" or "fp8dist train" not in proc.stdout


# launch/torchrun.sh trains for real on the two-node SLURM cluster below (torchrun.sbatch runs it on each node);
# its one-node command is the dry run's above (torchrun --standalone, the examples' and README's way under torchrun)

# The deepspeed launcher, through launch/deepspeed.sh, trains for real on the two-node SLURM cluster below
# (deepspeed.sbatch runs it on each node, writing and removing a hostfile); its one-node command is the dry run's above.


# --- a real 2-node SLURM cluster on this machine ------------------------------------------------------------

@pytest.fixture
def slurm(tmp_path_factory):
    _need(missing_reason())
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    start = time.monotonic()
    cluster.start()
    print(f"SLURM test cluster up in {time.monotonic() - start:.1f}s")
    yield cluster
    cluster.stop()


def _submit(slurm: SlurmCluster, template: str, *args: str, via_cli: bool = False, **env: str) -> str:
    """Submit launch/slurm/TEMPLATE on 2 nodes with sbatch, or (``via_cli``) through ``fp8dist launch slurm``,
    which submits the copy installed with the package."""
    bin_path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"  # sbatch exports it: the job runs this venv
    env = {"PATH": bin_path, "PYTHONUNBUFFERED": "1", **env}
    if via_cli:
        code, output = slurm.sbatch("--nodes=2", "--", *args, cwd=ROOT, env=env,
                                    submit=(str(BIN / "fp8dist"), "launch", "slurm", template.split(".")[0]))
    else:
        code, output = slurm.sbatch("--nodes=2", str(LAUNCH / "slurm" / template), *args, cwd=ROOT, env=env)
    assert code == 0, f"{output[-4000:]}\n{slurm.logs()}"
    return output


@pytest.mark.slow
def test_sbatch_templates_on_a_two_node_cluster(slurm, subtests):
    """One test, so one cluster serves every submission whichever xdist worker runs it."""
    for case in (_dry_runs_print_each_nodes_command, _torchrun_sbatch_trains_across_two_nodes_via_fp8dist_launch,
                 _deepspeed_sbatch_trains_across_two_nodes):
        with subtests.test(case.__name__.strip("_")):
            case(slurm)


def _dry_runs_print_each_nodes_command(slurm):
    out = _submit(slurm, "torchrun.sbatch", "--strategy", "fsdp", "--run-name", "a b", DRY_RUN="1",
                  NPROC_PER_NODE="2")
    head = re.search(r"head (\S+):(\d+)", out)
    assert head and head.group(1) == "127.0.0.1", "the head node's NodeAddr, not its unresolvable name"
    per_node = sorted(line for line in out.splitlines() if re.match(r"^[01]: ", line))
    assert len(per_node) == 2
    for task, line in enumerate(per_node):
        words = shlex.split(line.split(": ", 1)[1])
        assert words[:4] == ["torchrun", "--nnodes", "2", "--nproc-per-node"] and words[-4:] == [
            "--strategy", "fsdp", "--run-name", "a b"]
        assert f"127.0.0.1:{head.group(2)}" in words
    assert "step " not in out, "a dry run trains nothing"
    out = _submit(slurm, "torchrun.sbatch", "--strategy", "fsdp", DRY_RUN="1", NPROC_PER_NODE="2", HSDP="1")
    per_node = [line for line in out.splitlines() if re.match(r"^[01]: torchrun", line)]
    assert len(per_node) == 2 and all(shlex.split(line.split(": ", 1)[1])[-4:] == [
        "--strategy", "fsdp", "--replicate-degree", "2"] for line in per_node), "HSDP=1: one replica per node"
    out = _submit(slurm, "deepspeed.sbatch", "--zero-stage", "3", DRY_RUN="1", NPROC_PER_NODE="1")
    for rank in (0, 1):
        assert re.search(rf"^{rank}: deepspeed --hostfile \S+ --master_addr 127\.0\.0\.1 --no_ssh --node_rank {rank} ",
                         out, flags=re.M), out
    assert re.search(r"^0: n1 slots=1$", out, flags=re.M) and re.search(r"^0: n2 slots=1$", out, flags=re.M)


def _torchrun_sbatch_trains_across_two_nodes_via_fp8dist_launch(slurm):
    # one process per node (the dry runs above check NPROC_PER_NODE=2's commands): two nodes are the point, and
    # four processes on the CI's two cores cost twice the time
    out = _submit(slurm, "torchrun.sbatch", "--strategy", "fsdp", "--steps", "6", "--seq-len", "64",
                  NPROC_PER_NODE="1", via_cli=True)
    ready = _ready(out)
    assert [(r, w) for r, w, _, _ in ready] == [(0, 2), (1, 2)], out[-3000:]
    hosts = {node: {h for _, _, n, h in ready if n == node} for node in (0, 1)}
    assert [n for _, _, n, _ in ready] == [0, 1], "torchrun's node ranks: one process on each node"
    assert hosts[0] | hosts[1] == {"n1", "n2"} and len(hosts[0]) == len(hosts[1]) == 1, hosts
    losses = _losses(out)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, out[-3000:]
    assert "over 2 ranks" in out
    assert "starting 2 processes" not in out, "fp8dist train runs in torchrun's processes, no second launch"


def _deepspeed_sbatch_trains_across_two_nodes(slurm):
    hostfiles = slurm.root / "tmp"  # where deepspeed.sh writes each node's hostfile (TMPDIR): removed at exit
    hostfiles.mkdir()
    out = _submit(slurm, "deepspeed.sbatch", "--zero-stage", "2", "--fp8", "torchao", "--steps", "6", "--seq-len",
                  "64", NPROC_PER_NODE="1", TMPDIR=str(hostfiles))
    assert [(r, w, n) for r, w, n, _ in _ready(out)] == [(0, 2, 0), (1, 2, 1)], out[-3000:]
    assert {h for *_, h in _ready(out)} == {"n1", "n2"}
    losses = _losses(out)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, out[-3000:]
    assert "DeepSpeed ZeRO-2" in out and "over 2 ranks" in out and "strategy deepspeed, fp8 torchao" in out
    # the launcher on each node read both nodes from the hostfile deepspeed.sh wrote (its world_info: host -> slots)
    infos = re.findall(r"deepspeed\.launcher\.launch --world_info=(\S+) ", out)
    assert [json.loads(base64.b64decode(i)) for i in infos] == [{"n1": [0], "n2": [0]}] * 2, out[-3000:]
    assert list(hostfiles.glob("*hostfile*")) == [], "each node's temporary hostfile is removed"
