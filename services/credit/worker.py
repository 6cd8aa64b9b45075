"""The credit worker: metrics and ``CreditWorker`` (rollouts -> groups -> credit ->
SAWItems, leader lease, timeouts). ``main.py`` wires it into a process.

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

Singleton: group assembly needs every rollout of a group in one process, so one credit
worker is active per run, holding the lease ``ludic:{run}:lease:credit``; extra workers
are hot standbys. A new leader XAUTOCLAIMs every rollout the previous one left pending
and rebuilds its groups (nothing is acked before its group is committed, so a crash
loses nothing; the done markers make a re-commit a no-op).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.exceptions as rexc
from prometheus_client import Counter, Gauge

from libludic import transport
from libludic.training import filters as flt
from libludic.training.algorithm import CreditStats
from libludic.transport import accounting
from libludic.types import Rollout
from services.common.lifecycle import sleep_or_stop, update_stream_gauges
from services.credit.settings import CreditSettings

log = logging.getLogger("ludic.credit")
MAX_GROUP_ROLLOUTS = 65536


def _group_size(declared: Any, default: int) -> int | None:
    """The rollouts a group waits for: the rollout's ``meta.group_rollouts`` (stamped by the
    actor) or the algorithm's group size; None when the declared value is not a sane count."""
    if declared is None:
        return default
    if isinstance(declared, bool) or not isinstance(declared, int):
        return None
    return declared if 1 <= declared <= MAX_GROUP_ROLLOUTS else None


ITEMS = Counter("ludic_credit_items_total", "SAWItems written to the saw stream")
GROUPS = Counter(
    "ludic_credit_groups_total",
    "Groups by outcome (complete, partial, empty, zero_variance, dropped, late, duplicate, error)",
    ["outcome"],
)
MASKED_NO_EOS = Counter(
    "ludic_credit_items_masked_no_eos_total",
    "SAWItems given weight 0 because their completion ended without EOS (mask_no_eos_with_zero)",
)
DEADLETTERED = Counter("ludic_credit_deadlettered_total", "Rollout entries dead-lettered")
ERRORS = Counter("ludic_credit_errors_total", "Credit worker failures by kind", ["kind"])
DUP_ROLLOUTS = Counter(
    "ludic_credit_duplicate_rollouts_total", "Rollout entries whose rollout id was already buffered"
)
BUFFERED = Gauge("ludic_credit_buffered_groups", "Incomplete groups held in memory")
LEADER = Gauge("ludic_credit_leader", "1 while this worker holds the credit lease")


def make_filter(names: list[str]) -> Callable[[Any], bool] | None:
    if not names:
        return None
    fs = []
    for n in names:
        f = getattr(flt, n, None)
        if f is None or not n.startswith("drop_") or n == "drop_zero_variance_groups":
            raise ValueError(
                f"unknown sample filter {n!r}; use drop_truncated, drop_incomplete_completions "
                "or drop_parse_errors"
            )
        fs.append(f())
    return flt.combine(*fs)


@dataclass
class Group:
    gid: str
    size: int
    first_seen: float
    entries: dict[str, transport.Entry] = field(default_factory=dict)  # rollout id -> entry
    rollouts: dict[str, Rollout] = field(default_factory=dict)


