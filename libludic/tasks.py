"""Tasks: what a run trains on, as its config writes them, and the check that builds them.

A task (one entry of ``feeder.tasks``) is ``{name, env, protocol, agent, inference, reward,
weight}``; ``TaskSpec.from_dict`` reads it and ``TaskSpec.request`` turns it into
RolloutRequests. ``check_task`` builds everything the task names once, before any model
loads: the env (reset with a seed), the protocol with its agents (agent kind, tools, parser,
context), the parser run on a sample reply, and the reward functions. ``ludic check``, the
start of ``ludic up`` and the feeder, actor and eval services run it, so a misspelt kind,
keyword or import fails in seconds with one message naming the config key, the value and
the choices.

``TaskSpec.key`` is what a request must match to be run by an actor: the run's own tasks
bound what a stream entry may name (an entry naming any other env, protocol, agent or
reward is dead-lettered and nothing it names is imported or opened).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from libludic import plugins
from libludic.envs.env import LudicEnv
from libludic.inference.client import ChatClient
from libludic.inference.request import ChatCompletionRequest, InferenceSpec, ReturnSpec
from libludic.interaction.base import InteractionProtocol
from libludic.parsers import ParseResult, make_parser
from libludic.plugins import PluginError
from libludic.registry import protocol_factory
from libludic.requests import EnvSpec, ProtocolSpec, RewardSpec, RolloutRequest
from libludic.scoring.base import build_reward_fn
from libludic.types import ChatResponse

#: the feeder's (and so the actors') tasks when a config names none
DEFAULT_TASKS: tuple[dict[str, Any], ...] = ({"env": {"kind": "arithmetic", "kwargs": {}}},)
SAMPLE_REPLY = "42"  # what a parser is tried on when the env states no reference completion


@dataclass(frozen=True)
class TaskSpec:
    """One task: what to run (env, protocol with its agent, inference, reward) and how often
    (relative ``weight``)."""

    name: str
    env: EnvSpec
    protocol: ProtocolSpec = field(default_factory=ProtocolSpec)
    inference: InferenceSpec | None = None
    reward: RewardSpec | None = None
    weight: float = 1.0

    KEYS = ("name", "env", "protocol", "agent", "inference", "reward", "weight")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "task") -> TaskSpec:
        """Read one config entry; errors name ``where`` (e.g. ``feeder.tasks[0]``)."""
        if not isinstance(d, Mapping):
            raise PluginError(f"{where} must be a mapping {{name, env, ...}}; got {d!r}")
        unknown = sorted(set(d) - set(cls.KEYS))
        if unknown:
            raise PluginError(f"{where}: unknown key(s) {unknown}; valid keys: {list(cls.KEYS)}")
        env = d.get("env")
        if not isinstance(env, Mapping) or "kind" not in env:
            raise PluginError(f"{where} needs env: {{kind: ..., kwargs: {{...}}}}; got {env!r}")
        unknown = sorted(set(env) - {"kind", "kwargs"})
        if unknown:
            raise PluginError(f"{where}.env: unknown key(s) {unknown}; known: kind, kwargs")
        where = f"{where} ({d.get('name') or env['kind']})"
        w = d.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, int | float) or not w > 0 or math.isinf(w):
            raise PluginError(f"{where}: weight={w!r} must be a number > 0")
        inf = d.get("inference")
        if inf is not None and not isinstance(inf, Mapping):
            raise PluginError(f"{where}: inference must be a mapping {{sampling: {{...}}}}")
        if inf is not None and "return_spec" not in inf:
            # training needs token ids + logprobs; InferenceSpec.from_dict would default to none
            inf = {**inf, "return_spec": ReturnSpec.for_rl().to_dict()}
        proto = dict(d.get("protocol") or {"kind": "single_agent"})
        if d.get("agent") is not None:
            if proto.get("agent") is not None:
                raise PluginError(
                    f"{where} sets agent twice (task agent: and protocol.agent:); keep one"
                )
            proto["agent"] = d["agent"]
        unknown = sorted(set(proto) - {"kind", "kwargs", "agent"})
        if unknown:
            raise PluginError(
                f"{where}.protocol: unknown key(s) {unknown}; known: kind, kwargs, agent"
            )
        try:
            return cls(
                name=str(d.get("name") or env["kind"]),
                env=EnvSpec.from_dict(env),
                protocol=ProtocolSpec.from_dict(proto),
                inference=None if inf is None else InferenceSpec.from_dict(dict(inf)),
                reward=None if d.get("reward") is None else RewardSpec.from_dict(d["reward"]),
                weight=float(w),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PluginError(f"{where}: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "env": self.env.to_dict()}
        d["protocol"] = self.protocol.to_dict()
        if self.inference is not None:
            d["inference"] = self.inference.to_dict()
        if self.reward is not None:
            d["reward"] = self.reward.to_dict()
        d["weight"] = self.weight
        return d

    def request(
        self,
        *,
        id: str,
        env_seed: int | None,
        sampling_seed: int | None,
        num_episodes: int,
        meta: Mapping[str, Any] | None = None,
        same_env_seed: bool = True,
    ) -> RolloutRequest:
        """A RolloutRequest of this task (``meta["task"]`` names it)."""
        return RolloutRequest(
            id=id,
            env=self.env,
            protocol=self.protocol,
            env_seed=env_seed,
            sampling_seed=sampling_seed,
            inference=self.inference,
            num_episodes=num_episodes,
            same_env_seed=same_env_seed,
            meta={**(meta or {}), "task": self.name},
            reward=self.reward,
        )

    def key(self) -> str:
        return request_key(self.env, self.protocol, self.inference, self.reward)


def request_key(
    env: EnvSpec,
    protocol: ProtocolSpec,
    inference: InferenceSpec | None,
    reward: RewardSpec | None,
) -> str:
    """What a request runs, as canonical JSON (equal for a task and its requests after the
    wire round trip)."""
    return json.dumps(
        [
            env.to_dict(),
            protocol.to_dict(),
            None if inference is None else inference.to_dict(),
            None if reward is None else reward.to_dict(),
        ],
        sort_keys=True,
        default=repr,
    )


class TaskSet:
    """The tasks a run's actors may run: ``match(request)`` is the task whose key the
    request's carries, or None."""

    def __init__(self, tasks: Sequence[TaskSpec]) -> None:
        self.tasks = list(tasks)
        self._by_key = {t.key(): t for t in self.tasks}

    def match(self, req: RolloutRequest) -> TaskSpec | None:
        return self._by_key.get(request_key(req.env, req.protocol, req.inference, req.reward))

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tasks]


