"""The feeder's worker: request building and one
top-up of the requests stream under admission control. ``main.py`` wires it into a process
(see its docstring for the loop)."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from prometheus_client import Counter

from libludic import staleness, transport
from libludic.requests import RolloutRequest
from libludic.tasks import TaskSpec
from libludic.transport import accounting
from services.feeder.settings import FeederSettings

log = logging.getLogger("ludic.feeder")

REQUESTS = Counter("ludic_feeder_requests_total", "RolloutRequests added", ["task"])
FULL = Counter("ludic_feeder_backpressure_waits_total", "Ticks skipped: requests stream full")
NO_ROOM = Counter(
    "ludic_feeder_admission_waits_total",
    "Ticks that added nothing because the learner had no room (max_head_offpolicyness)",
)
ERRORS = Counter("ludic_feeder_errors_total", "Feeder failures by kind", ["kind"])


def pick_task(tasks: list[TaskSpec], seed: int) -> TaskSpec:
    """Weighted choice that is a pure function of ``seed`` (same seed, same task)."""
    if len(tasks) == 1:
        return tasks[0]
    h = int.from_bytes(hashlib.blake2b(str(seed).encode(), digest_size=8).digest(), "big")
    x = (h / 2**64) * sum(t.weight for t in tasks)
    for t in tasks:
        x -= t.weight
        if x < 0:
            return t
    return tasks[-1]


def make_request(settings: FeederSettings, task: TaskSpec, seed: int) -> RolloutRequest:
    rid = f"{settings.run_id}-{seed}"
    return task.request(
        id=rid,
        env_seed=seed,
        sampling_seed=seed * 1000,
        num_episodes=settings.group_size,
        meta={"group_id": rid},
    )


async def admitted_groups(r: Any, keys: transport.Keys, settings: FeederSettings) -> int | None:
    """Groups the learner has room for now (None: admission control off; 0 before a learner
    announced its batch size)."""
    if settings.max_head_offpolicyness is None:
        return None
    st = await accounting.admission_state(r, keys, settings.group_size)
    if st is None:
        return 0
    room = staleness.admission_room(
        served_step=st["served_step"],
        batch_size=st["batch_size"],
        trained=st["trained"],
        outstanding=st["outstanding"],
        max_head_offpolicyness=settings.max_head_offpolicyness,
    )
    assert room is not None
    # a group is items_per_group items (a multi-turn episode: one per model call)
    return accounting.groups_for_room(room, st["items_per_group"])


async def top_up(r: Any, keys: transport.Keys, settings: FeederSettings, limit: int) -> int:
    """Add requests until the backlog reaches ``high_water`` (at most ``limit``, and at most
    what admission control has room for)."""
    n = min(settings.high_water - await transport.backlog(r, keys.requests), limit)
    if n <= 0:
        FULL.inc()
        return 0
    admitted = await admitted_groups(r, keys, settings)
    if admitted is not None and admitted < n:
        n = admitted
        if n <= 0:
            NO_ROOM.inc()
    if n <= 0:
        return 0
    last = int(await r.incrby(keys.feeder_seed, n))
    batch, tasks = [], []
    for seed in range(settings.seed_base + last - n, settings.seed_base + last):
        task = pick_task(settings.parsed_tasks, seed)
        req = make_request(settings, task, seed)
        batch.append((req.id, transport.encode_request(req)))
        tasks.append(task.name)
    await accounting.add_requests(r, keys, batch)  # XADD + groups_requested, atomically
    for name in tasks:
        REQUESTS.labels(task=name).inc()
    return n
