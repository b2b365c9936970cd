"""``ShmAllReduce``: the tensor-parallel all-reduce of CPU ranks on one host, through shared memory.

gloo's all-reduce goes through TCP on the loopback and its own I/O threads: about 1 ms a call
measured on this 2-core machine (ranks pinned one core each), and a decode step of a 30-layer model
makes 61 of them (o and down of each layer, and the embedding): more than the step's compute
(docs/tensor_parallel.md). vLLM's CPU backend sums through shared memory for the same reason. Here
each rank copies its tensor into its slot of a file mapped by every rank (in /dev/shm), raises its
sequence number, waits for every rank's, and sums the slots in rank order, so every rank computes
the same bytes:

    header: one int64 sequence number per rank (64 bytes apart)
    data:   2 buffers x N slots x SLOT_BYTES   (call k uses buffer k % 2)

Two buffers make one wait per call enough: a rank writes call k+2's slot (buffer k % 2) only after
every rank has raised its number to k+1, which each does only after reading call k's slots.

Tensors larger than a slot, or not float and contiguous on the CPU, go through gloo (every rank
takes the same path: the shapes are the same on every rank). x86 only: its stores become visible in
program order (a lock's atomic operation orders the copy before the sequence number); elsewhere the
ranks use gloo. A rank that stops raising its number is a hung or dead rank: past the collective
timeout, or at once when ``failed()`` (rank 0's watch on the workers) names one, the call raises.
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

SLOT_BYTES = 1 << 20  # the largest tensor summed here (a decode step's hidden states: rows x hidden x 4)
_HEADER = 64  # bytes per rank's sequence number (one cache line each: no false sharing)
_SPIN = 256  # checks before the waiting rank starts yielding its core
_YIELD_S = 0.002  # then sched_yield for this long, then short sleeps (ranks sharing cores)


def shm_supported() -> bool:
    """Whether this machine's stores are ordered as the protocol needs (x86) on Linux."""
    return platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class ShmAllReduce:
    """Rank ``rank`` of ``size``'s view of the shared file ``path`` (see the module docstring)."""

    def __init__(self, path: str | Path, rank: int, size: int, timeout_s: float,
                 failed: Callable[[], str | None] | None = None) -> None:
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.failed = failed
        self._seq = 0
        self._fence = threading.Lock()
        length = self.file_bytes(size)
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, length)
        finally:
            os.close(fd)
        self._seqs = memoryview(self._map)[:_HEADER * size].cast("q")  # rank r's number at r * 8
        data = torch.frombuffer(self._map, dtype=torch.uint8, offset=_HEADER * size,
                                count=2 * size * SLOT_BYTES)
        self._slots = data.view(2, size, SLOT_BYTES)

    @staticmethod
    def file_bytes(size: int) -> int:
        return _HEADER * size + 2 * size * SLOT_BYTES

    @staticmethod
    def create_file(size: int) -> str:
        """A new zeroed file for ``size`` ranks (rank 0 makes it; unlink it once every rank has it open)."""
        fd, path = tempfile.mkstemp(prefix="pagedkv-tp-", dir=_shm_dir())
        try:
            os.ftruncate(fd, ShmAllReduce.file_bytes(size))
        finally:
            os.close(fd)
        return path

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is summed here (else the caller uses gloo)."""
        return (x.device.type == "cpu" and x.is_contiguous() and x.is_floating_point()
                and x.numel() * x.element_size() <= SLOT_BYTES)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place (``takes(x)`` must hold); returns ``x``."""
        self._seq += 1
        seq, n = self._seq, x.numel()
        slots = self._slots[seq & 1]
        views = [slots[r, :n * x.element_size()].view(x.dtype)[:n].view(x.shape) for r in range(self.size)]
        views[self.rank].copy_(x)
        with self._fence:  # an atomic operation: the copy is visible before the number below
            self._seqs[self.rank * (_HEADER // 8)] = seq
        self._wait(seq)
        x.copy_(views[0])
        for view in views[1:]:
            x.add_(view)
        return x

    def _wait(self, seq: int) -> None:
        seqs, step, size = self._seqs, _HEADER // 8, self.size
        checks = 0
        start = 0.0
        while True:
            if all(seqs[r * step] >= seq for r in range(size)):
                return
            checks += 1
            if checks <= _SPIN:
                continue
            now = time.monotonic()
            if not start:
                start = now
            waited = now - start
            if waited < _YIELD_S:
                os.sched_yield()
                continue
            time.sleep(0.00005)
            if checks % 64 == 0:
                why = self.failed() if self.failed is not None else None
                if why is not None:
                    raise RuntimeError(why)
                if waited > self.timeout_s:
                    late = [r for r in range(size) if seqs[r * step] < seq]
                    raise RuntimeError(f"tensor-parallel all-reduce: rank(s) {late} did not answer within "
                                       f"{self.timeout_s:.0f} s (PAGEDKV_TP_TIMEOUT_S)")

    def close(self) -> None:
        self._seqs.release()
        del self._slots
        self._map.close()
