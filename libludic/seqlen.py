"""Whether a task's items fit the learner's ``max_seq_len``, estimated before any model runs.

An item is one model call: its prompt's tokens, then its reply (at most the task's sampling
``max_tokens``). The learner cuts an item longer than ``max_seq_len`` from the left of its
prompt, and dead-letters it (``unusable_item``) when the reply alone does not fit
(libludic/training/collate.py). ``task_shape`` reads what decides a task's longest item from
the task itself: the first call's messages at reset for a few env seeds (the task's protocol
and agents run against a client that records the call and answers none), the replies'
budget, the model calls an agent may make on one observation (``1 + max_tool_rounds``) and
whether its context keeps the earlier turns (``full``, ``truncated_thinking``, a kind of the
user's) or the latest observation only (``latest``). ``estimate`` counts the tokens with
``ChatTokens`` (the model's tokenizer and chat template, or a byte bound where none loads)::

    one call = P + M
    episode  = P + C * M + (C - 1) * t

P the longest first prompt, M ``max_tokens``, C the calls whose replies one prompt may hold,
its own included (``max_steps`` x calls per observation when the context keeps the earlier
turns, calls per observation with ``latest``), t the chat template's tokens around one
earlier turn. The episode figure leaves out the observations and tool results after the
first (unknown before the run): it is what the last call of an episode whose replies all run
to M needs at least. ``verdict`` refuses a task whose one call cannot fit and warns about an
episode that may not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libludic.agents.config import agent_maker
from libludic.context.latest import LatestObservation
from libludic.inference.request import ChatCompletionRequest
from libludic.inference.sampling import SamplingConfig
from libludic.models.tiny import CHAT_TEMPLATE, IM_END, PAD_TOKEN, build_tokenizer
from libludic.requests import AgentSpec
from libludic.tasks import TaskSpec, make_env, make_protocol
from libludic.types import ChatResponse, Message

SEEDS = 8  # env seeds whose first prompts are counted (the feeder's first ones)
# the byte bound's allowance for what a chat template adds: role markers around each message,
# a default system prompt some templates insert when the messages have none
BOUND_PER_MESSAGE = 8
BOUND_PER_PROMPT = 64


@dataclass(frozen=True)
class ChatTokens:
    """The tokens of a chat prompt as the inference server makes them: the chat template
    rendered, then tokenized without added special tokens. ``tokenizer`` None: the byte
    bound, the UTF-8 bytes of every message plus ``BOUND_PER_MESSAGE`` each and
    ``BOUND_PER_PROMPT`` (every token of a byte-level or byte-fallback tokenizer covers at
    least one byte; the allowances are a guess at the template)."""

    tokenizer: Any = None  # a transformers tokenizer with a chat template
    source: str = ""  # what counts: "the tokenizer of <dir>", or why the byte bound does

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def count(self, messages: Sequence[Message]) -> int:
        if self.tokenizer is None:
            return bound(messages)
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
        )
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def bound(messages: Sequence[Message]) -> int:
    """The byte bound of ``messages`` (:class:`ChatTokens`)."""
    return BOUND_PER_PROMPT + sum(
        len(str(m.get("content") or "").encode("utf-8")) + BOUND_PER_MESSAGE for m in messages
    )


def load_chat_tokens(model_dir: str | None) -> ChatTokens:
    """The model's tokenizer and chat template (``model_dir`` None: the tiny byte-level
    model's, libludic/models/tiny.py, which ``ludic up`` builds when ``up.model`` is empty);
    the byte bound, saying why, where it does not load or has no chat template."""
    if model_dir is not None and not Path(model_dir, "tokenizer_config.json").is_file():
        return ChatTokens(None, f"a byte bound, as {model_dir} holds no tokenizer yet")
    try:  # transformers (a second or two to import) only where a tokenizer is loaded
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:
        return ChatTokens(None, f"a byte bound, as transformers does not import: {e}")
    tok: Any
    try:
        if model_dir is None:
            tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
                tokenizer_object=build_tokenizer(),
                chat_template=CHAT_TEMPLATE,
                eos_token=IM_END,
                pad_token=PAD_TOKEN,
            )
            source = "the tiny model's byte-level tokenizer"
        else:  # AutoTokenizer imports torch (seconds more): only for a model of the user's
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_dir)
            source = f"the tokenizer of {model_dir}"
    except (OSError, ValueError) as e:
        where = model_dir or "the tiny model"
        return ChatTokens(None, f"a byte bound, as no tokenizer loads from {where}: {e}")
    if not getattr(tok, "chat_template", None):
        return ChatTokens(None, f"a byte bound, as {model_dir} has no chat template")
    return ChatTokens(tok, source)


class _Recorded(Exception):
    """What the recording client raises: the call is recorded, no model answers it."""


class _Recorder:
    """A ChatClient that records every call's messages and raises :class:`_Recorded`."""

    def __init__(self) -> None:
        self.calls: list[list[Message]] = []

    async def complete(self, request: ChatCompletionRequest) -> tuple[ChatResponse, dict[str, Any]]:
        self.calls.append(list(request.messages))
        raise _Recorded

    def sync_weights(
        self, params: Any, timeout_s: float = 600.0, version: int | None = None
    ) -> str:
        raise RuntimeError("the seq-len estimate runs no model")


