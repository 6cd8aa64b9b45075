"""The held-out evaluation, shared by ``ludic eval`` and ``ludic up``: eval sets, their
start-up check, and one pass over them against a ChatClient.

A set (libludic/eval/sets.py ``EvalSet``) runs its ``n`` problems greedily (and ``k``
samples each at its temperature) against one inference service's current weights, by its
``protocol`` (``{kind, kwargs[, agent]}`` like a feeder task's: a task whose env prompts a
chat model and whose parser extracts its answer is evaluated with the same parser; None:
``single_agent`` with the identity parser). Its result is the figures of
libludic/eval/metrics.py plus ``policy_version`` (what the service reported right after its
pass) and ``seconds`` (its wall time). Several sets flatten (:func:`flatten`) into
``eval/<set>/<figure>``, the first set's also as ``eval/<figure>``: the run's headline
figures (``eval/pass_rate``), what a one-set run always reported.

``up.eval_sets`` (``eval.sets``) lists the sets; when it is empty the single-set keys
``eval_env``, ``eval_protocol``, ``eval_n`` and ``eval_max_tokens`` make one set named
``heldout`` (:func:`eval_sets`). :data:`DEFAULTS` are the launcher's ``up.eval_*``
defaults, which the eval service falls back to as well.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from libludic.agents.config import validate_agent_config
from libludic.eval.evaluator import Evaluator
from libludic.eval.metrics import FIGURES, set_figures
from libludic.eval.sets import EvalSet
from libludic.inference.openai_client import OpenAIChatClient
from libludic.parsers import make_parser
from libludic.plugins import PluginError
from libludic.registry import build_registries
from libludic.requests import EnvSpec, ProtocolSpec, RolloutRequest
from libludic.rollout.engine import RolloutEngine
from libludic.tasks import TaskSpec, check_task
from libludic.types import Rollout

Protocol = Mapping[str, Any] | None

# up.<key>: its default (UpSettings' fields, and the eval service's fallbacks)
DEFAULTS: Mapping[str, Any] = {
    "eval_env": {"kind": "arithmetic", "kwargs": {"split": "eval"}},
    "eval_protocol": None,
    "eval_n": 200,
    "eval_every_steps": 10,
    "eval_max_tokens": 8,
    "eval_sets": [],
}
DEFAULT_SET = "heldout"  # the name of the one set the single-set keys make
# what a set may not be called: a figure's name, which eval/<name>/... would shadow
RESERVED = frozenset((*FIGURES, "policy_version", "seconds"))


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


def eval_sets(
    sets: Sequence[Any],
    env: Mapping[str, Any] | None,
    protocol: Protocol,
    n: int,
    max_tokens: int,
    *,
    sets_key: str,
    prefix: str,
    check: bool = True,
) -> list[EvalSet]:
    """The sets to evaluate: each entry of ``sets`` (config key ``sets_key``, e.g.
    ``up.eval_sets``), or, when it is empty, one set ``heldout`` of the single-set keys
    (named ``<prefix>env`` ... in errors, e.g. ``up.eval_env``). ``check``: build each set's
    env, protocol, agents and parser once (:func:`check_eval`), so that a bad one stops the
    start-up."""
    if not isinstance(sets, Sequence) or isinstance(sets, str | bytes):
        raise ValueError(f"{sets_key}={sets!r} must be a list of sets {{name, env, ...}}")
    if sets:
        out = [EvalSet.from_dict(d, f"{sets_key}[{i}]") for i, d in enumerate(sets)]
    else:
        if not isinstance(env, Mapping) or "kind" not in env:
            raise ValueError(f"{prefix}env={env!r} must be a mapping with 'kind' (and 'kwargs')")
        out = [EvalSet(DEFAULT_SET, env, protocol, n, max_tokens, where=prefix)]
    seen: set[str] = set()
    for s in out:
        if s.name in RESERVED or s.name in seen:
            why = "names another set too" if s.name in seen else "is a figure's name"
            raise ValueError(f"{s.where}name={s.name!r} {why}; give each set a name of its own")
        seen.add(s.name)
    if check:
        for s in out:
            check_eval(s.env, s.protocol, s.where)
    return out


def eval_requests(
    env: Mapping[str, Any], n: int, max_tokens: int, protocol: Protocol = None
) -> list[RolloutRequest]:
    """The greedy requests of a one-env evaluation (env seeds 0..n-1, temperature 0)."""
    protocol_spec(protocol, "eval protocol")
    return EvalSet(DEFAULT_SET, env, protocol, n, max_tokens).greedy_requests()


async def evaluate_set(client: Any, s: EvalSet) -> dict[str, float]:
    """One pass of set ``s`` with any ChatClient (the inference service's, or an in-process
    HFChatClient on a weight snapshot): its figures, ``policy_version`` and ``seconds``."""
    t0 = time.monotonic()
    engine = RolloutEngine(*build_registries(client))

    async def run(reqs: list[RolloutRequest]) -> list[Rollout]:
        if not reqs:
            return []
        ev = Evaluator(engine=engine, requests=reqs, max_steps=s.max_steps, concurrency=64)
        return await ev.rollouts()

    greedy = await run(s.greedy_requests())
    samples = await run(s.sample_requests())
    res = set_figures(greedy, samples, pass_threshold=s.pass_threshold, roles=s.roles)
    res["policy_version"] = float(await client.get_policy_version())
    res["seconds"] = time.monotonic() - t0
    return res


async def evaluate_sets_client(client: Any, sets: Sequence[EvalSet]) -> dict[str, float]:
    """Every set in turn, flattened (:func:`flatten`)."""
    return flatten({s.name: await evaluate_set(client, s) for s in sets})


def flatten(per_set: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """``{set: {figure: v}}`` -> ``eval/<set>/<figure>``, and the first set's figures again
    as ``eval/<figure>``."""
    out: dict[str, float] = {}
    for i, (name, figures) in enumerate(per_set.items()):
        if i == 0:
            out.update({f"eval/{k}": v for k, v in figures.items()})
        out.update({f"eval/{name}/{k}": v for k, v in figures.items()})
    return out


def split(flat: Mapping[str, Any], names: Sequence[str]) -> dict[str, dict[str, float]]:
    """:func:`flatten`'s inverse for the sets ``names``: ``{set: {figure: v}}`` (a set the
    result does not hold maps to ``{}``)."""
    out: dict[str, dict[str, float]] = {}
    for name in names:
        p = f"eval/{name}/"
        out[name] = {k[len(p) :]: float(v) for k, v in flat.items() if k.startswith(p)}
    return out


async def evaluate_client(
    client: Any, env: Mapping[str, Any], n: int, max_tokens: int, protocol: Protocol = None
) -> dict[str, float]:
    """One greedy pass over one env's held-out problems, as ``eval/<figure>``."""
    res = await evaluate_set(client, EvalSet(DEFAULT_SET, env, protocol, n, max_tokens))
    return {f"eval/{k}": v for k, v in res.items()}


