"""One service skeleton, shared by actor, credit, feeder and eval (the learner and inference
add torchrun / vLLM specifics around the same steps):

    service_main   settings (flags > LUDIC_* env > YAML section > defaults) -> logging ->
                   the resolved settings logged once -> SIGTERM/SIGINT set ``stop`` ->
                   ``run(settings, stop)`` -> exit code
    serving        the Redis connection (transport.connect: the one retry/backoff policy)
                   and the /metrics + /health endpoint, opened together and closed together

A service's ``run(settings, stop=...)`` stays callable in-process (tests, benches); on
``stop`` it drains and returns, and ``service_main`` then exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis

from libludic import transport
from services.common.http import HealthFn, start_http
from services.common.lifecycle import install_stop_signals
from services.common.settings import load_settings, log_settings, setup_logging

S = TypeVar("S")


class Endpoint:
    """The service's /health answer: 200 until ``health`` is set, then whatever it says."""

    def __init__(self) -> None:
        self.check: HealthFn | None = None

    async def health(self) -> bool:
        return True if self.check is None else bool(await self.check())


@contextlib.asynccontextmanager
async def serving(
    redis_url: str, metrics_port: int, *, socket_timeout: float = 30.0
) -> AsyncIterator[tuple[aioredis.Redis, Endpoint]]:
    """Redis client + metrics/health server for the life of the block; set
    ``endpoint.check`` to the service's health function once it exists."""
    r = transport.connect(redis_url, socket_timeout=socket_timeout)
    endpoint = Endpoint()
    server = await start_http(metrics_port, endpoint.health)
    try:
        yield r, endpoint
    finally:
        if server is not None:
            server.close()
        await r.aclose()


def service_main(
    service: str,
    settings_cls: type[S],
    run: Callable[..., Awaitable[Any]],
    argv: Sequence[str] | None,
    *,
    description: str,
    started: Callable[[S], None] | None = None,
    finished: Callable[[Any], None] | None = None,
    fatal: tuple[type[BaseException], ...] = (),
    cleanup: Callable[[], None] | None = None,
    log_config: bool = True,
) -> int:
    """The ``main()`` of a service: ``run(settings, stop=stop)`` until SIGTERM/SIGINT; exit 0.
    An exception of a ``fatal`` type is logged and exits 1 (a restart policy's cue);
    ``cleanup`` runs on every exit; ``log_config`` False skips logging the settings (ranks > 0)."""
    log = logging.getLogger(f"ludic.{service}")
    settings = load_settings(settings_cls, argv, service=service, description=description)
    setup_logging(settings.log_level)  # type: ignore[attr-defined]
    if log_config:
        log_settings(log, service, settings)
    if started is not None:
        started(settings)

    async def go() -> None:
        stop = asyncio.Event()
        install_stop_signals(stop)
        result = await run(settings, stop=stop)
        if finished is not None:
            finished(result)

    try:
        asyncio.run(go())
    except fatal as e:
        log.error("%s failed: %s", service, e)
        return 1
    finally:
        if cleanup is not None:
            cleanup()
    return 0
