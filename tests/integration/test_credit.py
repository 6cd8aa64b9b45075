"""`ludic credit` against a real redis-server: group assembly, the incomplete-group
policy, late rollouts, dead-lettering and leader take-over."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from libludic import transport as t
from libludic.types import Rollout, Step, TokenTrace
from services.credit import main as credit_main

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def rollout(gid: str, i: int, reward: float, steps: int = 1) -> Rollout:
    """``steps`` model calls, the reward on the last one."""
    tr = TokenTrace([257, 49, 43, 50], [51, 258], [-0.25, -0.5])
    out = [
        Step(
            k,
            "1+2=",
            "3",
            None,
            reward if k == steps - 1 else 0.0,
            terminated=k == steps - 1,
            trace=tr,
            policy_version=1,
            info={"finish_reason": "stop"},
        )
        for k in range(steps)
    ]
    return Rollout(id=f"{gid}-r{i}", steps=out, meta={"group_id": gid, "request_id": gid})


async def add(r: Any, keys: t.Keys, ros: Sequence[Rollout]) -> None:
    for ro in ros:
        await t.xadd(r, keys.rollouts, ro.id, t.encode_rollout(ro))


async def saw_items(r: Any, keys: t.Keys) -> list[Any]:
    return [t.decode_saw_item(f[b"d"]) for _, f in await r.xrange(keys.saw)]


def settings(redis_url: str, run_id: str, **kw: Any) -> credit_main.CreditSettings:
    base: dict[str, Any] = dict(
        redis_url=redis_url,
        run_id=run_id,
        algorithm={"name": "grpo", "group_size": 4},
        group_timeout_s=1.0,
        metrics_port=0,
        block_ms=100,
        claim_idle_ms=600,
        lease_ttl_ms=600,
    )
    base.update(kw)
    return credit_main.CreditSettings(**base)


async def wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def test_groups_complete_partial_dropped_late_and_deadlettered(redis_url: str) -> None:
    keys = t.Keys("cr1")
    r = t.connect(redis_url)
    await t.ensure_group(r, keys.rollouts, t.GROUP_CREDIT)
    a = [rollout("A", i, rw) for i, rw in enumerate([1.0, 0.0, 0.0, 1.0])]
    b = [rollout("B", i, rw) for i, rw in enumerate([1.0, 0.0, 0.0])]  # one short
    c = [rollout("C", 0, 1.0)]  # three short
    await add(r, keys, [a[0], b[0], a[1], c[0], b[1], a[2], a[1], b[2], a[3]])  # a[1] twice
    await t.xadd(r, keys.rollouts, "junk", b"\x92\x01")  # a msgpack list, not an envelope
    stop = asyncio.Event()
    task = asyncio.create_task(credit_main.run(settings(redis_url, "cr1"), stop=stop))

    async def settled() -> bool:
        return await r.xlen(keys.rollouts) == 0

    await wait_for(settled, 20, "every rollout to be acked")
    await add(r, keys, [rollout("C", 1, 0.0)])  # arrives after C was dropped
    await wait_for(settled, 10, "the late rollout to be acked")
    stop.set()
    worker = await asyncio.wait_for(task, 10)

    items = await saw_items(r, keys)
    by_group: dict[str, list[Any]] = {}
    for it in items:
        by_group.setdefault(it.meta["group_id"], []).append(it)
    # A complete: GRPO weight A_i = R_i - mean(R) = R_i - 0.5
    assert sorted(it.weight for it in by_group["A"]) == pytest.approx([-0.5, -0.5, 0.5, 0.5])
    # B partial (3 >= min_partial_group=2): mean = 1/3 -> weights 2/3, -1/3, -1/3
    assert sorted(it.weight for it in by_group["B"]) == pytest.approx([-1 / 3, -1 / 3, 2 / 3])
    assert "C" not in by_group  # dropped: 1 < min_partial_group
    assert worker.outcomes == {
        "complete": 1,
        "partial": 1,
        "dropped": 1,
        "late": 1,
        "duplicate_rollout": 1,
    }
    assert worker.items_written == 7
    ((_, dl),) = await r.xrange(keys.deadletter)
    assert dl[b"reason"] == b"bad_msgpack"
    # the trace's logprobs sit on the action tokens, zeros on the state
    it = by_group["A"][0]
    assert list(it.action_mask) == [0, 0, 0, 0, 1, 1]
    assert list(it.attachments.actor_logprobs) == [0.0] * 4 + [-0.25, -0.5]  # type: ignore[arg-type]
    assert int((await r.xpending(keys.rollouts, t.GROUP_CREDIT))["pending"]) == 0
    await r.aclose()


async def test_standby_takes_over_when_the_leader_is_killed(redis_url: str) -> None:
    keys = t.Keys("cr2")
    r = t.connect(redis_url)
    await t.ensure_group(r, keys.rollouts, t.GROUP_CREDIT)
    d = [rollout("D", i, float(i)) for i in range(4)]
    await add(r, keys, d[:2])
    leader = spawn_credit(
        redis_url,
        "cr2",
        "--consumer",
        "leader",
        "--group-timeout-s",
        "60",
        "--lease-ttl-ms",
        "600",
        "--claim-idle-ms",
        "600",
    )
    stop2 = asyncio.Event()
    t2 = None
    try:

        async def leader_holds_two() -> bool:
            return int((await r.xpending(keys.rollouts, t.GROUP_CREDIT))["pending"]) == 2

        await wait_for(leader_holds_two, 90, "the leader to buffer half of group D")
        s2 = settings(redis_url, "cr2", consumer="standby", group_timeout_s=60)
        t2 = asyncio.create_task(credit_main.run(s2, stop=stop2))
        await asyncio.sleep(0.5)
        assert await r.get(keys.lease("credit")) == b"leader"  # the standby waits
        os.kill(leader.pid, signal.SIGKILL)  # dies holding an incomplete group, nothing acked
        leader.wait(10)
        await add(r, keys, d[2:])

        async def done() -> bool:
            return await r.xlen(keys.saw) == 4

        await wait_for(done, 20, "the standby to take over and finish group D")
        assert await r.get(keys.lease("credit")) == b"standby"
        stop2.set()
        w2 = await asyncio.wait_for(t2, 10)
        assert w2.outcomes == {"complete": 1}
        # GRPO on rewards 0,1,2,3: mean 1.5 -> weights -1.5, -0.5, 0.5, 1.5
        weights = sorted(it.weight for it in await saw_items(r, keys))
        assert weights == pytest.approx([-1.5, -0.5, 0.5, 1.5])
        assert int((await r.xpending(keys.rollouts, t.GROUP_CREDIT))["pending"]) == 0
    finally:
        stop2.set()
        if leader.poll() is None:
            leader.kill()
            leader.wait(10)
        if t2 is not None:
            await asyncio.wait_for(asyncio.gather(t2, return_exceptions=True), 10)
        await r.aclose()


def spawn_credit(redis_url: str, run_id: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "credit",
            "--metrics-port",
            "0",
            "--block-ms",
            "200",
            *extra,
        ],
        cwd=REPO,
        stderr=subprocess.PIPE,
        env={
            **os.environ,
            "PYTHONPATH": str(REPO),
            "LUDIC_REDIS_URL": redis_url,
            "LUDIC_RUN_ID": run_id,
        },
    )


async def test_credit_cli_processes_a_group_and_exits_on_sigterm(redis_url: str) -> None:
    keys = t.Keys("cr3")
    r = t.connect(redis_url)
    await add(r, keys, [rollout("E", i, float(i % 2)) for i in range(2)])
    proc = spawn_credit(redis_url, "cr3", "--algorithm", '{"name": "grpo", "group_size": 2}')
    try:

        async def done() -> bool:
            return await r.xlen(keys.saw) == 2

        await wait_for(done, 90, "the credit CLI to write group E")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        err = proc.stderr.read().decode()  # type: ignore[union-attr]
        assert "ludic credit config:" in err and '"group_size": 2' in err  # logged once at start
        assert await r.get(keys.lease("credit")) is None  # released on exit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        await r.aclose()


async def test_poison_rollouts_are_dead_lettered_and_the_good_groups_go_on(redis_url: str) -> None:
    keys = t.Keys("cr-poison")
    r = t.connect(redis_url)
    await t.ensure_group(r, keys.rollouts, t.GROUP_CREDIT)
    bad_size = rollout("P", 0, 1.0)
    bad_size.meta["group_rollouts"] = "abc"
    nan_group = [rollout("N", i, rw) for i, rw in enumerate([1.0, float("nan"), 0.0, 1.0])]
    good = [rollout("G", i, rw) for i, rw in enumerate([1.0, 0.0, 0.0, 1.0])]
    await add(r, keys, [good[0], bad_size, *nan_group, *good[1:]])
    stop = asyncio.Event()
    task = asyncio.create_task(credit_main.run(settings(redis_url, "cr-poison"), stop=stop))

    async def settled() -> bool:
        return await r.xlen(keys.rollouts) == 0

    await wait_for(settled, 20, "every rollout to be acked or dead-lettered")
    stop.set()
    worker = await asyncio.wait_for(task, 10)  # still running: it stopped on request
    assert {it.meta["group_id"] for it in await saw_items(r, keys)} == {"G"}
    reasons = sorted(f[b"reason"].decode() for _, f in await r.xrange(keys.deadletter))
    # the bad size alone; the four rollouts of the group whose weights came out NaN
    assert reasons == ["bad_field"] + ["credit_error"] * 4
    details = [f[b"detail"].decode() for _, f in await r.xrange(keys.deadletter)]
    assert any("group_rollouts='abc'" in d for d in details)
    assert any("non-finite" in d for d in details)
    assert worker.outcomes.get("complete") == 1 and worker.outcomes.get("error") == 1
    await r.aclose()


async def test_dynamic_sampling_drops_zero_variance_groups_and_frees_their_admission_slot(
    redis_url: str,
) -> None:
    """Real feeder top-up under admission control -> the test as the actor stage -> credit
    running grpo with ``dynamic_sampling``: the zero-variance group leaves no item, is
    counted (Prometheus and the run accounting) and its samples leave ``outstanding``, so
    the feeder may request a replacement at once (credit wakes it)."""
    from prometheus_client import REGISTRY

    from libludic.transport import accounting
    from services.feeder import worker as feeder_worker

    run = "cr-ds"
    keys = t.Keys(run)
    r = t.connect(redis_url)
    alg = {"name": "grpo", "group_size": 2, "kwargs": {"dynamic_sampling": True}}
    fs = feeder_worker.FeederSettings(
        redis_url=redis_url,
        run_id=run,
        algorithm=alg,
        high_water=16,
        metrics_port=0,
        max_head_offpolicyness=0,
    )
    # the learner's batch is 4 items, served step 0: room = (0 + 0 + 1) * 4 = 4 samples
    await accounting.set_admission(r, keys, served_step=0, batch_size=4)
    assert await feeder_worker.top_up(r, keys, fs, 100) == 2  # 4 samples = 2 groups of 2
    assert await feeder_worker.admitted_groups(r, keys, fs) == 0
    await r.delete(keys.admission_wake)  # set_admission's own wake-up

    actor = accounting.AccountedConsumer(
        r, keys.requests, t.GROUP_ACTORS, "test-actor", keys.deadletter, stage="requests"
    )
    await actor.ensure_group()
    entries = await actor.read(2, block_ms=500)
    assert len(entries) == 2
    gids = []
    for e, rewards in zip(entries, ([1.0, 1.0], [1.0, 0.0]), strict=True):
        req = t.decode_request(e.payload)
        gids.append(req.id)
        ros = [rollout(req.id, i, x) for i, x in enumerate(rewards)]
        for ro in ros:
            ro.meta["group_rollouts"] = len(ros)
        await accounting.commit(
            actor,
            [e],
            [(ro.id, t.encode_rollout(ro)) for ro in ros],
            keys.rollouts,
            keys.done("actor", req.id),
            stage="actor",
            group_id=req.id,
        )
    flat, varied = gids

    def zero_variance_total() -> float:
        v = REGISTRY.get_sample_value("ludic_credit_groups_total", {"outcome": "zero_variance"})
        return v or 0.0

    before = zero_variance_total()
    stop = asyncio.Event()
    task = asyncio.create_task(
        credit_main.run(settings(redis_url, run, algorithm=alg, group_timeout_s=60), stop=stop)
    )

    async def settled() -> bool:
        return await r.xlen(keys.rollouts) == 0

    await wait_for(settled, 20, "both groups to be credited")
    stop.set()
    worker = await asyncio.wait_for(task, 10)

    # rewards (1, 1): equal, dropped; (1, 0): mean 0.5 -> GRPO weights +0.5, -0.5
    items = await saw_items(r, keys)
    assert {it.meta["group_id"] for it in items} == {varied}
    assert sorted(it.weight for it in items) == pytest.approx([-0.5, 0.5])
    assert worker.outcomes == {"complete": 1, "zero_variance": 1}
    assert zero_variance_total() - before == 1
    a = await accounting.snapshot(r, keys)
    assert (a["groups_requested"], a["groups_dropped_empty"], a["items_written"]) == (2, 1, 2)
    assert a["groups_zero_variance"] == 1  # the empty group, dropped by dynamic sampling
    assert a["groups_in_flight"] == 1 and a["consistent"], a
    # outstanding is now the 2 items in the saw stream (nothing trained yet): room = 4 - 2 =
    # 2 items; a requested group has become 2 items / 2 groups credited = 1 item so far (the
    # dropped one none), so the room is 2 groups: the dropped one's replacement and one more
    # in its expected place; credit woke the feeder
    st = await accounting.admission_state(r, keys, 2)
    assert st is not None and st["items_per_group"] == 1.0
    assert await feeder_worker.admitted_groups(r, keys, fs) == 2
    assert await r.llen(keys.admission_wake) == 1
    assert flat not in {it.meta["group_id"] for it in items}
    await r.aclose()


async def test_admission_counts_a_multi_turn_group_as_its_items(redis_url: str) -> None:
    """A group of multi-turn episodes becomes one item per model call: 2 episodes of 3 steps
    are 6 items, not 2. Admission measures it (items written / groups credited) and counts
    every group still outstanding as that many items, so a learner batch of 12 has room for
    2 such groups, not 6 (before: 67% of tic-tac-toe's items generated in vain, dropped as
    stale)."""
    from libludic.transport import accounting
    from services.feeder import worker as feeder_worker

    run = "cr-mt"
    keys = t.Keys(run)
    r = t.connect(redis_url)
    alg = {"name": "grpo", "group_size": 2}
    fs = feeder_worker.FeederSettings(
        redis_url=redis_url, run_id=run, algorithm=alg, high_water=16, metrics_port=0,
        max_head_offpolicyness=0,
    )  # fmt: skip
    await accounting.set_admission(r, keys, served_step=0, batch_size=12)
    # before any group was credited a group counts group_size items: 12 / 2 = 6 groups
    assert await feeder_worker.admitted_groups(r, keys, fs) == 6
    assert await feeder_worker.top_up(r, keys, fs, 1) == 1
    actor = accounting.AccountedConsumer(
        r, keys.requests, t.GROUP_ACTORS, "test-actor", keys.deadletter, stage="requests"
    )
    await actor.ensure_group()
    (e,) = await actor.read(1, block_ms=500)
    req = t.decode_request(e.payload)
    ros = [rollout(req.id, i, float(i), steps=3) for i in range(2)]  # rewards 0 and 1
    for ro in ros:
        ro.meta["group_rollouts"] = 2
    await accounting.commit(
        actor, [e], [(ro.id, t.encode_rollout(ro)) for ro in ros], keys.rollouts,
        keys.done("actor", req.id), stage="actor", group_id=req.id,
    )  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(
        credit_main.run(settings(redis_url, run, algorithm=alg, group_timeout_s=60), stop=stop)
    )
    await wait_for(lambda: _xlen(r, keys.rollouts, 0), 20, "the group to be credited")
    stop.set()
    await asyncio.wait_for(task, 10)
    st = await accounting.admission_state(r, keys, 2)
    assert st is not None and st["items_per_group"] == 6.0  # 2 episodes x 3 model calls
    # room = (0 + 0 + 1) * 12 - 6 items in the saw stream = 6 items = 1 group of 6
    assert await feeder_worker.admitted_groups(r, keys, fs) == 1
    await r.aclose()


async def _xlen(r: Any, key: str, n: int) -> bool:
    return int(await r.xlen(key)) == n


async def test_feeder_seeds_start_at_seed_base(redis_url: str) -> None:
    """``feeder.seed_base`` moves every env seed (and the group ids made of it) past an
    evaluation's 0..n-1; seeds are still consecutive and never repeat across top-ups."""
    from services.feeder import worker as feeder_worker

    run = "cr-seeds"
    r = t.connect(redis_url)
    fs = feeder_worker.FeederSettings(
        redis_url=redis_url, run_id=run, algorithm={"name": "grpo", "group_size": 2},
        high_water=16, metrics_port=0, max_head_offpolicyness=None, seed_base=1000,
    )  # fmt: skip
    assert await feeder_worker.top_up(r, t.Keys(run), fs, 2) == 2
    assert await feeder_worker.top_up(r, t.Keys(run), fs, 1) == 1
    reqs = [t.decode_request(f[b"d"]) for _, f in await r.xrange(t.Keys(run).requests)]
    assert [q.env_seed for q in reqs] == [1000, 1001, 1002]
    assert [q.id for q in reqs] == [f"{run}-1000", f"{run}-1001", f"{run}-1002"]
    with pytest.raises(ValueError, match="seed_base=-1"):
        feeder_worker.FeederSettings(run_id=run, seed_base=-1)
    await r.aclose()
