"""Imported first by ``fp8dist train``'s fork server (which preloads modules by name only), so the ranks it forks
are quiet too (:func:`fp8dist.cli.common.quiet_cpu_noise`)."""

from .common import quiet_cpu_noise

quiet_cpu_noise()
