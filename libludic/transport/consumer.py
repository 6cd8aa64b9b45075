"""Streams and consumers: ``Entry``, ``xadd``, ``backlog``/``wait_below`` (backpressure),
``StreamConsumer`` (read, claim, touch, commit, dead-letter: one Lua script each). The commit
and the dead-letter move are Lua functions owned here (:data:`COMMIT_FN`,
:data:`DEADLETTER_FN`); the accounting's scripts are composed from them.

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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as rexc

from libludic.transport.connection import as_str, wait_event
from libludic.transport.keys import DONE_TTL_S, Keys

log = logging.getLogger("libludic.transport")

# The commit and the dead-letter move, each implemented once, here, as a Lua function: the
# plain scripts below call them; libludic/transport/accounting.py composes its accounted
# scripts from the same functions plus its counters, so both paths write the same entries.

# commit(at, on_output, on_written): if the done marker is new, XADD every output, calling
# on_output(item id) after each XADD and on_written(count) after the last (both optional, for
# bookkeeping in the same script); then XACK+XDEL every input. Returns the outputs written,
# or -1 if the marker existed (a redelivery: nothing written, inputs acked).
# KEYS[1] in, KEYS[2] out, KEYS[3] done marker; ARGV[1] group, ARGV[2] marker ttl s,
# ARGV[at] n input ids, then the n ids, then (item id, payload)* to the end (a composed
# script puts its own arguments at ARGV[3..at-1]).
COMMIT_FN = """
local function commit(at, on_output, on_written)
  local n = tonumber(ARGV[at])
  local fresh = redis.call('SET', KEYS[3], '1', 'NX', 'EX', ARGV[2])
  local written = -1
  if fresh then
    written = 0
    for i = at + 1 + n, #ARGV, 2 do
      redis.call('XADD', KEYS[2], '*', 'id', ARGV[i], 'd', ARGV[i + 1])
      if on_output then on_output(ARGV[i]) end
      written = written + 1
    end
    if on_written then on_written(written) end
  end
  for i = at + 1, at + n do
    redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
    redis.call('XDEL', KEYS[1], ARGV[i])
  end
  return written
end
"""

# dead_letter(): if the entry is still pending (XACK answers 1), XADD it to the dead-letter
# stream (capped, approximately) with why and where from; XDEL it either way. Returns XACK's
# reply. An entry acked or dead-lettered already (by a consumer that claimed it) is not
# written a second time.
# KEYS[1] in, KEYS[2] dead-letter stream; ARGV[1] group, [2] entry id, [3] reason,
# [4] detail, [5] consumer, [6] payload (empty when too large), [7] item id, [8] the
# dead-letter stream's approximate max length, [9] the payload's size (a composed script
# puts its own keys and arguments after these).
DEADLETTER_FN = """
local function dead_letter()
  local x = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
  if x == 1 then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[8], '*', 'reason', ARGV[3], 'detail', ARGV[4],
               'source_stream', KEYS[1], 'source_id', ARGV[2], 'group', ARGV[1],
               'consumer', ARGV[5], 'id', ARGV[7], 'd', ARGV[6], 'd_bytes', ARGV[9])
  end
  redis.call('XDEL', KEYS[1], ARGV[2])
  return x
