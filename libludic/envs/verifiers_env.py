"""VerifiersEnv: an environment of ``verifiers`` 0.4.0 (prime-rl's library) as a LudicEnv.

verifiers runs a rollout by launching a harness program that calls the model through its
interception server. Here the actor owns every model call (its client samples and records
token ids and logprobs), so the adapter keeps the environment and replaces only the seat
the policy plays: ``agents.<role>.interaction(task).turn(message)`` hands ``message`` to
the caller as the next observation and answers with the caller's next action. The rest is
verifiers' own: the taskset's tasks, the env's ``run()`` (a plain taskset plays under
verifiers' ``SingleAgentEnv``: one reply), ``Task.score`` (``@vf.reward``, ``@vf.metric``,
plugged judges), trace ``@vf.stop`` hooks, the seat's ``max_turns`` and ``Env.finalize``.

Episode: ``reset(seed)`` takes task ``seed % len(taskset)`` (an infinite taskset's
``seed``-th; None: task 0); the observation is its prompt, its system prompt is
``suggested_system_prompt``. The first step starts the env's ``run()`` with that reply
(so its coroutines run on the caller's event loop, in its thread: verifiers' scoring
helpers such as math-verify time out with signals, which work in the main thread only).
Each step is one reply; the env answers with its next user turn (reward 0) or ends the
episode, whose last step carries

    r = sum_traces sum_k weight_k * score_k        (verifiers' ``Trace.reward``)

with the named scores in ``info["vf_rewards"]`` and the metrics in ``info["vf_metrics"]``.

Refused, with the reason: tasks without a prompt (the env would open the conversation,
which a synchronous ``reset`` cannot wait for), an env whose ``run()`` opens with another
prompt than the task's, tools (toolsets, MCP), tasks that need a runtime or a container
(``setup``/``finalize`` hooks, rewards taking ``runtime``), request/response stops and
intercepts, and a second seat a model must play (user simulators, judge seats).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

try:
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.dialects import parse_message
    from verifiers.v1.session import call_hook, hook_boundary
    from verifiers.v1.state import state_cls
    from verifiers.v1.types import content_text
    from verifiers.v1.utils.decorators import discover_decorated
except ImportError as e:
    raise ImportError(
        f"the verifiers env kind needs verifiers 0.4.0, which is not importable ({e}); "
        "pip install libludic[verifiers] (in its own virtualenv: scripts/adapter-venvs.sh)",
        name="verifiers",
    ) from e

from libludic.envs.single_agent_env import SingleAgentEnv
from libludic.types import Info, Obs, StepOutcome

_loaded_lock = threading.Lock()
_loaded: dict[str, tuple[Any, _Tasks]] = {}


class _Tasks:
    """A taskset's tasks by index; an infinite one is read as far as asked, once."""

    def __init__(self, taskset: Any) -> None:
        self.bounded = bool(taskset.bounded)
        self._iter: Iterator[Any] = iter(taskset)
        self._seen: list[Any] = list(self._iter) if self.bounded else []
        if self.bounded and not self._seen:
            raise ValueError(f"taskset {taskset.config.id!r} yields no tasks")

    def __getitem__(self, i: int) -> Any:
        if self.bounded:
            return self._seen[i % len(self._seen)]
        if i >= len(self._seen):
            self._seen.extend(itertools.islice(self._iter, i + 1 - len(self._seen)))
        return self._seen[i]


def _load(config: dict[str, Any]) -> tuple[Any, _Tasks]:
    """(verifiers Env, its tasks), once per config: the engine builds an env per episode,
    a verifiers Env serves any number of episodes."""
    key = json.dumps(config, sort_keys=True, default=repr)
    with _loaded_lock:
        if key not in _loaded:
            env = vf.load_environment(vf.resolve_env_config(config))
            _loaded[key] = (env, _Tasks(env.taskset))
        return _loaded[key]


def _text(message: Any) -> str:
    return content_text(message.content) if message.content is not None else ""


def _opening(data: Any) -> list[Any]:
    """The messages a prompted task opens with: its system prompt, then its prompt."""
    out: list[Any] = []
    if data.system_prompt:
        out.append(vf.SystemMessage(content=data.system_prompt))
    if isinstance(data.prompt, str):
        out.append(vf.UserMessage(content=data.prompt))
    elif data.prompt is not None:
        out.extend(data.prompt)
    return out


