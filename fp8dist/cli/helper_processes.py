"""The processes a launching process starts besides its ranks, and waiting for them before it exits.

torch's elastic launch with ``start_method="forkserver"`` (what ``fp8dist train`` runs) makes this process start
two helpers of Python's multiprocessing: the fork server the ranks fork from, and the resource tracker. Both are
this process's children and leave by themselves only once it has exited (they see their pipe from it close), so
each would end as an orphan that init reaps whenever it gets to it: a ``<defunct>`` entry outliving the command,
for seconds on a loaded host. A launcher reaps every child it started before it exits.
"""

from __future__ import annotations

from multiprocessing import forkserver, resource_tracker

__all__ = ["stop_multiprocessing_helpers"]


def stop_multiprocessing_helpers() -> None:
    """Stop multiprocessing's fork server and resource tracker, if this process started them, and reap both.

    Call it once every rank has been joined (the fork server leaves when the last process holding its pipe has
    gone, so a rank still running would make this wait for it). The fork server first: it and the ranks forked
    from it hold the resource tracker's pipe. A later launch starts fresh ones. multiprocessing has no public way
    to stop them: ``_stop`` is what CPython's own test suite stops them with."""
    for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
        helper._stop()
