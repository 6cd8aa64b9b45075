"""One algorithm through the services: ``ludic credit`` and ``ludic learner`` (in-process,
real redis-server, the tiny model) read the same top-level ``algorithm:`` section of a run
config. ScaleRL's batch-level std is taken over exactly the learner's batch (not one group,
which is all the credit worker sees), and ``kl_coeff > 0`` trains (reference logprobs from
the learner's frozen initial policy)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from libludic import transport as t
from libludic.training.presets import make_scalerl
from libludic.training.step import OptimizerStep
from libludic.types import Rollout, Step, TokenTrace
from services.common.settings import load_settings
from services.credit import main as credit_main
from services.learner import main as learner_main
from services.learner.settings import LearnerSettings

pytestmark = pytest.mark.integration

# rewards (0,0,0,1) and (0,0,0,5): centred c = (-0.25 x3, 0.75), (-1.25 x3, 3.75); over the
# batch of 8, std = sqrt(19.5 / 8) = 1.5612495 -> A = -0.16013, 0.48038, -0.80064, 2.40192.
# (One group at a time, as the credit worker computed it before: -0.577, 1.732 for both.)
STD = math.sqrt(19.5 / 8)
CENTRED = [-0.25] * 3 + [0.75] + [-1.25] * 3 + [3.75]
WANT = [c / STD for c in CENTRED]


def rollout(gid: str, i: int, reward: float) -> Rollout:
    tr = TokenTrace([257, 49, 43, 50], [51, 258], [-0.25, -0.5])
    step = Step(
        0,
        "1+2=",
        "3",
        None,
        reward,
        terminated=True,
        trace=tr,
        policy_version=0,
        info={"finish_reason": "stop"},
    )
    return Rollout(id=f"{gid}-r{i}", steps=[step], meta={"group_id": gid, "request_id": gid})


def run_config(
    tmp_path: Path, redis_url: str, run_id: str, model: Path, algorithm: str, batch_size: int = 8
) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(
        f"redis_url: {redis_url}\nrun_id: {run_id}\n"
        f"algorithm: {algorithm}\n"
        "credit:\n  metrics_port: 0\n  block_ms: 100\n  group_timeout_s: 60\n"
        f"learner:\n  model_dir: {model}\n  device: cpu\n  metrics_port: 0\n  block_ms: 200\n"
        f"  batch_size: {batch_size}\n  num_steps: 1\n  lr: 1.0e-3\n"
    )
    return p


def two_groups() -> list[Rollout]:
    return [
        rollout(gid, i, float(x))
        for gid, rewards in (("a", [0, 0, 0, 1]), ("b", [0, 0, 0, 5]))
        for i, x in enumerate(rewards)
    ]


async def credit_then_learner(
    cfg: Path,
    run_id: str,
    redis_url: str,
    monkeypatch: Any,
    rollouts: list[Rollout] | None = None,
    n_items: int = 8,
) -> tuple:
    keys = t.Keys(run_id)
    r = t.connect(redis_url)
    for ro in two_groups() if rollouts is None else rollouts:
        await t.xadd(r, keys.rollouts, ro.id, t.encode_rollout(ro))
    cs = load_settings(
        credit_main.CreditSettings, ["--config", str(cfg)], service="credit", environ={}
    )
    stop = asyncio.Event()
    task = asyncio.create_task(credit_main.run(cs, stop=stop))
    deadline = asyncio.get_running_loop().time() + 60
    while await r.xlen(keys.saw) < n_items:
        assert asyncio.get_running_loop().time() < deadline, (
            f"credit did not write {n_items} SAWItems"
        )
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(task, 30)
    saw = [t.decode_saw_item(f[b"d"]) for _, f in await r.xrange(keys.saw)]
    await r.aclose()

    trained: list[Any] = []
    original = OptimizerStep.accumulate_gradients

    def recording(self: OptimizerStep, items: Any) -> Any:  # what the learner trains on
        trained.extend(items)
        return original(self, items)

    monkeypatch.setattr(OptimizerStep, "accumulate_gradients", recording)
    ls = load_settings(LearnerSettings, ["--config", str(cfg)], service="learner", environ={})
    learner = await learner_main.run(ls)
    return saw, trained, learner


async def test_scalerl_batch_std_is_over_the_learners_batch(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    cfg = run_config(
        tmp_path,
        redis_url,
        "alg1",
        tiny_model_dir,
        "{name: scalerl, group_size: 4, kwargs: {filter_zvp: false}}",
    )
    saw, trained, learner = await credit_then_learner(cfg, "alg1", redis_url, monkeypatch)
    by_id = {it.meta["item_id"]: it for it in saw}
    ids = [f"{g}-r{i}:0" for g in "ab" for i in range(4)]
    # credit wrote the group stage only, marked pending
    assert [by_id[i].weight for i in ids] == pytest.approx(CENTRED)
    fingerprint = make_scalerl(group_size=4, filter_zvp=False).fingerprint
    assert all(by_id[i].pending is not None for i in ids)
    assert {by_id[i].credited_by for i in ids} == {fingerprint}
    # the learner trained on the batch-level values
    assert learner.trainer.step == 1 and len(trained) == 8
    got = {it.meta["item_id"]: it.weight for it in trained}
    assert [got[i] for i in ids] == pytest.approx(WANT, rel=1e-6)
    assert [round(got[i], 2) for i in ("a-r2:0", "a-r3:0", "b-r2:0", "b-r3:0")] == [
        -0.16,
        0.48,
        -0.8,
        2.4,
    ]


async def test_grpo_with_kl_trains_through_credit_and_learner(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    cfg = run_config(
        tmp_path,
        redis_url,
        "alg2",
        tiny_model_dir,
        "{name: grpo, group_size: 4, kwargs: {kl_coeff: 0.1}}",
    )
    saw, trained, learner = await credit_then_learner(cfg, "alg2", redis_url, monkeypatch)
    assert learner.trainer.step == 1 and len(trained) == 8
    assert learner.trainer.ref_model is not None
    assert all(it.pending is None for it in saw)  # grpo has no batch stage


def multi_step_rollout(gid: str, name: str, rewards: list[float]) -> Rollout:
    steps = [
        Step(
            i,
            "1+2=",
            "3",
            None,
            x,
            terminated=i == len(rewards) - 1,
            policy_version=0,
            trace=TokenTrace([257, 49, 43, 50], [51, 258], [-0.25, -0.5]),
            info={"finish_reason": "stop"},
        )
        for i, x in enumerate(rewards)
    ]
    return Rollout(id=f"{gid}-{name}", steps=steps, meta={"group_id": gid, "request_id": gid})


async def test_scalerl_batch_std_counts_each_multi_step_rollout_once(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    # group g: a (1 step, reward 1), b (3 steps, 0 + 0 + 0); group h: c (2 steps, 1 + 2),
    # d (1 step, 1). Centred per rollout: +0.5, -0.5, +1, -1; std over the 4 rollouts
    # sqrt((0.25 + 0.25 + 1 + 1) / 4) = sqrt(0.625): a 0.632 (over the 7 items it would be
    # sqrt(4 / 7): a 0.661). The learner's batch of 7 items matches the library's result.
    from libludic.training.presets import make_scalerl

    rs = [
        multi_step_rollout("g", "a", [1.0]),
        multi_step_rollout("g", "b", [0.0, 0.0, 0.0]),
        multi_step_rollout("h", "c", [1.0, 2.0]),
        multi_step_rollout("h", "d", [1.0]),
    ]
    cfg = run_config(
        tmp_path,
        redis_url,
        "alg3",
        tiny_model_dir,
        "{name: scalerl, group_size: 2, kwargs: {dynamic_sampling: false}}",
        batch_size=7,
    )
    saw, trained, learner = await credit_then_learner(cfg, "alg3", redis_url, monkeypatch, rs, 7)
    assert sorted(it.pending.rollout_items for it in saw) == [1, 1, 2, 2, 3, 3, 3]
    assert learner.trainer.step == 1 and len(trained) == 7
    got = {it.meta["item_id"]: it.weight for it in trained}
    library = {
        it.item_id: it.weight
        for it in make_scalerl(group_size=2, dynamic_sampling=False).to_saw_items(rs)
    }
    assert got.keys() == library.keys()
    for k, w in library.items():
        assert got[k] == pytest.approx(w, rel=1e-6)
    assert got["g-a:0"] == pytest.approx(0.5 / math.sqrt(0.625), rel=1e-6)
    assert got["h-c:1"] == pytest.approx(1.0 / math.sqrt(0.625), rel=1e-6)