def _render(messages: list[Any]) -> tuple[str | None, str]:
    """(system prompt or None, observation text) of messages shown to the seat: user turns
    joined by blank lines; any other role as ``[role]`` blocks."""
    system = [_text(m) for m in messages if m.role == "system"]
    rest = [m for m in messages if m.role != "system"]
    if all(m.role == "user" for m in rest):
        obs = "\n\n".join(_text(m) for m in rest)
    else:
        obs = "\n\n".join(f"[{m.role}]\n{_text(m)}" for m in rest)
    return ("\n\n".join(system) if system else None), obs


def _requires_runtime(fn: Any) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def unsupported(task: Any, taskset: Any) -> list[str]:
    """Why the adapter cannot play ``task`` (empty: it can)."""
    why = []
    name = type(task).__name__
    if task.data.prompt is None:
        why.append(f"{name} has no prompt (its env opens the conversation)")
    if type(task).NEEDS_CONTAINER:
        why.append(f"{name} needs a container runtime (NEEDS_CONTAINER)")
    if task.toolsets(task.config) or type(taskset).toolsets(taskset.config):
        why.append(f"{name} gives the model tools (toolsets): tool calls are not bridged")
    for hook in ("setup", "finalize"):
        if getattr(type(task), hook) is not getattr(vf.Task, hook):
            why.append(f"{name}.{hook} runs in a runtime")
    scoring = [*task.hooks("reward"), *task.hooks("metric")]
    scoring += [j.score for j in task.plugged_judges()]
    needs = [getattr(fn, "__name__", repr(fn)) for fn in scoring if _requires_runtime(fn)]
    if needs:
        why.append(f"scoring functions {needs} take a runtime")
    for fn in task.hooks("stop"):
        if hook_boundary(fn, allow_trace=True) is not vf.Trace:
            why.append(f"stop {fn.__name__} reads a Request/Response (only Trace stops run)")
    if discover_decorated(task, "intercept"):
        why.append(f"{name} has @vf.intercept hooks (requests are not intercepted)")
    return why


@dataclass
class _Turn:
    """The env asks the seat for a reply to ``obs``, or (``done``) its run ended."""

    obs: str = ""
    done: bool = False


@dataclass
class _Episode:
    """One episode: the env's ``run()`` as a task on the caller's loop, fed the caller's
    actions through ``actions`` and answering each with the next ``turns`` entry."""

    env: Any
    task: Any
    role: str
    opening: tuple[str | None, str]
    traces: list[Any] = field(default_factory=list)
    actions: asyncio.Queue[str] = field(default_factory=asyncio.Queue)
    turns: asyncio.Queue[_Turn | BaseException] = field(default_factory=asyncio.Queue)
    running: asyncio.Task[None] | None = None
    asked: int = 0

    async def answer(self, action: str) -> _Turn:
        """Give the env ``action``; its next turn (or the end) comes back."""
        self.actions.put_nowait(action)
        if self.running is None:
            self.running = asyncio.create_task(self._play())
        turn = await self.turns.get()
        if isinstance(turn, BaseException):
            raise turn
        return turn

    async def _play(self) -> None:
        try:
            agents = _Agents(self)
            await self.env.setup(agents)
            await self.env.run(self.task, agents)
            if not self.traces:
                raise RuntimeError(
                    f"{type(self.env).__name__}.run() never let seat {self.role!r} speak"
                )
            episode = vf.Episode(
                env=vf.EnvInfo(id=self.env.config.env_id),
                task=vf.TraceTask(
                    type=type(self.task).__name__,
                    data=self.task.data,
                    key=self.task.key,
                    hash=self.task.hash,
                ),
                traces=self.traces,
            )
            await self.env.finalize(self.task, episode)
        except Exception as e:  # the caller raises it: the episode fails
            self.turns.put_nowait(e)
            return
        self.turns.put_nowait(_Turn(done=True))

    async def ask(self, messages: list[Any]) -> str:
        """The seat's side: show ``messages``, wait for the caller's action. The first
        turn's messages were the reset's observation; the reply to them is already here."""
        seen = _render(messages)
        self.asked += 1
        if self.asked == 1:
            if seen != self.opening:
                raise RuntimeError(
                    f"{type(self.env).__name__}.run() opened with {seen!r}, not the task's "
                    f"prompt {self.opening!r} the reset showed; VerifiersEnv cannot play it"
                )
        else:
            system, obs = seen  # a system message mid-way is shown as text
            self.turns.put_nowait(_Turn(obs if system is None else f"{system}\n\n{obs}"))
        return await self.actions.get()


