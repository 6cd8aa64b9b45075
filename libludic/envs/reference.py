"""ReferenceEnv: a single-agent env that states the completion solving its current problem.

Supervised training needs (prompt, completion) pairs and a way to score a greedy answer. An
env that can state its reference completion gives both, for any seed
(``libludic.sft.tasks.env_task``): ``env_reset(seed=s)``'s observation is the
prompt, ``reference_completion()`` the completion that solves it, and
``score_completion(answer, reference)`` the reward the env gives ``answer`` on a problem
whose reference completion is ``reference`` (1.0: solved).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from libludic.types import Info, Obs


@runtime_checkable
class ReferenceEnv(Protocol):
    def env_reset(self, *, seed: int | None = None) -> tuple[Obs, Info]: ...

    def reference_completion(self) -> str:
        """The completion that solves the problem of the last ``env_reset``."""
        ...

    def score_completion(self, completion: str, reference: str) -> float:
        """The reward of ``completion`` on a problem whose reference completion is
        ``reference`` (1.0: solved). It may take a third parameter ``prompt`` (the problem's
        observation) when an answer is judged against the problem rather than the reference
        alone (any legal move of a board)."""
        ...


@runtime_checkable
class ToolReferenceEnv(ReferenceEnv, Protocol):
    """A ReferenceEnv that also states the tool call solving its current problem: a tool
    demonstration is the call, the tool's answer, then the reference completion."""

    def reference_tool_call(self) -> tuple[str, dict[str, Any]]:
        """(tool name, arguments) of the call that solves the problem of the last reset."""
        ...
