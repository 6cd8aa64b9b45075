"""Fuzz tier, streams: hostile entries (tests/fuzz/hostile.py) interleaved with valid ones
into the requests, rollouts and SAW streams of a real redis-server, read by the real actor,
credit and learner loops (in-process ``run()``, as tests/integration does).

For every stream: the service never crashes (its ``run()`` returns after ``stop``, and a
last batch of valid entries sent after the flood is processed); every entry is resolved
exactly once, by its declared fate (hostile.py: DEADLETTER with one of its reasons,
PROCESSED, or EITHER); nothing stays in the stream or pending; the run accounting is
``consistent`` with the counts the test derives from the fates. The learner's parameters
stay finite and change (the valid items trained).

``LUDIC_FUZZ_N`` hostile entries per stream (default 200), ``LUDIC_FUZZ_SEED`` (default 0).
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hostile import (  # noqa: E402
    DEADLETTER,
    EITHER,
    FUZZ_N,
    FUZZ_SEED,
    PROCESSED,
    TASK,
    Hostile,
    encode_valid,
    hostile,
    oversized,
)

from libludic import transport as t  # noqa: E402
from libludic.transport import accounting  # noqa: E402
from tests.fakes import ScriptedClient  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.fuzz]
Entry = tuple[str, bytes, Hostile | None]  # (item id, payload, None for a valid entry)


def mix(kind: str, valid_every: int = 2) -> list[Entry]:
    """The N hostile entries of ``kind`` (and one oversized), a valid one after every
    ``valid_every``, in a seeded order."""
    bad = hostile(kind, FUZZ_N, FUZZ_SEED) + [oversized(kind)]
    out: list[Entry] = []
    for i, h in enumerate(bad):
        out.append((f"h{i}", h.payload, h))
        if i % valid_every == 0:
            out.append((f"v{i}", encode_valid(kind, f"v{i}", seed=i), None))
    random.Random(FUZZ_SEED).shuffle(out)
    return out


async def wait_for(
    cond: Callable[[], Awaitable[bool]], timeout: float, what: str, task: Any
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if task.done():  # the service loop ended on its own: a crash (or a silent exit)
            task.result()
            raise AssertionError(f"the service stopped while waiting for {what}")
        if await cond():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def drained(r: Any, stream: str, group: str) -> bool:
    if int(await r.xlen(stream)):
        return False
    return int((await r.xpending(stream, group))["pending"]) == 0


async def dead_letters(r: Any, keys: t.Keys) -> dict[str, str]:
    """Item id -> reason of every dead-letter entry (each id at most once)."""
    out: dict[str, str] = {}
    for _, f in await r.xrange(keys.deadletter):
        iid = t.as_str(f[b"id"])
        assert iid not in out, f"{iid} dead-lettered twice"
        assert f[b"reason"], f"{iid} dead-lettered without a reason"
        out[iid] = t.as_str(f[b"reason"])
    return out


def judge(entries: Sequence[Entry], dead: dict[str, str]) -> tuple[int, int, list[str]]:
    """(dead-lettered, processed, problems): every entry against its declared fate."""
    problems: list[str] = []
    n_dead = n_done = 0
    for iid, _, h in entries:
        reason = dead.get(iid)
        n_dead += reason is not None
        n_done += reason is None
        if h is None or h.fate == PROCESSED:
            if reason is not None:
                what = "valid entry" if h is None else f"PROCESSED {h.mutation!r}"
                problems.append(f"{iid}: {what} dead-lettered ({reason})")
        elif h.fate == DEADLETTER:
            if reason is None:
                problems.append(f"{iid}: {h.mutation!r} was processed, not dead-lettered")
            elif h.reasons and reason not in h.reasons:
                problems.append(f"{iid}: {h.mutation!r} reason {reason}, want {sorted(h.reasons)}")
        else:
            assert h.fate == EITHER
    return n_dead, n_done, problems


def report(rows: list[Any], name: str, entries: Sequence[Entry], dead: dict[str, str]) -> None:
    hostile_only = [e for e in entries if e[2] is not None]
    n_dead, n_done, _ = judge(hostile_only, dead)
    rows.append((f"{name} (hostile)", len(hostile_only), n_dead, n_done, 0))
    valid = [e for e in entries if e[2] is None]
    v_dead, v_done, _ = judge(valid, dead)
    rows.append((f"{name} (valid)", len(valid), v_dead, v_done, 0))


# ------------------------------------------------------------------------------ upstream


async def request_groups(r: Any, keys: t.Keys, entries: Sequence[Entry]) -> None:
    """The feeder's step: one request per entry, counted requested (``add_requests``)."""
    for i in range(0, len(entries), 50):
        chunk = entries[i : i + 50]
        assert await accounting.add_requests(r, keys, [(iid, p) for iid, p, _ in chunk]) == len(
            chunk
        )