async def evaluate(
    url: str,
    env: Mapping[str, Any],
    n: int,
    max_tokens: int,
    api_key: str | None = None,
    protocol: Protocol = None,
) -> dict[str, float]:
    """One greedy pass over one env's held-out problems against ``url``."""
    client = OpenAIChatClient(url, api_key=api_key, timeout_s=120.0)
    try:
        return await evaluate_client(client, env, n, max_tokens, protocol)
    finally:
        await client.aclose()


async def evaluate_sets(
    url: str, sets: Sequence[EvalSet], api_key: str | None = None
) -> dict[str, float]:
    """Every set against ``url``, flattened (:func:`flatten`)."""
    client = OpenAIChatClient(url, api_key=api_key, timeout_s=120.0)
    try:
        return await evaluate_sets_client(client, sets)
    finally:
        await client.aclose()


def evaluate_served(
    url: str, sets: Sequence[EvalSet], api_key: str | None = None
) -> dict[str, float]:
    """:func:`evaluate_sets` from synchronous code (``ludic up``'s before/curve/after)."""
    return asyncio.run(evaluate_sets(url, sets, api_key))


def evaluate_snapshot(
    model_dir: str | Path,
    weights: str | Path,
    sets: Sequence[EvalSet],
    policy_version: int = 0,
) -> dict[str, float]:
    """The same sets, flattened, in this process on a saved weight snapshot (fp32 transformers, the
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
    return asyncio.run(evaluate_sets_client(client, sets))
