"""Throwaway redis-server processes on loopback (no persistence): one server, or three masters joined into a
cluster. The one launcher the tier benchmarks (`tiers.py`, `controller.py`) and the tests (`tests/redis_helpers.py`,
which turns `RedisUnavailable` into a skipped test) share."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class RedisUnavailable(RuntimeError):
    """redis-server, redis-cli or redis-py is not installed, or no free port is left."""


class RedisStartError(RuntimeError):
    """A server was launched but did not become ready."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    raise RedisUnavailable("no free port pair for a Redis Cluster node")


def _redis_module() -> Any:
    try:
        import redis
    except ImportError:
        raise RedisUnavailable("redis-py is not installed (pip install redis)") from None
    return redis


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RedisUnavailable(f"{name} is not installed (apt-get install redis-server)")
    return path


def _server_args(port: int) -> list[str]:
    return [_binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]


def _wait(port: int, ready: Callable[[Any], bool], timeout_s: float, alive: Callable[[], bool]) -> None:
    """Poll the server on `port` until `ready(client)`; RedisStartError when it dies or the time runs out."""
    redis = _redis_module()
    client = redis.Redis(port=port, socket_connect_timeout=0.2, decode_responses=True)
    deadline = time.monotonic() + timeout_s
    try:
        while alive() and time.monotonic() < deadline:
            try:
                if ready(client):
                    return
            except redis.RedisError:
                pass
            time.sleep(0.05)
    finally:
        client.close()
    raise RedisStartError(f"redis-server on port {port} did not become ready")


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


class RedisServer:
    """One redis-server on a free loopback port: `start()`, use `url`, `stop()` (or `with RedisServer() as s`)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        _redis_module()
        proc = subprocess.Popen(_server_args(self.port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.proc = proc
        try:
            _wait(self.port, lambda c: c.ping(), 10.0, lambda: proc.poll() is None)
        except RedisStartError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None:
            _kill(self.proc)
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisClusterServers:
    """`masters` redis-server masters on loopback joined into one cluster (no replicas, no persistence)."""

    def __init__(self, directory: str, masters: int = 3) -> None:
        self.directory = directory
        self.ports = [_free_cluster_port() for _ in range(masters)]
        self.url = f"redis://127.0.0.1:{self.ports[0]}/0?cluster=1"
        self.procs: list[subprocess.Popen] = []

    def start(self) -> RedisClusterServers:
        _redis_module()
        cli = _binary("redis-cli")
        try:
            for port in self.ports:
                args = _server_args(port) + ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
                args += ["--dir", self.directory]
                self.procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            for port, proc in zip(self.ports, self.procs, strict=True):
                _wait(port, lambda c: c.ping(), 30.0, lambda p=proc: p.poll() is None)
            create = [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports)]
            done = subprocess.run(
                [*create, "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60
            )
            if done.returncode != 0:
                raise RedisStartError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
            for port, proc in zip(self.ports, self.procs, strict=True):
                ready = lambda c: "cluster_state:ok" in c.execute_command("CLUSTER", "INFO")  # noqa: E731
                _wait(port, ready, 30.0, lambda p=proc: p.poll() is None)
        except BaseException:
            self.stop()  # a start that fails half-way must not leave nodes running
            raise
        return self

    def keys_per_node(self) -> list[int]:
        redis = _redis_module()
        counts = []
        for port in self.ports:
            client = redis.Redis(port=port)
            counts.append(client.dbsize())
            client.close()
        return counts

    def stop(self) -> None:
        for proc in self.procs:
            _kill(proc)
        self.procs = []


@contextmanager
def started_cluster(directory: str) -> Iterator[RedisClusterServers]:
    """A running three-master cluster for the duration of the block."""
    servers = RedisClusterServers(directory)
    try:
        yield servers.start()
    finally:
        servers.stop()


@contextmanager
def private_server() -> Iterator[RedisServer | None]:
    """A started server for a benchmark's Redis tier during the block, or None (the reason on stderr) where none
    can start."""
    try:
        server = RedisServer().start()
    except (RedisUnavailable, RedisStartError) as e:
        print(f"no private Redis tier: {e}", file=sys.stderr)
        yield None
        return
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def tier_url(given: str | None) -> Iterator[str | None]:
    """The URL of a benchmark's Redis tier during the block: `given` (a --redis-url) as is, else a private server's,
    else None where none can start (`private_server`)."""
    if given:
        yield given
        return
    with private_server() as server:
        yield None if server is None else server.url
