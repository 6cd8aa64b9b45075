"""``ludic credit``: rollouts stream -> complete groups -> credit -> SAWItems -> saw stream.

Group assembly. Rollouts are buffered by ``meta.group_id`` (a rollout without one is
its own group) until the group holds ``meta.group_rollouts`` rollouts (stamped by the
actor when a group is exactly one request, ``group_id == request_id``, as the feeder
makes them: then multi-agent requests count right too), else ``algorithm.group_size``.
Then ``algorithm.to_saw_items(group, sample_filter, defer_batch_stage=True)`` (preprocess
-> CreditAssigner -> rollouts_to_saw_items -> filters) runs and one Lua commit writes the
SAWItems, the ``done:credit:{group_id}`` marker and the XACK of every rollout entry of the
group. The algorithm is the run's top-level ``algorithm:`` section (the learner reads the
same one). A batch-level statistic (ScaleRL's std) cannot be computed one group at a time:
its items carry the group-stage weight and ``SAWItem.pending``, and the learner's
Trainer finishes it over exactly each training batch.

Incomplete-group policy (a group still short ``group_timeout_s`` after its first
rollout arrived -- e.g. its request was dead-lettered half-way or an actor lost some
episodes): if it holds at least ``min_partial_group`` rollouts (default 2, the least a
group-relative baseline needs) it is processed as-is with ``group_size = len(group)``,
counted as ``ludic_credit_groups_total{outcome="partial"}``; otherwise its rollouts are
acked with the done marker and no output, counted as ``outcome="dropped"``. A rollout
whose group is already done (arrived after the timeout) is acked and counted as
``outcome="late"``; a second entry of a rollout id already buffered is acked and counted
in ``ludic_credit_duplicate_rollouts_total``. Groups whose credit computation raises are dead-lettered
(``outcome="error"``). A group that ends with zero SAWItems after preprocess/filters is
``outcome="empty"``, or ``outcome="zero_variance"`` when dynamic sampling (the algorithm's
``dynamic_sampling``) dropped it because its rewards were all equal; the run accounting
counts both ``groups_dropped_empty``. Such a group (and a dropped incomplete one) is no
longer outstanding for admission control, so credit wakes the feeder
(``accounting.wake_admission``) to request a replacement at once: the learner's batch
stays full.

Singleton: group assembly needs every rollout of a group in one process, so one credit
worker is active per run, holding the lease ``ludic:{run}:lease:credit``; extra workers
are hot standbys. A new leader XAUTOCLAIMs every rollout the previous one left pending
and rebuilds its groups (nothing is acked before its group is committed, so a crash
loses nothing; the done markers make a re-commit a no-op).
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
