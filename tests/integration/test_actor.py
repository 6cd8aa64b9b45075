"""`ludic actor` against a real redis-server and a fake OpenAI-compatible HTTP server.

The fake server (tests/fakes.py: FakeOpenAIServer) answers like `ludic inference` (token
ids, chosen-token logprobs, policy_version) after a configurable delay, so actors can be
killed while they hold work; in-process actors get a ScriptedClient.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from libludic import transport as t
from libludic.requests import EnvSpec, RolloutRequest
from libludic.tasks import TaskSpec
from services.actor import main as actor_main
from tests.fakes import FakeOpenAIServer, ScriptedClient

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_openai() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as f:
        yield f


#: the tasks of the actors' run config (feeder.tasks): what a request may run
TASK = {
    "name": "add2",
    "env": {"kind": "arithmetic", "kwargs": {"digits": 2}},
    "inference": {"sampling": {"max_tokens": 4}},
}
PARTIAL = {
    **TASK,
    "name": "partial",
    "env": {"kind": "arithmetic", "kwargs": {"digits": 2, "partial_credit": True}},
}
FLAKY = {**TASK, "name": "flaky", "env": {"kind": "tests.user_plugins:OddSeedsFail"}}
TASKS = [TASK, PARTIAL, FLAKY]


def request(i: int, task: dict[str, Any] = TASK, **kw: Any) -> RolloutRequest:
    """Request ``req-<i>`` of ``task``; ``kw`` replaces fields of it (an entry that is no
    task of the run)."""
    req = TaskSpec.from_dict(task).request(
        id=f"req-{i}", env_seed=i, sampling_seed=None, num_episodes=1, same_env_seed=False
    )
    return dataclasses.replace(req, **kw)


async def feed(r: Any, keys: t.Keys, reqs: list[RolloutRequest]) -> None:
    await t.ensure_group(r, keys.requests, t.GROUP_ACTORS)
    for q in reqs:
        await t.xadd(r, keys.requests, q.id, t.encode_request(q))


async def rollouts(r: Any, keys: t.Keys) -> list[Any]:
    return [t.decode_rollout(f[b"d"]) for _, f in await r.xrange(keys.rollouts)]


def spawn_actor(redis_url: str, run_id: str, inference_url: str, *extra: str) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "services.cli",
        "actor",
        "--redis-url",
        redis_url,
        "--run-id",
        run_id,
        "--inference-urls",
        inference_url,
        "--concurrency",
        "3",
        "--claim-idle-ms",
        "1000",
        "--metrics-port",
        "0",
        "--max-head-offpolicyness",
        "null",
        "--heartbeat-ttl-s",
        "2",
        "--block-ms",
        "200",
        "--tasks",
        json.dumps(TASKS),
        *extra,
    ]
    return subprocess.Popen(
        args,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


async def wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await cond():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def test_kill9_actor_then_peer_finishes_all_and_sigterm_drains(
    redis_url: str, fake_openai: FakeOpenAIServer
) -> None:
    fake_openai.delay_s = 1.0
    keys = t.Keys("act1")
    r = t.connect(redis_url)
    await feed(r, keys, [request(i) for i in range(6)])
    procs: list[subprocess.Popen] = []
    try:
        a = spawn_actor(redis_url, "act1", fake_openai.url)
        procs.append(a)

        async def a_holds_work() -> bool:
            p = await r.xpending(keys.requests, t.GROUP_ACTORS)
            return int(p["pending"]) >= 2

        await wait_for(a_holds_work, 60, "actor A to claim requests")

        async def one_alive() -> bool:
            return len(await t.alive(r, keys, "actor")) == 1

        await wait_for(one_alive, 10, "actor A's heartbeat")
        os.kill(a.pid, signal.SIGKILL)
        a.wait(10)
        b = spawn_actor(redis_url, "act1", fake_openai.url)
        procs.append(b)

        async def all_done() -> bool:
            return len(await rollouts(r, keys)) >= 6 and await r.xlen(keys.requests) == 0

        await wait_for(all_done, 90, "actor B to finish every request")
        ros = await rollouts(r, keys)
        assert sorted(ro.meta["request_id"] for ro in ros) == [f"req-{i}" for i in range(6)]
        assert all(
            ro.steps[0].trace.completion_logprobs == pytest.approx([-0.1, -0.2, -0.3]) for ro in ros
        )
        # SIGTERM mid-work: B stops claiming, finishes within the grace period, exits 0
        await feed(r, keys, [request(i) for i in range(6, 8)])
        await wait_for(a_holds_work, 30, "actor B to claim the new requests")
        b.send_signal(signal.SIGTERM)
        assert b.wait(30) == 0, b.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
        assert len(await rollouts(r, keys)) == 8
        assert int((await r.xpending(keys.requests, t.GROUP_ACTORS))["pending"]) == 0
        assert await t.alive(r, keys, "actor") == {}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        await r.aclose()


def flaky(fail: int) -> ScriptedClient:
    """Answers "42" (3 token ids: "4", "2", EOS) after ``fail`` calls that raise InferenceError."""
    return ScriptedClient(["42"], fail_first=fail)


async def test_actor_deadletters_bad_requests_and_retries_inference_errors(redis_url: str) -> None:
    keys = t.Keys("act2")
    r = t.connect(redis_url)
    # req-1 names an env that is not a task of the run; req-3's env raises (an odd seed)
    await feed(r, keys, [request(0), request(1, env=EnvSpec("no_such_env")), request(3, FLAKY)])
    await t.xadd(r, keys.requests, "junk", b"\x00not msgpack")
    settings = actor_main.ActorSettings(
        redis_url=redis_url,
        run_id="act2",
        metrics_port=0,
        claim_idle_ms=300,
        max_head_offpolicyness=None,
        tasks=TASKS,
        block_ms=100,
        concurrency=2,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(actor_main.run(settings, client=flaky(1), stop=stop))

    async def settled() -> bool:
        return await r.xlen(keys.requests) == 0

    await wait_for(settled, 30, "the actor to settle every request")
    stop.set()
    stats = await asyncio.wait_for(task, 30)
    assert stats.retried == 1 and stats.episodes == 1 and stats.deadlettered == 3
    dead = {
        t.as_str(f[b"reason"]): t.as_str(f[b"detail"]) for _, f in await r.xrange(keys.deadletter)
    }
    assert sorted(dead) == ["bad_msgpack", "episode_error", "not_a_task"]
    assert "task flaky: ValueError: problem 3 is malformed" in dead["episode_error"]
    assert "not one of this run's tasks ['add2', 'partial', 'flaky']" in dead["not_a_task"]
    (ro,) = await rollouts(r, keys)
    assert ro.meta["request_id"] == "req-0" and ro.meta["group_rollouts"] == 1
    await r.aclose()


async def test_actor_waits_while_inference_is_stale(redis_url: str) -> None:
    keys = t.Keys("act3")
    r = t.connect(redis_url)
    await feed(r, keys, [request(0)])
    await t.set_policy_version(r, keys, 5)  # learner at 5, inference (the client) at 0
    settings = actor_main.ActorSettings(
        redis_url=redis_url,
        run_id="act3",
        metrics_port=0,
        max_head_offpolicyness=2,
        block_ms=100,
        tasks=TASKS,
    )
    before = stale_waits()
    stop = asyncio.Event()
    client = flaky(0)
    fake_inference_version = {"v": 0}

    async def version() -> int:
        return fake_inference_version["v"]

    client.get_policy_version = version  # type: ignore[method-assign]
    task = asyncio.create_task(actor_main.run(settings, client=client, stop=stop))
    await asyncio.sleep(1.0)
    assert await r.xlen(keys.rollouts) == 0 and stale_waits() == before + 1
    fake_inference_version["v"] = 3  # lag 5 - 3 = 2 <= max_head_offpolicyness: admitted
    await wait_for(lambda: _xlen_positive(r, keys.rollouts), 10, "the actor to be admitted")
    stop.set()
    await asyncio.wait_for(task, 30)
    await r.aclose()


def stale_waits() -> float:
    return REGISTRY.get_sample_value("ludic_actor_stale_admission_waits_total") or 0.0


async def _xlen_positive(r: Any, key: str) -> bool:
    return int(await r.xlen(key)) > 0


def scrape(body: str) -> dict[str, float]:
    """``{'name{label="v"}': value}`` of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        series(sample.name, sample.labels): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


