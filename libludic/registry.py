"""Built-in env and protocol registries for a given ChatClient.

Env kinds: ``arithmetic``, ``tic_tac_toe`` (vs a fixed opponent), ``tic_tac_toe_2p``,
``code_exec``, ``dataset_qa``. Protocol kinds: ``single_agent`` and ``multi_agent``,
whose kwargs are plain data (so they cross Redis): ``parser`` (see
``libludic.parsers.make_parser``), ``context`` (``"full"`` or ``"truncated_thinking"``),
``system_prompt``, ``stop_on_parse_error``; ``multi_agent`` builds one agent per role in
``roles``. Sampling and return specs come from the request's InferenceSpec.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from libludic.agents.base_agent import Agent
from libludic.context.base import ContextStrategy
from libludic.context.full_dialog import FullDialog
from libludic.context.truncated_thinking import TruncatedThinkingContext
from libludic.inference.client import ChatClient
from libludic.inference.request import InferenceSpec
from libludic.interaction.multi_agent import MultiAgentProtocol
from libludic.interaction.single_agent import SingleAgentSyncProtocol
from libludic.parsers import ParserSpec, make_parser
from libludic.training.batching.rollout_engine import (
    EnvFactory,
    ProtocolFactory,
    inference_overrides,
)


def make_context(kind: str = "full", **kwargs: Any) -> ContextStrategy:
    if kind == "full":
        return FullDialog()
    if kind == "truncated_thinking":
        return TruncatedThinkingContext(**kwargs)
    raise ValueError(f"unknown context kind {kind!r}; use 'full' or 'truncated_thinking'")


def _code_exec_env(**kw: Any) -> Any:
    from libludic.envs.code_exec.env import CodeExecEnv

    return CodeExecEnv(**kw)


def _dataset_qa_env(**kw: Any) -> Any:
    from libludic.envs.dataset_qa_env import DatasetQAEnv

    return DatasetQAEnv(**kw)


def default_env_registry() -> Dict[str, EnvFactory]:
    from libludic.envs.arithmetic import ArithmeticEnv
    from libludic.envs.tic_tac_toe import TicTacToeEnv, TwoPlayerTicTacToeEnv

    return {
        "arithmetic": ArithmeticEnv,
        "tic_tac_toe": TicTacToeEnv,
        "tic_tac_toe_2p": TwoPlayerTicTacToeEnv,
        "code_exec": _code_exec_env,
        "dataset_qa": _dataset_qa_env,
    }


def build_registries(client: ChatClient) -> Tuple[Dict[str, EnvFactory], Dict[str, ProtocolFactory]]:
    def agent(inference: Optional[InferenceSpec], parser: ParserSpec, context: str) -> Agent:
        return Agent(client=client, ctx=make_context(context), parser=make_parser(parser), **inference_overrides(inference))

    def single_agent(
        inference: Optional[InferenceSpec] = None,
        parser: ParserSpec = None,
        context: str = "full",
        system_prompt: Optional[str] = None,
        stop_on_parse_error: bool = False,
    ) -> SingleAgentSyncProtocol:
        return SingleAgentSyncProtocol(agent(inference, parser, context), stop_on_parse_error, system_prompt)

    def multi_agent(
        inference: Optional[InferenceSpec] = None,
        roles: Optional[List[str]] = None,
        parser: ParserSpec = None,
        context: str = "full",
        system_prompts: Optional[Dict[str, str]] = None,
    ) -> MultiAgentProtocol:
        if not roles:
            raise ValueError("multi_agent protocol needs kwargs roles=[...] naming the env's agent ids")
        return MultiAgentProtocol({r: agent(inference, parser, context) for r in roles}, system_prompts)

    return default_env_registry(), {"single_agent": single_agent, "multi_agent": multi_agent}
