"""Run accounting (libludic/transport/accounting.py) against a real redis-server, the real feeder
top-up, real ``ludic credit`` and ``ludic learner`` processes, each killed with SIGKILL
mid-run and restarted: the identity

    requested = trained + dropped (stale, incomplete, empty) + dead-lettered + in flight

holds in every snapshot taken while they run, in flight is also observed from the streams,
and no item is trained twice.

The actor stage is the test itself (a real ``ludic actor`` needs vLLM): it reads the
requests stream with the transport's StreamConsumer and commits synthetic rollouts through
the same ``accounting.commit`` / ``dead_letter`` calls as services/actor/main.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from libludic import transport as t
from libludic.transport import accounting
from libludic.types import Rollout, Step, TokenTrace
from services.feeder import worker as feeder_worker

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "services.cli"]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return e


def rollouts_for(req: Any, pv: int) -> list[Rollout]:
    out = []
    for i in range(req.num_episodes):  # rewards 0, 1: a GRPO group with non-zero advantages
        tr = TokenTrace([257, 49, 43, 50], [51, 258], [-0.25, -0.5])
        step = Step(
            0,
            "1+2=",
            "3",
            None,
            float(i % 2),
            terminated=True,
            trace=tr,
            policy_version=pv,
            info={"finish_reason": "stop"},
        )
        out.append(
            Rollout(
                id=f"{req.id}-r{i}", steps=[step], meta={"group_id": req.id, "request_id": req.id}
            )
        )
    return out


async def snap(url: str, run: str) -> dict[str, Any]:
    r = t.connect(url)
    try:
        return await accounting.snapshot(r, t.Keys(run))
    finally:
        await r.aclose()


class Sampler(threading.Thread):
    """Takes an accounting snapshot every 50 ms until stopped."""

    def __init__(self, url: str, run: str):
        super().__init__(daemon=True)
        self.url, self.run_id = url, run
        self.samples: list[dict[str, Any]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.samples.append(asyncio.run(snap(self.url, self.run_id)))
            time.sleep(0.05)


def wait(cond: Any, timeout: float, what: str, procs: list[Any] = ()) -> None:  # type: ignore[assignment]
    deadline = time.monotonic() + timeout
    while not cond():
        for p, logf in procs:
            assert p.poll() is None, f"{what}: process exited\n" + Path(logf).read_text()[-3000:]
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.1)


def test_identity_holds_through_kill9_of_credit_and_learner(
    redis_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """16 requests of 2 episodes. The test's actor dead-letters requests 0-1
    (-> 2 dead-lettered), commits request 2 with no rollouts (-> 1 dropped empty), stamps
    requests 3-4 with policy_version -1 (the learner runs max_lag=0 at version 0, so their
    items are stale -> 2 dropped stale) and 5-15 normally: 11 groups x 2 items = 22 items =
    11 steps of batch 2 (-> 11 trained). Credit is killed -9 after 6 groups went through the
    actor and restarted; the learner (checkpoint every 2 steps) is killed -9 at step >= 3,
    before the actor has taken the last 3 requests, and resumed. Expected end state: 16 = 11 + 2 + 0 + 1 + 2 + 0, items_trained 22,
    items_stale 4, trained twice 0, and every snapshot on the way consistent."""
    url, run = redis_server.url, "acct1"
    keys = t.Keys(run)
    n_req, group = 16, 2
    sampler = Sampler(url, run)
    sampler.start()
    procs: list[Any] = []

    def start(name: str, args: list[str]) -> Any:
        logf = tmp_path / f"{name}.log"
        f = open(logf, "ab")
        p = subprocess.Popen(CLI + args, cwd=REPO, env=env(), stdout=f, stderr=subprocess.STDOUT)
        procs.append((p, logf))
        return p

    credit_args = [
        "credit",
        "--redis-url",
        url,
        "--run-id",
        run,
        "--algorithm",
        json.dumps({"name": "grpo", "group_size": group}),
        "--metrics-port",
        "0",
        "--block-ms",
        "100",
        "--claim-idle-ms",
        "600",
        "--lease-ttl-ms",
        "600",
        "--group-timeout-s",
        "30",
    ]
    out = tmp_path / "learner"
    learner_args = [
        "learner",
        "--redis-url",
        url,
        "--run-id",
        run,
        "--model-dir",
        str(tiny_model_dir),
        "--device",
        "cpu",
        "--metrics-port",
        "0",
        "--block-ms",
        "200",
        "--trained-log",
        "--output-dir",
        str(out),
        "--batch-size",
        "2",
        "--num-steps",
        "11",
        "--checkpoint-every",
        "2",
        "--max-lag",
        "0",
        "--lr",
        "1e-3",
        "--algorithm",
        json.dumps({"name": "grpo", "group_size": group}),
    ]
    step = lambda: int(asyncio.run(_get(url, keys.learner_step)) or 0)  # noqa: E731

    async def actor_stage(first: int, last: int) -> None:
        r = t.connect(url)
        sc = accounting.AccountedConsumer(
            r, keys.requests, t.GROUP_ACTORS, "test-actor", keys.deadletter, stage="requests"
        )
        await sc.ensure_group()
        done = first
        try:
            while done < last:
                for e in await sc.read(1, block_ms=200):
                    req = t.decode_request(e.payload)
                    i = int(req.env_seed)
                    if i < 2:
                        await sc.dead_letter(e, "episode_error", "test: env failed")
                    else:
                        ros = [] if i == 2 else rollouts_for(req, -1 if i in (3, 4) else 0)
                        for ro in ros:  # as services/actor/main.py stamps them
                            ro.meta["group_rollouts"] = len(ros)
                        await accounting.commit(
                            sc,
                            [e],
                            [(ro.id, t.encode_rollout(ro)) for ro in ros],
                            keys.rollouts,
                            keys.done("actor", req.id),
                            stage="actor",
                            group_id=req.id,
                        )
                    done += 1
                    await asyncio.sleep(0.15)
        finally:
            await r.aclose()

    try:
        # feeder: the real top-up (requests + groups_requested in one script)
        fs = feeder_worker.FeederSettings(
            redis_url=url,
            run_id=run,
            algorithm={"name": "grpo", "group_size": group},
            high_water=n_req,
            metrics_port=0,
            max_head_offpolicyness=None,
        )

        async def feed() -> int:
            r0 = t.connect(url)
            try:
                return await feeder_worker.top_up(r0, keys, fs, n_req)
            finally:
                await r0.aclose()

        assert asyncio.run(feed()) == n_req
        a = asyncio.run(snap(url, run))
        assert a["groups_requested"] == n_req and a["groups_in_flight_observed"] == n_req

        credit = start("credit1", credit_args)
        learner = start("learner1", learner_args)
        asyncio.run(actor_stage(0, 6))
        credit.send_signal(signal.SIGKILL)
        credit.wait(10)
        procs.pop(0)
        asyncio.run(actor_stage(6, 10))  # credit is down: rollouts wait in their stream
        a = asyncio.run(snap(url, run))
        assert a["consistent"], a
        start("credit2", credit_args)
        # the last 3 requests stay unread until the learner is dead, so it cannot have
        # finished all 11 steps before the kill (it did once, on a fast CI machine)
        asyncio.run(actor_stage(10, n_req - 3))
        wait(lambda: step() >= 3, 240, "learner step 3", procs)
        learner.send_signal(signal.SIGKILL)
        learner.wait(10)
        procs[:] = [(p, f) for p, f in procs if p is not learner]
        a = asyncio.run(snap(url, run))
        assert a["consistent"] and a["groups_in_flight"] >= 3, a
        asyncio.run(actor_stage(n_req - 3, n_req))  # learner is down: items wait in the stream
        learner2 = start("learner2", learner_args + ["--resume"])
        assert learner2.wait(300) == 0, (tmp_path / "learner2.log").read_text()[-3000:]
        procs[:] = [(p, f) for p, f in procs if p is not learner2]
        wait(lambda: asyncio.run(snap(url, run))["groups_in_flight"] == 0, 30, "in flight 0")
    finally:
        sampler.halt.set()
        sampler.join(10)
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)

    final = asyncio.run(snap(url, run))
    assert {
        k: final[k]
        for k in (
            "groups_requested",
            "groups_trained",
            "groups_dropped_stale",
            "groups_dropped_incomplete",
            "groups_dropped_empty",
            "groups_deadlettered",
            "groups_in_flight",
        )
    } == {
        "groups_requested": 16,
        "groups_trained": 11,
        "groups_dropped_stale": 2,
        "groups_dropped_incomplete": 0,
        "groups_dropped_empty": 1,
        "groups_deadlettered": 2,
        "groups_in_flight": 0,
    }
    assert final["items_written"] == 26 and final["items_trained"] == 22  # 13 groups x 2
    assert final["items_stale"] == 4 and final["items_trained_twice"] == 0
    assert final["consistent"], final
    # every snapshot on the way (dozens, across both kills) satisfied the identity
    bad = [s for s in sampler.samples if not s["consistent"]]
    assert not bad, bad[:3]
    assert len(sampler.samples) >= 20
    assert len({s["groups_in_flight"] for s in sampler.samples}) >= 5  # it really moved
    # independent: the learner's own log of committed steps has every trained item once
    log = [json.loads(x) for x in (out / "trained_items.jsonl").read_text().splitlines()]
    ids = [i for x in log for i in x["items"]]
    assert len(ids) == len(set(ids)) == 22
    fin = json.loads((out / "learner_final.json").read_text())
    assert fin["accounting"]["items_trained_twice"] == 0
    assert fin["accounting"]["groups_trained"] == 11


async def _get(url: str, key: str) -> Any:
    r = t.connect(url)
    try:
        return await r.get(key)
    finally:
        await r.aclose()


async def test_trained_twice_is_counted(redis_url: str) -> None:
    """The same item id in two saw entries, both acked as trained -> trained twice = 1,
    items_trained = 2 (a de-dup failure upstream is made visible, not hidden)."""
    r = t.connect(redis_url)
    keys = t.Keys("acct2")
    try:
        sc = accounting.AccountedConsumer(
            r, keys.saw, t.GROUP_LEARNER, "learner-0", keys.deadletter, stage="saw"
        )
        await sc.ensure_group()
        for _ in range(2):
            await t.xadd(r, keys.saw, "g1:0", b"x")
        got = await sc.read(10, block_ms=100)
        assert len(got) == 2
        assert await accounting.ack_items(sc, [e.id for e in got], "trained") == 2
        assert await accounting.ack_items(sc, [e.id for e in got], "trained") == 0  # re-ack
        a = await accounting.snapshot(r, keys)
        assert a["items_trained"] == 2 and a["items_trained_twice"] == 1
    finally:
        await r.aclose()


async def test_credit_commit_of_a_group_no_actor_committed_stays_consistent(
    redis_url: str,
) -> None:
    """Request g's rollout reaches credit without its group_id (lost on the way), so credit
    commits it as group "g-r0": no group opens for it (it was never requested) and its item
    counts at item level only; g stays in flight (rolling), as the documented limit says.
    Before, "g-r0" opened too: in flight observed 2 for 1 requested (inconsistent)."""
    r = t.connect(redis_url)
    keys = t.Keys("stray")
    try:
        await accounting.add_requests(r, keys, [("g", b"q")])
        ac = accounting.AccountedConsumer(
            r, keys.requests, t.GROUP_ACTORS, "a", keys.deadletter, stage="requests"
        )
        await ac.ensure_group()
        (req,) = await ac.read(1, block_ms=100)
        await accounting.commit(
            ac, [req], [("g-r0", b"ro")], keys.rollouts, keys.done("actor", "g"),
            stage="actor", group_id="g",
        )  # fmt: skip
        cc = accounting.AccountedConsumer(
            r, keys.rollouts, t.GROUP_CREDIT, "c", keys.deadletter, stage="rollouts"
        )
        await cc.ensure_group()
        ros = await cc.read(1, block_ms=100)
        assert await accounting.commit(
            cc, ros, [("g-r0:0", b"s")], keys.saw, keys.done("credit", "g-r0"),
            stage="credit", group_id="g-r0",
        ) == 1  # fmt: skip
        a = await accounting.snapshot(r, keys)
        assert a["consistent"], accounting.format_line(a)
        assert (a["groups_in_flight"], a["observed_rolling"], a["observed_open"]) == (1, 1, 0)
        assert (a["items_written"], a["items_in_flight"]) == (1, 1)
        lc = accounting.AccountedConsumer(
            r, keys.saw, t.GROUP_LEARNER, "l", keys.deadletter, stage="saw"
        )
        await lc.ensure_group()
        (item,) = await lc.read(1, block_ms=100)
        assert await accounting.ack_items(lc, [item.id], "trained") == 1
        a = await accounting.snapshot(r, keys)
        assert a["consistent"] and a["groups_trained"] == 0 and a["items_trained"] == 1
    finally:
        await r.aclose()


async def test_status_shows_the_accounting(redis_url: str) -> None:
    """``ludic status`` (collect + render) carries the snapshot: 3 requests added by the
    feeder, one dead-lettered by an actor -> requested 3 = dead-lettered 1 + in flight 2."""
    from services import status

    keys = t.Keys("acct3")
    r = t.connect(redis_url)
    try:
        fs = feeder_worker.FeederSettings(
            redis_url=redis_url,
            run_id="acct3",
            algorithm={"name": "grpo", "group_size": 2},
            high_water=3,
            metrics_port=0,
            max_head_offpolicyness=None,
        )
        assert await feeder_worker.top_up(r, keys, fs, 3) == 3
        assert await feeder_worker.top_up(r, keys, fs, 3) == 0  # at the high-water mark
        sc = accounting.AccountedConsumer(
            r, keys.requests, t.GROUP_ACTORS, "a", keys.deadletter, stage="requests"
        )
        await sc.ensure_group()
        e = (await sc.read(1, block_ms=100))[0]
        await sc.dead_letter(e, "episode_error", "test")
        await sc.dead_letter(e, "episode_error", "test")  # a second dead-letter: not pending
        # the dead-letter stream holds the entry once: the second move wrote nothing
        assert await r.xlen(keys.deadletter) == 1
    finally:
        await r.aclose()
    st = await status.collect(redis_url, "acct3")
    a = st["accounting"]
    assert (a["groups_requested"], a["groups_deadlettered"], a["groups_in_flight"]) == (3, 1, 2)
    assert a["groups_in_flight_observed"] == 2 and a["consistent"]
    assert (
        "groups requested=3 = trained 0 + dropped stale 0 + dropped incomplete 0 + dropped "
        "empty 0 + dead-lettered 1 + in flight 2 (observed 2)"
    ) in status.render(st)


# ------------------------------------------- one commit, one dead-letter: plain and accounted
# consumer.py owns the two operations (COMMIT_FN, DEADLETTER_FN); accounting.py's scripts are
# composed from them. Both paths run against the same Redis and must write the same entries;
# only the accounted one moves counters.


async def entries_of(r: Any, stream: str) -> list[list[tuple[bytes, bytes]]]:
    """Every entry's fields of ``stream`` in order, as (name, value) pairs in wire order."""
    return [list(f.items()) for _, f in await r.xrange(stream)]