# (sample, labels); the reward histogram has negative buckets, so prometheus_client exports
# no _sum for it (a sum could fall): its cumulative buckets carry the values
REWARD_BUCKETS = ("0.0", "0.25", "0.9", "1.0")
ACTOR_SERIES: tuple[tuple[str, dict[str, str]], ...] = (
    ("ludic_actor_episodes_total", {}),
    ("ludic_actor_tokens_total", {}),
    ("ludic_actor_reward_count", {}),
    *(("ludic_actor_reward_bucket", {"le": le}) for le in REWARD_BUCKETS),
    ("ludic_actor_stale_admission_waits_total", {}),
)


def series(name: str, labels: dict[str, str]) -> str:
    """The key ``scrape`` gives the sample."""
    text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{text}}}" if text else name


async def test_metrics_and_health_endpoints(redis_url: str) -> None:
    """After N episodes the actor's /metrics says N: the counters and the reward histogram
    move by what the written rollouts hold (read back from the stream), not only exist
    (prometheus_client exports every name from import time). The registry is the test
    process's, shared with the other in-process actors above: the test reads deltas."""
    try:
        from conftest import free_port  # type: ignore[import-not-found]
    except ImportError:  # pragma: no cover
        from tests.conftest import free_port
    import httpx

    # the client answers "42"; with partial credit (score_answer: 0.5 x matching digits /
    # length, for an answer of the target's length) seed 714 (24+18=42) earns 1.0, seed 15
    # (36+11=47) 0.5 x 1/2 = 0.25, seed 0 (59+63=122, three digits) 0
    seeds = (714, 15, 0)
    n = len(seeds)
    keys = t.Keys("act4")
    r = t.connect(redis_url)
    await feed(r, keys, [request(i, PARTIAL) for i in seeds])
    port = free_port()
    settings = actor_main.ActorSettings(
        redis_url=redis_url,
        run_id="act4",
        metrics_port=port,
        max_head_offpolicyness=None,
        tasks=TASKS,
        block_ms=100,
        heartbeat_ttl_s=1.0,
    )
    before = {series(*k): REGISTRY.get_sample_value(*k) or 0.0 for k in ACTOR_SERIES}
    stop = asyncio.Event()
    task = asyncio.create_task(actor_main.run(settings, client=flaky(0), stop=stop))

    async def all_written() -> bool:
        return int(await r.xlen(keys.rollouts)) == n

    await wait_for(all_written, 10, f"{n} rollouts")
    await asyncio.sleep(0.5)  # one keepalive tick refreshes the gauges
    async with httpx.AsyncClient() as http:
        after = scrape((await http.get(f"http://127.0.0.1:{port}/metrics")).text)
        health = await http.get(f"http://127.0.0.1:{port}/health")
    assert health.status_code == 200
    delta = {k: after[k] - v for k, v in before.items()}
    ros = await rollouts(r, keys)
    # each episode is one step whose completion is the client's 3 token ids [52, 50, 258]
    assert delta["ludic_actor_episodes_total"] == n
    assert delta["ludic_actor_tokens_total"] == 3 * n
    assert sorted(ro.total_reward for ro in ros) == [0.0, 0.25, 1.0]
    # rewards 0, 0.25, 1 -> cumulative buckets: <= 0: 1, <= 0.25: 2, <= 0.9: 2, <= 1: 3
    bucket = {le: delta[series("ludic_actor_reward_bucket", {"le": le})] for le in REWARD_BUCKETS}
    assert bucket == {"0.0": 1, "0.25": 2, "0.9": 2, "1.0": 3}
    assert delta["ludic_actor_reward_count"] == n
    assert delta["ludic_actor_stale_admission_waits_total"] == 0  # admission off
    assert after['ludic_stream_length{stream="rollouts"}'] == n
    assert after["ludic_actor_inflight_requests"] == 0
    assert len(await t.alive(r, keys, "actor")) == 1
    stop.set()
    await asyncio.wait_for(task, 10)
    await r.aclose()


