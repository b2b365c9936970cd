"""Replicas of ``pagedkv serve`` behind the SMG router, all on loopback (tests and bench/scaleout.py).

    with Cluster(model, replicas=2, policy="cache_aware", replica_args=[...]) as c:
        httpx.post(c.router_url + "/v1/completions", json=...)
        c.metrics(0)["pagedkv_prefix_cache_hits_total"]
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pagedkv_testing.server import free_port, spawn_server, stop_server

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def smg_binary() -> str | None:
    """The SMG router's command (installed by setup with the test extras), or None."""
    found = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
    return found if Path(found).exists() else None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name or name{labels}: value}; names without labels sum their series."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.groups()
        out[name] = out.get(name, 0.0) + float(value)
        if labels:
            out[name + labels] = float(value)
    return out


class Cluster:
    def __init__(self, model: str, *, replicas: int = 2, policy: str = "cache_aware",
                 replica_args: list[str] | None = None, router_args: list[str] | None = None,
                 served_model_name: str = "m", env: dict[str, str] | None = None) -> None:
        self.model, self.n, self.policy = model, replicas, policy
        self.replica_args = replica_args or []
        self.router_args = router_args or []
        self.name = served_model_name
        self.env = env or {}
        self.procs: list[subprocess.Popen[str] | None] = []
        self.urls: list[str] = []
        self.router: subprocess.Popen[bytes] | None = None
        self.router_url = ""
        self.router_log = ""

    def __enter__(self) -> Cluster:
        try:
            for _ in range(self.n):
                port = free_port()
                proc, _ = spawn_server([self.model, "--port", str(port), "--served-model-name", self.name,
                                        *self.replica_args], env=self.env, timeout=300)
                self.procs.append(proc)
                self.urls.append(f"http://127.0.0.1:{port}")
            self.start_router(self.policy)
        except BaseException:
            self.__exit__()
            raise
        return self

    def start_router(self, policy: str) -> None:
        """(Re)start the router in front of the live replicas with ``policy``."""
        self.stop_router()
        binary = smg_binary()
        if binary is None:
            raise RuntimeError("the SMG router (pip install smg) is not installed")
        port, prom = free_port(), free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        self.router_log = f"/tmp/pagedkv-smg-{port}.log"
        live = [u for u, p in zip(self.urls, self.procs) if p is not None]
        cmd = [binary, "launch", "--worker-urls", *live, "--policy", policy, "--host", "127.0.0.1",
               "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
               "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
               "--health-failure-threshold", "1", "--load-monitor-interval", "1", "--log-level", "warn",
               *self.router_args]
        workdir = tempfile.mkdtemp(prefix="pagedkv-smg-")  # smg writes a pid file into its working directory
        with open(self.router_log, "wb") as log:
            self.router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"smg exited: {Path(self.router_log).read_text()[-2000:]}")
            try:
                workers = httpx.get(self.router_url + "/workers", timeout=2).json()
                listed = workers.get("workers", workers) if isinstance(workers, dict) else workers
                if isinstance(listed, list) and len(listed) >= len(live) and all(
                        w.get("is_healthy", True) for w in listed if isinstance(w, dict)) and self._loads_known(live):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"smg did not register the replicas: {Path(self.router_log).read_text()[-2000:]}")

    def _loads_known(self, live: list[str]) -> bool:
        """Whether the router's load monitor has polled every replica.

        Until it has, SMG scores a replica it knows no load for as busier than an idle one it
        does know, so a new prefix can land beside another family on an otherwise idle cluster.
        """
        r = httpx.get(self.router_url + "/get_loads", timeout=2)
        if r.status_code == 404:  # a router without load polling
            return True
        polled = {entry.get("worker") for entry in r.json().get("loads", [])}
        return set(live) <= polled

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.terminate()
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                self.router.kill()
            self.router = None

    def metrics(self, i: int) -> dict[str, float]:
        return parse_metrics(httpx.get(self.urls[i] + "/metrics", timeout=30).text)

    def kill(self, i: int) -> None:
        """SIGKILL replica ``i`` (a crash: no draining)."""
        proc = self.procs[i]
        if proc is not None:
            proc.kill()
            proc.wait()
            self.procs[i] = None

    def __exit__(self, *exc: object) -> None:
        self.stop_router()
        for proc in self.procs:
            if proc is not None:
                stop_server(proc, timeout=30)
        self.procs = []


def env_threads(n: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(n), **{k: v for k, v in os.environ.items() if k == "PAGEDKV_CACHE_DIR"}}