async def acct_state(r: Any, keys: t.Keys) -> dict[str, dict[bytes, bytes]]:
    ak = accounting.AcctKeys(keys)
    return {
        "counters": await r.hgetall(ak.counters),
        "rolling": await r.hgetall(ak.rolling),
        "open": await r.hgetall(ak.open),
        "items": await r.hgetall(ak.items),
    }


async def test_commit_writes_the_same_entries_with_or_without_accounting(redis_url: str) -> None:
    """Plain ``StreamConsumer.commit`` and ``accounting.commit`` (actor, then credit): the
    same outputs, return values (written, -1 on a redelivery, 0 for nothing) and acks; the
    counters move only on the accounted path: actor 2 rollouts -> rolling{g: 2}; credit 2
    items -> rolling{}, open{g: 2}, items_written 2; empty commits -> the if_empty fate."""
    r = t.connect(redis_url)
    keys = t.Keys("one")
    out_plain = "ludic:{one}:out"
    try:
        plain = t.StreamConsumer(r, keys.requests, t.GROUP_ACTORS, "p", keys.deadletter)
        ac = accounting.AccountedConsumer(
            r, keys.requests, t.GROUP_ACTORS, "a", keys.deadletter, stage="requests"
        )
        await plain.ensure_group()
        for i in range(4):
            await t.xadd(r, keys.requests, f"req-{i}", b"q%d" % i)
        e0, e1 = await plain.read(2, block_ms=100)
        e2, e3 = await ac.read(2, block_ms=100)
        outs = [("o1", b"x"), ("o2", b"y")]
        expected = [[(b"id", b"o1"), (b"d", b"x")], [(b"id", b"o2"), (b"d", b"y")]]
        empty: dict[str, dict[bytes, bytes]] = {
            "counters": {},
            "rolling": {},
            "open": {},
            "items": {},
        }

        assert await plain.commit([e0], outs, out_plain, keys.done("plain", "g")) == 2
        assert await entries_of(r, out_plain) == expected
        assert await acct_state(r, keys) == empty  # the plain path counts nothing
        assert (
            await accounting.commit(
                ac, [e2], outs, keys.rollouts, keys.done("actor", "g"), stage="actor", group_id="g"
            )
            == 2
        )
        assert await entries_of(r, keys.rollouts) == expected
        assert await acct_state(r, keys) == {**empty, "rolling": {b"g": b"2"}}
        assert await r.xlen(keys.requests) == 2  # e0, e2 acked and deleted
        assert (await r.xpending(keys.requests, t.GROUP_ACTORS))["pending"] == 2

        # a redelivery (the done marker exists): nothing written, the input acked, -1
        late = [("o3", b"z")]
        assert await plain.commit([e1], late, out_plain, keys.done("plain", "g")) == -1
        assert (
            await accounting.commit(
                ac, [e3], late, keys.rollouts, keys.done("actor", "g"), stage="actor", group_id="g"
            )
            == -1
        )
        assert await entries_of(r, out_plain) == await entries_of(r, keys.rollouts) == expected
        assert await r.xlen(keys.requests) == 0
        assert (await r.xpending(keys.requests, t.GROUP_ACTORS))["pending"] == 0
        assert await acct_state(r, keys) == {**empty, "rolling": {b"g": b"2"}}

        # credit commits the group's items: rolling -> open, items mapped to their group
        cc = accounting.AccountedConsumer(
            r, keys.rollouts, t.GROUP_CREDIT, "c", keys.deadletter, stage="rollouts"
        )
        await cc.ensure_group()
        ros = await cc.read(2, block_ms=100)
        items = [("g:0", b"s0"), ("g:1", b"s1")]
        assert (
            await accounting.commit(
                cc, ros, items, keys.saw, keys.done("credit", "g"), stage="credit", group_id="g"
            )
            == 2
        )
        assert await entries_of(r, keys.saw) == [
            [(b"id", b"g:0"), (b"d", b"s0")],
            [(b"id", b"g:1"), (b"d", b"s1")],
        ]
        assert await r.xlen(keys.rollouts) == 0
        assert await acct_state(r, keys) == {
            "counters": {b"items_written": b"2", b"groups_credited": b"1"},
            "rolling": {},
            "open": {b"g": b"2"},
            "items": {b"g:0": b"g", b"g:1": b"g"},
        }

        # nothing to write: 0 on both paths; the accounted one counts the group's fate
        assert await plain.commit([], [], out_plain, keys.done("plain", "h")) == 0
        assert (
            await accounting.commit(
                ac, [], [], keys.rollouts, keys.done("actor", "h"), stage="actor", group_id="h"
            )
            == 0
        )
        assert (
            await accounting.commit(
                cc,
                [],
                [],
                keys.saw,
                keys.done("credit", "k"),
                stage="credit",
                group_id="k",
                if_empty="groups_dropped_incomplete",
            )
            == 0
        )
        assert (await acct_state(r, keys))["counters"] == {
            b"items_written": b"2",
            b"groups_credited": b"1",
            b"groups_dropped_empty": b"1",
            b"groups_dropped_incomplete": b"1",
        }
        # ... and wrote nothing (credit consumed the two rollouts)
        assert (await r.xlen(out_plain), await r.xlen(keys.rollouts)) == (2, 0)
    finally:
        await r.aclose()


