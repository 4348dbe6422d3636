"""Connecting the Redis tier: redis-py imported on demand, our `?cluster=` URL flag, and a Redis Cluster client
that learns the slot map at start (an unreachable cluster is a ConfigError naming the fix)."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..config.checks import mask_url
from ..errors import ConfigError

__all__ = ["cluster_client", "import_redis", "split_cluster_flag"]


def import_redis() -> Any:
    try:
        import redis
    except ImportError as exc:
        raise ImportError("the Redis tier needs redis-py; install it with `pip install 'redis>=5.0'`") from exc
    return redis


def split_cluster_flag(url: str) -> tuple[str, bool]:
    """`redis://host:7000/0?cluster=1` -> (`redis://host:7000/0`, True): the flag is ours, not redis-py's."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    flags = [v for k, v in query if k == "cluster"]
    if not flags:
        return url, False
    if flags[-1].lower() not in ("1", "true", "yes", "0", "false", "no"):
        raise ConfigError(f"the redis URL's cluster= must be 1/true/yes or 0/false/no, got {flags[-1]!r}")
    rest = urlencode([(k, v) for k, v in query if k != "cluster"])
    return urlunsplit(parts._replace(query=rest)), flags[-1].lower() in ("1", "true", "yes")


def cluster_client(redis: Any, url: str, timeouts: dict[str, float]) -> Any:
    from redis.cluster import RedisCluster

    if urlsplit(url).path not in ("", "/", "/0"):
        raise ConfigError(f"a Redis Cluster has database 0 only; drop the /N from {mask_url(url)!r}")
    try:
        # Connecting here learns the slot map; an unreachable cluster makes the tier an outage until it is up.
        return RedisCluster.from_url(url, cluster_error_retry_attempts=1, **timeouts)
    except (redis.RedisError, redis.exceptions.RedisClusterException, ValueError) as exc:
        # redis-py raises RedisClusterUnreachableError (not a RedisError) when no node answers
        raise ConfigError(
            f"cannot reach the Redis Cluster at {mask_url(url)} ({type(exc).__name__}: {exc}): check that a node "
            "of the cluster listens at that host and port with cluster mode on (`redis-cli -h HOST -p PORT "
            "cluster info`), or drop ?cluster=1 for a single Redis server"
        ) from None
