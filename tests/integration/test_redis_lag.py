"""The figure the chart's KEDA trigger scales actors on must always be defined.

Our consumers XACK + XDEL every entry they finish (libludic/transport/consumer.py StreamConsumer.ack), so
XLEN of a requests stream is exactly its un-acked backlog (undelivered + delivered-but-pending).
XINFO GROUPS `lag` is not: once the group's last-delivered entry has been deleted while earlier
entries are still pending, Redis (7.0 here) cannot compute it and reports NULL until the next
read (reproduced below: the lag is NULL while two requests wait). KEDA's `lagCount` mode then has no
figure to scale on (a NULL lag is no reason to keep actors); the chart scales on `streamLength` (XLEN).
"""

from __future__ import annotations

import redis

STREAM = "ludic:exp42:requests"
GROUP = "actors"


def group_info(r: redis.Redis) -> dict:
    (info,) = [g for g in r.xinfo_groups(STREAM) if g["name"] == GROUP]
    return info


def ack_like_stream_consumer(r: redis.Redis, *ids: str) -> None:
    # same two commands, in one transaction, as StreamConsumer.ack
    pipe = r.pipeline(transaction=True)
    pipe.xack(STREAM, GROUP, *ids)
    pipe.xdel(STREAM, *ids)
    pipe.execute()


def test_group_lag_is_null_while_xlen_stays_the_unacked_backlog(redis_url):
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    version = r.info("server")["redis_version"]
    assert int(version.split(".")[0]) >= 7, f"XINFO GROUPS lag needs Redis >= 7, got {version}"
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    ids = [r.xadd(STREAM, {"i": str(i)}) for i in range(3)]

    # one actor reads all three requests
    got = r.xreadgroup(GROUP, "actor-0", {STREAM: ">"}, count=10)
    assert [e[0] for e in got[0][1]] == ids
    info = group_info(r)
    assert info["lag"] == 0 and info["pending"] == 3 and r.xlen(STREAM) == 3

    # it finishes the LAST delivered one first; the two earlier ones are still being worked on
    ack_like_stream_consumer(r, ids[2])
    assert group_info(r)["pending"] == 2
    # ... and two new requests arrive before the next read
    r.xadd(STREAM, {"i": "3"})
    r.xadd(STREAM, {"i": "4"})
    info = group_info(r)
    # the case this test is about: the group's last-delivered id is a tombstone and earlier entries are
    # still in the stream, so Redis cannot count the entries after it and reports lag NULL --
    # although 2 requests are waiting for an actor
    assert info["lag"] is None, info
    # XLEN is defined and equals the un-acked backlog: 5 added - 1 acked+deleted = 4
    # (2 pending + 2 undelivered)
    assert r.xlen(STREAM) == 4 == info["pending"] + 2

    # everything finished: XLEN drops to 0, so KEDA may deactivate (scale to minReplicaCount)
    rest = r.xreadgroup(GROUP, "actor-0", {STREAM: ">"}, count=10)
    ack_like_stream_consumer(r, ids[0], ids[1], *[e[0] for e in rest[0][1]])
    assert r.xlen(STREAM) == 0
    assert group_info(r)["pending"] == 0
