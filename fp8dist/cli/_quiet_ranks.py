"""Imported first by ``fp8dist train``'s fork server (multiprocessing preloads modules by name, nothing else): the
CPU noise :func:`fp8dist.cli.common.quiet_cpu_noise` silences is silenced there before it imports what the ranks
import, so the ranks it forks print none of it either."""

from .common import quiet_cpu_noise

quiet_cpu_noise()
