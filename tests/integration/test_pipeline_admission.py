"""The learner's batch source judges with the Trainer's Admission and calls nothing back.

On a real redis-server: staleness is judged at batch formation at the served version *then*
(an item read fresh goes stale when the version moves before its batch is complete), stale
items are acked and counted, an item the stepper cannot train is dead-lettered as
``unusable_item``; while no batch comes, ``next_batch`` raises SourceIdle every
``idle_every_s`` and a later call still returns the batch (nothing lost to the idle turn)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from learner_items import make_item, push  # noqa: E402

from libludic import transport as t  # noqa: E402
from libludic.saw import SAWItem  # noqa: E402
from libludic.training.admission import Admission  # noqa: E402
from libludic.training.batching.pipeline import PipelineBatchSource  # noqa: E402
from libludic.training.types import SourceIdle  # noqa: E402
from libludic.transport import accounting  # noqa: E402

pytestmark = pytest.mark.integration


@dataclass
class Versions:
    version: int = 0
    served_version: int = 0


class RefuseLong:
    def item_problem(self, item: SAWItem) -> str | None:
        return "too long" if item.num_tokens > 6 else None


async def test_staleness_is_judged_at_batch_formation_and_problems_dead_lettered(
    redis_url: str,
) -> None:
    run = "admit"
    keys = t.Keys(run)
    r = t.connect(redis_url)
    versions = Versions()
    src = PipelineBatchSource(
        redis=r,
        keys=keys,
        batch_size=3,
        block_ms=100,
        idle_every_s=0.5,
        admission=Admission(max_lag=1, versions=versions, checker=RefuseLong()),
    )
    await src.start()
    await push(
        redis_url,
        run,
        [
            make_item("old:0", b"ab", b"1", policy_version=0),
            make_item("long:0", b"abcdef", b"12", policy_version=2),  # 9 tokens: refused
            make_item("new:0", b"ab", b"1", policy_version=2),
        ],
    )
    # two trainable items read at served version 0; no batch of 3 yet
    with pytest.raises(SourceIdle):
        await src.next_batch()
    versions.served_version = 2  # the publish thread: v2 acknowledged; "old" (v0) is now stale
    await push(
        redis_url, run, [make_item(f"n{i}:0", b"ab", b"1", policy_version=2) for i in (1, 2)]
    )
    batch = await src.next_batch()
    assert [it.item_id for it in batch.items] == ["new:0", "n1:0", "n2:0"]
    assert src.stale_dropped == 1
    dead = await r.xrange(keys.deadletter)
    assert len(dead) == 1
    src.mark_trained()
    await src.commit()
    snap = await accounting.snapshot(r, keys)
    assert int((await r.xpending(keys.saw, t.GROUP_LEARNER))["pending"]) == 0
    assert snap["items_trained_twice"] == 0
    await r.aclose()


async def test_a_waiting_source_raises_source_idle_and_loses_nothing(redis_url: str) -> None:
    run = "idle"
    r = t.connect(redis_url)
    src = PipelineBatchSource(
        redis=r, keys=t.Keys(run), batch_size=2, block_ms=50, idle_every_s=0.3
    )
    await src.start()
    await push(redis_url, run, [make_item("a:0", b"ab", b"1")])
    t0 = time.monotonic()
    with pytest.raises(SourceIdle):
        await src.next_batch()
    assert 0.25 <= time.monotonic() - t0 < 5
    with pytest.raises(SourceIdle):  # again, one period later
        await src.next_batch()
    await push(redis_url, run, [make_item("b:0", b"ab", b"1")])
    batch = await src.next_batch()
    assert [it.item_id for it in batch.items] == ["a:0", "b:0"]
    await r.aclose()
