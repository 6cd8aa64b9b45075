"""Stream semantics against a real redis-server: claim-over after kill -9, de-dup on
redelivery, dead-lettering, backpressure, admission control, heartbeats and leases."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from libludic import transport as t
from libludic.requests import EnvSpec, RolloutRequest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STREAM, OUT, DL, GROUP = "ludic:{t}:in", "ludic:{t}:out", "ludic:{t}:deadletter", "g"


def consumer(r, name: str, **kw) -> t.StreamConsumer:
    kw.setdefault("claim_idle_ms", 300)
    kw.setdefault("claim_every_s", 0.05)
    return t.StreamConsumer(r, STREAM, GROUP, name, DL, **kw)


async def echo_once(c: t.StreamConsumer, n: int = 10, block_ms: int = 100) -> int:
    """One read + commit pass of a worker that copies each request to OUT (de-dup by id)."""
    done = 0
    for e in await c.read(n, block_ms=block_ms):
        try:
            req = t.decode_request(e.payload)
        except t.CodecError as err:
            await c.dead_letter(e, err.reason, err.detail)
            continue
        await c.commit([e], [(req.id, e.payload)], OUT, f"ludic:{{t}}:done:echo:{req.id}")
        done += 1
    return done


async def out_ids(r) -> list[str]:
    return [t.as_str(f[b"id"]) for _, f in await r.xrange(OUT)]


async def add_requests(r, n: int, start: int = 0) -> list[str]:
    ids = []
    for i in range(start, start + n):
        req = RolloutRequest(env=EnvSpec("arithmetic"), env_seed=i, id=f"req-{i}")
        await t.xadd(r, STREAM, req.id, t.encode_request(req))
        ids.append(req.id)
    return ids


async def pending(r) -> int:
    return int((await r.xpending(STREAM, GROUP))["pending"])


VICTIM = textwrap.dedent(
    """
    import asyncio, sys
    from libludic import transport as t

    async def main(url):
        r = t.connect(url)
        c = t.StreamConsumer(r, "ludic:{t}:in", "g", "victim", "ludic:{t}:deadletter")
        await c.ensure_group()
        entries = await c.read(6, block_ms=5000)
        for e in entries[:2]:  # finish two, hold the rest un-acked
            await c.commit([e], [(e.item_id, e.payload)], "ludic:{t}:out",
                           "ludic:{t}:done:echo:" + e.item_id)
        print("HOLDING", len(entries) - 2, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main(sys.argv[1]))
    """
)


async def test_kill9_consumer_entries_are_claimed_and_finished_once(redis_url: str) -> None:
    r = t.connect(redis_url)
    await t.ensure_group(r, STREAM, GROUP)
    ids = await add_requests(r, 10)
    proc = subprocess.Popen(
        [sys.executable, "-c", VICTIM, redis_url],
        stdout=subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)  # type: ignore[union-attr]
        assert line.decode().split() == ["HOLDING", "4"]
        assert await pending(r) == 4
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    rescuer = consumer(r, "rescuer")
    deadline = time.monotonic() + 20
    while len(await out_ids(r)) < 10 and time.monotonic() < deadline:
        await echo_once(rescuer)
    got = await out_ids(r)
    assert sorted(got) == sorted(ids)  # nothing lost, nothing twice
    assert await pending(r) == 0 and await r.xlen(STREAM) == 0
    await r.aclose()


async def test_redelivery_is_deduplicated(redis_url: str) -> None:
    r = t.connect(redis_url)
    await t.ensure_group(r, STREAM, GROUP)
    await add_requests(r, 1)
    # (1) a slow consumer: A reads, B claims after the idle timeout and commits, A commits late
    a, b = consumer(r, "A"), consumer(r, "B")
    (ea,) = await a.read(1, block_ms=100)
    await asyncio.sleep(0.4)
    (eb,) = await b.read(1, block_ms=100)
    assert eb.id == ea.id and eb.claimed
    assert await b.commit([eb], [("req-0", eb.payload)], OUT, "ludic:{t}:done:echo:req-0") == 1
    assert await a.commit([ea], [("req-0", ea.payload)], OUT, "ludic:{t}:done:echo:req-0") == -1
    # (2) the producer retried its XADD: the same request id arrives twice
    await add_requests(r, 1)
    assert await echo_once(a) == 1
    assert await out_ids(r) == ["req-0"]
    assert await pending(r) == 0 and await r.xlen(STREAM) == 0
    await r.aclose()


async def test_malformed_entries_are_deadlettered_counted_and_acked(redis_url: str) -> None:
    r = t.connect(redis_url)
    await t.ensure_group(r, STREAM, GROUP)
    bad = {
        "bad_msgpack": b"\xc1garbage",
        "unknown_schema_version": t.pack_msg(
            {"schema_version": 99, "kind": "rollout_request", "body": {}}
        ),
        "missing_field": t.pack_msg(
            {"schema_version": 1, "kind": "rollout_request", "body": {"id": "x"}}
        ),
    }
    src = {}
    for reason, payload in bad.items():
        src[reason] = await t.xadd(r, STREAM, f"bad-{reason}", payload)
    await add_requests(r, 1)
    counted: list[str] = []
    c = consumer(r, "w", on_deadletter=counted.append)
    while len(counted) < 3 or not await out_ids(r):
        await echo_once(c)
    assert sorted(counted) == sorted(bad)
    dl = {t.as_str(f[b"reason"]): f for _, f in await r.xrange(DL)}
    for reason, sid in src.items():
        assert t.as_str(dl[reason][b"source_id"]) == sid
        assert t.as_str(dl[reason][b"source_stream"]) == STREAM
        assert dl[reason][b"d"] == bad[reason]
    assert await out_ids(r) == ["req-0"]
    assert await pending(r) == 0 and await r.xlen(STREAM) == 0
    await r.aclose()


async def test_the_deadletter_stream_is_capped_and_keeps_large_payloads_as_sizes(
    redis_url: str,
) -> None:
    from libludic.transport import accounting

    r = t.connect(redis_url)
    await r.delete(DL)
    await t.ensure_group(r, STREAM, GROUP)
    c = consumer(r, "w", deadletter_maxlen=100, deadletter_payload_bytes=1000)
    # the same consumer, dead-lettering through the accounting script (the services' path)
    ac = accounting.AccountedConsumer(
        r,
        STREAM,
        GROUP,
        "w",
        DL,
        deadletter_maxlen=100,
        deadletter_payload_bytes=1000,
        stage="rollouts",
    )
    for i in range(400):
        await t.xadd(r, STREAM, f"junk-{i}", b"\xc1" * (10 if i % 2 else 5000))
    got: list[t.Entry] = []
    while len(got) < 400:
        got += await c.read(100, block_ms=100)
    for i, e in enumerate(got):  # half each way
        await (c if i % 2 else ac).dead_letter(e, "bad_msgpack", "junk")
    # MAXLEN ~ 100: Redis trims whole macro nodes, so a little over 100 stays, never 400
    n = await r.xlen(DL)
    assert 100 <= n < 250, n
    for _, f in await r.xrange(DL):
        size = int(f[b"d_bytes"])
        assert f[b"d"] == (b"\xc1" * size if size <= 1000 else b"")
    assert await pending(r) == 0 and await r.xlen(STREAM) == 0
    await r.delete(DL)
    await r.aclose()


async def test_poison_entry_deadlettered_after_max_deliveries(redis_url: str) -> None:
    r = t.connect(redis_url)
    await t.ensure_group(r, STREAM, GROUP)
    await add_requests(r, 1)
    c = consumer(r, "crashy", claim_idle_ms=100, max_deliveries=3)
    seen = 0
    deadline = time.monotonic() + 10
    while await r.xlen(DL) == 0 and time.monotonic() < deadline:
        seen += len(await c.read(1, block_ms=50))  # never acks: a worker that keeps dying
        await asyncio.sleep(0.12)
    assert seen == 3  # delivered max_deliveries times, then dead-lettered
    ((_, f),) = await r.xrange(DL)
    assert f[b"reason"] == b"max_deliveries"
    assert await pending(r) == 0
    await r.aclose()


async def test_backpressure_holds_producer_and_trims_nothing(redis_url: str) -> None:
    r = t.connect(redis_url)
    await t.ensure_group(r, STREAM, GROUP)
    waits: list[int] = []
    produced: list[str] = []

    async def producer() -> None:
        for i in range(20):
            await t.wait_below(r, STREAM, 5, poll_s=0.02, on_wait=waits.append)
            produced.extend(await add_requests(r, 1, start=i))

    task = asyncio.create_task(producer())
    await asyncio.sleep(0.5)
    assert not task.done() and len(produced) == 5 and await r.xlen(STREAM) == 5
    assert waits and max(waits) == 5
    c = consumer(r, "w")
    while len(await out_ids(r)) < 20:
        await echo_once(c, n=3)
        assert await r.xlen(STREAM) <= 5
    await asyncio.wait_for(task, 5)
    assert sorted(await out_ids(r)) == sorted(produced)
    await r.aclose()


async def test_touch_keeps_inflight_work_from_being_claimed(redis_url: str) -> None:
    r = t.connect(redis_url)
    await t.ensure_group(r, STREAM, GROUP)
    await add_requests(r, 1)
    a, b = consumer(r, "A"), consumer(r, "B")
    (ea,) = await a.read(1)
    for _ in range(6):  # 0.6 s > claim_idle_ms, but A keeps touching
        await asyncio.sleep(0.1)
        assert await a.touch([ea]) == 1
        assert await b.claim_stale(10) == []
    await asyncio.sleep(0.4)
    (eb,) = await b.claim_stale(10)
    assert eb.id == ea.id
    assert await a.touch([ea]) == 0  # A never steals it back
    await r.aclose()


async def test_admission_control_waits_for_inference_to_catch_up(redis_url: str) -> None:
    r = t.connect(redis_url)
    keys = t.Keys("adm")
    assert await t.set_policy_version(r, keys, 5) == 5
    assert await t.set_policy_version(r, keys, 3) == 5  # never goes back
    inference = {"v": 2}
    waits: list[int] = []

    async def inf_version() -> int:
        return inference["v"]

    adm = t.AdmissionController(
        r,
        keys,
        max_head_offpolicyness=2,
        inference_version=inf_version,
        poll_s=0.02,
        on_wait=lambda: waits.append(1),
    )
    task = asyncio.create_task(adm.admit())
    await asyncio.sleep(0.2)
    assert not task.done() and waits == [1]  # 5 - 2 = 3 > max_head_offpolicyness: one counted wait
    inference["v"] = 3
    assert await asyncio.wait_for(task, 2) == 3
    assert await adm.admit() == 3 and waits == [1]
    await r.aclose()


async def test_heartbeats_and_lease(redis_url: str) -> None:
    r = t.connect(redis_url)
    keys = t.Keys("hb")
    await t.beat(r, keys, "actor", "a1", 0.3, {"pid": 1})
    await t.beat(r, keys, "actor", "a2", 5.0, {"pid": 2})
    assert set(await t.alive(r, keys, "actor")) == {"a1", "a2"}
    await asyncio.sleep(0.5)
    assert set(await t.alive(r, keys, "actor")) == {"a2"}
    l1 = t.Lease(r, keys.lease("credit"), "c1", ttl_ms=300)
    l2 = t.Lease(r, keys.lease("credit"), "c2", ttl_ms=300)
    assert await l1.hold() and not await l2.hold() and await l1.hold()
    await asyncio.sleep(0.4)  # c1 stopped renewing
    assert await l2.hold() and not await l1.hold()
    await l2.release()
    assert await l1.hold()
    await r.aclose()


async def test_a_full_redis_refuses_writes_and_the_writer_waits_instead_of_crashing(
    redis_url: str,
) -> None:
    """maxmemory with noeviction (compose, the chart, ludic up): a write to a full Redis
    fails with OOM, which the services treat like Redis being down: back off, retry."""
    r = t.connect(redis_url)
    old = await r.config_get("maxmemory*")
    errors: list[BaseException] = []
    try:
        await r.config_set("maxmemory-policy", "noeviction")
        await r.config_set("maxmemory", "1")  # below what is already used: full
        write = asyncio.create_task(
            t.retry_redis(
                lambda: r.xadd("ludic:{oom}:s", {"d": b"x"}), deadline_s=30, on_error=errors.append
            )
        )
        await asyncio.sleep(1.0)
        assert not write.done() and errors and isinstance(errors[0], t.REDIS_DOWN_ERRORS)
        await r.config_set("maxmemory", "0")  # drained
        await asyncio.wait_for(write, 30)
        assert await r.xlen("ludic:{oom}:s") == 1
    finally:
        await r.config_set("maxmemory", old["maxmemory"])
        await r.config_set("maxmemory-policy", old["maxmemory-policy"])
        await r.delete("ludic:{oom}:s")
        await r.aclose()


async def test_the_launchers_tally_counts_the_learners_dead_letters(redis_url: str) -> None:
    """What a consumer of the saw stream dead-letters (the learner's pipeline does it with
    reason unusable_item and the item's problem), counted by services/launcher/deadletters.py
    through XREAD after the last id read, an actor's dead letter left out."""
    # the sync client, torch (collate) and the launcher for this test only
    import redis

    from libludic.training.collate import untrainable
    from services.launcher.deadletters import DeadLetterTally
    from tests.fakes import make_item

    keys = t.Keys("tally")
    r = t.connect(redis_url)
    too_long = untrainable(make_item(1, 40), max_seq_len=32, vocab_size=None)
    assert too_long is not None
    for name, stream, reason, detail in [
        ("a", keys.saw, "unusable_item", too_long),
        ("b", keys.saw, "unusable_item", "the item has no action token"),
        ("c", keys.requests, "episode_error", "ValueError: no problem 3"),
    ]:
        await t.ensure_group(r, stream, "g")
        await t.xadd(r, stream, name, b"payload")
        c = t.StreamConsumer(r, stream, "g", "w", keys.deadletter)
        (e,) = await c.read(1, block_ms=1000)
        await c.dead_letter(e, reason, detail)
    sync = redis.Redis.from_url(redis_url)
    tally = DeadLetterTally(keys)
    tally.update(sync, batch=1)  # one entry a read: the reads go on from the last id
    assert (tally.by_reason, tally.too_long) == ({"unusable_item": 2}, 1)
    tally.update(sync)  # nothing new
    assert tally.unusable == 2
    sync.close()
    await r.aclose()
