"""The one place for the wire: Redis keys, stream names, the msgpack codec, stream consumers.

Data flow (one consumer group per stream)::

    feeder --XADD--> requests --[actors]--> rollouts --[credit]--> saw --[learner]-->
                        \\___________________ deadletter <_______________/

Keys (all of one run share the Redis Cluster hash tag ``{run_id}``, so the Lua scripts
below may touch several of them atomically)::

    ludic:{run_id}:requests | rollouts | saw | deadletter      streams
    ludic:{run_id}:policy_version                              learner's published version
    ludic:{run_id}:learner_step                                learner's optimizer step
    ludic:{run_id}:feeder:seed                                 next env seed (INCRBY)
    ludic:{run_id}:heartbeat:{role}:{consumer}                 liveness, SET ... EX ttl
    ludic:{run_id}:lease:{role}                                singleton lease (credit)
    ludic:{run_id}:acct, acct:*                             run accounting (libludic/accounting.py)
    ludic:{run_id}:done:{role}:{item_id}                       de-dup marker, EX done_ttl

Codec. An entry is ``{"id": item_id, "d": payload}``; ``payload`` is msgpack of
``{"schema_version": SCHEMA_VERSION, "kind": k, "body": {...}}`` with ``k`` one of
``rollout_request``, ``rollout``, ``saw_item``. Token ids travel as msgpack ``bin`` of
little-endian int32 bytes, logprobs as float32 bytes, masks as uint8 bytes -- never lists
of Python ints. Unpacking uses ``raw=False`` (strings must be valid UTF-8),
``strict_map_key=True`` (map keys are str/bytes only), rejects every ext type and caps
the buffer size. Anything that does not decode to the expected shape raises
:class:`CodecError` with a machine-readable ``reason``. No pickle anywhere.

Delivery: at-least-once in, exactly-once effect out. A consumer reads with XREADGROUP
(and XAUTOCLAIMs entries a dead peer left pending for longer than ``claim_idle_ms``),
does the work, then :meth:`StreamConsumer.commit` runs one Lua script that

    SET done-marker NX EX ttl  ->  if new: XADD every output  ->  XACK + XDEL the inputs

so outputs, the marker and the ack become durable together. A redelivered input whose
marker exists writes nothing and is just acked: it is never counted or processed twice.
Consumers delete entries on ack, so ``XLEN`` of a stream is its un-acked backlog
(unread + pending) and producers apply backpressure on it (:func:`wait_below`); no
stream is ever trimmed (no MAXLEN), so nothing is lost unread. A consumer still working
on an entry keeps it fresh with :meth:`StreamConsumer.touch` (XCLAIM JUSTID by its owner
resets the idle time), so ``claim_idle_ms`` can be short even when episodes are long.
Malformed entries (bad msgpack, unknown schema_version, missing fields, wrong kind) and
entries delivered more than ``max_deliveries`` times go to the ``deadletter`` stream
with the reason, source stream and source id, and are acked; they never crash a worker.

Durability trade-off. Run Redis with ``appendonly yes``. With ``appendfsync always``
Redis fsyncs the AOF before it replies, so an XADD (or a commit script) that returned is
on disk: kill -9 of the server loses nothing that was acknowledged (tested in
tests/integration/test_transport_faults.py), at the cost of one fsync per write batch
(Redis groups the writes of one event-loop turn; ~1-3 ms per fsync on SSDs, the
throughput ceiling becomes the disk's fsync rate). With ``appendfsync everysec`` writes
are ~as fast as without AOF, but a crash of the *host* (or of redis-server, if the
background fsync lags) can lose up to ~1-2 s of acknowledged writes: new requests or
rollouts vanish, and since the inputs' acks vanish with them the inputs are redelivered
and recomputed -- except that work whose output was lost *and* whose input ack survived
is lost for good. For RL this is usually acceptable (a lost rollout is a lost sample,
not a correctness bug; the de-dup markers keep redelivery safe either way), so
``everysec`` is a reasonable choice for throughput-bound runs; use ``always`` when
every sample counts or the disk is fast.

Reconnects: clients from :func:`connect` retry single commands with exponential backoff;
the service loops additionally catch :data:`REDIS_DOWN_ERRORS`, back off and resume
(consumer groups persist in the AOF; a missing group is recreated).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import (
    Any,
)

import msgpack
import numpy as np
import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from libludic.rollout.request import RolloutRequest
from libludic.training.types import SampleAttachments, SAWItem
from libludic.types import Rollout

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024

KIND_REQUEST = "rollout_request"
KIND_ROLLOUT = "rollout"
KIND_SAW = "saw_item"

GROUP_ACTORS = "actors"
GROUP_CREDIT = "credit"
GROUP_LEARNER = "learner"

#: Errors that mean "Redis is unreachable right now": back off and retry, never crash.
REDIS_DOWN_ERRORS: tuple[type[BaseException], ...] = (
    rexc.ConnectionError,
    rexc.TimeoutError,
    ConnectionError,
    OSError,
)

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_U8 = np.dtype("u1")


# --------------------------------------------------------------------------------------
# keys


@dataclass(frozen=True)
class Keys:
    """Every Redis key of run ``run_id``."""

    run_id: str

    def __post_init__(self) -> None:
        if not self.run_id or any(c in self.run_id for c in "{}: \t\n"):
            raise ValueError(
                f"run_id={self.run_id!r} must be non-empty without braces, colons or spaces; "
                "set LUDIC_RUN_ID"
            )

    @property
    def prefix(self) -> str:
        return f"ludic:{{{self.run_id}}}"

    @property
    def requests(self) -> str:
        return f"{self.prefix}:requests"

    @property
    def rollouts(self) -> str:
        return f"{self.prefix}:rollouts"

    @property
    def saw(self) -> str:
        return f"{self.prefix}:saw"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}:deadletter"

    @property
    def policy_version(self) -> str:
        return f"{self.prefix}:policy_version"

    @property
    def learner_step(self) -> str:
        return f"{self.prefix}:learner_step"

    @property
    def feeder_seed(self) -> str:
        return f"{self.prefix}:feeder:seed"

    def heartbeat(self, role: str, consumer: str) -> str:
        return f"{self.prefix}:heartbeat:{role}:{consumer}"

    def heartbeat_pattern(self, role: str) -> str:
        # the braces of the hash tag are glob metacharacters: escape them for SCAN MATCH
        return f"ludic:\\{{{self.run_id}\\}}:heartbeat:{role}:*"

    def lease(self, role: str) -> str:
        return f"{self.prefix}:lease:{role}"

    def done(self, role: str, item_id: str) -> str:
        return f"{self.prefix}:done:{role}:{item_id}"

    def streams(self) -> dict[str, str]:
        """Short name -> key of every stream, with the consumer group reading it."""
        return {
            "requests": self.requests,
            "rollouts": self.rollouts,
            "saw": self.saw,
            "deadletter": self.deadletter,
        }


STREAM_GROUPS = {"requests": GROUP_ACTORS, "rollouts": GROUP_CREDIT, "saw": GROUP_LEARNER}


def consumer_name(role: str) -> str:
    """Unique, human-readable consumer name: ``actor-host-pid-ab12``."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


