"""kill -9 of redis-server (appendonly yes, appendfsync always) and restart: no entry
whose XADD returned is lost, and the consumer resumes by itself."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from libludic import transport as t

try:  # tests/ is on sys.path under pytest's default import mode
    from conftest import RedisContainer, RedisServer, make_redis  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    from tests.conftest import RedisContainer, RedisServer, make_redis

pytestmark = pytest.mark.integration

STREAM, OUT, DL, GROUP = "ludic:{f}:in", "ludic:{f}:out", "ludic:{f}:deadletter", "g"


async def test_redis_kill9_and_restart_loses_no_acknowledged_entry(
    tmp_path: Path, redis_kind: str
) -> None:
    """Both for a redis-server process and for a Redis container (testcontainers) killed
    with SIGKILL (``docker kill``) and started again."""
    srv = make_redis(redis_kind, tmp_path, appendonly=True, fsync="always")
    srv.start()
    try:
        await _run(srv)
    finally:
        srv.stop()


async def _run(srv: RedisServer | RedisContainer) -> None:
    producer_r = t.connect(srv.url)
    consumer_r = t.connect(srv.url)
    await t.ensure_group(producer_r, STREAM, GROUP)
    acked: list[str] = []  # ids whose XADD returned
    processed: set[str] = set()
    stop = asyncio.Event()
    outages = {"producer": 0, "consumer": 0}

    async def produce() -> None:
        i = 0
        while not stop.is_set() and i < 400:
            item = f"item-{i}"
            try:
                await t.xadd(producer_r, STREAM, item, t.pack_msg({"n": i}))
                acked.append(item)
                i += 1
            except t.REDIS_DOWN_ERRORS:
                outages["producer"] += 1  # same item retried: duplicates are de-duplicated
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.002)

    async def consume() -> None:
        c = t.StreamConsumer(consumer_r, STREAM, GROUP, "worker", DL, claim_idle_ms=500)
        attempt = 0
        while not stop.is_set():
            try:
                for e in await c.read(20, block_ms=200):
                    await c.commit(
                        [e], [(e.item_id, e.payload)], OUT, f"ludic:{{f}}:done:{e.item_id}"
                    )
                    processed.add(e.item_id)
                attempt = 0
            except t.REDIS_DOWN_ERRORS:
                outages["consumer"] += 1
                await t.backoff_sleep(attempt, stop, cap=0.5)
                attempt += 1

    tasks = [asyncio.create_task(produce()), asyncio.create_task(consume())]
    while len(acked) < 100:
        await asyncio.sleep(0.02)
    run_id_before = (await consumer_r.info("server"))["run_id"]
    srv.kill()  # SIGKILL mid-stream
    n_before = len(acked)
    # longer than the client's own command retries (~3 s), so the loops' backoff runs too
    await asyncio.sleep(4.0)
    srv.start()  # same port, same AOF
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (len(acked) < 400 or not set(acked) <= processed):
        await asyncio.sleep(0.1)
    stop.set()
    await asyncio.gather(*tasks)

    assert (await consumer_r.info("server"))["run_id"] != run_id_before  # a new process
    assert outages["consumer"] > 0 and outages["producer"] > 0  # both saw the outage
    assert len(acked) == 400 and n_before >= 100
    out = [t.as_str(f[b"id"]) for _, f in await consumer_r.xrange(OUT)]
    assert set(acked) <= set(out)  # every acknowledged XADD made it through
    assert len(out) == len(set(out))  # and none twice
    assert int((await consumer_r.xpending(STREAM, GROUP))["pending"]) == 0
    await producer_r.aclose()
    await consumer_r.aclose()
