"""``ludic credit``: rollouts stream -> complete groups -> credit -> SAWItems -> saw stream.

``run()`` connects to Redis, serves ``/metrics`` and the health check on ``metrics_port`` and
runs a :class:`CreditWorker` until it stops; ``main()`` is the ``ludic credit`` entry point.
What the worker does (group assembly, incomplete groups, the singleton lease):
services/credit/worker.py.
"""

from __future__ import annotations

import asyncio
import logging

from services.common.skeleton import service_main, serving
from services.credit.settings import CreditSettings
from services.credit.worker import (  # noqa: F401 (re-exported for callers of main)
    CreditWorker,
)

log = logging.getLogger("ludic.credit")


async def run(settings: CreditSettings, *, stop: asyncio.Event | None = None) -> CreditWorker:
    stop = stop or asyncio.Event()
    async with serving(
        settings.redis_url,
        settings.metrics_port,
        socket_timeout=settings.block_ms / 1000 + 30,
        metrics_host=settings.metrics_host,
    ) as (r, endpoint):
        worker = CreditWorker(settings, r, stop)
        endpoint.check = worker.health
        await worker.run()
    return worker


def main(argv: list[str] | None = None) -> int:
    return service_main(
        "credit",
        CreditSettings,
        run,
        argv,
        description=__doc__.split("\n")[0],
        finished=lambda w: log.info(
            "credit exiting: items=%d groups=%s", w.items_written, w.outcomes
        ),
    )


if __name__ == "__main__":
    raise SystemExit(main())