async def act_out(r: Any, keys: t.Keys, outputs: dict[str, bytes], out_stream: str) -> None:
    """The actor's step for every request of ``outputs`` (request id -> one output payload):
    an accounted commit writing the output as ``<id>-r0`` to ``out_stream``."""
    sc = t.StreamConsumer(r, keys.requests, t.GROUP_ACTORS, "fuzz-actor", keys.deadletter)
    await sc.ensure_group()
    left = len(outputs)
    while left:
        for e in await sc.read(50, block_ms=100):
            await accounting.commit(
                sc, [e], [(f"{e.item_id}-r0", outputs[e.item_id])], out_stream,
                keys.done("actor", e.item_id), stage="actor", group_id=e.item_id,
            )  # fmt: skip
            left -= 1


async def credit_out(r: Any, keys: t.Keys, entries: Sequence[Entry]) -> None:
    """The credit step: each entry is the one SAW item of its own group."""
    await request_groups(r, keys, entries)
    scratch = f"{keys.prefix}:fuzz-scratch"
    await act_out(r, keys, {iid: b"-" for iid, _, _ in entries}, scratch)
    sc = t.StreamConsumer(r, keys.rollouts, t.GROUP_CREDIT, "fuzz-credit", keys.deadletter)
    for iid, payload, _ in entries:
        await accounting.commit(
            sc, [], [(iid, payload)], keys.saw, keys.done("credit", iid),
            stage="credit", group_id=iid,
        )  # fmt: skip
    await r.delete(scratch)


async def assert_consistent(r: Any, keys: t.Keys, entries: Sequence[Entry]) -> dict[str, Any]:
    acct = await accounting.snapshot(r, keys)
    ak = accounting.AcctKeys(keys)
    ids = {iid for iid, _, _ in entries}
    rolling = {t.as_str(k) for k in await r.hkeys(ak.rolling)}
    opened = {t.as_str(k) for k in await r.hkeys(ak.open)}
    # a request or rollout whose group_id was mutated keys its group otherwise: allowed
    # (several requests may share a group), shown here when the identity breaks
    strays = sorted((rolling | opened) - ids)
    assert acct["consistent"], (
        f"{accounting.format_line(acct)}; groups never requested: {strays[:5]}; in both "
        f"rolling and open: {sorted(rolling & opened)[:5]}"
    )
    assert acct["items_trained_twice"] == 0
    return acct


# ------------------------------------------------------------------------------ actor


async def test_actor_survives_hostile_requests(redis_url: str, fuzz_summary: list[Any]) -> None:
    from services.actor import main as actor_main

    keys = t.Keys("fz-act")
    r = t.connect(redis_url)
    entries = mix("requests")
    await t.ensure_group(r, keys.requests, t.GROUP_ACTORS)
    await request_groups(r, keys, entries)
    settings = actor_main.ActorSettings(
        redis_url=redis_url, run_id="fz-act", metrics_port=0, claim_idle_ms=500,
        max_head_offpolicyness=None, block_ms=100, concurrency=4, max_steps=2,
        tasks=[TASK],
    )  # fmt: skip
    stop = asyncio.Event()
    client = ScriptedClient(["42"])  # every call the same answer: the streams are fuzzed
    task = asyncio.create_task(actor_main.run(settings, client=client, stop=stop))
    try:
        await wait_for(lambda: drained(r, keys.requests, t.GROUP_ACTORS), 120, "requests", task)
        tail = [(f"tail{i}", encode_valid("requests", f"tail{i}", seed=i), None) for i in range(3)]
        await request_groups(r, keys, tail)  # the actor still takes work after the flood
        await wait_for(lambda: drained(r, keys.requests, t.GROUP_ACTORS), 30, "the tail", task)
    finally:
        stop.set()
        stats = await asyncio.wait_for(task, 30)
    entries += tail
    dead = await dead_letters(r, keys)
    n_dead, n_done, problems = judge(entries, dead)
    assert not problems, "\n".join(problems)
    assert n_dead + n_done == len(entries) == len(dead) + stats.requests_done
    requested = {
        t.as_str(t.decode_rollout(f[b"d"]).meta["request_id"])
        for _, f in await r.xrange(keys.rollouts)
    }
    for iid, _, h in entries:  # a processed request wrote its rollouts
        if iid not in dead:
            assert iid in requested, f"{iid} ({h and h.mutation}) acked without rollouts"
    acct = await assert_consistent(r, keys, entries)
    assert acct["groups_requested"] == len(entries)
    assert acct["groups_deadlettered"] == n_dead and acct["groups_in_flight"] == n_done
    # an entry naming a module by its import path never got it imported
    assert "tests.import_marker" not in sys.modules
    report(fuzz_summary, "requests -> actor", entries, dead)
    await r.aclose()


# ------------------------------------------------------------------------------ credit


