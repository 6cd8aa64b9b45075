"""Built-in env and protocol registries for a given ChatClient.

Env kinds: ``arithmetic``, ``tic_tac_toe`` (vs a fixed opponent), ``tic_tac_toe_2p``,
``code_exec``, ``dataset_qa``. Protocol kinds: ``single_agent`` and ``multi_agent``,
whose kwargs are plain data (so they cross Redis): ``parser`` (see
``libludic.parsers.make_parser``), ``context`` (``"full"`` or ``"truncated_thinking"``, or ``{kind, kwargs}`` with the
strategy's keyword arguments, e.g. ``{kind: truncated_thinking, kwargs: {max_thinking_chars:
200}}``),
``system_prompt``, ``stop_on_parse_error``; ``multi_agent`` builds one agent per role in
``roles``. Both take ``agent=AgentSpec`` (the request's ``protocol.agent``, from a task's
``agent: {kind: plain|tool|react, ...}``), which picks the class of every agent they build
(see ``libludic.agents.config``); none means a plain Agent. Sampling and return specs
come from the request's InferenceSpec.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from libludic.agents.base_agent import Agent
from libludic.agents.config import build_agent
from libludic.context.base import ContextStrategy
from libludic.context.full_dialog import FullDialog
from libludic.context.truncated_thinking import TruncatedThinkingContext
from libludic.envs import dataset_qa_env as dq
from libludic.envs.arithmetic import ArithmeticEnv
from libludic.envs.code_exec.config import CodeExecConfig
from libludic.envs.code_exec.env import DEFAULT_SYSTEM_PROMPT, CodeExecEnv, load_problems
from libludic.envs.tic_tac_toe import TicTacToeEnv, TwoPlayerTicTacToeEnv
from libludic.inference.client import ChatClient
from libludic.inference.request import InferenceSpec
from libludic.interaction.multi_agent import MultiAgentProtocol
from libludic.interaction.single_agent import SingleAgentSyncProtocol
from libludic.parsers import ParserSpec, make_parser
from libludic.requests import AgentSpec
from libludic.rollout.engine import (
    EnvFactory,
    ProtocolFactory,
    inference_overrides,
)

CONTEXTS: dict[str, type[ContextStrategy]] = {
    "full": FullDialog,
    "truncated_thinking": TruncatedThinkingContext,
}
#: a protocol's ``context``: a kind, or ``{kind, kwargs}`` with the strategy's keyword arguments
ContextSpec = str | Mapping[str, Any]


def make_context(kind: ContextSpec = "full", **kwargs: Any) -> ContextStrategy:
    """The context strategy ``kind`` (or ``{kind, kwargs}``) built with its keyword arguments;
    an unknown kind or keyword lists the known ones."""
    if isinstance(kind, Mapping):
        unknown = sorted(set(kind) - {"kind", "kwargs"})
        if unknown:
            raise ValueError(f"context: unknown key(s) {unknown}; known: kind, kwargs")
        kwargs = {**dict(kind.get("kwargs") or {}), **kwargs}
        kind = kind.get("kind", "full")
    if kind not in CONTEXTS:
        raise ValueError(f"unknown context kind {kind!r}; use one of {sorted(CONTEXTS)}")
    cls = CONTEXTS[str(kind)]
    params = [p for p in inspect.signature(cls).parameters if p != "self"]
    bad = sorted(set(kwargs) - set(params))
    if bad:
        raise ValueError(f"context {kind}: unknown kwargs {bad}; known: {params}")
    return cls(**kwargs)


_PROBLEM_CACHE: dict[str, Any] = {}


def code_exec_env(
    problems_path: str, config: dict[str, Any] | None = None, system_prompt: str | None = None
) -> Any:
    """CodeExecEnv from plain data: a JSONL of problems and CodeExecConfig fields."""
    if problems_path not in _PROBLEM_CACHE:
        _PROBLEM_CACHE[problems_path] = load_problems(problems_path)
    return CodeExecEnv(
        _PROBLEM_CACHE[problems_path],
        config=CodeExecConfig(**(config or {})),
        system_prompt=DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt,
    )


def dataset_qa_env(
    path: str | None = None,
    hf: dict[str, Any] | None = None,
    format: str = "plain",
    verifier: str = "exact",
    **kw: Any,
) -> Any:
    """DatasetQAEnv from plain data: a local file (``path``) or a HF dataset (``hf``:
    {name, split, config_name}); ``format="gsm8k"`` takes the answer after ``####`` and
    compares numbers; ``verifier`` is ``"exact"`` or ``"numeric"``."""
    if format not in ("plain", "gsm8k"):
        raise ValueError(f"dataset_qa format={format!r}: use 'plain' or 'gsm8k'")
    verifiers = {"exact": dq.exact_match_verifier, "numeric": dq.numeric_verifier}
    if verifier not in verifiers:
        raise ValueError(f"dataset_qa verifier={verifier!r}: use one of {sorted(verifiers)}")
    kw["verifier"] = dq.numeric_verifier if format == "gsm8k" else verifiers[verifier]
    if format == "gsm8k":
        kw["answer_extractor"] = dq.gsm8k_extract_answer
    if (path is None) == (hf is None):
        raise ValueError("dataset_qa needs exactly one of path=<local file> or hf={name, split}")
    key = repr((path, sorted((hf or {}).items()), format))
    if key not in _PROBLEM_CACHE:
        src = (
            dq.DatasetQAEnv.from_file(path, **kw)
            if path
            else dq.DatasetQAEnv.from_hf(**(hf or {}), **kw)
        )
        _PROBLEM_CACHE[key] = src.rows
    return dq.DatasetQAEnv(_PROBLEM_CACHE[key], **kw)


def default_env_registry() -> dict[str, EnvFactory]:
    return {
        "arithmetic": ArithmeticEnv,
        "tic_tac_toe": TicTacToeEnv,
        "tic_tac_toe_2p": TwoPlayerTicTacToeEnv,
        "code_exec": code_exec_env,
        "dataset_qa": dataset_qa_env,
    }


def build_registries(
    client: ChatClient,
) -> tuple[dict[str, EnvFactory], dict[str, ProtocolFactory]]:
    def make_agent(
        inference: InferenceSpec | None,
        parser: ParserSpec,
        context: ContextSpec,
        spec: AgentSpec | None,
    ) -> Agent:
        spec = spec if spec is not None else AgentSpec()
        return build_agent(
            spec.kind,
            spec.kwargs,
            client=client,
            ctx=make_context(context),
            parser=make_parser(parser),
            **inference_overrides(inference),
        )

    def single_agent(
        inference: InferenceSpec | None = None,
        parser: ParserSpec = None,
        context: ContextSpec = "full",
        system_prompt: str | None = None,
        stop_on_parse_error: bool = False,
        agent: AgentSpec | None = None,
    ) -> SingleAgentSyncProtocol:
        return SingleAgentSyncProtocol(
            make_agent(inference, parser, context, agent), stop_on_parse_error, system_prompt
        )

    def multi_agent(
        inference: InferenceSpec | None = None,
        roles: list[str] | None = None,
        parser: ParserSpec = None,
        context: ContextSpec = "full",
        system_prompts: dict[str, str] | None = None,
        agent: AgentSpec | None = None,
    ) -> MultiAgentProtocol:
        if not roles:
            raise ValueError(
                "multi_agent protocol needs kwargs roles=[...] naming the env's agent ids"
            )
        return MultiAgentProtocol(
            {r: make_agent(inference, parser, context, agent) for r in roles}, system_prompts
        )

    return default_env_registry(), {"single_agent": single_agent, "multi_agent": multi_agent}