end
"""

_COMMIT_LUA = COMMIT_FN + "return commit(3)\n"

# the plain move answers 1 whatever XACK said (its caller ignores the reply)
_DEADLETTER_LUA = DEADLETTER_FN + "dead_letter()\nreturn 1\n"

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

# --------------------------------------------------------------------------------------
# streams


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
        return "" if v is None else as_str(v)


def _entries(raw: Any, claimed: bool = False) -> list[Entry]:
    out = []
    for eid, fields in raw or []:
        if fields is None:  # deleted while pending
            continue
        out.append(Entry(as_str(eid), dict(fields), claimed=claimed))
    return out


async def xadd(r: aioredis.Redis, stream: str, item_id: str, payload: bytes) -> str:
    """Append one entry (never trimmed). Returns the entry id."""
    return as_str(await r.xadd(stream, {"id": item_id, "d": payload}))


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
    # how often read() scans for idle entries; None: min(1 s, claim_idle_ms / 3), so a dead
    # peer's entries come back within ~4/3 claim_idle_ms without a scan per read
    claim_every_s: float | None = None
    max_deliveries: int = 5
    done_ttl_s: int = DONE_TTL_S
    # the dead-letter stream keeps about this many entries (the oldest go first), each with
    # its payload when it is at most deadletter_payload_bytes (else only its size, d_bytes)
    deadletter_maxlen: int = 10_000
    deadletter_payload_bytes: int = 1 << 20
    on_deadletter: Callable[[str], None] | None = None
    _cursor: str = field(default="0-0", init=False)
    _last_claim: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.claim_every_s is None:
            self.claim_every_s = min(1.0, self.claim_idle_ms / 3000)
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
        self._cursor = as_str(res[0])
        entries = _entries(res[1], claimed=True)
        if not entries:
            return []
        return await self.under_delivery_limit(entries)

    async def claim_all(self, count: int) -> AsyncIterator[list[Entry]]:
        """One XAUTOCLAIM pass over the whole group, idle time ignored, in batches of up to
        ``count``: every pending entry, whoever holds it (a new leader taking over its
        predecessor's work). Over-delivered entries are dead-lettered as in ``claim_stale``."""
        while True:
            yield await self.claim_stale(count, min_idle_ms=0)
            if self._cursor in ("0-0", "0"):  # XAUTOCLAIM wrapped around: the pass is done
                return

    async def read(self, count: int, block_ms: int = 1000) -> list[Entry]:
        """Up to ``count`` entries: stale claims first, then new ones (blocking)."""
        if count <= 0:
            return []
        try:
            now = time.monotonic()
            if now - self._last_claim >= (self.claim_every_s or 0.0):
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
        keys, args = self.commit_call(entries, outputs, out_stream, done_key)
        return int(await self._commit(keys=keys, args=args))

    def commit_call(
        self,
        entries: Sequence[Entry],
        outputs: Sequence[tuple[str, bytes]],
        out_stream: str,
        done_key: str,
        extra: Sequence[Any] = (),
    ) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of :data:`COMMIT_FN` for :meth:`commit`. ``extra``: a composed
        script's own arguments, put at ``ARGV[3..]`` (it calls ``commit(3 + len(extra))``);
        it appends its own keys after the three returned."""
        args: list[Any] = [self.group, self.done_ttl_s, *extra, len(entries)]
        args += [e.id for e in entries]
        for item_id, payload in outputs:
            args += [item_id, payload]
        return [self.stream, out_stream, done_key], args

    async def ack(self, entries: Sequence[Entry]) -> None:
        """XACK + XDEL without output (e.g. a late duplicate)."""
        if not entries:
            return
        ids = [e.id for e in entries]
        pipe = self.redis.pipeline(transaction=True)
        pipe.xack(self.stream, self.group, *ids)
        pipe.xdel(self.stream, *ids)
        await pipe.execute()

    def deadletter_payload(self, entry: Entry) -> tuple[bytes, int]:
        """What the dead-letter stream keeps of ``entry``'s payload, and its size."""
        raw = entry.payload if entry.payload is not None else b""
        size = len(raw)
        return (bytes(raw) if size <= self.deadletter_payload_bytes else b""), size

    async def dead_letter(self, entry: Entry, reason: str, detail: str = "") -> None:
        """Move ``entry`` to the dead-letter stream with its reason; ack it here."""
        await self._move_to_deadletter(entry, reason, detail[:2000])
        log.warning("dead-lettered %s %s: %s %s", self.stream, entry.id, reason, detail[:200])
        if self.on_deadletter is not None:
            self.on_deadletter(reason)

    async def _move_to_deadletter(self, entry: Entry, reason: str, detail: str) -> None:
        """The atomic move (a subclass runs its own script, composed from the same
        :data:`DEADLETTER_FN`, with its keys and arguments after :meth:`deadletter_call`'s)."""
        keys, args = self.deadletter_call(entry, reason, detail)
        await self._dl(keys=keys, args=args)

    def deadletter_call(
        self, entry: Entry, reason: str, detail: str
    ) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of :data:`DEADLETTER_FN` for moving ``entry``."""
        payload, size = self.deadletter_payload(entry)
        args: list[Any] = [
            self.group,
            entry.id,
            reason,
            detail,
            self.consumer,
            payload,
            entry.item_id,
            self.deadletter_maxlen,
            size,
        ]
        return [self.stream, self.deadletter], args

    async def read_own(
        self, start: str, count: int, block_ms: int | None
    ) -> tuple[list[Entry], list[str]]:
        """XREADGROUP from ``start``: ``">"`` new entries (blocking ``block_ms``), or a stream
        id to re-read this consumer's own pending entries after it (no claiming, never
        another consumer's). Returns the entries and every id read, in stream order; an
        entry deleted while pending (no fields) is acked here and only its id is returned.
        A re-read counts as a delivery (Redis increments it): see ``under_delivery_limit``.
        Errors propagate (the caller decides: REDIS_DOWN_ERRORS, NOGROUP)."""
        res = await self.redis.xreadgroup(
            self.group, self.consumer, {self.stream: start}, count=count, block=block_ms
        )
        raw: list[Any] = []
        if isinstance(res, dict):  # RESP3 shape: {stream: [messages]}
            for v in res.values():
                for msgs in v:
                    raw.extend(msgs)
        else:
            for _, msgs in res or []:
                raw.extend(msgs)
        ids = [as_str(eid) for eid, _ in raw]
        deleted = [i for i, (_, fields) in zip(ids, raw, strict=True) if not fields]
        if deleted:
            await self.redis.xack(self.stream, self.group, *deleted)
        entries = [
            Entry(i, dict(fields)) for i, (_, fields) in zip(ids, raw, strict=True) if fields
        ]
        return entries, ids

    async def under_delivery_limit(self, entries: list[Entry]) -> list[Entry]:
        """The entries delivered at most ``max_deliveries`` times; the others are
        dead-lettered ("max_deliveries"): a consumer that died while holding an entry that
        often (a worker, or a learner whose step raised on it) must not die on it again."""
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

    async def hand_back(self, entry_ids: Sequence[str]) -> None:
        """Make entries this consumer owns claimable by any peer now (XCLAIM JUSTID with an
        idle time past ``claim_idle_ms``): a draining worker's unfinished work."""
        if entry_ids:
            await self.redis.xclaim(
                self.stream,
                self.group,
                self.consumer,
                0,
                list(entry_ids),
                idle=self.claim_idle_ms + 1,
                justid=True,
            )

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
                if as_str(c.get("name")) == self.consumer and int(c.get("pending", 0)) == 0:
                    await self.redis.xgroup_delconsumer(self.stream, self.group, self.consumer)
        except rexc.ResponseError:
            pass


# ------------------------------------------------------------------ inspection (status, gauges)


async def stream_lengths(r: aioredis.Redis, streams: Mapping[str, str]) -> dict[str, int]:
    """``{name: XLEN}`` for ``{name: key}`` (one pipeline); XLEN is the un-acked backlog."""
    pipe = r.pipeline(transaction=False)
    for key in streams.values():
        pipe.xlen(key)
    lens = await pipe.execute()
    return {name: int(n) for name, n in zip(streams, lens, strict=True)}


def stream_lengths_sync(r: Any, streams: Mapping[str, str]) -> dict[str, int]:
    """:func:`stream_lengths` with a synchronous ``redis.Redis`` (the launcher's live view)."""
    pipe = r.pipeline(transaction=False)
    for key in streams.values():
        pipe.xlen(key)
    return {name: int(n) for name, n in zip(streams, pipe.execute(), strict=True)}


def deadletters_sync(r: Any, keys: Keys, count: int) -> list[dict[bytes, Any]]:
    """The fields of the first ``count`` dead-letter entries, oldest first, with a
    synchronous ``redis.Redis`` (the launcher's failing-task report)."""
    return [fields for _, fields in r.xrange(keys.deadletter, count=count)]


def deadletters_after_sync(
    r: Any, keys: Keys, after: str, count: int
) -> list[tuple[str, dict[bytes, Any]]]:
    """(id, fields) of up to ``count`` dead-letter entries written after the entry ``after``
    (``"0-0"``: from the first), oldest first, with a synchronous ``redis.Redis`` (the
    launcher's count of the learner's dead letters)."""
    got = r.xread({keys.deadletter: after}, count=count)
    return [(as_str(entry_id), fields) for entry_id, fields in got[0][1]] if got else []


async def stream_info(r: aioredis.Redis, key: str) -> dict[str, Any]:
    """Length, consumer groups (pending, lag, last delivered id) and their consumers."""
    info: dict[str, Any] = {"key": key, "length": int(await r.xlen(key)), "groups": []}
    try:
        groups = await r.xinfo_groups(key) if info["length"] or await r.exists(key) else []
    except rexc.ResponseError:
        groups = []
    for g in groups:
        gname = as_str(g["name"])
        consumers = [
            {
                "name": as_str(c["name"]),
                "pending": int(c["pending"]),
                "idle_ms": int(c["idle"]),
                "inactive_ms": int(c["inactive"]) if c.get("inactive") is not None else None,
            }
            for c in await r.xinfo_consumers(key, gname)
        ]
        lag = g.get("lag")
        info["groups"].append(
            {
                "name": gname,
                "pending": int(g["pending"]),
                "lag": None if lag is None else int(lag),
                "last_delivered_id": as_str(g.get("last-delivered-id")),
                "consumers": consumers,
            }
        )
    return info


async def recent_fields(r: aioredis.Redis, key: str, field: bytes, count: int) -> list[str]:
    """``field`` of the newest ``count`` entries of a stream (e.g. dead-letter reasons)."""
    out = []
    for _, fields in await r.xrevrange(key, count=count) or []:
        out.append(as_str((fields or {}).get(field, b"?")))
    return out