async def test_credit_survives_hostile_rollouts(redis_url: str, fuzz_summary: list[Any]) -> None:
    from services.credit import main as credit_main

    keys = t.Keys("fz-cr")
    r = t.connect(redis_url)
    entries = mix("rollouts")
    await t.ensure_group(r, keys.rollouts, t.GROUP_CREDIT)
    await request_groups(r, keys, entries)
    await act_out(r, keys, {iid: p for iid, p, _ in entries}, keys.rollouts)
    settings = credit_main.CreditSettings(
        redis_url=redis_url, run_id="fz-cr", algorithm={"name": "grpo", "group_size": 4},
        group_timeout_s=1.0, metrics_port=0, block_ms=100, claim_idle_ms=600, lease_ttl_ms=600,
    )  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(credit_main.run(settings, stop=stop))
    try:
        await wait_for(lambda: drained(r, keys.rollouts, t.GROUP_CREDIT), 120, "rollouts", task)
        tail = [(f"tail{i}", encode_valid("rollouts", f"tail{i}", seed=i), None) for i in range(3)]
        await request_groups(r, keys, tail)
        await act_out(r, keys, {iid: p for iid, p, _ in tail}, keys.rollouts)
        await wait_for(lambda: drained(r, keys.rollouts, t.GROUP_CREDIT), 30, "the tail", task)
    finally:
        stop.set()
        worker = await asyncio.wait_for(task, 30)
    entries += tail
    # the actor step named each rollout entry <request id>-r0
    dead = {k.removesuffix("-r0"): v for k, v in (await dead_letters(r, keys)).items()}
    n_dead, n_done, problems = judge(entries, dead)
    assert not problems, "\n".join(problems)
    assert (
        n_dead + n_done
        == len(entries)
        == len(dead)
        + sum(v for k, v in worker.outcomes.items() if k in ("complete", "partial", "dropped"))
    )
    groups = {it.meta["group_id"] for it in map(t.decode_saw_item, await saw_payloads(r, keys))}
    for iid, _, h in entries:
        if h is None:  # a valid group of one rollout: its item was written
            assert iid in groups, f"valid rollout {iid} wrote no SAW item"
    acct = await assert_consistent(r, keys, entries)
    assert acct["rollouts_deadlettered"] == n_dead
    assert acct["items_written"] == acct["observed_saw_backlog"] >= len(groups)
    assert acct["groups_deadlettered"] == sum(1 for v in dead.values() if v == "credit_error")
    report(fuzz_summary, "rollouts -> credit", entries, dead)
    await r.aclose()


async def saw_payloads(r: Any, keys: t.Keys) -> list[bytes]:
    return [f[b"d"] for _, f in await r.xrange(keys.saw)]


# ------------------------------------------------------------------------------ learner


async def test_learner_survives_hostile_saw_items(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path, fuzz_summary: list[Any]
) -> None:
    import torch

    from services.learner import main as learner_main
    from services.learner.settings import LearnerSettings

    keys = t.Keys("fz-ln")
    r = t.connect(redis_url)
    entries = mix("saw")
    await credit_out(r, keys, entries)
    settings = LearnerSettings(
        redis_url=redis_url, run_id="fz-ln", model_dir=str(tiny_model_dir),
        output_dir=str(tmp_path / "out"), device="cpu", metrics_port=0, block_ms=100,
        trained_log=True, batch_size=1, lr=1e-3, max_lag=None, algorithm={"name": "grpo"},
    )  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(learner_main.run(settings, stop=stop))
    before: dict[str, torch.Tensor] | None = None
    try:
        await wait_for(lambda: drained(r, keys.saw, t.GROUP_LEARNER), 300, "SAW items", task)
        tail = [(f"tail{i}", encode_valid("saw", f"tail{i}", seed=i), None) for i in range(3)]
        await credit_out(r, keys, tail)
        await wait_for(lambda: drained(r, keys.saw, t.GROUP_LEARNER), 60, "the tail", task)
    finally:
        stop.set()
        learner = await asyncio.wait_for(task, 60)
    entries += tail
    dead = await dead_letters(r, keys)
    n_dead, n_done, problems = judge(entries, dead)
    assert not problems, "\n".join(problems)
    tr = learner.trainer
    assert tr.step == n_done == learner.source.items_trained  # batch_size 1: a step per item
    params = dict(tr.model.named_parameters())
    bad = [n for n, p in params.items() if not torch.isfinite(p).all()]
    assert not bad, f"non-finite parameters after the fuzz: {bad[:5]}"
    from transformers import AutoModelForCausalLM

    before = dict(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).named_parameters())
    assert any(not torch.equal(before[n], p.detach()) for n, p in params.items())
    acct = await assert_consistent(r, keys, entries)
    assert acct["items_trained"] == n_done and acct["items_deadlettered"] == n_dead
    assert acct["groups_trained"] == n_done and acct["groups_deadlettered"] == n_dead
    assert acct["groups_in_flight"] == 0 and acct["items_in_flight"] == 0
    print(f"learner: {tr.step} steps, {tr.nonfinite_skipped_total} non-finite steps skipped")
    report(fuzz_summary, "saw -> learner", entries, dead)
    assert math.isfinite(float(sum(p.detach().sum() for p in params.values())))
    await r.aclose()
