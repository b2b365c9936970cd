"""uvicorn's server with pagedkv's shutdown rule: drain, don't drop.

On the first SIGTERM/SIGINT the app flips to draining and keeps listening: new requests get 503
with ``Retry-After`` (a load balancer retries them elsewhere, where "connection refused" would look
like a crash) while the requests in flight (streams included) finish, for up to the drain timeout.
Only then does uvicorn stop listening, close the idle connections and run the app's lifespan
shutdown, which stops the engine thread; the process exits 0. A second signal stops at once.

Connections run on ``GuardedH11Protocol`` (server/connections.py): a connection cap, header and
keep-alive timeouts, and out-of-descriptor errors logged once per interval.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from pagedkv.server.connections import GuardedH11Protocol, RateLimitedLog, fd_budget, install_fd_exhaustion_handler
from pagedkv.server.serving import ServerState


def server_config(app: FastAPI, **options: Any) -> uvicorn.Config:
    """uvicorn's config for ``app`` with its connection limits (``create_app``'s
    ``connection_limits``); ``options`` go to ``uvicorn.Config`` (host, port, log_level, ...)."""
    limits = app.state.server.connection_limits
    budget = fd_budget(limits.max_connections)
    return uvicorn.Config(app, http=GuardedH11Protocol.bound_to(limits, budget.max_connections),
                          timeout_keep_alive=limits.keep_alive_timeout, **{"backlog": budget.backlog, **options})


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.state.draining:
            print(f"pagedkv serve: {signal.Signals(sig).name}, draining {self.state.active} in-flight "
                  "request(s)", file=sys.stderr, flush=True)
        elif self.should_exit:
            self.force_exit = True  # a second signal: stop waiting for the drain
        self.state.draining = True
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after its shutdown, so the process would die by SIGTERM
        # even after a clean drain; a drained server exits 0 instead.
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        timeout = self.config.timeout_graceful_shutdown  # the drain timeout; None: wait for ever
        deadline = None if timeout is None else loop.time() + timeout
        while self.state.active > 0 and not self.force_exit and (deadline is None or loop.time() < deadline):
            await asyncio.sleep(0.05)
        if deadline is not None:  # uvicorn's own wait for connections gets what is left, not all again
            self.config.timeout_graceful_shutdown = max(1, round(deadline - loop.time()))
        await super().shutdown(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        install_fd_exhaustion_handler(asyncio.get_running_loop(), RateLimitedLog())
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                shown = f"[{host}]" if ":" in host else host
                print(f"pagedkv serve: model {self.state.model_name} listening on http://{shown}:{port}",
                      flush=True)