def parse_tasks(entries: Sequence[Mapping[str, Any]], where: str) -> list[TaskSpec]:
    """``entries`` (a config's task list) as TaskSpecs; names must be unique."""
    if isinstance(entries, str | Mapping) or not isinstance(entries, Sequence) or not entries:
        raise PluginError(f"{where} must be a non-empty list of tasks; got {entries!r}")
    tasks = [TaskSpec.from_dict(d, f"{where}[{i}]") for i, d in enumerate(entries)]
    names = [t.name for t in tasks]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise PluginError(f"{where}: task name(s) {dup} used twice; give each task its own name")
    return tasks


class NoModel:
    """The ChatClient ``check_task`` builds agents with: the check runs no model."""

    async def complete(self, request: ChatCompletionRequest) -> tuple[ChatResponse, dict[str, Any]]:
        raise RuntimeError("check_task builds agents but runs no model")

    def sync_weights(
        self, params: Any, timeout_s: float = 600.0, version: int | None = None
    ) -> str:
        raise RuntimeError("check_task runs no model")

    async def get_policy_version(self) -> int:
        return 0


def make_env(task: TaskSpec, where: str = "task") -> LudicEnv[Any, Any, Any]:
    """The env ``task`` names, built with its kwargs; errors name ``where``'s key."""
    target = plugins.resolve("envs", task.env.kind, where=f"{where}.env.kind")
    plugins.check_kwargs(target, task.env.kwargs, where=f"{where}.env ({task.env.kind})")
    env = plugins.call(target, f"{where}.env ({task.env.kind})", **task.env.kwargs)
    if not isinstance(env, LudicEnv):
        raise PluginError(
            f"{where}.env.kind={task.env.kind!r} built a {type(env).__name__}, not a LudicEnv "
            "(libludic/envs/env.py)"
        )
    return env