@dataclass(frozen=True)
class TaskShape:
    """What decides a task's longest item (module docstring), read before any model runs."""

    key: str  # the task's config key: "feeder.tasks[0]"
    name: str
    prompts: list[list[Message]]  # the first call's messages at reset, per seed and agent
    max_tokens: int
    calls_per_observation: int  # 1 + the agent's max_tool_rounds
    context: str  # the context kind the task names ("full" when it names none)
    keeps_history: bool  # False: the prompt holds the latest observation only
    failed: tuple[str, ...] = ()  # the seeds whose step raised, and why

    @property
    def where(self) -> str:
        return f"{self.key} ({self.name})"


def task_shape(task: TaskSpec, seeds: Iterable[int], key: str = "task") -> TaskShape:
    """Run ``task``'s protocol on its env for one step from each seed, against a client
    that records the first model call of each agent and answers none. A seed whose step
    raises (the env's reset) is left out and listed in ``failed``: a task that fails on
    some problems is the run's to report (the launcher stops a task whose requests are all
    dead-lettered), not this estimate's. Raises PluginError (a ValueError) naming ``key``
    when the env or protocol cannot be built."""
    where = f"{key} ({task.name})"
    rec = _Recorder()
    proto = make_protocol(task, rec, where)
    env = make_env(task, where)
    failed: list[str] = []

    async def first_calls() -> None:
        for seed in seeds:
            try:
                await proto.run(env, max_steps=1, env_seed=seed, sampling_seed=0)
            except _Recorded:
                pass
            except Exception as e:  # the user's env or protocol, listed with the reason
                failed.append(f"env seed {seed}: {type(e).__name__}: {e}")

    try:
        asyncio.run(first_calls())
    finally:
        env.close()
    spec = task.protocol.agent or AgentSpec()
    make = agent_maker(rec, task.inference, spec.kind, spec.kwargs, where=f"{where}.agent")
    context = task.protocol.kwargs.get("context")
    agent = make() if context is None else make(context=context)
    kind = context.get("kind", "full") if isinstance(context, Mapping) else context or "full"
    sampling = task.inference.sampling if task.inference is not None else SamplingConfig()
    return TaskShape(
        key=key,
        name=task.name,
        prompts=rec.calls,
        max_tokens=sampling.max_tokens,
        calls_per_observation=1 + int(getattr(agent, "max_tool_rounds", 0)),
        context=str(kind),
        keeps_history=not isinstance(agent.ctx, LatestObservation),
        failed=tuple(failed),
    )


@dataclass(frozen=True)
class SeqLenEstimate:
    """A task's item lengths in tokens (module docstring: P, M, C, t)."""

    shape: TaskShape
    prompt_tokens: int  # P: the longest first prompt
    prompts: int  # how many first prompts were counted
    max_tokens: int  # M
    calls: int  # C
    turn_tokens: int  # t
    exact: bool  # counted with the model's tokenizer (else the byte bound)
    counted_with: str

    @property
    def where(self) -> str:
        return self.shape.where

    @property
    def one_call(self) -> int:
        return self.prompt_tokens + self.max_tokens

    @property
    def episode(self) -> int:
        return (
            self.prompt_tokens + self.calls * self.max_tokens + (self.calls - 1) * self.turn_tokens
        )


