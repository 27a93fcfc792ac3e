"""The launcher's environment as fp8dist reads it: every variable's bad value is one line naming it, its value, what
is allowed and the way out, before anything starts; a rendezvous port held by another program is named as such on
rank 0 and on the other ranks, within the one rendezvous timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from cli_helpers import BIN
from fp8dist.runtime.env import LaunchError, detect_launch_env
from fp8dist.runtime.env_vars import VARIABLES

_INDEX = ("an integer, 0 or more", ["-1", "one", "1.5", ""])
_COUNT = ("an integer, 1 or more", ["0", "-2", "two", ""])
BAD = {  # variable -> (what the error says is allowed, values it refuses)
    "RANK": _INDEX, "WORLD_SIZE": _COUNT, "LOCAL_RANK": _INDEX, "LOCAL_WORLD_SIZE": _COUNT, "LOCAL_SIZE": _COUNT,
    "GROUP_RANK": _INDEX, "CROSS_RANK": _INDEX, "MASTER_ADDR": ("a host name or address", ["", "  "]),
    "MASTER_PORT": ("an integer from 1 to 65535", ["70000", "65536", "0", "-1", "http", "29500.0", ""]),
    "SLURM_PROCID": _INDEX, "SLURM_NTASKS": _COUNT, "SLURM_STEP_NUM_TASKS": _COUNT, "SLURM_LOCALID": _INDEX,
    "SLURM_NODEID": _INDEX, "SLURM_NTASKS_PER_NODE": _COUNT, "SLURM_JOB_ID": _INDEX,
    "SLURM_JOB_NODELIST": ("a SLURM node list", [""]), "SLURM_STEP_NODELIST": ("a SLURM node list", [""]),
    "TORCHELASTIC_RESTART_COUNT": _INDEX, "TORCHELASTIC_USE_AGENT_STORE": ("True or False", ["1", "yes", ""]),
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": ("an integer number of seconds, 0 or more", ["-1", "5s"]),
    "FP8DIST_RENDEZVOUS_TIMEOUT": ("a positive number of seconds (default 600)", ["0", "-5", "inf", "nan", "soon"]),
}
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
SRUN = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7", "MASTER_ADDR": "head"}


def test_every_variable_fp8dist_reads_has_its_rule():
    assert set(BAD) == set(VARIABLES)


@pytest.mark.parametrize("launch", [TORCHRUN, SRUN], ids=["torchrun", "srun"])
@pytest.mark.parametrize("name,value", [(name, value) for name, (_, values) in BAD.items() for value in values])
def test_a_bad_launch_variable_is_one_line_naming_it_its_value_and_what_is_allowed(launch, name, value):
    """Under either launcher, whether or not that launcher's path reads the variable."""
    with pytest.raises(LaunchError) as err:
        detect_launch_env({**launch, name: value})
    message = str(err.value)
    assert message.startswith(f"{name}={value!r} must be {BAD[name][0]}: ") and "\n" not in message


@pytest.mark.parametrize("launch,names", [({**TORCHRUN, "RANK": "2"}, ("RANK", "WORLD_SIZE")),
                                          ({**SRUN, "SLURM_PROCID": "2"}, ("SLURM_PROCID", "SLURM_NTASKS"))],
                         ids=["torchrun", "srun"])
def test_a_rank_outside_the_world_names_both_variables(launch, names):
    with pytest.raises(LaunchError, match=rf"^{names[0]}=2: rank 2 is outside world size 2 \({names[1]}=2, ranks 0 to "
                                          rf"1\): start every process with the same {names[1]}"):
        detect_launch_env(launch)


WAY_OUT = {
    "MASTER_PORT": ("'70000' must be an integer from 1 to 65535: set it to a free port on rank 0's machine, the same "
                    "for every rank (torchrun --master-port sets it; 0 would let rank 0's system pick one the other "
                    "ranks cannot know)."),
    "WORLD_SIZE": ("'0' must be an integer, 1 or more: set it to the number of processes in the job, the same for "
                   "every rank (torchrun, deepspeed and srun set it for each process), or unset RANK and WORLD_SIZE "
                   "to run as one process."),
}


@pytest.mark.parametrize("name,launched", [("MASTER_PORT", True), ("WORLD_SIZE", True), ("MASTER_PORT", False)],
                         ids=["MASTER_PORT-rank", "WORLD_SIZE-rank", "MASTER_PORT-launcher"])
def test_the_command_says_a_bad_launch_variable_in_one_line_with_exit_2(name, launched):
    """As one rank of a job started by hand (RANK, WORLD_SIZE set), and as the launcher of its own ``--nproc 2``
    ranks with the variable set in the shell."""
    environ = {k: v for k, v in os.environ.items() if k not in TORCHRUN}
    environ.update({**TORCHRUN, "RANK": "0"} if launched else {}, PYTHONUNBUFFERED="1")
    environ[name] = WAY_OUT[name].split("'")[1]
    proc = subprocess.run([str(BIN / "fp8dist"), "train", "--nproc", "2", "--steps", "1", "--fp8", "none"],
                          env=environ, capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"fp8dist train: error: {name}={WAY_OUT[name]}\n")


@pytest.fixture
def held_port():
    """A port on 127.0.0.1 held by another program: it listens, and never answers."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(8)
        yield holder.getsockname()[1]


_RENDEZVOUS = """
from fp8dist.runtime.env import LaunchError, init_distributed
try:
    init_distributed(device="cpu")
except LaunchError as err:
    print(err)
"""


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_master_port_held_by_another_program_is_named_within_the_rendezvous_timeout(rank, held_port):
    """A real rank, in its own process: before the fix rank 1 waited for an answer forever, so the test's only clock
    is the generous limit on that process."""
    environ = {k: v for k, v in os.environ.items() if k not in (*TORCHRUN, *SRUN, "TORCHELASTIC_USE_AGENT_STORE")}
    environ.update(RANK=rank, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(held_port),
                   FP8DIST_RENDEZVOUS_TIMEOUT="1")
    proc = subprocess.run([sys.executable, "-c", _RENDEZVOUS], env=environ, capture_output=True, text=True,
                          timeout=300)
    where = f"127.0.0.1:{held_port} (MASTER_ADDR:MASTER_PORT)"
    free = "choose a free MASTER_PORT, the same for every rank."
    if rank == "0":
        assert proc.stdout == (f"rank 0 cannot host the rendezvous at {where}: port {held_port} is in use by another "
                               f"program on this machine. Stop that program (ss -ltnp 'sport = :{held_port}' names "
                               f"it), or {free}\n")
    else:
        assert proc.stdout == (f"rank 1 of 2: the program at {where} accepted a connection but did not answer as rank "
                               f"0's rendezvous within 1 s: another program holds that port. Stop it (ss -ltnp 'sport "
                               f"= :{held_port}' on that machine names it), or {free}\n")
    assert proc.returncode == 0, proc.stderr  # no abort: torch's client thread was ended before the process exits