class CreditWorker:
    """Assembles groups from the rollouts stream and commits their SAWItems (module
    docstring), counting every group's outcome in ``ludic_credit_groups_total``.

    Incomplete groups (a group still short ``group_timeout_s`` after its first rollout
    arrived -- e.g. its request was dead-lettered half-way or an actor lost some episodes):
    if it holds at least ``min_partial_group`` rollouts (default 2, the least a
    group-relative baseline needs) it is processed as-is with ``group_size = len(group)``,
    counted as ``ludic_credit_groups_total{outcome="partial"}``; otherwise its rollouts are
    acked with the done marker and no output, counted as ``outcome="dropped"``. A rollout
    whose group is already done (arrived after the timeout) is acked and counted as
    ``outcome="late"``; a second entry of a rollout id already buffered is acked and counted
    in ``ludic_credit_duplicate_rollouts_total``. Groups whose credit computation raises are
    dead-lettered (``outcome="error"``). A group that ends with zero SAWItems after
    preprocess/filters is ``outcome="empty"``, or ``outcome="zero_variance"`` when dynamic
    sampling (the algorithm's ``dynamic_sampling``) dropped it because its rewards were all
    equal; the run accounting counts both ``groups_dropped_empty``. Such a group (and a
    dropped incomplete one) is no longer outstanding for admission control, so credit wakes
    the feeder (``accounting.wake_admission``) to request a replacement at once: the
    learner's batch stays full.
    """

    def __init__(self, settings: CreditSettings, r: Any, stop: asyncio.Event):
        self.s = settings
        self.r = r
        self.stop = stop
        self.keys = transport.Keys(settings.run_id)
        self.name = settings.consumer or transport.consumer_name("credit")
        self.consumer = accounting.AccountedConsumer(
            r,
            self.keys.rollouts,
            transport.GROUP_CREDIT,
            self.name,
            self.keys.deadletter,
            claim_idle_ms=settings.claim_idle_ms,
            max_deliveries=settings.max_deliveries,
            on_deadletter=lambda reason: DEADLETTERED.inc(),
            stage="rollouts",
        )
        self.lease = transport.Lease(r, self.keys.lease("credit"), self.name, settings.lease_ttl_ms)
        self.sample_filter = make_filter(settings.filters)
        self._algos: dict[int, Any] = {}
        self.groups: dict[str, Group] = {}
        self.leader = False
        self.last_tick = time.monotonic()
        self.items_written = 0
        self.outcomes: dict[str, int] = {}
        self.process_s = 0.0  # credit + encode + commit, summed over groups
        self.groups_processed = 0

    def algo(self, n: int) -> Any:
        if n not in self._algos:
            self._algos[n] = self.s.spec.build(group_size=n)
        return self._algos[n]

    async def health(self) -> bool:
        return time.monotonic() - self.last_tick < 30.0 + self.s.block_ms / 1000

    def _count(self, outcome: str) -> None:
        GROUPS.labels(outcome=outcome).inc()
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    # ---- leadership ---------------------------------------------------------------------

    async def _keep_lease(self) -> None:
        # until stop, not only until cancelled: a cancel that lands inside a Redis call can be
        # absorbed by the client, and the worker's shutdown then waited for this loop forever
        # (tests/fuzz/test_fuzz_streams.py::test_credit_survives_hostile_rollouts, once)
        while not self.stop.is_set():
            try:
                held = await self.lease.hold()
            except (rexc.RedisError, OSError):
                ERRORS.labels(kind="redis").inc()
                held = False
            if held and not self.leader:
                log.info("credit %s is the leader", self.name)
            if not held and self.leader:
                log.warning("credit %s lost the lease; dropping its buffered groups", self.name)
                self.groups.clear()  # not acked: the next leader claims them
            self.leader = held
            LEADER.set(1 if held else 0)
            try:
                if held:
                    pending = [e for g in self.groups.values() for e in g.entries.values()]
                    await self.consumer.touch(pending)
                await update_stream_gauges(self.r, self.keys)
            except (rexc.RedisError, OSError):
                ERRORS.labels(kind="redis").inc()
            BUFFERED.set(len(self.groups))
            await sleep_or_stop(
                self.stop, min(self.s.lease_ttl_ms / 3000, self.s.claim_idle_ms / 3000)
            )

    # ---- groups -------------------------------------------------------------------------

    async def _take(self, entry: transport.Entry) -> None:
        try:
            await self._take_one(entry)
        except (rexc.RedisError, OSError, asyncio.CancelledError):
            raise
        except Exception as e:  # a rollout nothing anticipated: dead-letter it, keep going
            log.exception("rollout entry %s cannot be processed; dead-lettering it", entry.id)
            ERRORS.labels(kind="credit").inc()
            await self.consumer.dead_letter(entry, "credit_error", f"{type(e).__name__}: {e}")

    async def _take_one(self, entry: transport.Entry) -> None:
        try:
            ro = transport.decode_rollout(entry.payload)
        except transport.CodecError as e:
            await self.consumer.dead_letter(entry, e.reason, e.detail)
            return
        gid = ro.group_id or ro.id
        g = self.groups.get(gid)
        if g is None:
            if await self.r.exists(self.keys.done("credit", gid)):
                await self.consumer.ack([entry])
                self._count("late")
                return
            size = (
                _group_size(ro.meta.get("group_rollouts"), self.s.spec.group_size)
                if ro.group_id
                else 1
            )
            if size is None:  # poison: never let it take the loop (and its group) down
                await self.consumer.dead_letter(
                    entry,
                    "bad_field",
                    f"rollout {ro.id}: meta.group_rollouts={ro.meta.get('group_rollouts')!r} is "
                    f"not an integer in [1, {MAX_GROUP_ROLLOUTS}]",
                )
                return
            g = self.groups[gid] = Group(gid, size, time.monotonic())
        twin = g.entries.get(ro.id)
        if twin is not None and twin.id != entry.id:  # the same rollout written twice
            await self.consumer.ack([entry])
            DUP_ROLLOUTS.inc()
            self.outcomes["duplicate_rollout"] = self.outcomes.get("duplicate_rollout", 0) + 1
            return
        g.entries[ro.id] = entry  # (a re-claim of our own entry just refreshes it)
        g.rollouts[ro.id] = ro
        if len(g.rollouts) >= g.size:
            await self._process(g, "complete")

    async def _process(self, g: Group, outcome: str) -> None:
        t0 = time.monotonic()
        try:
            await self._process_group(g, outcome)
        finally:
            self.process_s += time.monotonic() - t0
            self.groups_processed += 1

    async def _process_group(self, g: Group, outcome: str) -> None:
        rollouts = list(g.rollouts.values())
        entries = list(g.entries.values())
        stats = CreditStats()
        try:
            items = self.algo(len(rollouts)).to_saw_items(
                rollouts, self.sample_filter, defer_batch_stage=True, stats=stats
            )
            outputs = [(it.item_id, transport.encode_saw_item(it)) for it in items]
        except Exception as e:  # bad rollouts for this algorithm: dead-letter, never crash
            ERRORS.labels(kind="credit").inc()
            detail = f"group {g.gid}: {type(e).__name__}: {e}"
            for en in entries:
                await self.consumer.dead_letter(en, "credit_error", detail)
            await accounting.group_failed(self.r, self.keys, g.gid)
            self.groups.pop(g.gid, None)
            self._count("error")
            return
        await transport.wait_below(self.r, self.keys.saw, self.s.saw_high_water, stop=self.stop)
        written = await transport.retry_redis(
            lambda: accounting.commit(
                self.consumer,
                entries,
                outputs,
                self.keys.saw,
                self.keys.done("credit", g.gid),
                stage="credit",
                group_id=g.gid,
                # dynamic sampling dropped the group: the run accounting counts it apart
                empty_because="groups_zero_variance" if stats.groups_zero_variance else "",
            ),
            on_error=lambda e: ERRORS.labels(kind="redis").inc(),
        )
        self.groups.pop(g.gid, None)
        if written < 0:
            self._count("duplicate")
            return
        ITEMS.inc(written)
        MASKED_NO_EOS.inc(stats.items_masked_no_eos)
        self.items_written += written
        if items:
            self._count(outcome)
            return
        self._count("zero_variance" if stats.groups_zero_variance else "empty")
        await self._wake_feeder()

    async def _wake_feeder(self) -> None:
        """A group that ends with no item frees its admission slot at once (it is no longer
        outstanding and will never be trained): wake the feeder to request a replacement
        now rather than at its next poll."""
        try:
            await accounting.wake_admission(self.r, self.keys)
        except (rexc.RedisError, OSError):
            ERRORS.labels(kind="redis").inc()

    async def _expire(self) -> None:
        now = time.monotonic()
        for g in [g for g in self.groups.values() if now - g.first_seen > self.s.group_timeout_s]:
            if len(g.rollouts) >= self.s.min_partial_group:
                log.warning(
                    "group %s timed out with %d/%d rollouts; processing as-is",
                    g.gid,
                    len(g.rollouts),
                    g.size,
                )
                await self._process(g, "partial")
            else:
                log.warning(
                    "group %s timed out with %d/%d rollouts; dropping",
                    g.gid,
                    len(g.rollouts),
                    g.size,
                )
                await accounting.commit(
                    self.consumer,
                    list(g.entries.values()),
                    [],
                    self.keys.saw,
                    self.keys.done("credit", g.gid),
                    stage="credit",
                    group_id=g.gid,
                    if_empty="groups_dropped_incomplete",
                )
                self.groups.pop(g.gid, None)
                self._count("dropped")
                await self._wake_feeder()

    # ---- main loop ----------------------------------------------------------------------

    async def run(self) -> None:
        await transport.retry_redis(self.consumer.ensure_group, stop=self.stop)
        lease_task = asyncio.create_task(self._keep_lease())
        was_leader, attempt = False, 0
        try:
            while not self.stop.is_set():
                self.last_tick = time.monotonic()
                if not self.leader:
                    was_leader = False
                    await sleep_or_stop(self.stop, 0.2)
                    continue
                try:
                    if not was_leader:  # take over everything the previous leader held
                        was_leader = True
                        async for got in self.consumer.claim_all(self.s.batch):
                            for e in got:
                                await self._take(e)
                    entries = await self.consumer.read(self.s.batch, block_ms=self.s.block_ms)
                    for e in entries:
                        await self._take(e)
                    await self._expire()
                    attempt = 0
                except transport.REDIS_DOWN_ERRORS as e:
                    ERRORS.labels(kind="redis").inc()
                    log.warning("redis unavailable (%s); backing off", e)
                    await transport.backoff_sleep(attempt, self.stop)
                    attempt += 1
        finally:
            lease_task.cancel()
            await asyncio.gather(lease_task, return_exceptions=True)
            log.info(
                "credit profile: %d groups, %d items; per group %.4f s (credit, encode, commit)",
                self.groups_processed,
                self.items_written,
                self.process_s / max(self.groups_processed, 1),
            )
            try:  # buffered groups stay pending; let the next leader claim them at once
                await self.lease.release()
            except transport.REDIS_DOWN_ERRORS:
                pass