def estimate(shape: TaskShape, tokens: ChatTokens, max_steps: int) -> SeqLenEstimate:
    """``shape``'s item lengths counted with ``tokens`` for episodes of up to ``max_steps``
    steps (the actor's ``max_steps``). A chat template that fails on a prompt makes the
    byte bound count it, and says so."""
    if not shape.prompts:
        why = f" ({len(shape.failed)} raised; {shape.failed[0]})" if shape.failed else ""
        raise ValueError(
            f"{shape.where}: no first model call was recorded from its env seeds{why}, so "
            "its prompts cannot be counted"
        )
    exact, counted_with = tokens.exact, tokens.source
    longest = max(shape.prompts, key=bound)
    try:
        p = max(tokens.count(m) for m in shape.prompts)
        # the template's tokens around one earlier turn: an empty reply and an empty message
        turn: list[Message] = [
            {"role": "assistant", "content": ""},
            {"role": "user", "content": ""},
        ]
        t = max(0, tokens.count([*longest, *turn]) - tokens.count(longest))
    except Exception as e:  # a template that cannot render a prompt: vLLM's problem to report
        exact, counted_with = False, f"a byte bound, as the chat template failed: {e}"
        p, t = max(bound(m) for m in shape.prompts), 2 * BOUND_PER_MESSAGE
    per_obs = shape.calls_per_observation
    return SeqLenEstimate(
        shape=shape,
        prompt_tokens=p,
        prompts=len(shape.prompts),
        max_tokens=shape.max_tokens,
        calls=max_steps * per_obs if shape.keeps_history else per_obs,
        turn_tokens=t,
        exact=exact,
        counted_with=counted_with,
    )


def verdict(
    est: SeqLenEstimate, max_seq_len: int, steps_key: str = "actor.max_steps"
) -> str | None:
    """A warning when an episode may not fit ``max_seq_len`` (None: it fits). Raises
    ValueError, naming the numbers and the settings to change, when one call cannot: its
    first prompt counted by the model's tokenizer plus ``max_tokens``, or, with the byte
    bound (which may overcount), one token plus ``max_tokens``."""
    m_key = f"{est.shape.key}.inference.sampling.max_tokens"
    sure = est.prompt_tokens if est.exact else 1
    if sure + est.max_tokens > max_seq_len:
        what = (
            f"the longest of {est.prompts} first prompts ({est.prompt_tokens} tokens by "
            f"{est.counted_with})"
            if est.exact
            else "one prompt token"
        )
        room = max_seq_len - sure
        lower = f"lower {m_key} to at most {room}" if room >= 1 else "shorten the prompt"
        raise ValueError(
            f"{est.where}: one model call needs {sure + est.max_tokens} tokens, {what} + "
            f"max_tokens {est.max_tokens}, more than learner.max_seq_len={max_seq_len}: the "
            "learner would cut the prompt of every reply that long, or dead-letter the item "
            f"(unusable_item) when the reply alone does not fit; raise learner.max_seq_len to "
            f"at least {sure + est.max_tokens} or {lower}"
        )
    if est.one_call > max_seq_len:  # the byte bound only: it may overcount
        return (
            f"{est.where}: one model call may need up to {est.one_call} tokens, its longest "
            f"first prompt ({est.prompt_tokens} by {est.counted_with}) + max_tokens "
            f"{est.max_tokens}, more than learner.max_seq_len={max_seq_len}; items that long "
            f"are cut or dead-lettered: raise learner.max_seq_len or lower {m_key}"
        )
    if est.calls > 1 and est.episode > max_seq_len:
        shape, per_obs = est.shape, est.shape.calls_per_observation
        steps = est.calls // per_obs  # the observations one prompt may hold
        tools = f"1 + max_tool_rounds {per_obs - 1}"
        per = (
            f"{tools} calls on one observation"
            if steps == 1
            else f"{steps_key}={steps} calls"
            if per_obs == 1
            else f"{steps_key}={steps} x ({tools}) calls"
        )
        counted = "" if est.exact else f" (counted with {est.counted_with})"
        fixes = ["raise learner.max_seq_len", f"lower {m_key}"]
        if steps > 1:
            fixes += [f"lower {steps_key}", "use context: latest"]
        if per_obs > 1:
            fixes.append(f"lower the agent's max_tool_rounds ({per_obs - 1})")
        return (
            f"{est.where}: the last call of an episode may not fit learner.max_seq_len="
            f"{max_seq_len}: with context {shape.context} its prompt holds up to {est.calls} "
            f"replies ({per}), so it needs at least {est.prompt_tokens} + {est.calls} x "
            f"{est.max_tokens} + {est.calls - 1} x {est.turn_tokens} (template) = "
            f"{est.episode} tokens when every reply runs to max_tokens, not counting later "
            f"observations and tool results{counted}; the learner cuts such items from the "
            f"left or dead-letters them: {', '.join(fixes[:-1])} or {fixes[-1]}"
        )
    return None
