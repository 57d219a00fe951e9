"""Redis clients configured so that no call can hang: short timeouts, no backoff, one quick reconnect.

redis-py's default retry policy backs off for seconds on connection errors; a gateway must instead
fail within a few hundred milliseconds and switch to its configured failure mode.
"""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

# One immediate retry on a *connection* error heals a pooled connection that died with a Redis
# restart. Timeouts are not retried: a second wait would double the worst case.
_RETRY_ERRORS = (redis.exceptions.ConnectionError,)


def async_client(url: str, *, timeout_s: float, max_connections: int = 128) -> aioredis.Redis:
    """An asyncio client whose every command answers or fails within about ``2 * timeout_s``."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout_s,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=AsyncRetry(NoBackoff(), 1, supported_errors=_RETRY_ERRORS),
        health_check_interval=0,
    )
    return aioredis.Redis(connection_pool=pool)


def async_pubsub_client(url: str, *, timeout_s: float) -> aioredis.Redis:
    """A client for the change subscription: a short connect timeout, but idle reads are normal."""
    return aioredis.Redis.from_url(
        url,
        socket_connect_timeout=timeout_s,
        socket_timeout=None,
        retry=AsyncRetry(NoBackoff(), 0),
        health_check_interval=0,
    )


def sync_client(url: str, *, timeout_s: float) -> redis.Redis:
    """A blocking client for admin tooling, with the same no-hang policy."""
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=_RETRY_ERRORS),
    )
