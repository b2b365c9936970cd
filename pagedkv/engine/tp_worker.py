"""A spawned tensor-parallel rank: ``python -m pagedkv.engine.tp_worker RANK SIZE``, its rendezvous
port, engine config and parent pid pickled on stdin (``distributed/launch.spawn_workers``); runs
``tp_build.worker_main`` until rank 0 stops it."""

from __future__ import annotations

from pagedkv.distributed.launch import read_worker_payload
from pagedkv.engine.build import build_rank_runner
from pagedkv.engine.tp_build import worker_main


def main() -> None:
    rank, size, (port, config, parent_pid) = read_worker_payload()
    worker_main(rank, size, port, config, parent_pid, build_rank_runner)


if __name__ == "__main__":
    main()
