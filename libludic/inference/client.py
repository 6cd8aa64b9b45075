"""The inference backend interface.

A ChatClient turns a ChatCompletionRequest into a ChatResponse (text, completion token
ids, chosen-token logprobs, finish reason and the policy_version that produced it).
``sync_weights`` pushes new parameters into the backend and returns a status string.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from libludic.inference.request import ChatCompletionRequest
from libludic.types import ChatResponse


class InferenceError(RuntimeError):
    """The backend could not answer (down, timed out after retries, malformed reply)."""


@runtime_checkable
class ChatClient(Protocol):
    async def complete(
        self, request: ChatCompletionRequest
    ) -> tuple[ChatResponse, dict[str, Any]]: ...

    def sync_weights(
        self,
        params: Mapping[str, Any],
        timeout_s: float = 600.0,
        version: int | None = None,
    ) -> str: ...


@runtime_checkable
class VersionedClient(ChatClient, Protocol):
    async def get_policy_version(self) -> int: ...
