"""Synthetic SAWItems for the learner tests and bench, written with the transport codec.

Token ids are the tiny model's (byte value == id, 258 = <|im_end|>): a prompt of bytes, an
action of bytes + <|im_end|>, actor logprobs of -5.5 (about log(1/259), what an untrained
tiny model gives) on action tokens.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable, Sequence
from typing import Any

from libludic import transport as t
from libludic.saw import SampleAttachments, SAWItem

IM_END = 258


def make_item(
    item_id: str,
    prompt: bytes,
    action: bytes,
    *,
    weight: float = 1.0,
    policy_version: int | None = 0,
    reward: float = 1.0,
) -> SAWItem:
    state = list(prompt)
    act = list(action) + [IM_END]
    ids = state + act
    return SAWItem(
        input_ids=ids,
        attention_mask=[1] * len(ids),
        action_mask=[0] * len(state) + [1] * len(act),
        weight=weight,
        meta={"item_id": item_id, "reward": reward, "group_id": item_id.split(":")[0]},
        attachments=SampleAttachments(
            actor_logprobs=[0.0] * len(state) + [-5.5] * len(act), policy_version=policy_version
        ),
    )


def random_items(
    n: int, seed: int = 0, prefix: str = "it", policy_version: int = 0
) -> list[SAWItem]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = bytes(rng.randrange(97, 123) for _ in range(rng.randint(6, 12)))
        a = bytes(rng.randrange(48, 58) for _ in range(rng.randint(2, 5)))
        out.append(
            make_item(
                f"{prefix}{i}:0",
                p,
                a,
                weight=rng.choice([1.0, -0.5, 0.75]),
                policy_version=policy_version,
                reward=rng.random(),
            )
        )
    return out


async def push(redis_url: str, run_id: str, items: Iterable[SAWItem]) -> list[str]:
    """XADD every item to the run's saw stream in order; returns the entry ids."""
    r = t.connect(redis_url)
    keys = t.Keys(run_id)
    try:
        return [await t.xadd(r, keys.saw, it.item_id, t.encode_saw_item(it)) for it in items]
    finally:
        await r.aclose()


def push_sync(redis_url: str, run_id: str, items: Sequence[SAWItem]) -> list[str]:
    return asyncio.run(push(redis_url, run_id, items))


async def redis_state(redis_url: str, run_id: str) -> dict[str, Any]:
    """Stream length, learner-group pending count, policy_version and learner_step."""
    r = t.connect(redis_url)
    keys = t.Keys(run_id)
    try:
        pending = 0
        try:
            info = await r.xpending(keys.saw, t.GROUP_LEARNER)
            pending = int(info["pending"])
        except Exception:  # no group yet
            pending = 0
        return {
            "xlen": int(await r.xlen(keys.saw)),
            "pending": pending,
            "policy_version": await t.get_policy_version(r, keys),
            "learner_step": await t.get_int(r, keys.learner_step),
        }
    finally:
        await r.aclose()


def redis_state_sync(redis_url: str, run_id: str) -> dict[str, Any]:
    return asyncio.run(redis_state(redis_url, run_id))