async def test_deadletter_writes_the_same_entry_with_or_without_accounting(
    redis_url: str,
) -> None:
    """``StreamConsumer.dead_letter`` and ``AccountedConsumer.dead_letter`` write one entry
    each with the same fields in the same order (reason, detail, source_stream, source_id,
    group, consumer, id, d, d_bytes) and ack+delete the source; only the accounted one
    counts, and only entries still pending: a request -> groups_deadlettered 1 and its
    done:actor marker; a rollout -> rollouts_deadlettered 1; the last item of group g ->
    items_deadlettered 1 and the group dead-lettered (none of it trained)."""
    r = t.connect(redis_url)
    keys = t.Keys("dl")
    try:
        plain = t.StreamConsumer(r, keys.requests, t.GROUP_ACTORS, "p", keys.deadletter)
        ac = accounting.AccountedConsumer(
            r, keys.requests, t.GROUP_ACTORS, "a", keys.deadletter, stage="requests"
        )
        await plain.ensure_group()
        await t.xadd(r, keys.requests, "req-0", b"q0")
        await t.xadd(r, keys.requests, "req-1", b"q11")
        (e0,) = await plain.read(1, block_ms=100)
        (e1,) = await ac.read(1, block_ms=100)

        def expected(e: t.Entry, consumer: bytes) -> list[tuple[bytes, bytes]]:
            return [
                (b"reason", b"episode_error"),
                (b"detail", b"boom"),
                (b"source_stream", keys.requests.encode()),
                (b"source_id", e.id.encode()),
                (b"group", t.GROUP_ACTORS.encode()),
                (b"consumer", consumer),
                (b"id", e.item_id.encode()),
                (b"d", e.payload or b""),
                (b"d_bytes", str(len(e.payload or b"")).encode()),
            ]

        await plain.dead_letter(e0, "episode_error", "boom")
        assert await entries_of(r, keys.deadletter) == [expected(e0, b"p")]
        assert (await acct_state(r, keys))["counters"] == {}
        assert not await r.exists(keys.done("actor", "req-0"))
        await ac.dead_letter(e1, "episode_error", "boom")
        assert await entries_of(r, keys.deadletter) == [expected(e0, b"p"), expected(e1, b"a")]
        assert (await acct_state(r, keys))["counters"] == {b"groups_deadlettered": b"1"}
        assert await r.exists(keys.done("actor", "req-1"))
        assert await r.xlen(keys.requests) == 0
        assert (await r.xpending(keys.requests, t.GROUP_ACTORS))["pending"] == 0
        # again, no longer pending: nothing is written, nothing is counted twice
        await ac.dead_letter(e1, "episode_error", "boom")
        assert await r.xlen(keys.deadletter) == 2
        assert (await acct_state(r, keys))["counters"] == {b"groups_deadlettered": b"1"}

        # the learner's side: group g has one item in saw; dead-lettering it resolves g
        # credit's side: an undecodable rollout, dead-lettered twice, is counted once (only
        # XACK's reply guards it: rollouts have no done marker)
        rc = accounting.AccountedConsumer(
            r, keys.rollouts, t.GROUP_CREDIT, "c", keys.deadletter, stage="rollouts"
        )
        await rc.ensure_group()
        await t.xadd(r, keys.rollouts, "g-r0", b"\xc1")
        (ro,) = await rc.read(1, block_ms=100)
        for _ in range(2):
            await rc.dead_letter(ro, "bad_msgpack", "junk")
        assert (await acct_state(r, keys))["counters"] == {
            b"groups_deadlettered": b"1",
            b"rollouts_deadlettered": b"1",
        }
        # group g's rollout was committed by an actor (credit opens only such a group)
        await r.hset(accounting.AcctKeys(keys).rolling, "g", 1)
        await accounting.commit(
            rc,
            [],
            [("g:0", b"s0")],
            keys.saw,
            keys.done("credit", "g"),
            stage="credit",
            group_id="g",
        )
        lc = accounting.AccountedConsumer(
            r, keys.saw, t.GROUP_LEARNER, "l", keys.deadletter, stage="saw"
        )
        await lc.ensure_group()
        (s0,) = await lc.read(1, block_ms=100)
        await lc.dead_letter(s0, "untrainable", "boom")
        (*_, (_, last)) = await r.xrange(keys.deadletter)
        assert (last[b"source_stream"], last[b"id"], last[b"group"]) == (
            keys.saw.encode(),
            b"g:0",
            t.GROUP_LEARNER.encode(),
        )
        assert await acct_state(r, keys) == {
            "counters": {
                b"groups_deadlettered": b"2",
                b"rollouts_deadlettered": b"1",
                b"groups_credited": b"1",
                b"items_written": b"1",
                b"items_deadlettered": b"1",
            },
            "rolling": {},
            "open": {},
            "items": {},
        }
        assert (await accounting.snapshot(r, keys))["items_in_flight"] == 0
    finally:
        await r.aclose()


