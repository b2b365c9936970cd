"""Building a tensor-parallel engine's runner: the ranks started (``distributed/launch.py``), each
rank's shard on its own ModelRunner (``build.build_runner`` with its ``TPGroup``), and rank 0's
``TPRunner`` over them (``runner/tp_runner.py``).

    pagedkv spawns:  rank 0 (this process)                 ranks 1..N-1 (python -m pagedkv.engine.tp_worker)
                     RankWatch on the workers' processes    die with rank 0 (PDEATHSIG + pid watch)
                     init gloo/NCCL on a free port   <--->  init on the same port
                     build_runner(tp=rank 0)         <--->  build_runner(tp=rank r)
                     TPRunner(local, ...)            ---->  serve_plans (until "stop")

    torchrun:        every process runs the same command; ``build_runner`` in rank r > 0 enters
                     serve_plans and, at the "stop" plan, exits the process (it never returns)

The engine never sees any of it: ``build_runner`` hands it a ``Runner``.
"""

from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from pagedkv import envs
from pagedkv.distributed.group import TPGroup
from pagedkv.distributed.launch import (
    RankFailedError,
    RankWatch,
    collective_timeout,
    die_with_parent,
    free_port,
    init_process_group,
    pin_threads,
    spawn_workers,
    torchrun_rank,
    wait_for_keys,
)
from pagedkv.distributed.shm import ShmAllReduce, shm_supported
from pagedkv.engine.config import EngineConfig
from pagedkv.errors import PagedKVError

# build.build_rank_runner, handed in by its callers (build.py imports this module, not the reverse):
# (config, tp) -> (RunnerParts, the whole model's ModelConfig)
RankBuilder = Callable[..., tuple[Any, Any]]

logger = logging.getLogger(__name__)


# The rendezvous store of this process's ranks (``launch.init_process_group``): start-up's waits go
# through it, so a rank still loading (or building the native kernels) is never taken for a hung
# one. One TP engine per process at a time, as torch.distributed's default group is.
_store: Any = None


def agree_pool_sizes(tp: TPGroup, *sizes: int) -> tuple[int, ...]:
    """Rank 0's ``sizes`` (block size, device, host and full-precision blocks) on every rank: block
    ids mean the same everywhere, so every rank holds the same pools (each sized its own from its
    free memory). Through the store: a rank waits for rank 0's sizes however long rank 0 loads."""
    if tp.rank == 0:
        _store.set("pagedkv-tp-pool", json.dumps(sizes))
        return tuple(sizes)
    return tuple(int(v) for v in json.loads(_store.get("pagedkv-tp-pool")))


def _device_of(config: EngineConfig, rank: int) -> EngineConfig:
    """The rank's config: on CUDA its own GPU (``cuda:rank``, torchrun's ``cuda:LOCAL_RANK``)."""
    if not config.device.startswith("cuda") and config.device != "auto":
        return config
    import torch

    if config.device == "auto" and not torch.cuda.is_available():
        return dataclasses.replace(config, device="cpu")
    launched = torchrun_rank()
    local = launched.local_rank if launched is not None else rank
    if local >= torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} on cuda needs a GPU per rank; rank "
                         f"{rank} would use cuda:{local} but torch sees {torch.cuda.device_count()} GPU(s)")
    return dataclasses.replace(config, device=f"cuda:{local}")


def _as_they_are() -> None:
    """The threads and cores of a process whose rank pinned none (a GPU rank's): nothing to put back."""


def _rank_setup(config: EngineConfig, rank: int, size: int, port: int | None,
                watch: RankWatch | None = None) -> tuple[EngineConfig, TPGroup, Any, Callable[[], None]]:
    """Join the group as ``rank`` and give the rank its device and threads: (its config, its
    TPGroup, the group step plans travel on, what puts the process's threads back)."""
    config = _device_of(config, rank)
    device_type = "cuda" if config.device.startswith("cuda") else "cpu"
    restore: Callable[[], None] = _as_they_are
    if device_type == "cpu":
        restore = pin_threads(rank, size, config.threads)
    else:
        import torch
        torch.cuda.set_device(config.device)
    global _store
    plan_group, _store = init_process_group(rank, size, port=port, device_type=device_type, watch=watch)
    # spawned CPU ranks share this host: their all-reduces go through shared memory (torchrun's
    # ranks may sit on several hosts: gloo)
    shm = None
    if device_type == "cpu" and port is not None and envs.TP_SHM.get() and shm_supported():
        shm = _open_shm(rank, size, watch)
    return config, TPGroup(rank, size, shm=shm), plan_group, restore


