"""The shared-memory all-reduce of CPU ranks on one host (pagedkv/distributed/shm.py) against the
sum computed here: every rank ends with the same bytes, many calls in a row (both buffers, shapes
and dtypes changing), and a rank that never answers ends the call with an error naming it."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from pagedkv.distributed.shm import SLOT_BYTES, ShmAllReduce, shm_supported
from pagedkv_testing.tp_ranks import SHM_CALLS, shm_inputs, shm_rank_main

pytestmark = pytest.mark.skipif(not shm_supported(), reason="the shared-memory all-reduce runs on x86 Linux only")

@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_gets_the_same_sum_call_after_call(size: int) -> None:
    path = ShmAllReduce.create_file(size)
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=shm_rank_main, args=(path, r, size, out), daemon=True) for r in range(size)]
    try:
        for p in procs:
            p.start()
        got = dict(out.get(timeout=120) for _ in range(size))
    finally:
        os.unlink(path)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for call in range(SHM_CALLS):
        parts = [shm_inputs(r, call) for r in range(size)]
        want = parts[0].clone()
        for part in parts[1:]:
            want.add_(part)  # the ranks sum in rank order, in the tensors' dtype
        for rank in range(size):
            assert got[rank][call] == want.tolist(), (rank, call)  # the same bytes on every rank


def test_a_rank_that_never_answers_ends_the_call_naming_it(tmp_path) -> None:
    path = ShmAllReduce.create_file(2)
    try:
        reducer = ShmAllReduce(path, 0, 2, timeout_s=0.3)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] did not answer"):
            reducer.all_reduce(torch.ones(4))
        assert time.monotonic() - start < 10
        dead = ShmAllReduce(path, 0, 2, timeout_s=60.0, failed=lambda: "tensor-parallel rank 1 died")
        with pytest.raises(RuntimeError, match="rank 1 died"):
            dead.all_reduce(torch.ones(4))
    finally:
        os.unlink(path)


def test_what_does_not_fit_a_slot_is_left_to_gloo() -> None:
    path = ShmAllReduce.create_file(2)
    try:
        reducer = ShmAllReduce(path, 0, 2, timeout_s=1.0)
        assert reducer.takes(torch.zeros(SLOT_BYTES // 4))
        assert not reducer.takes(torch.zeros(SLOT_BYTES // 4 + 1))
        assert not reducer.takes(torch.zeros(8, 8).t())  # not contiguous
        assert not reducer.takes(torch.zeros(8, dtype=torch.int64))
    finally:
        os.unlink(path)
