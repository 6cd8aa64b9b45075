"""Entry point: ``ludic inference --model DIR --port P`` / ``python -m services.inference.main``.

Order: resolve settings (bad config -> exit 2 with one line), start vLLM (failure -> exit 1
with one line), serve HTTP. SIGTERM/SIGINT: uvicorn stops accepting, lets in-flight
requests finish (``graceful_shutdown_s``), then vLLM is shut down and the process exits 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from typing import List, Optional

from services.inference.settings import InferenceSettings, SettingsError, load_settings

log = logging.getLogger("ludic.inference")


async def run(settings: InferenceSettings) -> None:
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
        await server.serve()
    finally:
        await engine.shutdown()


def _interrupt(*_: object) -> None:
    # Before uvicorn installs its handlers (vLLM start-up), SIGTERM aborts start-up cleanly.
    raise KeyboardInterrupt("SIGTERM")


def main(argv: Optional[List[str]] = None) -> int:
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
        asyncio.run(run(settings))
    except KeyboardInterrupt:
        return 0
    except Exception as e:  # start-up failure: one line, non-zero exit (details in the log)
        log.debug("start-up failed", exc_info=True)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"ludic inference: failed to start: {type(e).__name__}: {msg}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