async def test_inference_pool_round_robin_and_failover() -> None:
    from libludic.inference.pool import InferencePool
    from libludic.inference.request import ChatCompletionRequest

    a, b = FakeOpenAIServer(version=3), FakeOpenAIServer(version=2)
    downs: list[str] = []
    pool = InferencePool([a.url, b.url], max_retries=0, down_for_s=30, on_replica_down=downs.append)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "1+1="}])
    try:
        for _ in range(4):
            resp, info = await pool.complete(req)
            assert resp.completion_token_ids == [52, 50, 258]
        assert a.calls == 2 and b.calls == 2  # round robin
        assert await pool.get_policy_version() == 2  # the stalest healthy replica
        b.close()  # replica b dies
        for _ in range(4):
            _, info = await pool.complete(req)
            assert info["url"] == a.url
        assert downs == [b.url] and a.calls == 6
        assert await pool.get_policy_version() == 3  # b is down: only a counts
    finally:
        await pool.aclose()
        a.close()


async def test_an_entry_claimed_back_while_in_flight_runs_once(redis_url: str) -> None:
    """A busy event loop can miss the touch of an in-flight request for claim_idle_ms; the
    actor's own claim then hands it back while it runs, or just after it finished. Neither
    starts a second run (two dead-letter entries, or two commits, for one request)."""
    from services.actor.worker import Actor

    keys = t.Keys("act5")
    r = t.connect(redis_url)
    await feed(r, keys, [request(0, env=EnvSpec("no_such_env"))])
    settings = actor_main.ActorSettings(
        redis_url=redis_url, run_id="act5", metrics_port=0, max_head_offpolicyness=None,
        tasks=TASKS,
    )  # fmt: skip
    actor = Actor(settings, flaky(0), r, asyncio.Event())
    (entry,) = await actor.consumer.read(1, block_ms=100)
    actor._spawn(entry)
    actor._spawn(t.Entry(entry.id, dict(entry.fields), claimed=True))  # the claim-back
    assert len(actor.tasks) == 1
    await asyncio.gather(*actor.tasks.values())
    actor._spawn(t.Entry(entry.id, dict(entry.fields), claimed=True))  # claimed before the end
    assert actor.tasks == {} and actor.stats.deadlettered == 1
    assert [f[b"reason"] for _, f in await r.xrange(keys.deadletter)] == [b"not_a_task"]
    await r.aclose()


