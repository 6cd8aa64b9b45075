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
    actor and restarted; the learner (checkpoint every 2 steps) is killed -9 at step >= 3
    and resumed. Expected end state: 16 = 11 + 2 + 0 + 1 + 2 + 0, items_trained 22,
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
        asyncio.run(actor_stage(10, n_req))
        wait(lambda: step() >= 3, 240, "learner step 3", procs)
        learner.send_signal(signal.SIGKILL)
        learner.wait(10)
        procs[:] = [(p, f) for p, f in procs if p is not learner]
        a = asyncio.run(snap(url, run))
        assert a["consistent"] and a["groups_in_flight"] > 0, a
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
