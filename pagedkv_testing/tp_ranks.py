"""Tensor-parallel ranks for the tests: N gloo processes on this machine, each running one function.

``run_ranks(size, fn, args)`` spawns ``size`` processes (``torch.multiprocessing``'s spawn context),
joins them into one gloo group on a free local port, calls ``fn(tp, *args)`` in each with its
:class:`~pagedkv.distributed.group.TPGroup` and returns every rank's result in rank order. A rank
that raises or dies, or a run past ``timeout`` seconds, fails the call with the rank's error: the
processes are killed, never left behind, and a test never hangs. ``fn`` must be importable
(module level). ``sharded_greedy`` is the usual ``fn``: a model's rank shard through a
``ModelRunner``, greedy decoding several prompts with their logits.

Imported explicitly (``from pagedkv_testing.tp_ranks import ...``); pytest does not collect it.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from pagedkv.distributed.group import TPGroup


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
               out: Any, threads: int) -> None:
    torch.set_num_threads(threads)
    try:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=size, timeout=timedelta(seconds=60))
        result = fn(TPGroup(rank, size), *args)
        buf = io.BytesIO()  # bytes, not tensors: a tensor put on the queue lives in this process's shared memory
        torch.save(result, buf)
        out.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test with it
        out.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_ranks(size: int, fn: Callable[..., Any], args: Sequence[Any] = (), *, timeout: float = 240.0,
              threads: int = 1) -> list[Any]:
    """``fn(tp, *args)`` on ``size`` gloo ranks; their results in rank order (see the module doc)."""
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    env = {"OMP_NUM_THREADS": str(threads)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        procs = [ctx.Process(target=_rank_main, args=(r, size, port, fn, tuple(args), out, threads), daemon=True)
                 for r in range(size)]
        for p in procs:
            p.start()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results: dict[int, Any] = {}
    try:
        import time

        deadline = time.monotonic() + timeout
        while len(results) < size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"tensor-parallel ranks did not finish within {timeout:.0f} s "
                                   f"(done: {sorted(results)})")
            try:
                rank, ok, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode and r not in results]
                if dead:
                    raise RuntimeError(f"tensor-parallel rank {dead[0]} died (exit code "
                                       f"{procs[dead[0]].exitcode})") from None
                continue
            if not ok:
                raise RuntimeError(f"tensor-parallel rank {rank} of {size} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(size)]


def sharded_greedy(tp: TPGroup | None, cases: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """For each case (``folder``, ``prompts``, ``steps``; optional ``kv_cache_dtype``,
    ``quantization``, ``block_size``, ``lora``: a PEFT folder every prompt runs with, read against the
    whole model's config and given whole to the rank, as the engine does): load the model's shard on
    this rank, prefill every prompt
    together, then decode ``steps`` greedy tokens as one batch; returns (on rank 0; None elsewhere)
    per case ``tokens`` (per prompt) and ``logits`` (the float32 logits of every step, stacked)."""
    from pagedkv.models import load_model
    from pagedkv.runner import ModelRunner, SeqChunk
    from pagedkv_testing.hf_checkpoints import TinyAllocator

    results = []
    for case in cases:
        loaded = load_model(case["folder"], quantization=case.get("quantization", "none"), tp=tp)
        bs = int(case.get("block_size", 4))
        prompts, steps = case["prompts"], int(case["steps"])
        num_blocks = sum(-(-(len(p) + steps) // bs) for p in prompts) * 3 + 8  # up to 3 KV groups
        lora = case.get("lora")
        runner = ModelRunner(loaded, block_size=bs, num_blocks=num_blocks,
                             kv_cache_dtype=case.get("kv_cache_dtype"), max_loras=1 if lora else 0)
        if lora:
            from pagedkv.lora.adapter import load_adapter

            assert loaded.full_config is not None
            runner.set_lora_slot(0, load_adapter("a", 1, lora, loaded.full_config, max_rank=16))
        groups = len(runner.cache.groups)
        alloc = TinyAllocator(num_blocks, seed=1)
        tables = [alloc.take(-(-(len(p) + steps) // bs)) for p in prompts]
        extra = [tuple(alloc.take(-(-(len(p) + steps) // bs)) for _ in range(groups - 1)) for p in prompts]
        seqs = [list(p) for p in prompts]
        done = [0] * len(prompts)
        logits_all = []
        for _ in range(steps):
            chunks = [SeqChunk(s[d:], d, t, group_tables=g, lora_slot=0 if lora else -1)
                      for s, d, t, g in zip(seqs, done, tables, extra)]
            logits = runner.execute(chunks)
            logits_all.append(logits)
            for i, s in enumerate(seqs):
                done[i] = len(s)
                s.append(int(logits[i].argmax()))
        if tp is None or tp.rank == 0:
            results.append({"tokens": [s[len(p):] for s, p in zip(seqs, prompts)],
                            "logits": torch.cat(logits_all), "kv_heads": loaded.config.num_key_value_heads,
                            "bytes_per_block": runner.cache.bytes_per_block
                            if hasattr(runner.cache, "bytes_per_block") else None})
    return results if tp is None or tp.rank == 0 else None


SHM_CALLS = 40  # all-reduces each rank of tests/distributed/test_tp_shm.py makes


def shm_inputs(rank: int, call: int) -> torch.Tensor:
    """Rank ``rank``'s tensor for all-reduce number ``call``: the shape and dtype change call to call."""
    g = torch.Generator().manual_seed(1000 * rank + call)
    rows = 1 + call % 7
    dtype = torch.bfloat16 if call % 5 == 4 else torch.float32
    return torch.randn(rows, 3 + call % 4, 32, generator=g).to(dtype)


def shm_rank_main(path: str, rank: int, size: int, out: Any) -> None:
    """A process of the shared-memory all-reduce test: ``SHM_CALLS`` sums through the file ``path``,
    the results put on ``out`` as ``(rank, [nested lists])`` (lists: a tensor sent through a queue
    stays in this process's shared memory, gone once it exits)."""
    from pagedkv.distributed.shm import ShmAllReduce

    torch.set_num_threads(1)
    reducer = ShmAllReduce(path, rank, size, timeout_s=60.0)
    results = []
    for call in range(SHM_CALLS):
        x = shm_inputs(rank, call)
        assert reducer.takes(x)
        results.append(reducer.all_reduce(x).tolist())
    out.put((rank, results))
