"""What a task gives supervised training (``run_sft``): prompt/completion pairs to train on,
and greedy checks (``GreedyCheck``) for the target stop and the held-out report.

A task is any env that states its reference completion (``ReferenceEnv``,
libludic/envs/reference.py) built from the env registry (``env_task``):

- training pairs: ``env`` at seeds ``train_seed_base + i``, its observation as the prompt
  and ``reference_completion()`` as the completion, minus any prompt among the held-out
  problems (so no seed arithmetic can leak one into training);
- ``check`` (what a target stop measures): ``env`` at ``check_seeds``, never the held-out
  problems;
- ``held_out(n)``: ``held_out_env`` (default ``env``) at seeds ``0..n-1``, the seeds
  ``ludic up`` and ``ludic eval`` evaluate on; give it its own split or file when the two
  envs would otherwise share problems;
- scored by the env's ``score_completion`` (1.0 = passed).

``TASKS`` names what ``ludic sft --task KIND --task-arg K=V`` and ``up.sft_task`` (a kind, or
``{kind, kwargs}``) accept: ``env`` takes ``env_task``'s arguments as they are, ``tool``
``tool_task``'s (tool use: an env that states the tool call solving each problem), and an
env may name its own task with defaults (``arithmetic``, the demo's:
``libludic.envs.arithmetic.sft_task``). Any other dataset is a JSONL file (``ludic sft
--data``): one ``{"prompt": ..., "completion": ...}`` or ``{"messages": [...]}`` record
per line.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from libludic import plugins
from libludic.agents.tool_agent import tool_call_text, tool_result_message
from libludic.envs import arithmetic
from libludic.envs.reference import ReferenceEnv, ToolReferenceEnv
from libludic.eval.greedy import GreedyCheck
from libludic.registry import default_env_registry
from libludic.requests import EnvSpec
from libludic.types import Message

TRAIN_SEED_BASE = 10_000_000
CHECK_SEEDS = range(20_000_000, 20_000_200)
MAX_HELD_OUT = 200  # held-out problems a task keeps out of its training data
# a greedy answer's budget beyond its reference's UTF-8 bytes (a token is at least a byte)
ANSWER_SLACK_TOKENS = 3


@dataclass(frozen=True)
class SFTTask:
    """``write(path, n)`` writes up to ``n`` training records to ``path`` (JSONL) and returns
    how many; ``check`` is what a target stop measures; ``held_out(n)`` the first ``n``
    held-out problems (at most ``max_held_out``)."""

    name: str
    write: Callable[[Path, int], int]
    check: GreedyCheck
    held_out: Callable[[int], GreedyCheck]
    max_held_out: int

    def data_in(self, out_dir: Path, n: int) -> Path:
        """Write up to ``n`` training records to ``out_dir/sft_train.jsonl``; its path."""
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "sft_train.jsonl"
        self.write(path, n)
        return path


def record(prompt: str, completion: str) -> dict[str, str]:
    return {"prompt": prompt, "completion": completion}


def build_env(spec: Mapping[str, Any], where: str) -> ReferenceEnv:
    """The env ``spec`` ({kind, kwargs}) names, from the built-in registry; it must state
    its reference completions."""
    env_spec = EnvSpec.from_dict(dict(spec))
    registry = default_env_registry()
    if env_spec.kind not in registry:
        raise ValueError(f"{where}: unknown env kind {env_spec.kind!r}; known: {sorted(registry)}")
    env = registry[env_spec.kind](**env_spec.kwargs)
    if not isinstance(env, ReferenceEnv):
        env.close()
        raise ValueError(
            f"{where}: env {env_spec.kind!r} states no reference completion, so it gives no "
            "supervised data; give the env reference_completion() and score_completion() "
            "(libludic/envs/reference.py) or train on a JSONL file"
        )
    return env


def takes_prompt(env: ReferenceEnv) -> bool:
    """Whether ``env.score_completion`` judges an answer against its problem as well
    (``score_completion(completion, reference, prompt)``)."""
    return "prompt" in inspect.signature(env.score_completion).parameters


def pairs(env: ReferenceEnv, seeds: Sequence[int]) -> Iterator[tuple[str, str]]:
    """(prompt, reference completion) of ``env`` at each seed."""
    for s in seeds:
        obs, _ = env.env_reset(seed=s)
        yield str(obs), env.reference_completion()


def env_task(
    env: Mapping[str, Any],
    held_out_env: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    max_new_tokens: int | None = None,
    train_seed_base: int = TRAIN_SEED_BASE,
    check_seeds: Sequence[int] = CHECK_SEEDS,
    max_held_out: int = MAX_HELD_OUT,
) -> SFTTask:
    """The supervised task of the env ``env`` ({kind, kwargs}; module docstring).
    ``max_new_tokens``, a greedy answer's budget, defaults to the longest check reference in
    UTF-8 bytes plus ``ANSWER_SLACK_TOKENS``."""
    train = build_env(env, "sft task env")
    held = build_env(held_out_env if held_out_env is not None else env, "sft task held_out_env")
    check_problems = list(pairs(train, check_seeds))
    if max_new_tokens is None:
        longest = max(len(ref.encode()) for _, ref in check_problems)
        max_new_tokens = longest + ANSWER_SLACK_TOKENS
    budget = max_new_tokens

    def held_out(n: int) -> GreedyCheck:
        if not 0 < n <= max_held_out:
            raise ValueError(f"held-out problems: n={n} must be in [1, {max_held_out}]")
        return GreedyCheck(
            list(pairs(held, range(n))),
            held.score_completion,
            budget,
            takes_prompt=takes_prompt(held),
        )

    def write(path: Path, n: int) -> int:
        exclude = {q for q, _ in held_out(max_held_out).problems}
        written = 0
        with open(path, "w", encoding="utf-8") as f:
            for prompt, completion in pairs(train, range(train_seed_base, train_seed_base + n)):
                if prompt not in exclude:
                    f.write(json.dumps(record(prompt, completion)) + "\n")
                    written += 1
        return written

    return SFTTask(
        name=name or f"env {EnvSpec.from_dict(dict(env)).kind}",
        write=write,
        check=GreedyCheck(
            check_problems, train.score_completion, budget, takes_prompt=takes_prompt(train)
        ),
        held_out=held_out,
        max_held_out=max_held_out,
    )


def tool_demonstrations(
    env: ToolReferenceEnv, seeds: Sequence[int], where: str
) -> Iterator[tuple[str, str, list[Message]]]:
    """(prompt, tool call text, the whole demonstration) of ``env`` at each seed: the user's
    prompt, the assistant's tool call, the tool's answer (the tool run for real), the
    assistant's reference completion."""
    for s in seeds:
        obs, _ = env.env_reset(seed=s)
        name, arguments = env.reference_tool_call()
        tool = plugins.resolve("tools", name, where=f"{where} tool")
        call = tool_call_text(name, arguments)
        demo: list[Message] = [
            {"role": "user", "content": str(obs)},
            {"role": "assistant", "content": call},
            tool_result_message(name, str(tool(**arguments))),
            {"role": "assistant", "content": env.reference_completion()},
        ]
        yield str(obs), call, demo


