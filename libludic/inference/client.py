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


class ContextLengthExceeded(RuntimeError):
    """The request's prompt leaves no room for a completion in the model's context (the
    server refused it with 400). Not an InferenceError: retrying cannot help. A multi-turn
    protocol ends the episode there (``truncation_reason="context_length"``)."""


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
