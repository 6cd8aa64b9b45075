"""Run state beside the streams: policy version and learner step, admission control,
heartbeats and the singleton lease."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from libludic.staleness import replica_admitted
from libludic.transport.codec import CodecError, pack_msg, unpack_msg
from libludic.transport.connection import as_str, wait_event
from libludic.transport.keys import Keys

log = logging.getLogger("libludic.transport")

_LEASE_LUA = """
local cur = redis.call('GET', KEYS[1])
if (not cur) or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

SET_MAX_LUA = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '-1')
local v = tonumber(ARGV[1])
if v > cur then redis.call('SET', KEYS[1], ARGV[1]) return v end
return cur
"""

# --------------------------------------------------------------------------------------
# policy versions, admission control, heartbeats, leases


async def get_int(r: aioredis.Redis, key: str, default: int = 0) -> int:
    v = await r.get(key)
    return default if v is None else int(v)


async def get_policy_version(r: aioredis.Redis, keys: Keys) -> int:
    """The learner's current version (0 before the first publish)."""
    return await get_int(r, keys.policy_version)


async def set_policy_version(r: aioredis.Redis, keys: Keys, version: int) -> int:
    """Raise the learner's version to ``version`` (never lowers it). Returns the stored value."""
    return int(await r.eval(SET_MAX_LUA, 1, keys.policy_version, int(version)))


async def set_learner_step(r: aioredis.Redis, keys: Keys, step: int) -> None:
    await r.set(keys.learner_step, int(step))


@dataclass
class AdmissionController:
    """An actor's check before it starts work: its inference replica must serve a version at
    most ``max_head_offpolicyness`` behind the learner's
    (:func:`libludic.staleness.replica_admitted`; a replica that restarted on its base
    weights fails it until the learner republishes). ``inference_version`` returns the
    version the actor's next completion would be served by. While the check fails the
    actor waits (``on_wait`` is called once per wait, to count them); ``None`` disables it.
    How much work exists at all is the feeder's admission (libludic/staleness.py)."""

    redis: aioredis.Redis
    keys: Keys
    max_head_offpolicyness: int | None
    inference_version: Callable[[], Awaitable[int]]
    poll_s: float = 0.5
    on_wait: Callable[[], None] | None = None

    async def lag(self) -> tuple[int, int, int]:
        learner = await get_policy_version(self.redis, self.keys)
        inf = await self.inference_version()
        return learner - inf, learner, inf

    async def admit(self, stop: asyncio.Event | None = None) -> int:
        """Wait until admitted; returns the inference version (or -1 when disabled)."""
        if self.max_head_offpolicyness is None:
            return -1
        waited = False
        while True:
            lag, learner, inf = await self.lag()
            if replica_admitted(learner, inf, self.max_head_offpolicyness) or (
                stop is not None and stop.is_set()
            ):
                return inf
            if not waited:
                waited = True
                if self.on_wait is not None:
                    self.on_wait()
                log.info(
                    "stale admission: inference v%d is %d behind learner v%d "
                    "(max_head_offpolicyness=%d); waiting",
                    inf,
                    lag,
                    learner,
                    self.max_head_offpolicyness,
                )
            if stop is None:
                await asyncio.sleep(self.poll_s)
            else:
                await wait_event(stop, self.poll_s)


async def beat(
    r: aioredis.Redis, keys: Keys, role: str, consumer: str, ttl_s: float, info: Mapping[str, Any]
) -> None:
    """Write the liveness key of ``consumer`` (expires after ``ttl_s`` without a beat)."""
    body = dict(info)
    body["ts"] = time.time()
    await r.set(keys.heartbeat(role, consumer), pack_msg(body), px=int(ttl_s * 1000))


async def alive(r: aioredis.Redis, keys: Keys, role: str) -> dict[str, dict[str, Any]]:
    """consumer -> last heartbeat body, for every live ``role`` process."""
    out: dict[str, dict[str, Any]] = {}
    prefix = keys.heartbeat(role, "")
    async for k in r.scan_iter(match=keys.heartbeat_pattern(role), count=500):
        v = await r.get(k)
        if v is None:
            continue
        try:
            body = unpack_msg(v)
        except CodecError:
            body = {}
        out[as_str(k)[len(prefix) :]] = body if isinstance(body, dict) else {}
    return out


@dataclass
class Lease:
    """A singleton lease (``SET key owner PX ttl``): at most one holder at a time.

    ``hold()`` acquires or renews; call it at least every ``ttl_ms / 3``. A holder that
    failed to renew in time must assume it lost the lease (another may have taken it).
    """

    redis: aioredis.Redis
    key: str
    owner: str
    ttl_ms: int = 10_000

    async def hold(self) -> bool:
        return bool(await self.redis.eval(_LEASE_LUA, 1, self.key, self.owner, self.ttl_ms))

    async def release(self) -> None:
        await self.redis.eval(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end "
            "return 0",
            1,
            self.key,
            self.owner,
        )