def make_protocol(task: TaskSpec, client: ChatClient, where: str = "task") -> InteractionProtocol:
    """The protocol ``task`` names, its agents (of the task's agent kind) on ``client``;
    errors name ``where``'s key."""
    target = plugins.resolve("protocols", task.protocol.kind, where=f"{where}.protocol.kind")
    factory = protocol_factory(client, task.protocol.kind, target)
    extra: dict[str, Any] = {} if task.protocol.agent is None else {"agent": task.protocol.agent}
    try:
        return factory(inference=task.inference, **task.protocol.kwargs, **extra)
    except PluginError as e:
        raise PluginError(f"{where}.protocol: {e}") from e
    except (TypeError, ValueError) as e:
        raise PluginError(f"{where}.protocol ({task.protocol.kind}): {e}") from e


def check_task(
    task: TaskSpec, where: str = "task", seed: int = 0, build_rewards: bool = True
) -> float:
    """Build everything ``task`` names once (module docstring); returns the seconds it took.
    Raises PluginError naming ``where``'s key, the value and the choices.

    ``build_rewards=False`` resolves the reward functions and checks their keywords without
    constructing them: a process that never scores (the feeder) may lack what a reward
    function reads at construction (an API key only the actors are given)."""
    t0 = time.monotonic()
    where = f"{where} ({task.name})"
    env = make_env(task, where)
    try:
        try:
            env.reset(seed=seed)
        except Exception as e:  # the user's env: its failure is the message
            raise PluginError(
                f"{where}.env ({task.env.kind}): reset(seed={seed}) raised {type(e).__name__}: {e}"
            ) from e
        reference = getattr(env, "reference_completion", None)
        sample = SAMPLE_REPLY
        if callable(reference):
            try:
                sample = str(reference())
            except Exception:  # a reference is optional: the fixed sample reply then
                sample = SAMPLE_REPLY
    finally:
        env.close()
    make_protocol(task, NoModel(), where)
    parser = make_parser(
        task.protocol.kwargs.get("parser"), where=f"{where}.protocol.kwargs.parser"
    )
    try:
        parsed = parser(sample)
    except Exception as e:  # the user's parser: its failure is the message
        raise PluginError(
            f"{where}.protocol.kwargs.parser raised {type(e).__name__} on the sample reply "
            f"{sample!r}: {e}"
        ) from e
    if not isinstance(parsed, ParseResult):
        raise PluginError(
            f"{where}.protocol.kwargs.parser returned {type(parsed).__name__}, not a ParseResult"
        )
    for f in task.reward.functions if task.reward is not None else ():
        label = f"{where}.reward.functions[{f.name}]"
        if build_rewards:
            build_reward_fn(f, NoModel(), where=f"{where}.reward")
            continue
        target = plugins.resolve("rewards", f.kind, where=f"{label}.kind")
        kwargs = (
            {"client": None, **f.kwargs} if "client" in plugins.parameters(target)[0] else f.kwargs
        )
        injected = () if isinstance(target, type) else plugins.parameters(target)[0][:1]
        plugins.check_kwargs(target, kwargs, where=f"{label} ({f.kind})", injected=injected)
    return time.monotonic() - t0
