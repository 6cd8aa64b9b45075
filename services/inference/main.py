"""Entry point: ``ludic inference --model DIR --port P`` / ``python -m services.inference.main``.

Order: resolve settings (bad config -> exit 2 with one line), start vLLM (failure -> exit 1
with one line), serve HTTP. SIGTERM/SIGINT: uvicorn stops accepting, lets in-flight
requests finish (``graceful_shutdown_s``), then vLLM is shut down and the process exits 0.
A vLLM engine that dies while serving (``EngineDeadError``: its core process crashed or was
killed) makes the process stop serving and exit 1 within ``ENGINE_WATCH_S``, so a restart
policy (Docker, Kubernetes, ``ludic up``) brings a working replica back; a server answering
503 forever would only be marked unhealthy, which no restart policy acts on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys

from services.inference.settings import InferenceSettings, SettingsError, load_settings

log = logging.getLogger("ludic.inference")

ENGINE_WATCH_S = 2.0


class EngineDied(RuntimeError):
    """vLLM's engine died while serving."""


async def watch_engine(llm: object, server: object, every_s: float = ENGINE_WATCH_S) -> None:
    """Ask ``server`` to exit once ``llm.errored`` (vLLM's AsyncLLM: its engine core is dead)."""
    while not getattr(server, "should_exit", False):
        if getattr(llm, "errored", False):
            log.error("the vLLM engine died; stopping the server (exit 1) so it is restarted")
            server.should_exit = True  # type: ignore[attr-defined]
            return
        await asyncio.sleep(every_s)


def listen(host: str, port: int) -> socket.socket:
    """Bind the API port before vLLM starts. vLLM's start-up (tens of seconds) opens many
    ephemeral sockets of its own; a port chosen by a launcher and bound only after it can be
    taken in between ("address already in use", seen in CI)."""
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


async def run(settings: InferenceSettings, sock: socket.socket | None = None) -> None:
    import uvicorn

    from services.inference.app import create_app
    from services.inference.engine import LudicEngine
    from services.inference.metrics import InferenceMetrics

    metrics = InferenceMetrics()
    engine = await LudicEngine.start(settings, metrics)
    try:
        app = create_app(settings, engine=engine, metrics=metrics)
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
        watch = asyncio.create_task(watch_engine(engine.llm, server))
        try:
            await server.serve(sockets=[sock] if sock is not None else None)
        finally:
            watch.cancel()
        if engine.llm.errored:
            raise EngineDied("the vLLM engine died while serving (see the log above)")
    finally:
        await engine.shutdown()


def _interrupt(*_: object) -> None:
    # Before uvicorn installs its handlers (vLLM start-up), SIGTERM aborts start-up cleanly.
    raise KeyboardInterrupt("SIGTERM")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        settings = load_settings(args)
    except SettingsError as e:
        print(f"ludic inference: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    log.info("settings %s", json.dumps(settings.public_dict(), sort_keys=True))
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        sock = listen(settings.host, settings.port)
    except OSError as e:
        print(f"ludic inference: cannot listen on {settings.host}:{settings.port}: {e}", file=sys.stderr)
        return 1
    try:
        asyncio.run(run(settings, sock))
    except KeyboardInterrupt:
        return 0
    except EngineDied as e:
        print(f"ludic inference: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # start-up failure: one line, non-zero exit (details in the log)
        log.debug("start-up failed", exc_info=True)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"ludic inference: failed to start: {type(e).__name__}: {msg}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
