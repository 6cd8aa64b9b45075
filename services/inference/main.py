"""Entry point: ``ludic inference --model-dir DIR`` / ``python -m services.inference.main``.

On the shared service skeleton (``services.common.skeleton.service_main``) and its settings
loader: the ``inference:`` section of the run config (``--config`` / ``LUDIC_CONFIG``), then
``LUDIC_*`` environment, then flags (``ludic inference --help`` lists them with defaults).
Order: resolve settings (bad config -> exit 2 with one line), bind the API port, start vLLM
(failure -> exit 1 with one line), serve HTTP. A stop signal during vLLM's start-up (which
blocks the event loop) aborts it and exits 0. While serving, ``stop`` (SIGTERM/SIGINT) makes
uvicorn stop accepting and let in-flight requests finish (``graceful_shutdown_s``); then vLLM
is shut down and the process exits 0. A vLLM engine that dies while serving
(``EngineDeadError``: its core process crashed or was killed) makes the process stop serving
and exit 1 within ``ENGINE_WATCH_S``, so a restart policy (Docker, Kubernetes, ``ludic up``)
brings a working replica back; a server answering 503 forever would only be marked unhealthy,
which no restart policy acts on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

from services.common.http import start_http
from services.common.lifecycle import abort_on_stop_signals
from services.common.secrets import drop_secret_env
from services.common.skeleton import service_main
from services.inference.settings import InferenceSettings

log = logging.getLogger("ludic.inference")

ENGINE_WATCH_S = 2.0
# with the engine dead there is nothing to drain: requests in flight wait for an engine that
# will not answer (seen: a weight update held the shutdown for the whole graceful timeout,
# 30 s, before the restart)
DEAD_ENGINE_GRACE_S = 2


class InferenceFailed(RuntimeError):
    """The port cannot be bound, vLLM failed to start, or its engine died while serving."""


def engine_failure(engine: object) -> str | None:
    """Why the engine cannot serve any more (None: it can): vLLM's engine core died, or a
    failed weight reload could not be rolled back (``LudicEngine.broken``)."""
    if getattr(getattr(engine, "llm", None), "errored", False):
        return "the vLLM engine died"
    broken = getattr(engine, "broken", None)
    return str(broken) if broken else None


async def watch_engine(engine: object, server: object, every_s: float = ENGINE_WATCH_S) -> None:
    """Ask ``server`` to exit once :func:`engine_failure` reports one."""
    while not getattr(server, "should_exit", False):
        why = engine_failure(engine)
        if why is not None:
            log.error("%s; stopping the server (exit 1) so it is restarted", why)
            config = getattr(server, "config", None)
            if config is not None:
                config.timeout_graceful_shutdown = DEAD_ENGINE_GRACE_S
            server.should_exit = True  # type: ignore[attr-defined]
            return
        await asyncio.sleep(every_s)


async def exit_on_stop(stop: asyncio.Event, server: object) -> None:
    """The skeleton's ``stop`` starts uvicorn's graceful shutdown."""
    await stop.wait()
    server.should_exit = True  # type: ignore[attr-defined]


def listen(host: str, port: int) -> socket.socket:
    """Bind the API port before vLLM starts. vLLM's start-up (tens of seconds) opens many
    ephemeral sockets of its own; a port chosen by a launcher and bound only after it can be
    taken in between, and the server would then fail with "address already in use"."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    return sock


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


async def run(settings: InferenceSettings, *, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` (graceful) or until vLLM's engine dies (``InferenceFailed``)."""
    # the server and the engine (vLLM, seconds to import) load here: `--help` and refused
    # settings answer without them
    import uvicorn

    from services.inference.app import create_app
    from services.inference.metrics import InferenceMetrics
    from services.inference.worker import LudicEngine

    stop = stop or asyncio.Event()
    metrics_server = None
    try:
        sock = listen(settings.host, settings.port)
    except OSError as e:
        raise InferenceFailed(f"cannot listen on {settings.host}:{settings.port}: {e}") from e
    try:
        metrics = InferenceMetrics()
        try:
            with abort_on_stop_signals():
                engine = await LudicEngine.start(settings, metrics)
        except Exception as e:  # start-up failure: one line, exit 1 (details at debug level)
            log.debug("start-up failed", exc_info=True)
            raise InferenceFailed(f"failed to start: {_one_line(e)}") from e
        try:
            app = create_app(settings, engine=engine, metrics=metrics)
            if settings.metrics_port is not None:
                # /metrics alone (its /health says the process is up; the API port's
                # /health probes the engine)
                try:
                    metrics_server = await start_http(
                        settings.metrics_port, host=settings.metrics_host, render=metrics.render
                    )
                except OSError as e:
                    where = f"{settings.metrics_host}:{settings.metrics_port}"
                    raise InferenceFailed(f"cannot listen on metrics port {where}: {e}") from e
            config = uvicorn.Config(
                app,
                host=settings.host,
                port=settings.port,
                log_level=settings.log_level,
                timeout_graceful_shutdown=int(settings.graceful_shutdown_s),
                access_log=False,
            )
            server = uvicorn.Server(config)
            log.info("serving on http://%s:%d (policy_version=0)", settings.host, settings.port)
            watchers = [
                asyncio.create_task(watch_engine(engine, server)),
                asyncio.create_task(exit_on_stop(stop, server)),
            ]
            try:
                await server.serve(sockets=[sock])
            finally:
                for w in watchers:
                    w.cancel()
                if metrics_server is not None:
                    metrics_server.close()
            why = engine_failure(engine)
            if why is not None:
                raise InferenceFailed(f"{why} while serving (see the log above)")
        finally:
            await engine.shutdown()
    finally:
        sock.close()


def _process_env(_: InferenceSettings) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM's engine processes inherit this environment, and neither they nor this process
    # (its settings hold its tokens; the model is a local directory) need any secret in it
    drop_secret_env(every=True)


def main(argv: list[str] | None = None) -> int:
    return service_main(
        "inference",
        InferenceSettings,
        run,
        argv,
        description="vLLM inference service with versioned in-place weight updates",
        started=_process_env,
        fatal=(InferenceFailed,),
    )


if __name__ == "__main__":
    raise SystemExit(main())