async def test_every_script_is_sent_once_then_run_by_its_sha(redis_url: str) -> None:
    """The transport and accounting scripts run by EVALSHA: each of the 9 below is loaded
    once (its first EVALSHA answers NOSCRIPT, redis-py loads it and retries), after that
    only its sha travels; no EVAL sends a script's text. Each op runs twice, so EVALSHA
    calls = 9 scripts x 2 runs + 9 NOSCRIPT replies = 27."""
    r = t.connect(redis_url)
    keys = t.Keys("sha")
    try:
        await r.script_flush()
        await r.config_resetstat()
        plain = t.StreamConsumer(r, keys.requests, t.GROUP_ACTORS, "p", keys.deadletter)
        ac = accounting.AccountedConsumer(
            r, keys.requests, t.GROUP_ACTORS, "a", keys.deadletter, stage="requests"
        )
        lc = accounting.AccountedConsumer(
            r, keys.saw, t.GROUP_LEARNER, "l", keys.deadletter, stage="saw"
        )
        await plain.ensure_group()
        await lc.ensure_group()
        for i in range(2):
            await accounting.add_requests(r, keys, [(f"req-{i}", b"q")])  # 1 request script
            await t.xadd(r, keys.requests, f"x-{i}", b"q")
            await t.xadd(r, keys.saw, f"s-{i}", b"s")
        es = await plain.read(4, block_ms=100)
        for i in range(2):
            await plain.commit([es[i]], [], "ludic:{sha}:out", keys.done("p", str(i)))  # 2
            await accounting.commit(  # 3
                ac,
                [],
                [],
                keys.rollouts,
                keys.done("actor", str(i)),
                stage="actor",
                group_id=str(i),
            )
            await plain.dead_letter(es[2], "r", "")  # 4
            await ac.dead_letter(es[3], "r", "")  # 5
            await accounting.group_failed(r, keys, f"f{i}")  # 6
            await accounting.snapshot(r, keys)  # 7
            await accounting.admission_state(r, keys, 2)  # 8
        saw = await lc.read(2, block_ms=100)
        for e in saw:
            await accounting.ack_items(lc, [e.id], "trained")  # 9
        stats = await r.info("commandstats")
        assert "cmdstat_eval" not in stats
        assert stats["cmdstat_script|load"]["calls"] == 9
        assert stats["cmdstat_evalsha"]["calls"] == 27
        assert stats["cmdstat_evalsha"]["failed_calls"] == 9
        # what the work did: 2 requests counted, 2 items trained, 2 groups failed
        a = await accounting.snapshot(r, keys)
        assert (a["groups_requested"], a["items_trained"]) == (2, 2)
        assert a["groups_deadlettered"] == 3  # f0, f1 and the dead-lettered request x-1
    finally:
        await r.aclose()
