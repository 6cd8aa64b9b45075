"""Redis connections and the one retry/backoff policy: ``connect``, ``REDIS_DOWN_ERRORS``,
``backoff_sleep``, ``retry_redis``.

Reconnects: clients from :func:`connect` retry single commands with exponential backoff;
the service loops additionally catch :data:`REDIS_DOWN_ERRORS`, back off and resume
(consumer groups persist in the AOF; a missing group is recreated).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from libludic.retry import Backoff

log = logging.getLogger("libludic.transport")

#: Errors that mean "Redis cannot serve right now": unreachable, or full (maxmemory with
#: noeviction refuses writes until consumers drain it): back off and retry, never crash.
REDIS_DOWN_ERRORS: tuple[type[BaseException], ...] = (
    rexc.OutOfMemoryError,
    rexc.ConnectionError,
    rexc.TimeoutError,
    ConnectionError,
    OSError,
)


# --------------------------------------------------------------------------------------
# connections


def as_str(x: Any) -> str:
    """A Redis reply value (bytes, or already decoded) as str."""
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)


def connect(url: str, *, socket_timeout: float = 30.0) -> aioredis.Redis:
    """An asyncio client that retries single commands across short outages.

    ``socket_timeout`` must exceed every XREADGROUP ``block_ms`` used on the client.
    """
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        protocol=2,
        socket_timeout=socket_timeout,
        socket_connect_timeout=5.0,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=5),
        retry_on_error=[rexc.ConnectionError, rexc.TimeoutError],
        health_check_interval=15,
    )


async def wait_event(ev: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``ev``; True if set. Unlike ``asyncio.wait_for`` on
    Python 3.11 this never swallows a cancellation of the caller."""
    if ev.is_set():
        return True
    waiter = asyncio.ensure_future(ev.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return ev.is_set()


async def backoff_sleep(attempt: int, stop: asyncio.Event | None = None, cap: float = 5.0) -> None:
    """Wait :class:`~libludic.retry.Backoff` (0.1 s doubling, capped at ``cap``) after failed
    attempt ``attempt``, or until ``stop`` is set."""
    delay = Backoff(min(0.1, cap), cap).delay(attempt)
    if stop is None:
        await asyncio.sleep(delay)
        return
    await wait_event(stop, delay)


_stopping = False


def stop_retrying() -> None:
    """From now on :func:`retry_redis` re-raises at once: the process is stopping (a stop
    signal) and must not wait for a Redis that may be gone for good (its work that did not
    commit is redelivered: every stream is at least once)."""
    global _stopping
    _stopping = True


async def retry_redis(
    fn: Callable[[], Awaitable[Any]],
    *,
    stop: asyncio.Event | None = None,
    deadline_s: float | None = None,
    on_error: Callable[[BaseException], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Any:
    """Call ``fn`` until it does not raise a REDIS_DOWN_ERRORS (idempotent calls only).

    Gives up (re-raises) once ``deadline_s`` has passed, or when ``stop`` is set or
    ``should_stop()`` is true (a service asked to stop does not wait for a Redis that is
    gone).
    """
    t0 = time.monotonic()
    attempt = 0
    while True:
        try:
            return await fn()
        except REDIS_DOWN_ERRORS as e:
            if on_error is not None:
                on_error(e)
            if deadline_s is not None and time.monotonic() - t0 > deadline_s:
                raise
            if (
                _stopping
                or (stop is not None and stop.is_set())
                or (should_stop is not None and should_stop())
            ):
                raise
            log.warning("redis unavailable (%s: %s); retrying", type(e).__name__, e)
            await backoff_sleep(attempt, stop)
            attempt += 1
