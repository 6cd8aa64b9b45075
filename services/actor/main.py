"""``ludic actor``: stateless rollout worker, requests stream -> rollouts stream.

Loop: (1) wait while the rollouts backlog is above ``rollouts_high_water``; (2) admission
control: wait while ``learner_version - inference_version > max_head_offpolicyness``
(libludic/staleness.py); (3) read up to
``concurrency - in_flight`` RolloutRequests (XAUTOCLAIM of entries a dead peer left idle
for ``claim_idle_ms`` first, then XREADGROUP); (4) run each with RolloutEngine against the
inference pool; (5) commit: one Lua script writes every rollout of the request, the
``done:actor:{request_id}`` marker and the XACK together (a redelivered request writes
nothing). In-flight entries are touched every ``claim_idle_ms / 3`` so peers never steal
work that is still running.

Failures: an undecodable request is dead-lettered; an episode that raises
InferenceError (or Redis/HTTP trouble) is left pending and retried by whoever claims it
(dead-lettered after ``max_deliveries``); any other exception dead-letters the request
with the exception text. Each case is counted in ``ludic_actor_errors_total{kind}``.

SIGTERM: stop claiming; in-flight requests get ``drain_grace_s`` to finish; the rest are
handed back (their idle time is set past ``claim_idle_ms`` so a peer claims them at once)
and the process exits. Any number of actors may run, start and die at any time.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from libludic.inference.pool import InferencePool
from services.actor.settings import ActorSettings
from services.actor.worker import (  # noqa: F401 (re-exported for callers of main)
    ERRORS,
    Actor,
    ActorStats,
)
from services.common.skeleton import service_main, serving

log = logging.getLogger("ludic.actor")


async def run(
    settings: ActorSettings, *, client: Any = None, stop: asyncio.Event | None = None
) -> ActorStats:
    """Run until ``stop`` is set (or SIGTERM). ``client`` overrides the inference pool."""
    stop = stop or asyncio.Event()
    own_client = client is None
    if client is None:
        client = InferencePool(
            settings.inference_urls,
            api_key=settings.api_key,
            timeout_s=settings.inference_timeout_s,
            max_retries=settings.request_retries,
            on_replica_down=lambda url: ERRORS.labels(kind="replica_down").inc(),
        )
    try:
        async with serving(
            settings.redis_url,
            settings.metrics_port,
            socket_timeout=settings.block_ms / 1000 + 30,
            metrics_host=settings.metrics_host,
        ) as (r, endpoint):
            actor = Actor(settings, client, r, stop)
            endpoint.check = actor.health
            log.info("actor %s consuming %s", actor.name, actor.keys.requests)
            return await actor.run()
    finally:
        if own_client:
            await client.aclose()


def main(argv: list[str] | None = None) -> int:
    return service_main(
        "actor",
        ActorSettings,
        run,
        argv,
        description=__doc__.split("\n")[0],
        finished=lambda stats: log.info("actor exiting: %s", stats),
    )


if __name__ == "__main__":
    raise SystemExit(main())
