"""Fakes for the unit tier: a scripted ChatClient with byte-level token ids."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from libludic.inference.request import ChatCompletionRequest
from libludic.types import ChatResponse

Reply = str | Callable[[ChatCompletionRequest], str]


class ScriptedClient:
    """Answers with the next scripted reply (or a function of the request).

    Token ids are UTF-8 bytes of the prompt/reply (like the tiny model's tokenizer);
    logprobs are -0.5 per token; ``policy_version`` is settable.
    """

    def __init__(self, replies: Sequence[Reply], policy_version: int = 0):
        self.replies = list(replies)
        self.requests: list[ChatCompletionRequest] = []
        self.policy_version = policy_version

    async def complete(self, request: ChatCompletionRequest) -> tuple[ChatResponse, dict[str, Any]]:
        self.requests.append(request)
        if not self.replies:
            raise AssertionError("ScriptedClient ran out of replies")
        r = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        text = r(request) if callable(r) else r
        prompt = "".join(f"<{m['role']}>{m['content']}" for m in request.messages)
        ids = list(text.encode()) + [258]
        return (
            ChatResponse(
                text=text,
                finish_reason="stop",
                prompt_token_ids=list(prompt.encode()),
                completion_token_ids=ids,
                completion_logprobs=[-0.5] * len(ids),
                policy_version=self.policy_version,
            ),
            {},
        )

    async def get_policy_version(self) -> int:
        return self.policy_version

    def sync_weights(
        self, params: Mapping[str, Any], timeout_s: float = 600.0, version: int | None = None
    ) -> str:
        self.policy_version = self.policy_version + 1 if version is None else version
        return "ok"