def _open_shm(rank: int, size: int, watch: RankWatch | None) -> ShmAllReduce:
    """Every rank maps the one file rank 0 made (named through the rendezvous store); rank 0
    removes its name once all have it open, so nothing is left behind in /dev/shm."""
    if rank == 0:
        path = ShmAllReduce.create_file(size)
        try:
            failed = None if watch is None else watch.dead_rank
            reducer = ShmAllReduce(path, 0, size, collective_timeout(), failed=failed)
            _store.set("pagedkv-tp-shm", path)
            wait_for_keys(_store, [f"pagedkv-tp-shm-open-{r}" for r in range(1, size)], watch, "map shared memory")
        finally:
            os.unlink(path)
        return reducer
    path = _store.get("pagedkv-tp-shm").decode()
    reducer = ShmAllReduce(path, rank, size, collective_timeout())
    _store.set(f"pagedkv-tp-shm-open-{rank}", "1")
    return reducer


WORKER_MODULE = "pagedkv.engine.tp_worker"  # what a spawned rank runs: worker_main, below


def worker_main(rank: int, size: int, port: int, config: EngineConfig, parent_pid: int, build: RankBuilder) -> None:
    """A spawned rank's process: join the group, load the rank's shard (``build``), apply step
    plans until rank 0 says stop. Any error ends the process (rank 0 names the rank)."""
    die_with_parent(parent_pid)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: the rank's stacks on stderr
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    try:
        _serve(config, rank, size, port, build)
    except (PagedKVError, ValueError, OSError) as exc:  # a user error (rank 0 says it too): one line, no trace
        logger.error("tensor-parallel rank %d stops: %s", rank, exc)
        sys.exit(1)


def _serve(config: EngineConfig, rank: int, size: int, port: int | None, build: RankBuilder) -> None:
    import torch.distributed as dist

    from pagedkv.runner.model_runner import ModelRunner
    from pagedkv.runner.tp_runner import serve_plans

    config, group, plan_group, _ = _rank_setup(config, rank, size, port)
    parts, _ = build(config, tp=group)
    assert isinstance(parts.runner, ModelRunner)  # (a rank's own shard)
    _store.set(f"pagedkv-tp-built-{rank}", "1")  # rank 0 sends its first plan once every rank is here
    serve_plans(parts.runner, plan_group, rank, size)
    dist.destroy_process_group()


def build_tp_runner(config: EngineConfig, build: RankBuilder) -> Any:
    """Rank 0's ``RunnerParts`` of an engine over ``config.tensor_parallel_size`` ranks, each rank's
    shard built by ``build``: workers spawned here, or (under torchrun) already running; in a
    torchrun rank > 0 this serves plans and exits the process instead of returning. Raises
    ValueError for a torchrun world of another size."""
    from pagedkv.runner.model_runner import ModelRunner
    from pagedkv.runner.tp_runner import TPRunner

    size = config.tensor_parallel_size
    launched = torchrun_rank()
    procs: list[Any] = []
    if launched is not None:
        if launched.world_size != size:
            raise ValueError(f"tensor_parallel_size {size} but torchrun started WORLD_SIZE={launched.world_size} "
                             f"processes: give --nproc-per-node {size} (or tensor_parallel_size "
                             f"{launched.world_size})")
        if launched.rank > 0:
            _serve(config, launched.rank, size, None, build)
            sys.exit(0)  # a worker rank's command ends with the engine it served
        port = None
    else:
        port = free_port()
        procs = spawn_workers(WORKER_MODULE, size, (port, config, os.getpid()))
    watch = RankWatch(procs)
    restore: Callable[[], None] = _as_they_are

    def shutdown(grace_s: float = 5.0) -> None:
        watch.end_workers(grace_s)
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        restore()  # this process's threads and cores as they were

    try:
        rank_config, group, plan_group, restore = _rank_setup(config, 0, size, port, watch)
        parts, full_config = build(rank_config, tp=group)
        wait_for_keys(_store, [f"pagedkv-tp-built-{r}" for r in range(1, size)], watch, "load the model")
    except BaseException as exc:
        failure = watch.dead_rank(wait_s=1.0) if not isinstance(exc, PagedKVError) else None
        shutdown(0.0)
        if failure is not None:  # a worker died first (its error is in its log above): say which
            raise RankFailedError(f"{failure} while the ranks started") from exc
        raise

    assert isinstance(parts.runner, ModelRunner)  # (rank 0's own shard)
    runner = TPRunner(parts.runner, group, full_config, plan_group=plan_group, watch=watch,
                      shutdown=shutdown)
    atexit.register(runner.close)
    logger.info("tensor parallelism: %d ranks (%s), %d KV blocks of %d bytes per rank", size,
                "torchrun" if launched is not None else "spawned", runner.num_blocks, runner.bytes_per_block)
    return parts._replace(runner=runner)