class _Agents:
    """``agents`` as ``Env.run`` sees it: the policy's seat, and stand-ins for the others
    that accept settings (``trainable``) but refuse to play."""

    def __init__(self, episode: _Episode) -> None:
        roles = agent_config_fields(episode.env.config)
        self._seats = {
            name: _Seat(episode, name, cfg) if name == episode.role else _Absent(name, episode.role)
            for name, cfg in roles.items()
        }

    def __getattr__(self, name: str) -> Any:
        seats = self.__dict__.get("_seats") or {}
        if name not in seats:
            raise AttributeError(f"no agent {name!r}; this config declares {sorted(seats)}")
        return seats[name]


@dataclass
class _Absent:
    name: str
    role: str
    trainable: bool = True

    def __getattr__(self, attr: str) -> Any:
        raise RuntimeError(
            f"the env's run() asked seat {self.name!r} to {attr}; VerifiersEnv plays only "
            f"the policy's seat {self.role!r}, and no model plays {self.name!r}"
        )


class _Seat:
    """The policy's seat: verifiers' ``Agent`` surface that ``Env.run`` uses."""

    def __init__(self, episode: _Episode, name: str, config: Any) -> None:
        self.episode = episode
        self.name = name
        self.config = config
        self.trainable = True

    async def run(self, task: Any, **kwargs: Any) -> Any:
        """One reply to the task's prompt (verifiers' one-segment run)."""
        async with self.interaction(task, **kwargs) as exchange:
            await exchange.turn()
            exchange.trace.stop("agent_completed")
        return exchange.trace

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any, **kwargs: Any) -> AsyncIterator[_Exchange]:
        """The exchange; leaving it scores the trace (``Task.score``), as verifiers does."""
        given = sorted(k for k, v in kwargs.items() if v not in (None, False))
        if given:
            raise RuntimeError(f"VerifiersEnv does not support interaction/run options {given}")
        trace = vf.Trace(
            task=vf.TraceTask(
                type=type(task).__name__, data=task.data, key=task.key, hash=task.hash
            ),
            agent=vf.AgentInfo(config=self.config, name=self.name, trainable=self.trainable),
            state=state_cls(type(task))(),
        )
        exchange = _Exchange(self, task, trace)
        try:
            yield exchange
        except Exception as e:
            trace.record_error(e)
            raise
        if not trace.is_completed:
            trace.stop("user_closed")
        await task.score(trace)
        trace.ok = not trace.errors
        self.episode.traces.append(trace)


class _Exchange:
    """verifiers' ``Interaction`` over the caller: ``turn(message)`` is one step."""

    def __init__(self, seat: _Seat, task: Any, trace: Any) -> None:
        self.seat = seat
        self.task = task
        self.trace = trace
        self.started = False
        self.over = False
        self.stops = task.hooks("stop")

    def _add(self, message: Any, sampled: bool) -> None:
        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(vf.MessageNode(parent=parent, message=message, sampled=sampled))

    async def turn(self, message: Any = None) -> Any:
        data = self.task.data
        if self.over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        prompted = not self.started and data.prompt is not None
        if message is None and not prompted:
            raise ValueError("a bare turn() takes a prompted task's opening reply only")
        if message is not None and prompted:
            raise ValueError("the task's prompt opens this exchange: take its reply with turn()")
        if self.trace.stop_condition is not None:
            self.over = True
            return vf.Segment(messages=[], terminated=True)
        new = [] if self.started else _opening(data)
        if isinstance(message, str):
            new.append(vf.UserMessage(content=message))
        elif message is not None:
            new.extend(parse_message(m) if isinstance(m, dict) else m for m in message)
        self.started = True
        for m in new:
            self._add(m, sampled=False)
        reply = vf.AssistantMessage(content=await self.seat.episode.ask(new))
        self._add(reply, sampled=True)
        max_turns = self.seat.config.max_turns
        if max_turns is not None and self.trace.num_turns >= max_turns:
            self.trace.stop("max_turns")
        for stop in self.stops:
            if await call_hook(stop, {vf.Trace: self.trace}):
                self.trace.stop(stop.__name__)
        return vf.Segment(messages=[reply])