async def test_a_request_whose_body_names_another_id_is_dead_lettered(redis_url: str) -> None:
    """The done marker and the accounting key on the entry's id; a body naming another id
    (corrupted: ``id: true`` decodes as "True") would run under a marker other requests can
    share, and a second such request would be acked as a redelivery, uncounted."""
    keys = t.Keys("act6")
    r = t.connect(redis_url)
    await t.ensure_group(r, keys.requests, t.GROUP_ACTORS)
    for entry_id in ("a", "b"):  # two entries whose bodies both say id "req-0"
        await t.xadd(r, keys.requests, entry_id, t.encode_request(request(0)))
    await feed(r, keys, [request(1)])
    settings = actor_main.ActorSettings(
        redis_url=redis_url, run_id="act6", metrics_port=0, max_head_offpolicyness=None,
        block_ms=100, tasks=TASKS,
    )  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(actor_main.run(settings, client=flaky(0), stop=stop))
    await wait_for(lambda: _xlen_zero(r, keys.requests), 30, "every request settled")
    stop.set()
    stats = await asyncio.wait_for(task, 30)
    assert stats.deadlettered == 2 and stats.episodes == 1
    dead = [(f[b"id"], f[b"reason"]) for _, f in await r.xrange(keys.deadletter)]
    assert sorted(dead) == [(b"a", b"bad_field"), (b"b", b"bad_field")]
    await r.aclose()


async def _xlen_zero(r: Any, key: str) -> bool:
    return int(await r.xlen(key)) == 0


async def test_an_entry_naming_what_its_run_does_not_is_dead_lettered_unopened(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream entry is bounded by the run's config: an env named by an import path (a
    module that marks its import), a protocol or agent the tasks do not name, or a dataset
    path outside the task's own (a FIFO: opening it would block the actor for good) is
    dead-lettered as not_a_task, and nothing it names is imported or opened."""
    import os as _os

    mark = tmp_path / "imported"
    monkeypatch.setenv("LUDIC_TEST_IMPORT_MARK", str(mark))
    fifo = tmp_path / "secrets.jsonl"
    _os.mkfifo(fifo)
    qa = {
        "name": "qa",
        "env": {
            "kind": "dataset_qa",
            "kwargs": {"path": str(REPO / "examples/gsm8k/gsm8k_sample.jsonl"), "format": "gsm8k"},
        },
    }
    keys = t.Keys("act7")
    r = t.connect(redis_url)
    bad = [
        request(1, env=EnvSpec("tests.import_marker:Env")),
        request(2, env=EnvSpec("os:system", {"command": "true"})),
        request(3, env=EnvSpec("dataset_qa", {"path": str(fifo), "format": "gsm8k"})),
        request(
            4, protocol=dataclasses.replace(request(4).protocol, kind="tests.import_marker:Env")
        ),
    ]
    await feed(r, keys, [request(0), *bad])
    settings = actor_main.ActorSettings(
        redis_url=redis_url, run_id="act7", metrics_port=0, max_head_offpolicyness=None,
        block_ms=100, tasks=[TASK, qa],
    )  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(actor_main.run(settings, client=flaky(0), stop=stop))
    await wait_for(lambda: _xlen_zero(r, keys.requests), 30, "every request settled")
    stop.set()
    stats = await asyncio.wait_for(task, 30)
    assert stats.episodes == 1 and stats.deadlettered == len(bad)
    dead = [
        (t.as_str(f[b"id"]), t.as_str(f[b"reason"])) for _, f in await r.xrange(keys.deadletter)
    ]
    assert sorted(dead) == [(f"req-{i}", "not_a_task") for i in range(1, 5)]
    assert not mark.exists() and "tests.import_marker" not in sys.modules
    await r.aclose()
