"""Imported first by ``fp8dist train``'s fork server (which preloads modules by name only), so the ranks it forks
are quiet too (:func:`fp8dist.cli.common.quiet_cpu_noise`) and find the training job imported once, not once per
rank (the CLI's modules import it only when a command runs)."""

from ..train.job import run_training  # noqa: F401
from .common import quiet_cpu_noise

quiet_cpu_noise()
