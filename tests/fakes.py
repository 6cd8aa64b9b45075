"""The fakes of the unit tier, in one module: a scripted ChatClient with byte-level token
ids; hand-built rollouts, SAW items, a list batch source and a rollout engine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from libludic.inference.request import ChatCompletionRequest
from libludic.saw import SampleAttachments, SAWBatch, SAWItem
from libludic.types import ChatResponse, Rollout, Step, TokenTrace

Reply = str | Callable[[ChatCompletionRequest], str]
T = TypeVar("T")


async def ticks_during(work: Awaitable[T], period_s: float) -> tuple[T, int]:
    """``work``'s result, and how often a task on the same event loop woke every
    ``period_s`` meanwhile: ~duration / period when ``work`` leaves the loop free, 0 when
    it holds it."""
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(period_s)
            ticks += 1

    ticker = asyncio.create_task(tick())
    try:
        return await work, ticks
    finally:
        ticker.cancel()


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


def make_step(
    index: int = 0,
    reward: float = 0.0,
    prompt: Sequence[int] = (1, 2, 3),
    completion: Sequence[int] = (4, 5),
    logprobs: Sequence[float] | None = None,
    policy_version: int | None = 0,
    info: dict[str, Any] | None = None,
    truncated: bool = False,
    trace: bool = True,
) -> Step:
    return Step(
        index=index,
        prev_obs="q",
        action="a",
        next_obs=None,
        reward=reward,
        truncated=truncated,
        terminated=not truncated,
        info=dict(info or {}),
        trace=TokenTrace(
            list(prompt), list(completion), None if logprobs is None else list(logprobs)
        )
        if trace
        else None,
        policy_version=policy_version,
    )


def make_rollout(
    rid: str, rewards: Sequence[float], group_id: str | None = None, **kw: Any
) -> Rollout:
    meta = {} if group_id is None else {"group_id": group_id}
    return Rollout(id=rid, steps=[make_step(i, r, **kw) for i, r in enumerate(rewards)], meta=meta)


def make_item(
    n_state: int,
    n_action: int,
    weight: float = 1.0,
    seed: int = 0,
    policy_version: int | None = 0,
    vocab: int = 250,
    logprobs: bool = True,
) -> SAWItem:
    ids = [(seed * 31 + 7 * i + 3) % vocab for i in range(n_state + n_action)]
    lp = [0.0] * n_state + [-1.0 - 0.01 * ((seed + i) % 7) for i in range(n_action)]
    return SAWItem(
        input_ids=ids,
        attention_mask=[1] * len(ids),
        action_mask=[0] * n_state + [1] * n_action,
        weight=weight,
        meta={"item_id": f"it{seed}", "reward": weight},
        attachments=SampleAttachments(
            actor_logprobs=lp if logprobs else None, policy_version=policy_version
        ),
    )


class ListBatchSource:
    """Hands out the given batches in order, cycling; has a resumable position."""

    def __init__(self, batches: Sequence[Sequence[SAWItem]]) -> None:
        self.batches = [list(b) for b in batches]
        self.pos = 0

    async def next_batch(self) -> SAWBatch:
        b = self.batches[self.pos % len(self.batches)]
        self.pos += 1
        return SAWBatch(items=list(b))

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, s: dict[str, int]) -> None:
        self.pos = int(s["pos"])


class FakeEngine:
    """generate_rollouts: request i's episodes get reward ``rewards[call][i]`` (one step each)."""

    def __init__(self, rewards_per_call: list[list[float]]) -> None:
        self.rewards_per_call = rewards_per_call
        self.calls: list[dict[str, Any]] = []

    async def generate_rollouts(
        self, requests, max_steps: int, concurrency: int = 8
    ) -> list[Rollout]:
        rewards = self.rewards_per_call[len(self.calls) % len(self.rewards_per_call)]
        self.calls.append(
            {"requests": list(requests), "max_steps": max_steps, "concurrency": concurrency}
        )
        out = []
        k = 0
        for req in requests:
            for e in range(req.num_episodes):
                out.append(
                    make_rollout(
                        f"{req.id}-{e}",
                        [rewards[k % len(rewards)]],
                        group_id=req.meta.get("group_id"),
                        logprobs=[-0.5, -0.7],
                    )
                )
                k += 1
        return out
