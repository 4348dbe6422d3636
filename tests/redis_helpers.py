"""The benchmarks' Redis launcher (`benchlib.redis_server`) for tests: a test whose server cannot start is
skipped, not failed, where Redis is not installed.

`benchlib` is imported when a server is made, not with this module: child processes of the tests import test
modules (and so this one) without the pytest option that puts `benchmarks/` on their path."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest


class RedisServer:
    """A throwaway redis-server on loopback; `start()` skips the test where none can start."""

    def __init__(self, port: int | None = None) -> None:
        from benchlib.redis_server import RedisServer as Launcher

        self._server = Launcher(port)
        self.port, self.url = self._server.port, self._server.url

    def start(self) -> RedisServer:
        from benchlib.redis_server import RedisStartError, RedisUnavailable

        try:
            self._server.start()
        except (RedisUnavailable, RedisStartError) as e:
            pytest.skip(str(e))
        return self

    def stop(self) -> None:
        self._server.stop()


@contextlib.contextmanager
def started_cluster(directory: str) -> Iterator[Any]:
    """A running three-master cluster (`benchlib.redis_server.RedisClusterServers`) for the duration of the block;
    skips the test where Redis is missing."""
    from benchlib.redis_server import RedisUnavailable
    from benchlib.redis_server import started_cluster as launch

    try:
        with launch(directory) as servers:
            yield servers
    except RedisUnavailable as e:
        pytest.skip(str(e))
