"""Starting the ranks of a tensor-parallel engine, and noticing when one is gone.

Two ways to get N processes (docs/tensor_parallel.md):

- **spawned by pagedkv** (``tensor_parallel_size N`` on any entry point): rank 0 is the engine's own
  process (it runs the scheduler and the memory core, and computes its shard like vLLM's driver
  worker); it starts ranks 1..N-1 as fresh interpreters (``python -m <worker module>``, spawned,
  never forked: no copied torch state, and the caller's script is not run again in each worker,
  so it needs no ``if __name__ == "__main__"`` guard), meeting on a free local port;
- **launched by torchrun** (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` set): every
  process runs the same command; rank 0 goes on to the engine or server, ranks > 0 enter the worker
  loop and never return to the caller.

Failure is loud, never a hang: rank 0 watches the spawned workers' processes (:class:`RankWatch`:
a dead rank is named within a fraction of a second, at start-up too), every collective has a
timeout (``PAGEDKV_TP_TIMEOUT_S``) for a rank that stops answering, and each worker dies with its
parent (``PR_SET_PDEATHSIG`` where Linux has it, and a thread that watches the parent's pid), so
no worker outlives rank 0.

This module knows processes, ports, cores and ``torch.distributed``'s setup; what the ranks run is
the caller's (``engine/tp_build.py``).
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv import envs
from pagedkv.errors import PagedKVError

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class RankFailedError(PagedKVError, RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot go on (the message
    names the rank). The engine turns it into EngineDeadError."""


@dataclass(frozen=True, slots=True)
class TorchrunRank:
    """This process's place in a ``torchrun`` launch (its environment variables)."""

    rank: int
    world_size: int
    local_rank: int


def torchrun_rank() -> TorchrunRank | None:
    """The rank torchrun (or any launcher setting ``RANK`` and ``WORLD_SIZE``) gave this process,
    or None when it was not launched so (or with a world of one)."""
    rank, world = envs.TORCH_RANK.get(), envs.TORCH_WORLD_SIZE.get()
    if rank is None or world is None or world <= 1:
        return None
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
    return TorchrunRank(rank, world, envs.TORCH_LOCAL_RANK.get() or 0)


def free_port() -> int:
    """A TCP port the OS says is free on this host (for the ranks' rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def collective_timeout() -> float:
    """Seconds one collective may wait for a rank (``PAGEDKV_TP_TIMEOUT_S``)."""
    return float(envs.TP_TIMEOUT_S.get())


# The longest a rank may take to start: a fresh interpreter importing torch, the native kernels'
# first build (minutes), loading a large model. Start-up waits on the rendezvous store (polled,
# watching the workers), never in a collective, whose timeout is PAGEDKV_TP_TIMEOUT_S.
STARTUP_S = 1800.0


def init_process_group(rank: int, size: int, *, port: int | None, device_type: str,
                       watch: RankWatch | None = None) -> tuple[Any, Any]:
    """Join the ranks' default process group (gloo on CPU, NCCL on CUDA) at ``127.0.0.1:port``
    (None: torchrun's ``MASTER_ADDR``/``MASTER_PORT``); returns (the group the step plans travel on:
    None, the default group, or beside NCCL a gloo group, plans being host bytes; the rendezvous
    store, for start-up's waits: :func:`wait_for_keys`). Rank 0 of spawned workers waits for each
    to check in, and fails at once, naming it, when ``watch`` sees one die. Raises RankFailedError
    when the ranks do not meet."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=collective_timeout())
    backend = "nccl" if device_type == "cuda" else "gloo"
    where = "torchrun's MASTER_ADDR:MASTER_PORT" if port is None else f"127.0.0.1:{port}"
    try:
        if port is None:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size, timeout=timeout)
            from torch.distributed.distributed_c10d import _get_default_store
            store = _get_default_store()
            store.set_timeout(datetime.timedelta(seconds=STARTUP_S))
        else:
            store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0,
                                  timeout=datetime.timedelta(seconds=STARTUP_S), wait_for_workers=False)
            if rank == 0:
                wait_for_keys(store, [f"pagedkv-tp-ready-{r}" for r in range(1, size)], watch, "start")
            else:
                store.set(f"pagedkv-tp-ready-{rank}", "1")
            dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    except (RuntimeError, ValueError) as exc:  # (DistStoreError is a RuntimeError)
        if isinstance(exc, RankFailedError):
            raise
        raise RankFailedError(f"tensor-parallel rank {rank} of {size}: the ranks did not meet at {where}: "
                              f"{exc}") from exc
    if backend == "gloo":
        return None, store  # the default group
    return dist.new_group(backend="gloo", timeout=timeout), store


def wait_for_keys(store: Any, keys: list[str], watch: RankWatch | None, what: str) -> None:
    """Rank 0: wait until every key is set at ``store`` (the workers' check-ins); RankFailedError
    naming a rank that died first, or after STARTUP_S."""
    deadline = time.monotonic() + STARTUP_S
    while not store.check(keys):
        if watch is not None and watch.failure is not None:
            raise RankFailedError(watch.failure)
        if time.monotonic() > deadline:
            raise RankFailedError(f"the tensor-parallel workers did not {what} within {STARTUP_S:.0f} s")
        time.sleep(0.05)


