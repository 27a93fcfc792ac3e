"""The launcher's environment variables fp8dist reads: what each may hold, and one reader that refuses a bad value
in one line before anything starts (not deep inside torch, nor in a rendezvous that cannot succeed)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["LaunchError", "Variable", "VARIABLES", "RENDEZVOUS_TIMEOUT_S", "TIMEOUT_VARIABLE", "read",
           "check_variables"]


class LaunchError(RuntimeError):
    """The launcher's environment is incomplete or inconsistent, or the ranks did not meet (says what to set)."""


@dataclass(frozen=True)
class Variable:
    """What one environment variable may hold."""

    parse: Callable[[str], Any]
    """The value of an allowed text, None for a text that is not allowed."""
    allowed: str
    """What is allowed, as the error says it: "an integer from 1 to 65535"."""
    way_out: str
    """What to do instead: the end of the error's sentence."""


def _number(cast: Callable[[str], Any], allowed: Callable[[Any], bool]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            return None
        return value if allowed(value) else None
    return parse


def _text(text: str) -> str | None:
    return text if text.strip() else None


def _set(what: str, who: str, otherwise: str = "or unset it") -> str:
    return f"set it to {what} ({who}), {otherwise}"


RENDEZVOUS_TIMEOUT_S = 600.0
"""Seconds the ranks wait for each other to start by default: torchrun's ``join_timeout`` (SLURM nodes start apart)."""
TIMEOUT_VARIABLE = "FP8DIST_RENDEZVOUS_TIMEOUT"
"""The environment variable that changes it (torch has none for its ``env://`` rendezvous)."""

_EACH = "torchrun, deepspeed and srun set it for each process"
_PORT = ("set it to a free port on rank 0's machine, the same for every rank (torchrun --master-port sets it; 0 would "
         "let rank 0's system pick one the other ranks cannot know)")
_SLURM = "srun sets it for each task; start the job with srun or sbatch, or unset it to run without SLURM"
_TORCHRUN = "torchrun sets it; unset it outside torchrun"
_NODELIST = "run inside a SLURM job, or set MASTER_ADDR to the head node's address"
_INDEX, _INDEX_TEXT = _number(int, lambda v: v >= 0), "an integer, 0 or more"
_COUNT, _COUNT_TEXT = _number(int, lambda v: v >= 1), "an integer, 1 or more"

VARIABLES: dict[str, Variable] = {
    "RANK": Variable(_INDEX, _INDEX_TEXT, _set("this process's index in the job, below WORLD_SIZE", _EACH,
                                               "or unset RANK and WORLD_SIZE to run as one process")),
    "WORLD_SIZE": Variable(_COUNT, _COUNT_TEXT, _set("the number of processes in the job, the same for every rank",
                                                     _EACH, "or unset RANK and WORLD_SIZE to run as one process")),
    "LOCAL_RANK": Variable(_INDEX, _INDEX_TEXT, _set("this process's index on its node", _EACH)),
    "LOCAL_WORLD_SIZE": Variable(_COUNT, _COUNT_TEXT, _set("the number of processes on this node", "torchrun sets it")),
    "LOCAL_SIZE": Variable(_COUNT, _COUNT_TEXT, _set("the number of processes on this node",
                                                     "the deepspeed launcher sets it")),
    "GROUP_RANK": Variable(_INDEX, _INDEX_TEXT, _set("this node's index in the job", "torchrun sets it")),
    "CROSS_RANK": Variable(_INDEX, _INDEX_TEXT, _set("this node's index in the job", "the deepspeed launcher sets it")),
    "MASTER_ADDR": Variable(_text, "a host name or address", "set it to rank 0's machine, the same for every rank"),
    "MASTER_PORT": Variable(_number(int, lambda v: 1 <= v <= 65535), "an integer from 1 to 65535", _PORT),
    "SLURM_PROCID": Variable(_INDEX, _INDEX_TEXT, _SLURM),
    "SLURM_NTASKS": Variable(_COUNT, _COUNT_TEXT, _SLURM),
    "SLURM_STEP_NUM_TASKS": Variable(_COUNT, _COUNT_TEXT, _SLURM),
    "SLURM_LOCALID": Variable(_INDEX, _INDEX_TEXT, _SLURM),
    "SLURM_NODEID": Variable(_INDEX, _INDEX_TEXT, _SLURM),
    "SLURM_NTASKS_PER_NODE": Variable(_COUNT, _COUNT_TEXT, _SLURM),
    "SLURM_JOB_ID": Variable(_INDEX, _INDEX_TEXT, "sbatch and salloc set it: run inside a SLURM job, or unset it"),
    "SLURM_JOB_NODELIST": Variable(_text, "a SLURM node list", _NODELIST),
    "SLURM_STEP_NODELIST": Variable(_text, "a SLURM node list", _NODELIST),
    "TORCHELASTIC_RESTART_COUNT": Variable(_INDEX, _INDEX_TEXT, _TORCHRUN),
    "TORCHELASTIC_USE_AGENT_STORE": Variable({"True": True, "False": False}.get, "True or False", _TORCHRUN),
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": Variable(_INDEX, "an integer number of seconds, 0 or more",
                                               "set it to how long interrupted ranks get to exit, or unset it"),
    TIMEOUT_VARIABLE: Variable(_number(float, lambda v: v > 0 and math.isfinite(v)),
                               f"a positive number of seconds (default {RENDEZVOUS_TIMEOUT_S:.0f})",
                               "set it to how long the ranks wait for each other to start, or unset it"),
}
"""Every variable fp8dist reads from a launcher's environment (``OMP_NUM_THREADS`` aside: only whether it is set)."""


def read(environ: Mapping[str, str], name: str, default: Any = None) -> Any:
    """The value of ``name`` in ``environ`` as its row of :data:`VARIABLES` parses it, ``default`` when unset;
    LaunchError naming the variable, its value, what is allowed and the way out when the value is not allowed."""
    text = environ.get(name)
    if text is None:
        return default
    variable = VARIABLES[name]
    value = variable.parse(text)
    if value is None:
        raise LaunchError(f"{name}={text!r} must be {variable.allowed}: {variable.way_out}.")
    return value


def check_variables(environ: Mapping[str, str]) -> None:
    """LaunchError for the first variable of :data:`VARIABLES` set to a bad value, read by this launch or not."""
    for name in VARIABLES:
        read(environ, name)
