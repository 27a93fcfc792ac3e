"""The multi-process harness itself: failures and hangs surface every rank's traceback."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks


def _sum_of_ranks(rank: int, world: int) -> int:
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t.item())


def _rank1_raises(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 waits for a peer that is gone


def _rank0_hangs(rank: int, world: int) -> None:
    if rank == 0:
        time.sleep(3600)
    # the peer waits for it: had it exited at once, a rank 0 still finishing gloo's connection set-up would fail
    # with "connection closed by peer" instead of hanging (seen on a loaded machine)
    dist.barrier()


def _skips(rank: int, world: int) -> None:
    pytest.skip("needs a GPU")


def test_results_come_back_in_rank_order():
    assert run_ranks(_sum_of_ranks, world_size=3) == [6, 6, 6]


def test_a_failing_rank_fails_the_test_with_every_rank_shown():
    with pytest.raises(pytest.fail.Exception) as err:
        run_ranks(_rank1_raises)
    text = str(err.value)
    assert "ValueError: boom on rank 1" in text and "--- rank 0" in text and "--- rank 1 (exit 1)" in text


def test_a_hang_times_out_with_stack_dumps():
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as err:
        run_ranks(_rank0_hangs, timeout=8)
    text = str(err.value)
    assert "timed out after 8s" in text
    assert "_rank0_hangs" in text, "the hung rank's stack is dumped"
    assert time.monotonic() - start < 30


def test_skip_inside_ranks_skips_the_test():
    with pytest.raises(pytest.skip.Exception, match="needs a GPU"):
        run_ranks(_skips)