def pin_threads(rank: int, size: int, threads: int | None) -> Callable[[], None]:
    """Give this rank its torch threads: ``threads`` (default: this process's cores / ``size``),
    pinned to its own cores (``os.sched_setaffinity``) when ``size * threads`` fits in the cores
    this process may use, else left unpinned with a one-line warning. Returns what puts the
    process's threads and cores back (rank 0 is the caller's process: its engine's close does)."""
    import torch

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per = threads or max(1, len(cores) // size)
    before = torch.get_num_threads()

    def restore() -> None:
        torch.set_num_threads(before)
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)

    torch.set_num_threads(per)
    if size * per <= len(cores) and hasattr(os, "sched_setaffinity"):
        mine = cores[rank * per:(rank + 1) * per]
        os.sched_setaffinity(0, mine)
        logger.info("tensor-parallel rank %d: %d thread(s) on cores %s", rank, per, ",".join(map(str, mine)))
    elif rank == 0:
        hint = (f"give --threads {len(cores) // size} or fewer" if len(cores) >= size
                else f"{size} ranks want {size} cores at least")
        logger.warning("tensor parallelism: %d ranks x %d threads exceed the %d cores this process may use; "
                       "the ranks are not pinned (they share cores, which slows every all-reduce): %s",
                       size, per, len(cores), hint)
    return restore


def die_with_parent(parent_pid: int) -> None:
    """End this worker when its parent (rank 0) ends: SIGKILL from the kernel where Linux offers
    ``PR_SET_PDEATHSIG``, and a daemon thread that notices a new parent pid within 0.5 s."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the thread below does it
    if os.getppid() != parent_pid:  # the parent died before the call above
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(1)  # no cleanup: rank 0 is gone, nothing waits for this one

    threading.Thread(target=watch, name="pagedkv-tp-parent-watch", daemon=True).start()


def spawn_workers(module: str, size: int, payload: Any) -> list[subprocess.Popen[bytes]]:
    """Start ranks 1..size-1 as ``python -m module RANK SIZE`` (a fresh interpreter each), with
    ``payload`` pickled on its stdin (:func:`read_worker_payload`). Returns the processes, rank order."""
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    procs = []
    for rank in range(1, size):
        proc = subprocess.Popen([sys.executable, "-m", module, str(rank), str(size)], stdin=subprocess.PIPE)
        assert proc.stdin is not None
        proc.stdin.write(data)
        proc.stdin.close()
        procs.append(proc)
    return procs


def read_worker_payload() -> tuple[int, int, Any]:
    """In a spawned worker: (rank, size, the payload) from its command line and stdin."""
    rank, size = int(sys.argv[1]), int(sys.argv[2])
    return rank, size, pickle.load(sys.stdin.buffer)


class RankWatch:
    """Rank 0's watch on the spawned workers: a daemon thread per worker waits for its process to
    end and records the first that does (``failure``: a message naming the rank), then calls the
    ``on_failure`` callbacks once. ``stop()`` ends the watch before a clean shutdown."""

    def __init__(self, procs: Sequence[subprocess.Popen[bytes]]) -> None:
        self.procs = list(procs)
        self.failure: str | None = None
        self._callbacks: list[Callable[[str], None]] = []
        self._stopping = False
        self._lock = threading.Lock()
        for rank, proc in enumerate(self.procs, 1):
            threading.Thread(target=self._wait, args=(rank, proc), name=f"pagedkv-tp-watch-rank{rank}",
                             daemon=True).start()

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(message)`` when a rank fails (at once if one has already)."""
        with self._lock:
            failure = self.failure
            if failure is None:
                self._callbacks.append(callback)
        if failure is not None:
            callback(failure)

    def fail(self, message: str) -> None:
        """Record ``message`` as the failure (the first one wins) and tell the callbacks."""
        with self._lock:
            if self.failure is not None or self._stopping:
                return
            self.failure = message
            callbacks, self._callbacks = self._callbacks, []
        logger.error("%s", message)
        for callback in callbacks:
            try:
                callback(message)
            except Exception:  # a callback must not keep the others from running
                logger.exception("a tensor-parallel failure callback failed")

    def dead_rank(self, wait_s: float = 0.0) -> str | None:
        """The failure, waiting up to ``wait_s`` for a sentinel (a collective error usually comes
        a moment before the process is reaped)."""
        deadline = time.monotonic() + wait_s
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.failure

    def _wait(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        self.fail(f"tensor-parallel rank {rank} (pid {proc.pid}) died ({how}); the engine cannot go on")

    def stop(self) -> None:
        """A clean shutdown: workers ending from now on are not failures."""
        with self._lock:
            self._stopping = True

    def end_workers(self, grace_s: float = 5.0) -> None:
        """Wait up to ``grace_s`` for the workers to exit, then kill those left (no orphans)."""
        self.stop()
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)