def tool_task(
    env: Mapping[str, Any],
    held_out_env: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    train_seed_base: int = TRAIN_SEED_BASE,
    check_seeds: Sequence[int] = CHECK_SEEDS,
    max_held_out: int = MAX_HELD_OUT,
) -> SFTTask:
    """Tool use of the env ``env`` ({kind, kwargs}), which states the tool call solving each
    problem (``ToolReferenceEnv``: ``reference_tool_call``). Each problem gives two records:
    the prompt -> the tool call, and the prompt, the call and the tool's answer -> the
    reference completion (what a ToolAgent with ``describe_tools: false`` sees at each of
    its two model calls). Checks (target stop, held-out): the greedy first turn is exactly
    the tool call."""

    def tool_env(spec: Mapping[str, Any], key: str) -> ToolReferenceEnv:
        e = build_env(spec, f"sft task {key}")
        if not isinstance(e, ToolReferenceEnv):
            raise ValueError(
                f"sft task tool {key}: {type(e).__name__} states no tool call; give it "
                "reference_tool_call() (libludic/envs/reference.py ToolReferenceEnv)"
            )
        return e

    train = tool_env(env, "env")
    held = tool_env(held_out_env if held_out_env is not None else env, "held_out_env")

    def calls(e: ToolReferenceEnv, seeds: Sequence[int], where: str) -> list[tuple[str, str]]:
        return [(p, c) for p, c, _ in tool_demonstrations(e, seeds, where)]

    def exact(answer: str, reference: str) -> float:
        return 1.0 if answer.strip() == reference else 0.0

    check_problems = calls(train, check_seeds, "sft task env")
    budget = max(len(c.encode()) for _, c in check_problems) + ANSWER_SLACK_TOKENS

    def held_out(n: int) -> GreedyCheck:
        if not 0 < n <= max_held_out:
            raise ValueError(f"held-out problems: n={n} must be in [1, {max_held_out}]")
        return GreedyCheck(calls(held, range(n), "sft task held_out_env"), exact, budget)

    def write(path: Path, n: int) -> int:
        exclude = {q for q, _ in held_out(max_held_out).problems}
        seeds = range(train_seed_base, train_seed_base + (n + 1) // 2)
        written = 0
        with open(path, "w", encoding="utf-8") as f:
            for prompt, _, demo in tool_demonstrations(train, seeds, "sft task env"):
                if prompt in exclude:
                    continue
                for messages in (demo[:2], demo):  # the call; then the answer after the tool's
                    f.write(json.dumps({"messages": messages}) + "\n")
                    written += 1
        return written

    return SFTTask(
        name=name or f"tool use of env {EnvSpec.from_dict(dict(env)).kind}",
        write=write,
        check=GreedyCheck(check_problems, exact, budget),
        held_out=held_out,
        max_held_out=max_held_out,
    )


def _arithmetic(**kwargs: Any) -> SFTTask:
    return env_task(**arithmetic.sft_task(**kwargs))


#: task kind -> the task it builds from its kwargs
TASKS: dict[str, Callable[..., SFTTask]] = {
    "env": env_task,
    "tool": tool_task,
    "arithmetic": _arithmetic,  # the demo's, kept with its env
}


def task_spec(spec: str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(kind, kwargs) of a task named by ``spec``: a kind, ``{kind, kwargs}``, or that
    mapping as YAML/JSON text (``LUDIC_SFT_TASK``); errors name the valid kinds."""
    if isinstance(spec, str) and spec.strip().startswith("{"):
        spec = yaml.safe_load(spec)
    if isinstance(spec, str):
        kind, kwargs = spec, {}
    elif isinstance(spec, Mapping) and "kind" in spec and set(spec) <= {"kind", "kwargs"}:
        kind, kwargs = str(spec["kind"]), dict(spec.get("kwargs") or {})
    else:
        raise ValueError(
            f"sft task {spec!r}: give a kind or {{kind, kwargs}}, e.g. {{kind: arithmetic, "
            "kwargs: {digits: 3}}"
        )
    if kind not in TASKS:
        raise ValueError(f"sft task kind {kind!r}: use one of {sorted(TASKS)}")
    return kind, kwargs


def make_task(spec: str | Mapping[str, Any]) -> SFTTask:
    """The task ``spec`` names (``task_spec``), built; a kwarg its kind does not take is an
    error naming the kind."""
    kind, kwargs = task_spec(spec)
    try:
        return TASKS[kind](**kwargs)
    except TypeError as e:
        raise ValueError(f"sft task {kind!r} with kwargs {kwargs}: {e}") from e