# --------------------------------------------------------------------------------------
# codec


class CodecError(ValueError):
    """An entry that cannot be decoded. ``reason`` is one of ``bad_msgpack``,
    ``unknown_schema_version``, ``wrong_kind``, ``missing_field``, ``bad_field``."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _reject_ext(code: int, data: bytes) -> Any:
    raise CodecError("bad_msgpack", f"msgpack ext type {code} is not allowed on the wire")


def _pack(obj: Any) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True, datetime=False)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(
            f"cannot encode {type(obj).__name__} for the wire: {e}; meta/info values must be "
            "str/int/float/bool/None/bytes or lists/dicts of them"
        ) from e


def _unpack(data: Any) -> Any:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError("bad_msgpack", f"payload is {type(data).__name__}, expected bytes")
    if len(data) > MAX_PAYLOAD_BYTES:
        raise CodecError("bad_msgpack", f"payload of {len(data)} bytes > {MAX_PAYLOAD_BYTES}")
    try:
        return msgpack.unpackb(
            bytes(data), raw=False, strict_map_key=True, use_list=True, ext_hook=_reject_ext
        )
    except CodecError:
        raise
    except Exception as e:  # msgpack raises ValueError subclasses, UnicodeDecodeError, ...
        raise CodecError("bad_msgpack", f"{type(e).__name__}: {e}") from e


def pack_array(values: Sequence[Any] | None, dtype: np.dtype) -> bytes | None:
    if values is None:
        return None
    try:
        return np.asarray(values, dtype=dtype).tobytes()
    except OverflowError as e:
        raise ValueError(f"value does not fit {dtype}: {e}") from e


def unpack_array(raw: Any, dtype: np.dtype, what: str) -> list[Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, bytes):
        raise CodecError("bad_field", f"{what} must be packed {dtype} bytes, got {type(raw).__name__}")
    if len(raw) % dtype.itemsize:
        raise CodecError(
            "bad_field", f"{what} has {len(raw)} bytes, not a multiple of {dtype.itemsize}"
        )
    return np.frombuffer(raw, dtype=dtype).tolist()


def _envelope(kind: str, body: dict[str, Any]) -> bytes:
    return _pack({"schema_version": SCHEMA_VERSION, "kind": kind, "body": body})


def _open(data: Any, kind: str) -> dict[str, Any]:
    obj = _unpack(data)
    if not isinstance(obj, dict):
        raise CodecError("bad_msgpack", f"top level is {type(obj).__name__}, expected a map")
    if "schema_version" not in obj:
        raise CodecError("missing_field", "schema_version")
    v = obj["schema_version"]
    if v != SCHEMA_VERSION:
        raise CodecError(
            "unknown_schema_version",
            f"schema_version={v!r}, this build reads {SCHEMA_VERSION}; upgrade the consumer "
            "or drain the stream with the old build",
        )
    if obj.get("kind") != kind:
        raise CodecError("wrong_kind", f"kind={obj.get('kind')!r}, expected {kind!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise CodecError("missing_field", "body (a map)")
    return body


def _build(what: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except CodecError:
        raise
    except KeyError as e:
        raise CodecError("missing_field", f"{what}: {e.args[0]}") from e
    except (TypeError, ValueError, AttributeError, IndexError) as e:
        raise CodecError("bad_field", f"{what}: {type(e).__name__}: {e}") from e


def encode_request(req: RolloutRequest) -> bytes:
    return _envelope(KIND_REQUEST, req.to_dict())


def decode_request(data: Any) -> RolloutRequest:
    body = _open(data, KIND_REQUEST)
    return _build("RolloutRequest", lambda: RolloutRequest.from_dict(body))


def _opt_number(x: Any, field: str) -> float | None:
    if x is None:
        return None
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        raise TypeError(f"{field} must be a number or nil, got {x!r}")
    return float(x)


def _pack_trace(tr: dict[str, Any] | None) -> dict[str, Any] | None:
    if tr is None:
        return None
    return {
        "prompt_token_ids": pack_array(tr["prompt_token_ids"], _I32),
        "completion_token_ids": pack_array(tr["completion_token_ids"], _I32),
        "completion_logprobs": pack_array(tr.get("completion_logprobs"), _F32),
        "temperature": tr.get("temperature"),
    }


def _unpack_trace(tr: Any) -> dict[str, Any] | None:
    if tr is None:
        return None
    if not isinstance(tr, dict):
        raise CodecError("bad_field", f"trace is {type(tr).__name__}, expected a map")
    return {
        "prompt_token_ids": unpack_array(tr["prompt_token_ids"], _I32, "trace.prompt_token_ids"),
        "completion_token_ids": unpack_array(
            tr["completion_token_ids"], _I32, "trace.completion_token_ids"
        ),
        "completion_logprobs": unpack_array(
            tr.get("completion_logprobs"), _F32, "trace.completion_logprobs"
        ),
        "temperature": _opt_number(tr.get("temperature"), "trace.temperature"),
    }


def encode_rollout(rollout: Rollout) -> bytes:
    d = rollout.to_dict()
    for s in d["steps"]:
        s["trace"] = _pack_trace(s["trace"])
    return _envelope(KIND_ROLLOUT, d)


def decode_rollout(data: Any) -> Rollout:
    body = _open(data, KIND_ROLLOUT)

    def build() -> Rollout:
        steps = body["steps"]
        if not isinstance(steps, list):
            raise TypeError("steps must be a list")
        for s in steps:
            if not isinstance(s, dict):
                raise TypeError("each step must be a map")
            s["trace"] = _unpack_trace(s.get("trace"))
        return Rollout.from_dict(body)

    return _build("Rollout", build)


def encode_saw_item(item: SAWItem) -> bytes:
    att = item.attachments
    body = {
        "input_ids": pack_array(item.input_ids, _I32),
        "attention_mask": pack_array(item.attention_mask, _U8),
        "action_mask": pack_array(item.action_mask, _U8),
        "weight": float(item.weight),
        "meta": dict(item.meta),
        "attachments": {
            "actor_logprobs": pack_array(att.actor_logprobs, _F32),
            "ref_logprobs": pack_array(att.ref_logprobs, _F32),
            "policy_version": att.policy_version,
            "temperature": att.temperature,
        },
    }
    return _envelope(KIND_SAW, body)


def decode_saw_item(data: Any) -> SAWItem:
    body = _open(data, KIND_SAW)

    def build() -> SAWItem:
        att = body.get("attachments") or {}
        if not isinstance(att, dict):
            raise TypeError("attachments must be a map")
        weight, meta, pv = body["weight"], body.get("meta") or {}, att.get("policy_version")
        if not isinstance(weight, (int, float)) or isinstance(weight, bool):
            raise TypeError(f"weight must be a number, got {type(weight).__name__}")
        if not isinstance(meta, dict):
            raise TypeError(f"meta must be a map, got {type(meta).__name__}")
        if pv is not None and (not isinstance(pv, int) or isinstance(pv, bool)):
            raise TypeError(f"policy_version must be an int or nil, got {pv!r}")
        # built directly (not SAWItem.from_dict): the arrays are typed lists already, and
        # re-coercing 4 x T Python numbers would triple the decode time
        return SAWItem(
            input_ids=unpack_array(body["input_ids"], _I32, "input_ids"),  # type: ignore[arg-type]
            attention_mask=unpack_array(body["attention_mask"], _U8, "attention_mask"),  # type: ignore[arg-type]
            action_mask=unpack_array(body["action_mask"], _U8, "action_mask"),  # type: ignore[arg-type]
            weight=float(weight),
            meta=meta,
            attachments=SampleAttachments(
                actor_logprobs=unpack_array(att.get("actor_logprobs"), _F32, "actor_logprobs"),
                ref_logprobs=unpack_array(att.get("ref_logprobs"), _F32, "ref_logprobs"),
                policy_version=pv,
                temperature=_opt_number(att.get("temperature"), "temperature"),
            ),
        )

    return _build("SAWItem", build)


# --------------------------------------------------------------------------------------
# connections


def connect(url: str, *, socket_timeout: float = 30.0) -> aioredis.Redis:
    """An asyncio client that retries single commands across short outages.

    ``socket_timeout`` must exceed every XREADGROUP ``block_ms`` used on the client.
    """
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        protocol=2,
        socket_timeout=socket_timeout,
        socket_connect_timeout=5.0,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=5),
        retry_on_error=[rexc.ConnectionError, rexc.TimeoutError],
        health_check_interval=15,
    )


async def wait_event(ev: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``ev``; True if set. Unlike ``asyncio.wait_for`` on
    Python 3.11 this never swallows a cancellation of the caller."""
    if ev.is_set():
        return True
    waiter = asyncio.ensure_future(ev.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return ev.is_set()


async def backoff_sleep(attempt: int, stop: asyncio.Event | None = None, cap: float = 5.0) -> None:
    delay = min(cap, 0.1 * (2 ** min(attempt, 10)))
    if stop is None:
        await asyncio.sleep(delay)
        return
    await wait_event(stop, delay)


async def retry_redis(
    fn: Callable[[], Awaitable[Any]],
    *,
    stop: asyncio.Event | None = None,
    deadline_s: float | None = None,
    on_error: Callable[[BaseException], None] | None = None,
) -> Any:
    """Call ``fn`` until it does not raise a REDIS_DOWN_ERRORS (idempotent calls only).

    Gives up (re-raises) once ``deadline_s`` has passed, or when ``stop`` is set.
    """
    t0 = time.monotonic()
    attempt = 0
    while True:
        try:
            return await fn()
        except REDIS_DOWN_ERRORS as e:
            if on_error is not None:
                on_error(e)
            if deadline_s is not None and time.monotonic() - t0 > deadline_s:
                raise
            if stop is not None and stop.is_set():
                raise
            log.warning("redis unavailable (%s: %s); retrying", type(e).__name__, e)
            await backoff_sleep(attempt, stop)
            attempt += 1


# --------------------------------------------------------------------------------------
# Lua scripts (atomic with respect to other clients and to the AOF)

# KEYS[1] in stream, KEYS[2] out stream, KEYS[3] done marker
# ARGV[1] group, ARGV[2] marker ttl s, ARGV[3] n input ids, ids..., then (item_id, payload)*
_COMMIT_LUA = """
local n = tonumber(ARGV[3])
local fresh = redis.call('SET', KEYS[3], '1', 'NX', 'EX', ARGV[2])
local written = -1
if fresh then
  written = 0
  for i = 4 + n, #ARGV, 2 do
    redis.call('XADD', KEYS[2], '*', 'id', ARGV[i], 'd', ARGV[i + 1])
    written = written + 1
  end
end
for i = 4, 3 + n do
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
  redis.call('XDEL', KEYS[1], ARGV[i])
end
return written
"""

# KEYS[1] in stream, KEYS[2] deadletter stream
# ARGV[1] group, ARGV[2] entry id, ARGV[3] reason, ARGV[4] detail, ARGV[5] consumer,
# ARGV[6] payload, ARGV[7] item id
_DEADLETTER_LUA = """
redis.call('XADD', KEYS[2], '*', 'reason', ARGV[3], 'detail', ARGV[4],
           'source_stream', KEYS[1], 'source_id', ARGV[2], 'group', ARGV[1],
           'consumer', ARGV[5], 'id', ARGV[7], 'd', ARGV[6])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""

# Reset the idle time of entries this consumer still owns (never steal back a claimed one).
# KEYS[1] stream; ARGV[1] group, ARGV[2] consumer, ids...
_TOUCH_LUA = """
local kept = 0
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    kept = kept + 1
  end
end
return kept
"""

# KEYS[1] lease key; ARGV[1] owner, ARGV[2] ttl ms. Acquire or renew; 1 = we hold it.
_LEASE_LUA = """
local cur = redis.call('GET', KEYS[1])
if (not cur) or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

# KEYS[1] version key; ARGV[1] new version. Versions only move forward.
_SET_MAX_LUA = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '-1')
local v = tonumber(ARGV[1])
if v > cur then redis.call('SET', KEYS[1], ARGV[1]) return v end
return cur
"""


# --------------------------------------------------------------------------------------
# streams


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)


@dataclass
class Entry:
    """One stream entry as read by a consumer."""

    id: str
    fields: dict[bytes, bytes]
    claimed: bool = False  # came from XAUTOCLAIM (a redelivery)
    deliveries: int = 1

    @property
    def payload(self) -> bytes | None:
        return self.fields.get(b"d")

    @property
    def item_id(self) -> str:
        v = self.fields.get(b"id")
        return "" if v is None else _s(v)


def _entries(raw: Any, claimed: bool = False) -> list[Entry]:
    out = []
    for eid, fields in raw or []:
        if fields is None:  # deleted while pending
            continue
        out.append(Entry(_s(eid), dict(fields), claimed=claimed))
    return out


async def xadd(r: aioredis.Redis, stream: str, item_id: str, payload: bytes) -> str:
    """Append one entry (never trimmed). Returns the entry id."""
    return _s(await r.xadd(stream, {"id": item_id, "d": payload}))


async def backlog(r: aioredis.Redis, stream: str) -> int:
    """Un-acked entries of ``stream`` (consumers XDEL on ack, so this is XLEN)."""
    return int(await r.xlen(stream))


async def wait_below(
    r: aioredis.Redis,
    stream: str,
    high_water: int,
    *,
    stop: asyncio.Event | None = None,
    poll_s: float = 0.2,
    on_wait: Callable[[int], None] | None = None,
) -> float:
    """Block while ``XLEN stream >= high_water`` (0 disables). Returns seconds waited.

    ``on_wait(length)`` is called once per poll that had to wait.
    """
    if high_water <= 0:
        return 0.0
    t0 = time.monotonic()
    while True:
        n = await backlog(r, stream)
        if n < high_water or (stop is not None and stop.is_set()):
            return time.monotonic() - t0
        if on_wait is not None:
            on_wait(n)
        if stop is None:
            await asyncio.sleep(poll_s)
        else:
            await wait_event(stop, poll_s)


async def ensure_group(r: aioredis.Redis, stream: str, group: str) -> None:
    """Create ``group`` on ``stream`` (and the stream) if missing; reads start at 0."""
    try:
        await r.xgroup_create(stream, group, id="0", mkstream=True)
    except rexc.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


@dataclass
class StreamConsumer:
    """One consumer of a consumer group, with claim-over, commit, touch and dead-letter.

    ``read()`` first XAUTOCLAIMs entries idle for ``claim_idle_ms`` (left by a dead or
    stalled consumer; entries already delivered more than ``max_deliveries`` times are
    dead-lettered instead of returned), then XREADGROUPs new ones.
    """

    redis: aioredis.Redis
    stream: str
    group: str
    consumer: str
    deadletter: str
    claim_idle_ms: int = 30_000
    claim_every_s: float = 1.0
    max_deliveries: int = 5
    done_ttl_s: int = 7 * 24 * 3600
    on_deadletter: Callable[[str], None] | None = None
    acct_stage: str = ""  # requests|rollouts|saw: dead-letters also move libludic.accounting
    _cursor: str = field(default="0-0", init=False)
    _last_claim: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self._commit = self.redis.register_script(_COMMIT_LUA)
        self._dl = self.redis.register_script(_DEADLETTER_LUA)
        self._touch = self.redis.register_script(_TOUCH_LUA)

    async def ensure_group(self) -> None:
        await ensure_group(self.redis, self.stream, self.group)

    async def claim_stale(self, count: int, min_idle_ms: int | None = None) -> list[Entry]:
        """XAUTOCLAIM up to ``count`` entries idle >= ``min_idle_ms`` from any consumer."""
        idle = self.claim_idle_ms if min_idle_ms is None else min_idle_ms
        res = await self.redis.xautoclaim(
            self.stream, self.group, self.consumer, idle, start_id=self._cursor, count=count
        )
        self._cursor = _s(res[0])
        entries = _entries(res[1], claimed=True)
        if not entries:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for e in entries:
            pipe.xpending_range(self.stream, self.group, e.id, e.id, 1)
        infos = await pipe.execute()
        out = []
        for e, info in zip(entries, infos, strict=True):
            e.deliveries = int(info[0]["times_delivered"]) if info else 1
            if e.deliveries > self.max_deliveries:
                await self.dead_letter(
                    e, "max_deliveries", f"delivered {e.deliveries} times (> {self.max_deliveries})"
                )
            else:
                out.append(e)
        return out

    async def read(self, count: int, block_ms: int = 1000) -> list[Entry]:
        """Up to ``count`` entries: stale claims first, then new ones (blocking)."""
        if count <= 0:
            return []
        try:
            now = time.monotonic()
            if now - self._last_claim >= self.claim_every_s:
                self._last_claim = now
                claimed = await self.claim_stale(count)
                if claimed:
                    return claimed
            res = await self.redis.xreadgroup(
                self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms
            )
        except rexc.ResponseError as e:
            if "NOGROUP" in str(e):  # redis restarted without persistence, or stream deleted
                log.warning("group %s on %s missing; recreating", self.group, self.stream)
                await self.ensure_group()
                return []
            raise
        if isinstance(res, dict):  # RESP3 shape: {stream: [messages]}
            return [e for v in res.values() for msgs in v for e in _entries(msgs)]
        return [e for _, msgs in res or [] for e in _entries(msgs)]

    async def commit(
        self,
        entries: Sequence[Entry],
        outputs: Sequence[tuple[str, bytes]],
        out_stream: str,
        done_key: str,
    ) -> int:
        """Atomically: if ``done_key`` is new, XADD ``outputs`` (item_id, payload) to
        ``out_stream``; then XACK+XDEL ``entries``. Returns the number written, or -1 if
        ``done_key`` already existed (a redelivery: nothing written, inputs acked)."""
        args: list[Any] = [self.group, self.done_ttl_s, len(entries)]
        args += [e.id for e in entries]
        for item_id, payload in outputs:
            args += [item_id, payload]
        return int(await self._commit(keys=[self.stream, out_stream, done_key], args=args))

    async def ack(self, entries: Sequence[Entry]) -> None:
        """XACK + XDEL without output (e.g. a late duplicate)."""
        if not entries:
            return
        ids = [e.id for e in entries]
        pipe = self.redis.pipeline(transaction=True)
        pipe.xack(self.stream, self.group, *ids)
        pipe.xdel(self.stream, *ids)
        await pipe.execute()

    async def dead_letter(self, entry: Entry, reason: str, detail: str = "") -> None:
        """Move ``entry`` to the dead-letter stream with its reason; ack it here."""
        if self.acct_stage:
            from libludic import accounting  # (imports this module)

            await accounting.dead_letter(self, entry, self.acct_stage, reason, detail)
        else:
            await self._dl(
                keys=[self.stream, self.deadletter],
                args=[
                    self.group,
                    entry.id,
                    reason,
                    detail[:2000],
                    self.consumer,
                    entry.payload if entry.payload is not None else b"",
                    entry.item_id,
                ],
            )
        log.warning("dead-lettered %s %s: %s %s", self.stream, entry.id, reason, detail[:200])
        if self.on_deadletter is not None:
            self.on_deadletter(reason)

    async def touch(self, entries: Sequence[Entry]) -> int:
        """Reset the idle time of entries still owned by this consumer."""
        if not entries:
            return 0
        return int(
            await self._touch(
                keys=[self.stream], args=[self.group, self.consumer] + [e.id for e in entries]
            )
        )

    async def delete_consumer(self) -> None:
        """Remove this consumer from the group if it owns nothing (clean shutdown)."""
        try:
            info = await self.redis.xinfo_consumers(self.stream, self.group)
            for c in info:
                if _s(c.get("name")) == self.consumer and int(c.get("pending", 0)) == 0:
                    await self.redis.xgroup_delconsumer(self.stream, self.group, self.consumer)
        except rexc.ResponseError:
            pass


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
    return int(await r.eval(_SET_MAX_LUA, 1, keys.policy_version, int(version)))


async def set_learner_step(r: aioredis.Redis, keys: Keys, step: int) -> None:
    await r.set(keys.learner_step, int(step))


@dataclass
class AdmissionController:
    """Start an episode only if ``learner_version - inference_version <= max_lag``.

    ``inference_version`` returns the version the actor's next completion would be served
    by. While the lag is larger the actor waits (``on_wait`` is called once per wait that
    happened, to count stale-admission waits); ``max_lag < 0`` disables the check.
    """

    redis: aioredis.Redis
    keys: Keys
    max_lag: int
    inference_version: Callable[[], Awaitable[int]]
    poll_s: float = 0.5
    on_wait: Callable[[], None] | None = None

    async def lag(self) -> tuple[int, int, int]:
        learner = await get_policy_version(self.redis, self.keys)
        inf = await self.inference_version()
        return learner - inf, learner, inf

    async def admit(self, stop: asyncio.Event | None = None) -> int:
        """Wait until admitted; returns the inference version (or -1 when disabled)."""
        if self.max_lag < 0:
            return -1
        waited = False
        while True:
            lag, learner, inf = await self.lag()
            if lag <= self.max_lag or (stop is not None and stop.is_set()):
                return inf
            if not waited:
                waited = True
                if self.on_wait is not None:
                    self.on_wait()
                log.info(
                    "stale admission: inference v%d is %d behind learner v%d (max_lag=%d); waiting",
                    inf, lag, learner, self.max_lag,
                )
            if stop is None:
                await asyncio.sleep(self.poll_s)
            else:
                await wait_event(stop, self.poll_s)


async def beat(r: aioredis.Redis, keys: Keys, role: str, consumer: str, ttl_s: float, info: Mapping[str, Any]) -> None:
    """Write the liveness key of ``consumer`` (expires after ``ttl_s`` without a beat)."""
    body = dict(info)
    body["ts"] = time.time()
    await r.set(keys.heartbeat(role, consumer), _pack(body), px=int(ttl_s * 1000))


async def alive(r: aioredis.Redis, keys: Keys, role: str) -> dict[str, dict[str, Any]]:
    """consumer -> last heartbeat body, for every live ``role`` process."""
    out: dict[str, dict[str, Any]] = {}
    prefix = keys.heartbeat(role, "")
    async for k in r.scan_iter(match=keys.heartbeat_pattern(role), count=500):
        v = await r.get(k)
        if v is None:
            continue
        try:
            body = _unpack(v)
        except CodecError:
            body = {}
        out[_s(k)[len(prefix):]] = body if isinstance(body, dict) else {}
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
