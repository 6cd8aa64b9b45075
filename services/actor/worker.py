"""The actor's worker: metrics and ``Actor`` (claim requests, run episodes, commit
rollouts, hand back on drain). ``main.py`` wires it into a process."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import redis.exceptions as rexc
from prometheus_client import Counter, Gauge, Histogram

from libludic import transport
from libludic.envs.code_exec.sandbox import described_sandboxes
from libludic.inference.client import InferenceError
from libludic.registry import build_registries
from libludic.requests import RolloutRequest
from libludic.rollout.engine import RolloutEngine
from libludic.scoring.base import RewardError
from libludic.transport import accounting
from services.actor.settings import ActorSettings
from services.common.lifecycle import update_stream_gauges

# a request that failed on these is left pending and retried (anything else is dead-lettered)
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (InferenceError, *transport.REDIS_DOWN_ERRORS)

log = logging.getLogger("ludic.actor")
RESOLVED_KEPT = 4096  # far more than one read can claim

EPISODES = Counter("ludic_actor_episodes_total", "Rollouts written to the rollouts stream")
REWARD = Histogram(
    "ludic_actor_reward",
    "Total reward per rollout",
    buckets=(-1.0, -0.5, 0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 2.0, 5.0),
)
TOKENS = Counter("ludic_actor_tokens_total", "Sampled completion tokens in written rollouts")
ERRORS = Counter("ludic_actor_errors_total", "Actor failures by kind", ["kind"])
TASK_REQUESTS = Counter(
    "ludic_actor_task_requests_total",
    "Requests resolved, by task and outcome (committed or deadlettered)",
    ["task", "outcome"],
)
CLAIM = Histogram(
    "ludic_actor_claim_seconds",
    "Time from asking for work to holding a request",
    buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0),
)
STALE_WAITS = Counter(
    "ludic_actor_stale_admission_waits_total",
    "Times the actor waited because inference lagged the learner by more than "
    "max_head_offpolicyness",
)
DUPLICATES = Counter(
    "ludic_actor_duplicates_total", "Requests already done by someone else (redelivery)"
)
INFLIGHT = Gauge("ludic_actor_inflight_requests", "Requests being run by this actor")
SANDBOX = Gauge(
    "ludic_actor_sandbox_info",
    "1 per code sandbox this actor probed, labelled with what it enforces on this host",
    ["mode", "runs_as_fresh_uid", "network_isolated", "environment_private", "allowed_without"],
)
GENERATE = Histogram(
    "ludic_actor_generate_seconds",
    "Time to run every episode of a request (inference + env)",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
COMMIT = Histogram(
    "ludic_actor_commit_seconds",
    "Time to commit a request's rollouts to Redis",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)


def export_sandboxes() -> None:
    """``ludic_actor_sandbox_info``: what each code sandbox the envs probed enforces."""
    for d in described_sandboxes():
        allowed = d["allowed_without"]
        SANDBOX.labels(
            mode=str(d["mode"]),
            runs_as_fresh_uid=str(d["runs_as_fresh_uid"]).lower(),
            network_isolated=str(d["network_isolated"]).lower(),
            environment_private=str(d["environment_private"]).lower(),
            allowed_without=",".join(map(str, allowed)) if isinstance(allowed, list) else "",
        ).set(1)


@dataclass
class ActorStats:
    requests_done: int = 0
    episodes: int = 0
    duplicates: int = 0
    deadlettered: int = 0
    retried: int = 0
    generate_s: float = 0.0  # summed over requests (they overlap: concurrency)
    commit_s: float = 0.0
    claim_wait_s: float = 0.0  # the loop's time waiting for work (admission, backlog, read)


class Actor:
    def __init__(self, settings: ActorSettings, client: Any, r: Any, stop: asyncio.Event):
        self.s = settings
        self.client = client
        self.r = r
        self.stop = stop
        self.keys = transport.Keys(settings.run_id)
        self.name = settings.consumer or transport.consumer_name("actor")
        self.consumer = accounting.AccountedConsumer(
            r,
            self.keys.requests,
            transport.GROUP_ACTORS,
            self.name,
            self.keys.deadletter,
            claim_idle_ms=settings.claim_idle_ms,
            max_deliveries=settings.max_deliveries,
            on_deadletter=lambda reason: ERRORS.labels(kind="deadletter").inc(),
            stage="requests",
        )
        self.engine = RolloutEngine(*build_registries(client))
        self.admission = transport.AdmissionController(
            r,
            self.keys,
            settings.max_head_offpolicyness,
            self._inference_version,
            on_wait=STALE_WAITS.inc,
        )
        self.inflight: dict[str, transport.Entry] = {}
        # entries this actor resolved lately, oldest first: a claim issued before their
        # commit can still return them (a second run would be a duplicate)
        self.resolved: dict[str, None] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.stats = ActorStats()
        self.last_tick = time.monotonic()

    async def _inference_version(self) -> int:
        get = getattr(self.client, "get_policy_version", None)
        return 0 if get is None else int(await get())

    async def health(self) -> bool:
        return time.monotonic() - self.last_tick < max(30.0, 3 * self.s.block_ms / 1000)

    # ---- background loops -------------------------------------------------------------

    async def _keepalive(self) -> None:
        """Heartbeat key, in-flight touch and stream gauges, every ~ttl/3."""
        every = max(0.05, min(self.s.heartbeat_ttl_s / 3, self.s.claim_idle_ms / 3000))
        while True:
            try:
                await transport.beat(
                    self.r,
                    self.keys,
                    "actor",
                    self.name,
                    self.s.heartbeat_ttl_s,
                    {
                        "pid": os.getpid(),
                        "host": socket.gethostname(),
                        "inflight": len(self.inflight),
                        "episodes": self.stats.episodes,
                    },
                )
                await self.consumer.touch(list(self.inflight.values()))
                await update_stream_gauges(self.r, self.keys)
            except (rexc.RedisError, OSError) as e:
                ERRORS.labels(kind="redis").inc()
                log.warning("keepalive failed (%s: %s); retrying", type(e).__name__, e)
            await asyncio.sleep(every)

    # ---- one request ------------------------------------------------------------------

    async def _handle(self, entry: transport.Entry) -> bool:
        """Run one request; True once it is resolved (committed or dead-lettered), False
        when it is left pending for a retry."""
        try:
            req = transport.decode_request(entry.payload)
        except transport.CodecError as err:
            ERRORS.labels(kind="decode").inc()
            reason, why = err.reason, err.detail
            await transport.retry_redis(lambda: self.consumer.dead_letter(entry, reason, why))
            self.stats.deadlettered += 1
            return True
        if entry.item_id and req.id != entry.item_id:
            # the feeder writes each request under its own id; the done marker and the run
            # accounting key on it, so a body naming another request cannot be run
            ERRORS.labels(kind="decode").inc()
            why = f"request id {req.id!r} differs from its entry's id {entry.item_id!r}"
            await transport.retry_redis(lambda: self.consumer.dead_letter(entry, "bad_field", why))
            self.stats.deadlettered += 1
            return True
        task = self.s.task_set.match(req)
        if task is None:
            # a stream entry names only what the run's own config does: nothing else is
            # imported, built or opened
            ERRORS.labels(kind="not_a_task").inc()
            why = (
                f"request {req.id} runs env {req.env.to_dict()} with protocol "
                f"{req.protocol.to_dict()}: not one of this run's tasks "
                f"{self.s.task_set.names} (feeder.tasks); an actor runs only its config's tasks"
            )
            await transport.retry_redis(lambda: self.consumer.dead_letter(entry, "not_a_task", why))
            self.stats.deadlettered += 1
            TASK_REQUESTS.labels(task="(none)", outcome="deadlettered").inc()
            return True
        req.meta.setdefault("group_id", req.id)
        t_gen = time.monotonic()
        try:
            rollouts = await self.engine.generate_rollouts(
                [req],
                max_steps=self.s.max_steps,
                concurrency=min(self.s.episode_concurrency, req.num_episodes),
            )
        except TRANSIENT_ERRORS as e:
            # transient: leave it pending; a claimer (maybe us) retries after claim_idle_ms
            ERRORS.labels(kind="inference").inc()
            self.stats.retried += 1
            log.warning(
                "request %s failed (%s: %s); left pending for retry", req.id, type(e).__name__, e
            )
            return False
        except Exception as e:  # deterministic failure (an env or reward raising): dead-letter
            reason = "reward_error" if isinstance(e, RewardError) else "episode_error"
            ERRORS.labels(kind="reward" if reason == "reward_error" else "episode").inc()
            detail = f"task {task.name}: {type(e).__name__}: {e}"
            await transport.retry_redis(lambda: self.consumer.dead_letter(entry, reason, detail))
            self.stats.deadlettered += 1
            TASK_REQUESTS.labels(task=task.name, outcome="deadlettered").inc()
            return True
        gen_s = time.monotonic() - t_gen
        GENERATE.observe(gen_s)
        self.stats.generate_s += gen_s
        t_commit = time.monotonic()
        await self._commit(entry, req, rollouts)
        TASK_REQUESTS.labels(task=task.name, outcome="committed").inc()
        COMMIT.observe(time.monotonic() - t_commit)
        self.stats.commit_s += time.monotonic() - t_commit
        return True

    async def _commit(
        self, entry: transport.Entry, req: RolloutRequest, rollouts: list[Any]
    ) -> None:
        whole_group = req.meta.get("group_id") == req.id
        for ro in rollouts:
            ro.meta.setdefault("actor", self.name)
            if whole_group:  # the group is exactly this request: tell credit its size
                ro.meta["group_rollouts"] = len(rollouts)
        outputs = [(ro.id, transport.encode_rollout(ro)) for ro in rollouts]
        written = await transport.retry_redis(
            lambda: accounting.commit(
                self.consumer,
                [entry],
                outputs,
                self.keys.rollouts,
                self.keys.done("actor", req.id),
                stage="actor",
                group_id=req.meta["group_id"],
            ),
            on_error=lambda e: ERRORS.labels(kind="redis").inc(),
        )
        self.stats.requests_done += 1
        if written < 0:
            DUPLICATES.inc()
            self.stats.duplicates += 1
            return
        EPISODES.inc(len(rollouts))
        self.stats.episodes += len(rollouts)
        export_sandboxes()
        for ro in rollouts:
            REWARD.observe(ro.total_reward)
            TOKENS.inc(sum(len(s.trace.completion_token_ids) for s in ro.steps if s.trace))

    def _spawn(self, entry: transport.Entry) -> None:
        if entry.id in self.inflight or entry.id in self.resolved:
            # our own entry, claimed back because the loop was too busy to touch it within
            # claim_idle_ms: it is running or done already (a second run would dead-letter
            # or commit it twice); the claim only refreshed its idle time
            return
        self.inflight[entry.id] = entry
        INFLIGHT.set(len(self.inflight))

        async def run() -> None:
            resolved = False
            try:
                resolved = await self._handle(entry)
            except Exception as e:  # e.g. Redis refusing the commit (OOM): stays pending
                ERRORS.labels(kind="commit").inc()
                log.error(
                    "request entry %s failed to commit (%s: %s); left pending",
                    entry.id,
                    type(e).__name__,
                    e,
                )
            finally:
                self.inflight.pop(entry.id, None)
                if resolved:
                    self.resolved[entry.id] = None
                    if len(self.resolved) > RESOLVED_KEPT:
                        del self.resolved[next(iter(self.resolved))]
                self.tasks.pop(entry.id, None)
                INFLIGHT.set(len(self.inflight))

        self.tasks[entry.id] = asyncio.create_task(run(), name=f"request-{entry.id}")

    # ---- main loop --------------------------------------------------------------------

    async def run(self) -> ActorStats:
        await transport.retry_redis(self.consumer.ensure_group, stop=self.stop)
        keepalive = asyncio.create_task(self._keepalive())
        attempt = 0
        try:
            while not self.stop.is_set():
                self.last_tick = time.monotonic()
                free = self.s.concurrency - len(self.inflight)
                if free <= 0:
                    await asyncio.wait(
                        list(self.tasks.values()), timeout=1.0, return_when=asyncio.FIRST_COMPLETED
                    )
                    continue
                t_wait = time.monotonic()
                try:
                    await transport.wait_below(
                        self.r, self.keys.rollouts, self.s.rollouts_high_water, stop=self.stop
                    )
                    await self.admission.admit(self.stop)
                    if self.stop.is_set():
                        break
                    t0 = time.monotonic()
                    entries = await self.consumer.read(free, block_ms=self.s.block_ms)
                    attempt = 0
                except transport.REDIS_DOWN_ERRORS as e:
                    ERRORS.labels(kind="redis").inc()
                    log.warning("redis unavailable (%s); backing off", e)
                    await transport.backoff_sleep(attempt, self.stop)
                    attempt += 1
                    continue
                except InferenceError as e:
                    ERRORS.labels(kind="inference").inc()
                    log.warning("inference unavailable for admission (%s); backing off", e)
                    await transport.backoff_sleep(attempt, self.stop)
                    attempt += 1
                    continue
                if entries:
                    CLAIM.observe(time.monotonic() - t0)
                self.stats.claim_wait_s += time.monotonic() - t_wait
                for entry in entries:
                    self._spawn(entry)
        finally:
            await self._drain()
            keepalive.cancel()
            await asyncio.gather(keepalive, return_exceptions=True)
            st = self.stats
            log.info(
                "actor profile: %d requests, %d episodes; per request: generate %.3f s, "
                "commit %.4f s; waiting for work %.1f s in all",
                st.requests_done,
                st.episodes,
                st.generate_s / max(st.requests_done, 1),
                st.commit_s / max(st.requests_done, 1),
                st.claim_wait_s,
            )
        return self.stats

    async def _drain(self) -> None:
        if self.tasks:
            log.info(
                "draining %d in-flight request(s) (grace %.0fs)",
                len(self.tasks),
                self.s.drain_grace_s,
            )
            await asyncio.wait(list(self.tasks.values()), timeout=self.s.drain_grace_s)
        left = list(self.inflight.values())
        for t in list(self.tasks.values()):
            t.cancel()
        if self.tasks:  # bounded: a task that ignores cancellation must not block the exit
            await asyncio.wait(list(self.tasks.values()), timeout=5.0)
        try:
            if left:  # hand back: make them claimable by peers right away
                await self.consumer.hand_back([e.id for e in left])
                log.info("handed back %d unfinished request(s)", len(left))
            await self.consumer.delete_consumer()
            await self.r.delete(self.keys.heartbeat("actor", self.name))
        except transport.REDIS_DOWN_ERRORS:
            ERRORS.labels(kind="redis").inc()
