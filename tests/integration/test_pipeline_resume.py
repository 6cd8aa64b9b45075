"""The learner's batch source on resume: "trained" means trained.

A reply to XREADGROUP lost on the wire and retried by the client leaves entries pending
on the learner's consumer that it never saw, older than entries it then trains and
checkpoints. On ``--resume`` exactly the checkpoint's trained-but-unacked entries are acked
without training; the unseen ones are trained, although their ids are below the last
trained id (an id bound would ack them as trained).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from learner_items import make_item, push  # noqa: E402

from libludic import transport as t  # noqa: E402
from libludic.training.batching.pipeline import PipelineBatchSource  # noqa: E402
from libludic.transport import accounting  # noqa: E402

pytestmark = pytest.mark.integration


def source(r, keys: t.Keys) -> PipelineBatchSource:
    return PipelineBatchSource(redis=r, keys=keys, batch_size=2, consumer="learner-0", block_ms=100)


async def test_entries_of_a_lost_read_reply_are_trained_on_resume_not_acked(redis_url: str) -> None:
    keys = t.Keys("resume-lost")
    r = t.connect(redis_url)
    first = source(r, keys)
    await first.start()
    await push(redis_url, "resume-lost", [make_item(f"i{n}:0", b"ab", b"1") for n in range(2)])
    assert [it.item_id for it in (await first.next_batch()).items] == ["i0:0", "i1:0"]
    first.mark_trained()
    await first.commit()
    eids = await push(
        redis_url, "resume-lost", [make_item(f"i{n}:0", b"ab", b"1") for n in range(2, 6)]
    )
    # the lost reply: i2, i3 delivered to this consumer, the client never saw them
    await r.xreadgroup(t.GROUP_LEARNER, "learner-0", {keys.saw: ">"}, count=2)
    batch = await first.next_batch()
    assert [it.item_id for it in batch.items] == ["i4:0", "i5:0"]
    first.mark_trained()
    state = first.state_dict()  # the checkpoint; the process dies before its ack
    assert state["trained_unacked"] == eids[2:]
    assert state["last_committed_id"] == eids[3]  # above the unseen i2, i3

    second = source(r, keys)
    second.load_state_dict(state)
    await second.start()
    batch = await second.next_batch()
    assert [it.item_id for it in batch.items] == ["i2:0", "i3:0"]  # trained, not acked as trained
    second.mark_trained()
    await second.commit()
    await push(redis_url, "resume-lost", [make_item(f"i{n}:0", b"ab", b"1") for n in range(6, 8)])
    batch = await second.next_batch()
    assert [it.item_id for it in batch.items] == ["i6:0", "i7:0"]
    assert second.recovered_acked == 2  # i4, i5: inside the checkpoint, acked without training
    second.mark_trained()
    await second.commit()
    pending = await r.xpending(keys.saw, t.GROUP_LEARNER)
    assert int(pending["pending"]) == 0
    snap = await accounting.snapshot(r, keys)
    assert snap["items_trained_twice"] == 0
    await r.aclose()


async def test_a_stop_request_ends_the_wait_for_items_while_redis_is_down() -> None:
    """SIGTERM of a learner whose Redis is gone (e.g. every service of a run stopping at
    once) must end it: the wait for items gives up on stop_fn even while reads fail."""
    import asyncio
    import socket
    import time

    from libludic.training.types import SourceStopped

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = t.connect(f"redis://127.0.0.1:{port}/0", socket_timeout=1.0)
    stop = False
    src = PipelineBatchSource(
        redis=r, keys=t.Keys("down"), batch_size=2, block_ms=100, stop_fn=lambda: stop
    )
    src._replay_cursor = None  # past start(): reading new entries

    async def request_stop() -> None:
        nonlocal stop
        await asyncio.sleep(1.0)
        stop = True

    t0 = time.monotonic()
    task = asyncio.create_task(request_stop())
    with pytest.raises(SourceStopped):
        await asyncio.wait_for(src.next_batch(), 30)
    await task
    assert time.monotonic() - t0 < 15
    await r.aclose()


async def test_entries_held_through_too_many_learner_stops_are_dead_lettered(
    redis_url: str,
) -> None:
    """A step that raises on an item kills the learner each time it is retried; without a
    checkpoint every restart re-reads its pending entries first. Each re-read is a delivery:
    after ``max_deliveries`` (3) the batch is dead-lettered ("max_deliveries"), once, and the
    next restart trains the entries behind it instead of crashing again."""
    keys = t.Keys("resume-poison")
    r = t.connect(redis_url)
    eids = await push(
        redis_url, "resume-poison", [make_item(f"i{n}:0", b"ab", b"1") for n in range(4)]
    )
    for _ in range(3):  # deliveries 1, 2, 3: the step "raises", the process dies unacked
        learner = source(r, keys)
        await learner.start()
        batch = await learner.next_batch()
        assert [it.item_id for it in batch.items] == ["i0:0", "i1:0"]
    last = source(r, keys)
    await last.start()
    batch = await last.next_batch()  # the 4th delivery of i0, i1 is refused
    assert [it.item_id for it in batch.items] == ["i2:0", "i3:0"]
    dead = await r.xrange(keys.deadletter)
    assert [f[b"reason"] for _, f in dead] == [b"max_deliveries", b"max_deliveries"]
    assert b"delivered 4 times (> 3)" in dead[0][1][b"detail"]
    last.mark_trained()
    await last.commit()
    pending = await r.xpending(keys.saw, t.GROUP_LEARNER)
    assert int(pending["pending"]) == 0
    snap = await accounting.snapshot(r, keys)
    assert snap["items_deadlettered"] == 2 and snap["items_trained"] == 2
    assert snap["items_trained_twice"] == 0
    assert len(eids) == 4
    await r.aclose()
