"""The benchmarks' Redis launcher (`benchlib.redis_server`) for tests: a test whose server cannot start is
skipped, not failed, where Redis is not installed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from benchlib import redis_server
from benchlib.redis_server import RedisStartError, RedisUnavailable


class RedisServer(redis_server.RedisServer):
    """A throwaway redis-server on loopback; `start()` skips the test where none can start."""

    def start(self) -> RedisServer:
        try:
            super().start()
        except (RedisUnavailable, RedisStartError) as e:
            pytest.skip(str(e))
        return self


@contextlib.contextmanager
def started_cluster(directory: str) -> Iterator[redis_server.RedisClusterServers]:
    """A running three-master cluster for the duration of the block (skips the test where Redis is missing)."""
    try:
        with redis_server.started_cluster(directory) as servers:
            yield servers
    except RedisUnavailable as e:
        pytest.skip(str(e))
