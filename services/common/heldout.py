"""The held-out greedy evaluation, shared by ``ludic eval`` and ``ludic up``.

``n`` episodes of ``env`` with env seeds ``0..n-1`` (the held-out split is the env's
``kwargs``, e.g. ``{"split": "eval"}``), temperature 0, against one inference service's
current weights, run by ``protocol`` (``{kind, kwargs[, agent]}`` like a feeder task's: a
task whose env prompts a chat model and whose parser extracts its answer is evaluated with
the same parser; None: ``single_agent`` with the identity parser). Returns the
Evaluator's figures (``eval/pass_rate``, ``eval/reward_mean``, ``eval/num_episodes``) plus
``eval/policy_version``: the version the service reported right after the pass.

:data:`DEFAULTS` are the launcher's ``up.eval_*`` defaults, which the eval service falls
back to as well.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from libludic.agents.config import validate_agent_config
from libludic.eval.evaluator import Evaluator
from libludic.inference.openai_client import OpenAIChatClient
from libludic.inference.request import InferenceSpec
from libludic.inference.sampling import SamplingConfig
from libludic.parsers import make_parser
from libludic.plugins import PluginError
from libludic.registry import build_registries
from libludic.requests import EnvSpec, ProtocolSpec, RolloutRequest
from libludic.rollout.engine import RolloutEngine
from libludic.tasks import TaskSpec, check_task

Protocol = Mapping[str, Any] | None

# up.<key>: its default (UpSettings' fields, and the eval service's fallbacks)
DEFAULTS: Mapping[str, Any] = {
    "eval_env": {"kind": "arithmetic", "kwargs": {"split": "eval"}},
    "eval_protocol": None,
    "eval_n": 200,
    "eval_every_steps": 10,
    "eval_max_tokens": 8,
}


def protocol_spec(protocol: Protocol, where: str) -> ProtocolSpec:
    """``protocol`` as a ProtocolSpec, its parser and agent built once so that a bad one
    stops the start-up (``where`` names the setting in the error)."""
    if protocol is None:
        return ProtocolSpec()
    try:
        if not isinstance(protocol, Mapping) or "kind" not in protocol:
            raise ValueError("it must be a mapping with 'kind' (and 'kwargs')")
        spec = ProtocolSpec.from_dict(protocol)
        make_parser(spec.kwargs.get("parser"))
        if spec.agent is not None:
            validate_agent_config(spec.agent.kind, spec.agent.kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{where}={protocol!r}: {e}; e.g. {{kind: single_agent, kwargs: {{parser: boxed}}}}"
        ) from e
    return spec


def check_eval(env: Mapping[str, Any], protocol: Protocol, where: str) -> None:
    """Build the evaluation's env (reset once), protocol, agents and parser, as
    ``check_task`` does a feeder task's. ``where``: the settings' prefix in errors
    (``up.eval_`` or ``eval.``)."""
    if not isinstance(env, Mapping) or "kind" not in env:
        raise ValueError(f"{where}env={env!r} must be a mapping with 'kind' (and 'kwargs')")
    task = TaskSpec(
        name="eval",
        env=EnvSpec.from_dict(env),
        protocol=protocol_spec(protocol, f"{where}protocol"),
    )
    try:
        check_task(task, "task")
    except PluginError as e:
        raise PluginError(f"the held-out evaluation ({where}env, {where}protocol): {e}") from e


def eval_requests(
    env: Mapping[str, Any], n: int, max_tokens: int, protocol: Protocol = None
) -> list[RolloutRequest]:
    spec = InferenceSpec(sampling=SamplingConfig(temperature=0.0, max_tokens=max_tokens))
    proto = protocol_spec(protocol, "eval protocol")
    return [
        RolloutRequest(
            env=EnvSpec.from_dict(env),
            protocol=proto,
            env_seed=i,
            sampling_seed=i,
            inference=spec,
            meta={"eval": True},
        )
        for i in range(n)
    ]


async def evaluate_client(
    client: Any, env: Mapping[str, Any], n: int, max_tokens: int, protocol: Protocol = None
) -> dict[str, float]:
    """One greedy pass over the held-out problems with any ChatClient (the inference
    service's, or an in-process HFChatClient on a weight snapshot)."""
    engine = RolloutEngine(*build_registries(client))
    reqs = eval_requests(env, n, max_tokens, protocol)
    ev = Evaluator(engine=engine, requests=reqs, concurrency=64)
    res: dict[str, float] = await ev.evaluate()
    res["eval/policy_version"] = float(await client.get_policy_version())
    return res


async def evaluate(
    url: str,
    env: Mapping[str, Any],
    n: int,
    max_tokens: int,
    api_key: str | None = None,
    protocol: Protocol = None,
) -> dict[str, float]:
    """One greedy pass over the held-out problems against ``url``."""
    client = OpenAIChatClient(url, api_key=api_key, timeout_s=120.0)
    try:
        return await evaluate_client(client, env, n, max_tokens, protocol)
    finally:
        await client.aclose()


def evaluate_snapshot(
    model_dir: str | Path,
    weights: str | Path,
    env: Mapping[str, Any],
    n: int,
    max_tokens: int,
    policy_version: int = 0,
    protocol: Protocol = None,
) -> dict[str, float]:
    """The same pass in this process on a saved weight snapshot (fp32 transformers, the
    learner's dtype: what fp32 serving serves, to ~5e-7 nats). ``ludic up``'s deferred
    curve evaluation, run after the RL phase so it takes nothing from it."""
    # torch and transformers for this in-process pass only: the eval service and the
    # settings that import this module evaluate through inference
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from libludic.inference.hf_client import HFChatClient

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(load_file(str(weights)), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(
            f"snapshot {weights} does not fit {model_dir}: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    client = HFChatClient(
        model=model,
        tokenizer=AutoTokenizer.from_pretrained(str(model_dir)),
        max_batch_size=64,
        policy_version=policy_version,
    )
    return asyncio.run(evaluate_client(client, env, n, max_tokens, protocol))
