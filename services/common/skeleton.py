"""One service skeleton, shared by inference, actor, credit, feeder, eval and learner:

    service_main   settings (flags > LUDIC_* env > YAML section > defaults: the one loader,
                   services.common.settings.load_settings) -> logging -> the resolved
                   settings logged once -> SIGTERM/SIGINT set ``stop`` ->
                   ``run(settings, stop)`` -> exit code
    serving        the Redis connection (transport.connect: the one retry/backoff policy)
                   and the /metrics + /health endpoint, opened together and closed together

Exit codes, the same for every service: 0 after a drain on ``stop`` (or an interrupted
start-up, see ``lifecycle.abort_on_stop_signals``); 1 on a ``fatal`` exception, logged in one
line (a restart policy's cue); 2 on bad settings, printed as one line naming the value.
Anything else is a crash with its traceback.

A service's ``run(settings, stop=...)`` stays callable in-process (tests, benches); on
``stop`` it drains and returns, and ``service_main`` then exits 0.

Secrets: every service process makes itself non-dumpable (``keep_secrets_in``) before it
reads its settings, so no other process of the same uid (the code_exec sandbox's plain
mode runs agent code as the actor's uid) can read its ``/proc/<pid>/environ`` (the auth
token, the Redis password) or ptrace it. ``LUDIC_DUMPABLE=1`` keeps a service dumpable for
a profiler or debugger run as the same user (``bench/step_profile.py --py-spy`` sets it).
Once its settings are read it drops ludic's secrets from its environment and marks the
descriptors `ludic up` handed its secret files over in close-on-exec, so a child it starts
inherits neither (services/common/secrets.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis

from libludic import transport
from services.common.http import HealthFn, start_http
from services.common.lifecycle import StartupAborted, install_stop_signals
from services.common.secrets import drop_secret_env, keep_secret_fds_in, keep_secrets_in
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
    redis_url: str,
    metrics_port: int,
    *,
    socket_timeout: float = 30.0,
    metrics_host: str = "0.0.0.0",
) -> AsyncIterator[tuple[aioredis.Redis, Endpoint]]:
    """Redis client + metrics/health server for the life of the block; set
    ``endpoint.check`` to the service's health function once it exists."""
    r = transport.connect(redis_url, socket_timeout=socket_timeout)
    endpoint = Endpoint()
    server = await start_http(metrics_port, endpoint.health, host=metrics_host)
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
    An exception of a ``fatal`` type is logged and exits 1 (a restart policy's cue); a
    settings error (``ValueError``, or ``OSError`` for an unreadable file) is printed as one
    line and exits 2; ``cleanup`` runs on every exit; ``log_config`` False skips logging the
    settings (ranks > 0)."""
    log = logging.getLogger(f"ludic.{service}")
    keep_secrets_in()
    argv = sys.argv[1:] if argv is None else list(argv)  # ``python -m services.X.main --flag``
    try:
        settings = load_settings(settings_cls, argv, service=service, description=description)
    except (ValueError, OSError) as e:
        print(f"ludic {service}: {e}", file=sys.stderr)
        return 2
    drop_secret_env()  # the settings hold them; no child inherits them
    keep_secret_fds_in()  # nor the descriptors `ludic up` handed them over in
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
    except StartupAborted as e:  # a stop signal during a start-up that blocks the event loop
        log.info("%s stopped during start-up (%s)", service, e)
        return 0
    except fatal as e:
        log.error("%s failed: %s", service, e)
        return 1
    finally:
        if cleanup is not None:
            cleanup()
    return 0
