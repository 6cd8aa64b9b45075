"""``ludic feeder``: keeps the requests stream topped up from a curriculum config.

See services/feeder/README.md. Each tick: ``n = high_water - XLEN(requests)`` (nothing
when the backlog is at the mark: backpressure), and, with admission control on
(``max_head_offpolicyness``, a top-level key of the run config; libludic/staleness.py), no
more groups than the learner has room for: ``room // items_per_group`` from the atomic
``accounting.admission_state`` (the items a requested group has become so far: a
multi-turn episode is one item per model call). Without room the feeder waits on the learner's wake-up
(``accounting.wait_admission``: the learner pushes one when items were resolved or new
weights are served) or ``poll_s``. Then it reserves ``n`` seeds with one
``INCRBY ludic:{run}:feeder:seed n`` (atomic, persisted: restarts and parallel feeders
never reuse a seed); for seed ``s`` pick task ``tasks[pick(s)]`` (weighted, a pure
function of the seed) and XADD one RolloutRequest with ``num_episodes=algorithm.group_size``,
``same_env_seed=True``, ``env_seed=s``, ``meta.group_id = request id = "{run_id}-{s}"``.
A crash between INCRBY and XADD skips seeds, never repeats them; the XADDs run in one
script with a ``done:feeder:{id}`` marker per request and the run accounting's
``groups_requested`` count (libludic/transport/accounting.py), so a retried top-up adds nothing twice.
"""

from __future__ import annotations

import asyncio
import logging

import redis

from libludic import transport
from libludic.transport import accounting
from services.common.lifecycle import (
    sleep_or_stop,
    update_footprint_gauges,
    update_stream_gauges,
)
from services.common.skeleton import service_main, serving
from services.feeder.settings import FeederSettings
from services.feeder.worker import ERRORS, top_up

log = logging.getLogger("ludic.feeder")

FOOTPRINT_EVERY_S = 5.0  # Redis's memory and key counts (the feeder alone reads them)


async def run(settings: FeederSettings, *, stop: asyncio.Event | None = None) -> int:
    """Feed until ``stop`` (or ``max_requests``). Returns the number of requests added."""
    stop = stop or asyncio.Event()
    loop_time = asyncio.get_running_loop().time
    keys = transport.Keys(settings.run_id)
    added, attempt = 0, 0
    footprint_at = -FOOTPRINT_EVERY_S
    async with serving(
        settings.redis_url, settings.metrics_port, metrics_host=settings.metrics_host
    ) as (r, _):
        while not stop.is_set():
            limit = settings.max_requests - added if settings.max_requests > 0 else 1 << 30
            if limit <= 0:
                break
            try:
                n = await top_up(r, keys, settings, limit)
                await update_stream_gauges(r, keys)
                if loop_time() - footprint_at >= FOOTPRINT_EVERY_S:
                    footprint_at = loop_time()
                    try:
                        await update_footprint_gauges(r)
                    except redis.ResponseError as e:  # INFO denied (an ACL, a managed Redis)
                        footprint_at = float("inf")  # the gauges stay unset; feeding goes on
                        log.warning("Redis footprint gauges off: INFO refused (%s)", e)
                attempt = 0
            except transport.REDIS_DOWN_ERRORS as e:
                ERRORS.labels(kind="redis").inc()
                log.warning("redis unavailable (%s); backing off", e)
                await transport.backoff_sleep(attempt, stop)
                attempt += 1
                continue
            added += n
            if settings.max_head_offpolicyness is None:
                await sleep_or_stop(stop, settings.poll_s)
                continue
            try:  # the learner wakes us when room may have opened
                await accounting.wait_admission(r, keys, settings.poll_s)
            except transport.REDIS_DOWN_ERRORS:
                await sleep_or_stop(stop, settings.poll_s)
    log.info("feeder added %d request(s)", added)
    return added


def main(argv: list[str] | None = None) -> int:
    return service_main("feeder", FeederSettings, run, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    raise SystemExit(main())
