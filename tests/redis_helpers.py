"""A throwaway redis-server on loopback for tests; skips the test when Redis is not installed."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A throwaway redis-server on loopback, no persistence."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install redis)")
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    client.close()
                    return
            except redis.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.skip(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(100):
        port = _free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    pytest.skip("no free port pair for a Redis Cluster node")


class RedisClusterServers:
    """Three throwaway redis-server masters on loopback joined into one cluster (no replicas, no persistence)."""

    def __init__(self, directory: str, masters: int = 3) -> None:
        self.directory = directory
        self.ports = [_free_cluster_port() for _ in range(masters)]
        self.url = f"redis://127.0.0.1:{self.ports[0]}/0?cluster=1"
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install redis)")
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        if cli is None:
            pytest.skip("redis-cli is not installed (it comes with redis-server: apt-get install redis-tools)")
        for port in self.ports:
            args = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf", "--dir", self.directory]
            self.procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port in self.ports:
            self._wait(redis, port, lambda c: c.ping())
        create = [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports)]
        done = subprocess.run(
            [*create, "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60
        )
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
        for port in self.ports:
            self._wait(redis, port, lambda c: "cluster_state:ok" in c.execute_command("CLUSTER", "INFO"))

    def _wait(self, redis, port: int, ready) -> None:
        client = redis.Redis(port=port, socket_connect_timeout=0.2, decode_responses=True)
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                try:
                    if ready(client):
                        return
                except redis.RedisError:
                    pass
                time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        raise RuntimeError(f"Redis Cluster node on port {port} did not become ready")

    def keys_per_node(self) -> list[int]:
        import redis

        counts = []
        for port in self.ports:
            client = redis.Redis(port=port)
            counts.append(client.dbsize())
            client.close()
        return counts

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        self.procs = []


@contextlib.contextmanager
def started_cluster(directory: str) -> Iterator[RedisClusterServers]:
    """A running three-master cluster for the duration of the block (skips the test where Redis is missing)."""
    servers = RedisClusterServers(directory)
    try:
        servers.start()  # inside the try: a start that fails half-way must not leave nodes running
        yield servers
    finally:
        servers.stop()
