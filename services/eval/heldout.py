"""The held-out greedy evaluation, shared by ``ludic eval`` and ``ludic up``.

``n`` episodes of ``env`` with env seeds ``0..n-1`` (the held-out split is the env's
``kwargs``, e.g. ``{"split": "eval"}``), temperature 0, against one inference service's
current weights. Returns the Evaluator's figures (``eval/pass_rate``, ``eval/reward_mean``,
``eval/num_episodes``) plus ``eval/policy_version``: the version the service reported
right after the pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from libludic.inference.openai_client import OpenAIChatClient
from libludic.inference.request import InferenceSpec
from libludic.inference.sampling import SamplingConfig
from libludic.rollout.request import EnvSpec, RolloutRequest


def eval_requests(env: Mapping[str, Any], n: int, max_tokens: int) -> list[RolloutRequest]:
    spec = InferenceSpec(sampling=SamplingConfig(temperature=0.0, max_tokens=max_tokens))
    return [
        RolloutRequest(env=EnvSpec.from_dict(env), env_seed=i, sampling_seed=i, inference=spec, meta={"eval": True})
        for i in range(n)
    ]


async def evaluate(
    url: str, env: Mapping[str, Any], n: int, max_tokens: int, api_key: str | None = None
) -> dict[str, float]:
    """One greedy pass over the held-out problems against ``url``."""
    from libludic.eval.evaluator import Evaluator
    from libludic.registry import build_registries
    from libludic.rollout.engine import RolloutEngine

    client = OpenAIChatClient(url, api_key=api_key, timeout_s=120.0)
    try:
        engine = RolloutEngine(*build_registries(client))
        ev = Evaluator(engine=engine, requests=eval_requests(env, n, max_tokens), concurrency=64)
        res = await ev.evaluate()
        res["eval/policy_version"] = float(await client.get_policy_version())
        return res
    finally:
        await client.aclose()