class VerifiersEnv(SingleAgentEnv):
    """A verifiers taskset (``taskset``: the id ``vf-eval`` takes, an installed module
    exporting its ``Taskset`` in ``__all__``; ``taskset_args``: its config's fields) under
    its own env or the one ``env_id`` names (``env_args``: the env config's other fields).
    ``role``: the seat the policy plays (default: the only one). ``timeout_s`` bounds each
    wait for the env (its run up to the next turn, scoring).

    An episode is stepped on one event loop: ``astep`` on the caller's, or ``step`` (no
    loop running) on one the env keeps."""

    def __init__(
        self,
        taskset: str,
        taskset_args: Mapping[str, Any] | None = None,
        env_id: str = "",
        env_args: Mapping[str, Any] | None = None,
        role: str | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        config = {
            **dict(env_args or {}),
            "id": env_id,
            "taskset": {**dict(taskset_args or {}), "id": taskset},
        }
        try:
            self.env, self.tasks = _load(config)
        except ModuleNotFoundError as e:
            raise ValueError(f"verifiers taskset {taskset!r} or env {env_id!r}: {e}") from e
        except Exception as e:  # pydantic's ValidationError names the bad field
            raise ValueError(f"verifiers config {config}: {e}") from e
        roles = sorted(agent_config_fields(self.env.config))
        if role is None and len(roles) != 1:
            raise ValueError(f"{type(self.env).__name__} has seats {roles}; choose one as role")
        self.role = role if role is not None else roles[0]
        if self.role not in roles:
            raise ValueError(f"role={self.role!r} is not a seat of {type(self.env).__name__}")
        self.timeout_s = timeout_s
        self._episode: _Episode | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._obs = ""
        self._system: str | None = None

    @property
    def suggested_system_prompt(self) -> str | None:
        """The current task's system prompt (after reset)."""
        return self._system

    def env_reset(self, *, seed: int | None = None) -> tuple[Obs, Info]:
        self.close()
        task = self.tasks[0 if seed is None else seed]
        why = unsupported(task, self.env.taskset)
        if why:
            raise ValueError(f"VerifiersEnv cannot play task {task.data.idx}: {'; '.join(why)}")
        self._system, self._obs = _render(_opening(task.data))
        self._episode = _Episode(self.env, task, self.role, (self._system, self._obs))
        info = {"vf_task": {"idx": task.data.idx, "id": task.data.id, "name": task.data.name}}
        return self._obs, info

    def _outcome(self, turn: _Turn) -> StepOutcome:
        if not turn.done:
            self._obs = turn.obs
            return StepOutcome(obs=turn.obs, reward=0.0)
        assert self._episode is not None
        traces = self._episode.traces
        self._episode = None
        self._obs = ""
        rewards = [(k, r) for t in traces for k, r in t.rewards.items()]
        info: Info = {
            "vf_rewards": {k: None if r is None else r.score for k, r in rewards},
            "vf_weights": {k: None if r is None else r.weight for k, r in rewards},
            "vf_metrics": {k: v for t in traces for k, v in t.metrics.items()},
            "vf_stop": [t.stop_condition for t in traces],
        }
        return StepOutcome(obs="", reward=sum(t.reward for t in traces), terminated=True, info=info)

    async def astep(self, actions: dict[str, str]) -> dict[str, StepOutcome]:
        """One reply: the env runs on the caller's loop until its next turn or its end."""
        if self.agent_id not in actions:
            raise KeyError(f"VerifiersEnv.astep got {sorted(actions)}; expected {self.agent_id!r}")
        if self._episode is None:
            raise RuntimeError("VerifiersEnv: step() before reset() or after the episode ended")
        try:
            turn = await asyncio.wait_for(
                self._episode.answer(actions[self.agent_id]), self.timeout_s
            )
        except TimeoutError:
            self.close()
            raise TimeoutError(
                f"{type(self.env).__name__} took longer than timeout_s={self.timeout_s} to "
                "answer a reply"
            ) from None
        return {self.agent_id: self._outcome(turn)}

    def env_step(self, action: str) -> StepOutcome:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("VerifiersEnv.step inside an event loop: await env.astep(...)")
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        out = self._loop.run_until_complete(self.astep({self.agent_id: action}))
        return out[self.agent_id]

    def env_current_obs(self) -> Obs:
        return self._obs

    def close(self) -> None:
        """Cancel an episode still running (cut by max_steps); close the env's own loop."""
        episode, self._episode = self._episode, None
        running = episode.running if episode is not None else None
        if running is not None and not running.done():
            running.cancel()
            if self._loop is not None and running.get_loop() is self._loop:
                self._loop.run_until_complete(asyncio.gather(running, return_exceptions=True))
        if self._loop is not None and (running is None or running.get_loop() is self._loop):
            self._loop.close()
            self._loop = None
