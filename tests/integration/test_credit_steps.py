"""Per-step rewards traced through the real credit worker to the trained weights.

Episodes with known step rewards (a format penalty, intermediate and final rewards) go
into a real redis-server's rollouts stream; ``ludic credit`` (``credit_main.run``) writes
the SAWItems; the test reads them back and, for an algorithm with a batch stage, finishes
them as the learner does (``algorithm.apply_batch_stage`` over the items of a training
batch, the learner's ``spec.build()``). Each item's weight, what the loss multiplies, must
equal the value derived by hand for its (rollout, step).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import pytest

from libludic import transport as t
from libludic.training.algorithm_spec import AlgorithmSpec
from libludic.types import Rollout, Step, TokenTrace
from services.credit import main as credit_main

pytestmark = pytest.mark.integration

# Two groups of three episodes (step rewards; the last step terminates):
#   g: a = (0, -0.5, 1)  a format penalty at step 1, then the final reward
#      b = (0, 0, 0)     c = (0, 0, 1)
#   h: d = (-0.5, 1)     a format penalty at step 0, then the final reward
#      e = (0,)          f = (0.2,)
# G_t = r_t + gamma G_{t+1}:
#   gamma 1:   G_a = (0.5, 0.5, 1), G_b = 0, G_c = (1, 1, 1), G_d = (0.5, 1), G_e = 0, G_f = 0.2
#   gamma 0.9: G_a = (0.9 * 0.4, -0.5 + 0.9 * 1, 1) = (0.36, 0.4, 1), G_c = (0.81, 0.9, 1),
#              G_d = (-0.5 + 0.9, 1) = (0.4, 1), G_b = G_e = 0, G_f = 0.2
EPISODES = {
    "g": {"a": [0.0, -0.5, 1.0], "b": [0.0, 0.0, 0.0], "c": [0.0, 0.0, 1.0]},
    "h": {"d": [-0.5, 1.0], "e": [0.0], "f": [0.2]},
}


def expected_grpo_gamma_1() -> dict[str, list[float]]:
    # A_{i,t} = G_{i,t} - mean_{j in group} G_{j,0}
    #   g: mean (0.5 + 0 + 1) / 3 = 0.5 -> a (0, 0, 0.5): a's last step, after the penalty,
    #      weighs like c's (0.5), its first two less; b -0.5; c +0.5
    #   h: mean (0.5 + 0 + 0.2) / 3 = 0.7 / 3 -> d (0.5 - 0.7/3, 1 - 0.7/3), e -0.7/3, f 0.2 - 0.7/3
    mh = 0.7 / 3
    return {
        "a": [0.0, 0.0, 0.5],
        "b": [-0.5] * 3,
        "c": [0.5] * 3,
        "d": [0.5 - mh, 1.0 - mh],
        "e": [-mh],
        "f": [0.2 - mh],
    }


def expected_grpo_default() -> dict[str, list[float]]:
    # gamma unset (before per-step credit): every step gets R_i - mean(R), R = total reward
    #   g: R = (0.5, 0, 1), mean 0.5;  h: R = (0.5, 0, 0.2), mean 0.7 / 3
    mh = 0.7 / 3
    return {
        "a": [0.0] * 3,
        "b": [-0.5] * 3,
        "c": [0.5] * 3,
        "d": [0.5 - mh] * 2,
        "e": [-mh],
        "f": [0.2 - mh],
    }


def expected_reinforce_gamma_09() -> dict[str, list[float]]:
    # MonteCarloReturn: the weight is G_{i,t} itself
    return {
        "a": [0.36, 0.4, 1.0],
        "b": [0.0] * 3,
        "c": [0.81, 0.9, 1.0],
        "d": [0.4, 1.0],
        "e": [0.0],
        "f": [0.2],
    }


def expected_scalerl_gamma_09() -> dict[str, list[float]]:
    # c_{i,t} = G_{i,t} - group mean of G_{j,0}
    #   g: mean (0.36 + 0 + 0.81) / 3 = 0.39 -> a (-0.03, 0.01, 0.61), b -0.39, c (0.42, 0.51, 0.61)
    #   h: mean (0.4 + 0 + 0.2) / 3 = 0.2   -> d (0.2, 0.8), e -0.2, f 0
    # learner: A = c / (std + 1e-8), the population std of one c_0 per rollout over the batch:
    #   (-0.03, -0.39, 0.42, 0.2, -0.2, 0), mean 0, sum of squares 0.4094 -> sqrt(0.4094 / 6)
    c = {
        "a": [-0.03, 0.01, 0.61],
        "b": [-0.39] * 3,
        "c": [0.42, 0.51, 0.61],
        "d": [0.2, 0.8],
        "e": [-0.2],
        "f": [0.0],
    }
    s = math.sqrt(0.4094 / 6) + 1e-8
    return {k: [x / s for x in v] for k, v in c.items()}


def expected_custom_rloo_batch_std_gamma_09() -> dict[str, list[float]]:
    # reward_norm RLOO: m_i = mean of the other episodes' G_{j,0} of the group
    #   g: e = (0.36, 0, 0.81): a m = 0.405 -> (-0.045, -0.005, 0.595); b m = 0.585 -> -0.585;
    #      c m = 0.18 -> (0.63, 0.72, 0.82)
    #   h: e = (0.4, 0, 0.2):   d m = 0.1 -> (0.3, 0.9); e m = 0.3 -> -0.3; f m = 0.2 -> 0
    # adv_norm (learner): std over the batch, unbiased, no centring, one value per rollout:
    #   (-0.045, -0.585, 0.63, 0.3, -0.3, 0): sum of squares 0.74115 + 0.18 = 0.92115
    #   -> sqrt(0.92115 / 5) = 0.429220, + eps 1e-5
    v = {
        "a": [-0.045, -0.005, 0.595],
        "b": [-0.585] * 3,
        "c": [0.63, 0.72, 0.82],
        "d": [0.3, 0.9],
        "e": [-0.3],
        "f": [0.0],
    }
    s = math.sqrt(0.92115 / 5) + 1e-5
    return {k: [x / s for x in xs] for k, xs in v.items()}


Expected = Callable[[], dict[str, list[float]]]
CASES: dict[str, tuple[dict[str, Any], Expected]] = {
    "grpo_gamma_1": ({"name": "grpo", "kwargs": {"gamma": 1.0}}, expected_grpo_gamma_1),
    "grpo_default": ({"name": "grpo"}, expected_grpo_default),
    "reinforce_gamma_09": (
        {"name": "reinforce", "kwargs": {"gamma": 0.9}},
        expected_reinforce_gamma_09,
    ),
    "scalerl_gamma_09": ({"name": "scalerl", "kwargs": {"gamma": 0.9}}, expected_scalerl_gamma_09),
    "custom_normalized_return_gamma_09": (
        {
            "name": "custom",
            "kwargs": {
                "gamma": 0.9,
                "credit": {
                    "kind": "NormalizedReturn",
                    "kwargs": {
                        "reward_norm": {
                            "mean_level": "group",
                            "mean_leave1out": True,
                            "std_level": None,
                        },
                        "adv_norm": {"mean_level": None, "std_level": "batch"},
                    },
                },
                "loss": {"kind": "ReinforceLoss"},
            },
        },
        expected_custom_rloo_batch_std_gamma_09,
    ),
}


def episode(gid: str, rid: str, rewards: list[float]) -> Rollout:
    tr = TokenTrace([257, 49, 43, 50], [51, 258], [-0.25, -0.5])
    steps = [
        Step(
            k,
            "q",
            "a",
            None,
            r,
            terminated=k == len(rewards) - 1,
            trace=tr,
            policy_version=1,
            info={"finish_reason": "stop"},
        )
        for k, r in enumerate(rewards)
    ]
    meta = {"group_id": gid, "request_id": gid, "group_rollouts": len(EPISODES[gid])}
    return Rollout(id=rid, steps=steps, meta=meta)


async def credit_items(redis_url: str, run: str, algorithm: dict[str, Any], **kw: Any) -> list:
    """Every episode through ``ludic credit``; the SAWItems it wrote, decoded."""
    keys = t.Keys(run)
    r = t.connect(redis_url)
    try:
        await t.ensure_group(r, keys.rollouts, t.GROUP_CREDIT)
        for gid, eps in EPISODES.items():
            for rid, rewards in eps.items():
                ro = episode(gid, rid, rewards)
                if rid == "a" and kw.get("filters"):
                    ro.steps[0].info["finish_reason"] = "length"  # dropped by the filter
                await t.xadd(r, keys.rollouts, ro.id, t.encode_rollout(ro))
        settings = credit_main.CreditSettings(
            redis_url=redis_url,
            run_id=run,
            algorithm={**algorithm, "group_size": 3},
            group_timeout_s=60.0,
            metrics_port=0,
            block_ms=100,
            claim_idle_ms=600,
            lease_ttl_ms=600,
            **kw,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(credit_main.run(settings, stop=stop))
        deadline = asyncio.get_running_loop().time() + 30
        while await r.xlen(keys.rollouts) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        stop.set()
        worker = await asyncio.wait_for(task, 10)
        assert worker.outcomes == {"complete": 2}, worker.outcomes
        entries: Any = await r.xrange(keys.saw)
        return [t.decode_saw_item(f[b"d"]) for _, f in entries]
    finally:
        await r.aclose()


@pytest.mark.parametrize("case", list(CASES))
async def test_step_rewards_reach_the_trained_weights(redis_url: str, case: str) -> None:
    algorithm, expected = CASES[case]
    items = await credit_items(redis_url, f"steps-{case}", algorithm)
    # the learner: its own build of the same algorithm: section, each item checked as read,
    # the batch stage (if any) over the training batch, here every item
    algo = AlgorithmSpec.from_mapping({**algorithm, "group_size": 3}).build()
    assert all(algo.item_problem(it) is None for it in items)
    trained = algo.apply_batch_stage(items)
    got = {(it.meta["rollout_id"], it.meta["step_index"]): it.weight for it in trained}
    want = {(rid, t): w for rid, ws in expected().items() for t, w in enumerate(ws)}
    assert got.keys() == want.keys()
    for key, w in want.items():
        assert got[key] == pytest.approx(w, rel=1e-6, abs=1e-9), (case, key)
    # items keep the task's step rewards: what the credit was traced from
    for it in trained:
        gid, rid = it.meta["group_id"], it.meta["rollout_id"]
        assert it.meta["step_reward"] == EPISODES[gid][rid][it.meta["step_index"]]


async def test_scalerl_episode_value_crosses_the_wire_when_step_0_is_filtered(
    redis_url: str,
) -> None:
    """a's step 0 holds its episode's c_0 = -0.03; with it filtered out by credit, a's other
    items carry that value in meta through msgpack, and the learner's std is unchanged."""
    algorithm, expected = CASES["scalerl_gamma_09"]
    items = await credit_items(
        redis_url, "steps-filtered", algorithm, filters=["drop_incomplete_completions"]
    )
    by_key = {(it.meta["rollout_id"], it.meta["step_index"]): it for it in items}
    assert ("a", 0) not in by_key and by_key[("a", 1)].pending.rollout_items == 2
    assert by_key[("a", 1)].pending.episode_weight == pytest.approx(-0.03)
    algo = AlgorithmSpec.from_mapping({**algorithm, "group_size": 3}).build()
    want = expected()
    for it in algo.apply_batch_stage(items):
        rid, step = it.meta["rollout_id"], it.meta["step_index"]
        assert it.weight == pytest.approx(want[rid][step], rel=1e-6), (rid, step)
