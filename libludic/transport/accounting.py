"""Run accounting: where every group (feeder request) of a run is, kept in Redis, so that at
every moment::

    groups_requested = groups_trained + groups_dropped_stale + groups_dropped_incomplete
                       + groups_dropped_empty + groups_deadlettered + groups_in_flight

Each counter moves inside the Lua script that makes the transition durable, and only when
XACK reports the entry was still pending, so neither a crash (kill -9 of any service) nor a
redelivery can make the counters disagree with the streams. What groups, items and
*trained* are, the observed ``in_flight`` and the known limits: DEVELOPERS.md, "Run accounting".

=====================  ==========================================================  ================
transition             script (atomic with)                                        counter
=====================  ==========================================================  ================
feeder adds request    :data:`_REQUEST_LUA` (XADD, ``done:feeder`` marker)         requested
actor commits          :data:`_COMMIT_LUA` (rollouts XADD, request XACK/XDEL)      -> ``rolling``
                       ... with 0 rollouts                                         dropped_empty
actor dead-letters     :data:`_DEADLETTER_LUA` (sets ``done:actor``: no late       deadlettered
                       commit can still write rollouts)
credit commits group   :data:`_COMMIT_LUA` (SAW XADD, rollouts XACK/XDEL)          -> ``open``
                       ... timed out with too few rollouts                         dropped_incomplete
                       ... 0 items after preprocess/filters                        dropped_empty
                       ... 0 items, dropped by dynamic sampling                    (+ zero_variance)
credit error           :func:`group_failed` (``done:credit`` marker)               deadlettered
learner acks item      :data:`_ACK_LUA` (XACK/XDEL of the saw entry)               items_trained|stale
learner dead-letters   :data:`_DEADLETTER_LUA`                                     items_deadlettered
last item of a group   (same script) any item trained -> trained, else any stale
                       -> dropped_stale, else deadlettered
=====================  ==========================================================  ================
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from libludic.transport.connection import as_str, connect
from libludic.transport.consumer import COMMIT_FN, DEADLETTER_FN, Entry, StreamConsumer
from libludic.transport.keys import DONE_TTL_S, Keys
from libludic.transport.state import SET_MAX_LUA

#: counters of the ``acct`` hash
GROUP_FATES = (
    "groups_trained",
    "groups_dropped_stale",
    "groups_dropped_incomplete",
    "groups_dropped_empty",
    "groups_deadlettered",
)
ITEM_FIELDS = (
    "items_written",
    "items_trained",
    "items_stale",
    "items_deadlettered",
    "items_trained_twice",
    "rollouts_deadlettered",
)
#: counters of the ``acct`` hash that say why a group met its fate (a part of that fate's
#: count, outside the identity): ``groups_zero_variance``, the groups dynamic sampling
#: dropped (all rewards equal; counted in ``groups_dropped_empty`` too)
DETAIL_FIELDS = ("groups_zero_variance",)


@dataclass(frozen=True)
class AcctKeys:
    """The accounting keys of one run (same hash tag as the streams)."""

    keys: Keys

    @property
    def counters(self) -> str:
        return f"{self.keys.prefix}:acct"

    @property
    def rolling(self) -> str:  # group id -> rollouts written, until credit commits the group
        return f"{self.keys.prefix}:acct:rolling"

    @property
    def open(self) -> str:  # group id -> items not yet resolved by the learner
        return f"{self.keys.prefix}:acct:open"

    @property
    def mix(self) -> str:  # "{gid}|t" / "{gid}|s" -> items of an open group trained / stale
        return f"{self.keys.prefix}:acct:mix"

    @property
    def items(self) -> str:  # item id -> group id, while the item is in the saw stream
        return f"{self.keys.prefix}:acct:items"


# Resolve one saw item (learner side). Needs KEYS[ACCT], KEYS[OPEN], KEYS[MIX], KEYS[ITEMS]
# set as locals ka, ko, km, ki, plus the trained-marker prefix and ttl.
_RESOLVE_FN = """
local function resolve(iid, outcome, ka, ko, km, ki, mprefix, ttl)
  if outcome == 'trained' then
    redis.call('HINCRBY', ka, 'items_trained', 1)
    if iid ~= '' and not redis.call('SET', mprefix .. iid, '1', 'NX', 'EX', ttl) then
      redis.call('HINCRBY', ka, 'items_trained_twice', 1)
    end
  elseif outcome == 'stale' then
    redis.call('HINCRBY', ka, 'items_stale', 1)
  else
    redis.call('HINCRBY', ka, 'items_deadlettered', 1)
  end
  local gid = redis.call('HGET', ki, iid)
  if not gid then return end
  redis.call('HDEL', ki, iid)
  if outcome == 'trained' then redis.call('HINCRBY', km, gid .. '|t', 1) end
  if outcome == 'stale' then redis.call('HINCRBY', km, gid .. '|s', 1) end
  local left = redis.call('HINCRBY', ko, gid, -1)
  if left <= 0 then
    local t = tonumber(redis.call('HGET', km, gid .. '|t') or '0')
    local s = tonumber(redis.call('HGET', km, gid .. '|s') or '0')
    local fate = 'groups_deadlettered'
    if t > 0 then fate = 'groups_trained' elseif s > 0 then fate = 'groups_dropped_stale' end
    redis.call('HINCRBY', ka, fate, 1)
    redis.call('HDEL', ko, gid)
    redis.call('HDEL', km, gid .. '|t', gid .. '|s')
  end
end
"""

# KEYS[1] requests, KEYS[2] acct, KEYS[3..] done:feeder markers (one per request)
# ARGV[1] marker ttl s, then (request id, payload)*
_REQUEST_LUA = """
local added = 0
for j = 3, #KEYS do
  local i = 2 + 2 * (j - 3)
  if redis.call('SET', KEYS[j], '1', 'NX', 'EX', ARGV[1]) then
    redis.call('XADD', KEYS[1], '*', 'id', ARGV[i], 'd', ARGV[i + 1])
    added = added + 1
  end
end
if added > 0 then redis.call('HINCRBY', KEYS[2], 'groups_requested', added) end
return added
"""

# The transport's commit (consumer.COMMIT_FN: marker NX -> XADD outputs -> XACK+XDEL inputs)
# with the counters moved by its hooks, in the same script.
# KEYS[1] in, KEYS[2] out, KEYS[3] done marker, KEYS[4] acct, KEYS[5] rolling, KEYS[6] open,
# KEYS[7] items. ARGV[1] group, ARGV[2] ttl, ARGV[3] stage (actor|credit), ARGV[4] group id,
# ARGV[5] counter when nothing is written, ARGV[6] a detail counter moved with it ('' none),
# ARGV[7] n input ids, ids..., (item id, payload)*
_COMMIT_LUA = (
    COMMIT_FN
    + """
local stage, gid = ARGV[3], ARGV[4]
-- credit opens only a group an actor committed: a rollout whose group_id was lost or
-- corrupted on the way names a group nobody requested, whose items count at item level only
local rolled = stage == 'credit' and redis.call('HEXISTS', KEYS[5], gid) == 1
local function on_output(iid)
  if rolled then redis.call('HSET', KEYS[7], iid, gid) end
end
local function on_written(written)
  if stage == 'credit' then
    redis.call('HDEL', KEYS[5], gid)
    -- admission's items per group: items_written / groups_credited
    if rolled then redis.call('HINCRBY', KEYS[4], 'groups_credited', 1) end
    if written > 0 then
      if rolled then redis.call('HINCRBY', KEYS[6], gid, written) end
      redis.call('HINCRBY', KEYS[4], 'items_written', written)
    end
  elseif written > 0 then
    redis.call('HINCRBY', KEYS[5], gid, written)
  end
  if written == 0 then
    redis.call('HINCRBY', KEYS[4], ARGV[5], 1)
    if ARGV[6] ~= '' then redis.call('HINCRBY', KEYS[4], ARGV[6], 1) end
  end
end
return commit(7, on_output, on_written)
"""
)

# The transport's dead-letter move (consumer.DEADLETTER_FN) plus the counters, which move only
# if the entry was still pending.
# KEYS[1] in, KEYS[2] deadletter, ARGV[1..9] as DEADLETTER_FN reads them (group, entry id,
# reason, detail, consumer, payload, item id, dead-letter max length, payload size), then
# KEYS[3] acct, KEYS[4] open, KEYS[5] mix, KEYS[6] items, KEYS[7] done marker of the item
# (requests: done:actor:{id}), ARGV[10] stage (requests|rollouts|saw), ARGV[11] ttl,
# ARGV[12] trained-marker prefix
_DEADLETTER_LUA = (
    _RESOLVE_FN
    + DEADLETTER_FN
    + """
local x = dead_letter()
if x == 1 then
  if ARGV[10] == 'requests' then
    if ARGV[7] ~= '' and redis.call('SET', KEYS[7], '1', 'NX', 'EX', ARGV[11]) then
      redis.call('HINCRBY', KEYS[3], 'groups_deadlettered', 1)
    end
  elseif ARGV[10] == 'rollouts' then
    redis.call('HINCRBY', KEYS[3], 'rollouts_deadlettered', 1)
  else
    resolve(ARGV[7], 'deadlettered', KEYS[3], KEYS[4], KEYS[5], KEYS[6], ARGV[12], ARGV[11])
  end
end
return x
"""
)

# Learner ack: XACK (+ resolve the item iff it was still pending) + XDEL.
# KEYS[1] saw, KEYS[2] acct, KEYS[3] open, KEYS[4] mix, KEYS[5] items
# ARGV[1] group, ARGV[2] outcome (trained|stale), ARGV[3] ttl, ARGV[4] marker prefix, ids...
_ACK_LUA = (
    _RESOLVE_FN
    + """
local acked = 0
for i = 5, #ARGV do
  local e = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
    acked = acked + 1
    local iid = ''
    if e[1] then
      local f = e[1][2]
      for j = 1, #f, 2 do if f[j] == 'id' then iid = f[j + 1] end end
    end
    resolve(iid, ARGV[2], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[4], ARGV[3])
  end
  redis.call('XDEL', KEYS[1], ARGV[i])
end
return acked
"""
)

# KEYS[1] done:credit:{gid}, KEYS[2] acct, KEYS[3] rolling; ARGV[1] ttl, ARGV[2] gid
_GROUP_FAILED_LUA = """
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  redis.call('HDEL', KEYS[3], ARGV[2])
  redis.call('HINCRBY', KEYS[2], 'groups_deadlettered', 1)
  return 1
end
return 0
"""

# One atomic read of everything the identity needs.
# KEYS acct, rolling, open, items, requests, rollouts, saw, deadletter
_SNAPSHOT_LUA = """
return {redis.call('HGETALL', KEYS[1]), redis.call('HLEN', KEYS[2]), redis.call('HLEN', KEYS[3]),
        redis.call('HLEN', KEYS[4]), redis.call('XLEN', KEYS[5]), redis.call('XLEN', KEYS[6]),
        redis.call('XLEN', KEYS[7]), redis.call('XLEN', KEYS[8])}
"""

# What admission control needs, in one atomic read (libludic/staleness.py).
# KEYS acct, rolling, requests, saw, admission
_ADMISSION_LUA = """
return {redis.call('HGET', KEYS[1], 'items_trained'), redis.call('HLEN', KEYS[2]),
        redis.call('XLEN', KEYS[3]), redis.call('XLEN', KEYS[4]),
        redis.call('HGET', KEYS[5], 'served_step'), redis.call('HGET', KEYS[5], 'batch_size'),
        redis.call('HGET', KEYS[1], 'items_written'), redis.call('HGET', KEYS[1], 'groups_credited')}
"""


async def _run(r: aioredis.Redis, script: str, keys: list[str], args: list[Any]) -> Any:
    """EVALSHA ``script`` (redis-py's Script loads it on a NOSCRIPT reply: a new or restarted
    server) rather than EVAL, which sends the script's text with every call."""
    return await r.register_script(script)(keys=keys, args=args)


async def add_requests(
    r: aioredis.Redis,
    keys: Keys,
    requests: Sequence[tuple[str, bytes]],
    ttl_s: int = DONE_TTL_S,
) -> int:
    """XADD each (request id, payload) not added before and count it requested, atomically.
    Returns the number added (a retried call adds nothing twice)."""
    if not requests:
        return 0
    ak = AcctKeys(keys)
    ks = [keys.requests, ak.counters] + [keys.done("feeder", rid) for rid, _ in requests]
    args: list[Any] = [ttl_s]
    for rid, payload in requests:
        args += [rid, payload]
    return int(await _run(r, _REQUEST_LUA, ks, args))


async def commit(
    sc: StreamConsumer,
    entries: Sequence[Entry],
    outputs: Sequence[tuple[str, bytes]],
    out_stream: str,
    done_key: str,
    *,
    stage: str,
    group_id: str,
    if_empty: str = "groups_dropped_empty",
    empty_because: str = "",
) -> int:
    """:meth:`transport.StreamConsumer.commit` plus the accounting of ``stage``
    (``actor``: the group's rollouts; ``credit``: its SAWItems, ``if_empty`` counted when
    none, and with it ``empty_because``, one of :data:`DETAIL_FIELDS`, when given). Same
    return value: outputs written, or -1 for a redelivery."""
    if stage not in ("actor", "credit"):
        raise ValueError(f"accounting commit stage={stage!r}; use 'actor' or 'credit'")
    if if_empty not in GROUP_FATES:
        raise ValueError(f"if_empty={if_empty!r}; use one of {GROUP_FATES}")
    if empty_because and empty_because not in DETAIL_FIELDS:
        raise ValueError(f"empty_because={empty_because!r}; use one of {DETAIL_FIELDS} or ''")
    ak = AcctKeys(Keys(_run_of(sc.stream)))
    ks, args = sc.commit_call(
        entries, outputs, out_stream, done_key, extra=[stage, group_id, if_empty, empty_because]
    )
    ks += [ak.counters, ak.rolling, ak.open, ak.items]
    return int(await _run(sc.redis, _COMMIT_LUA, ks, args))


STAGES = ("requests", "rollouts", "saw")


@dataclass
class AccountedConsumer(StreamConsumer):
    """A :class:`StreamConsumer` of one of a run's streams whose dead-letters also move the
    run's accounting, in the same script. ``stage``: the short name of the stream, one of
    :data:`STAGES`."""

    stage: str = "requests"

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"AccountedConsumer stage={self.stage!r}; use one of {STAGES}")
        super().__post_init__()
        self._acct_dl = self.redis.register_script(_DEADLETTER_LUA)

    async def _move_to_deadletter(self, entry: Entry, reason: str, detail: str) -> None:
        keys = Keys(_run_of(self.stream))
        ak = AcctKeys(keys)
        marker = keys.done("actor" if self.stage == "requests" else "learner", entry.item_id)
        ks, args = self.deadletter_call(entry, reason, detail)
        ks += [ak.counters, ak.open, ak.mix, ak.items, marker]
        args += [self.stage, self.done_ttl_s, keys.done("learner", "")]
        await self._acct_dl(keys=ks, args=args)


async def ack_items(sc: StreamConsumer, entry_ids: Sequence[str], outcome: str) -> int:
    """Learner: XACK + XDEL saw entries, counting each still-pending one as ``outcome``
    (``trained`` or ``stale``). Returns how many were still pending."""
    if outcome not in ("trained", "stale"):
        raise ValueError(f"ack outcome={outcome!r}; use 'trained' or 'stale'")
    if not entry_ids:
        return 0
    keys = Keys(_run_of(sc.stream))
    ak = AcctKeys(keys)
    ks = [sc.stream, ak.counters, ak.open, ak.mix, ak.items]
    args: list[Any] = [sc.group, outcome, sc.done_ttl_s, keys.done("learner", ""), *entry_ids]
    return int(await _run(sc.redis, _ACK_LUA, ks, args))


async def group_failed(
    r: aioredis.Redis, keys: Keys, group_id: str, ttl_s: int = DONE_TTL_S
) -> bool:
    """Credit could not process group ``group_id`` (its rollouts were dead-lettered): mark it
    done and count it dead-lettered, once. True if this call counted it."""
    ak = AcctKeys(keys)
    ks = [keys.done("credit", group_id), ak.counters, ak.rolling]
    return bool(await _run(r, _GROUP_FAILED_LUA, ks, [ttl_s, group_id]))


def _run_of(stream_key: str) -> str:
    """``ludic:{run}:saw`` -> ``run``."""
    lo, hi = stream_key.find("{"), stream_key.find("}")
    if lo < 0 or hi < lo:
        raise ValueError(f"stream key {stream_key!r} has no {{run_id}} hash tag")
    return stream_key[lo + 1 : hi]


def compute(counters: dict[str, int], observed: dict[str, int]) -> dict[str, Any]:
    """The accounting from raw counters and observed backlog sizes (pure; unit-tested).

    ``observed``: ``requests_backlog`` (XLEN requests), ``rolling`` / ``open`` (HLEN of the
    accounting hashes), ``saw_backlog`` (XLEN saw)."""
    c = {
        k: int(counters.get(k, 0))
        for k in ("groups_requested", *GROUP_FATES, *ITEM_FIELDS, *DETAIL_FIELDS)
    }
    done = sum(c[k] for k in GROUP_FATES)
    in_flight = c["groups_requested"] - done
    in_flight_observed = observed["requests_backlog"] + observed["rolling"] + observed["open"]
    items_in_flight = (
        c["items_written"] - c["items_trained"] - c["items_stale"] - c["items_deadlettered"]
    )
    return {
        **c,
        "groups_dropped": sum(c[k] for k in GROUP_FATES if k.startswith("groups_dropped")),
        "groups_in_flight": in_flight,
        "groups_in_flight_observed": in_flight_observed,
        "items_in_flight": items_in_flight,
        "items_in_flight_observed": observed["saw_backlog"],
        "consistent": in_flight == in_flight_observed
        and items_in_flight == observed["saw_backlog"],
        **{f"observed_{k}": v for k, v in observed.items()},
    }


async def snapshot(r: aioredis.Redis, keys: Keys) -> dict[str, Any]:
    """The run's accounting, read atomically (one script), with the derived and the
    observed in-flight figures and ``consistent``."""
    ak = AcctKeys(keys)
    ks = [
        ak.counters,
        ak.rolling,
        ak.open,
        ak.items,
        keys.requests,
        keys.rollouts,
        keys.saw,
        keys.deadletter,
    ]
    raw = await _run(r, _SNAPSHOT_LUA, ks, [])
    flat = raw[0]
    counters = {as_str(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
    observed = {
        "rolling": int(raw[1]),
        "open": int(raw[2]),
        "items_map": int(raw[3]),
        "requests_backlog": int(raw[4]),
        "rollouts_backlog": int(raw[5]),
        "saw_backlog": int(raw[6]),
        "deadletter_length": int(raw[7]),
    }
    return compute(counters, observed)


def items_per_group(items_written: int, groups_credited: int, group_size: int) -> float:
    """The items one requested group becomes, as measured so far: ``items_written /
    groups_credited`` (a multi-turn episode is one item per model call, a dropped group
    none), at least 1; ``group_size`` (one item an episode) before credit committed a group."""
    if groups_credited <= 0:
        return float(group_size)
    return max(1.0, items_written / groups_credited)


def groups_for_room(room: float, items_per_group: float) -> int:
    """Groups to admit for ``room`` items: rounded up, so a learner short of less than one
    group's items still gets the group that completes its batch (rounding down starved a
    synchronous run whose batch is not a whole number of multi-turn groups); at most one
    group more than the room, none when there is no room."""
    if room <= 0:
        return 0
    return math.ceil(room / items_per_group)


async def admission_state(r: aioredis.Redis, keys: Keys, group_size: int) -> dict[str, Any] | None:
    """``{served_step, batch_size, trained, outstanding, items_per_group}`` for
    :func:`libludic.staleness.admission_room`, read atomically; None before a learner
    announced itself (:func:`set_admission`). ``outstanding`` counts the items requested
    groups will become (``items_per_group`` per request in the requests stream or in
    credit's hands) plus the items in the ``saw`` stream (the batch being trained
    included)."""
    ak = AcctKeys(keys)
    ks = [ak.counters, ak.rolling, keys.requests, keys.saw, keys.admission]
    raw = await _run(r, _ADMISSION_LUA, ks, [])
    trained, rolling, requests, saw, served, batch, written, credited = raw
    if served is None or batch is None:
        return None
    per_group = items_per_group(int(written or 0), int(credited or 0), group_size)
    return {
        "served_step": int(served),
        "batch_size": int(batch),
        "trained": int(trained or 0),
        "outstanding": math.ceil((int(requests) + int(rolling)) * per_group) + int(saw),
        "items_per_group": per_group,
    }


async def set_admission(r: aioredis.Redis, keys: Keys, served_step: int, batch_size: int) -> None:
    """Learner: the step whose weights inference serves and the batch size admission is
    measured in; wakes the feeder (:func:`wait_admission`)."""
    await r.hset(
        keys.admission, mapping={"served_step": int(served_step), "batch_size": int(batch_size)}
    )
    await wake_admission(r, keys)


async def wake_admission(r: aioredis.Redis, keys: Keys) -> None:
    """Tell a waiting feeder that room may have opened (items resolved, weights served)."""
    pipe = r.pipeline(transaction=True)
    pipe.lpush(keys.admission_wake, 1)
    pipe.ltrim(keys.admission_wake, 0, 0)
    await pipe.execute()


def announce_served_sync(
    r: Any, keys: Keys, version: int, served_step: int, batch_size: int
) -> None:
    """Learner, from its publish thread with a synchronous client (``redis.Redis``), the
    moment inference acknowledged ``version``: raise the policy version (actors' replica
    check), record the served step (admission) and wake the feeder, in one transaction."""

    pipe = r.pipeline(transaction=True)
    # EVAL, not a registered Script: in a pipeline redis-py's Script costs a SCRIPT EXISTS
    # round trip at every execute, more than sending these five lines once per publish
    pipe.eval(SET_MAX_LUA, 1, keys.policy_version, int(version))
    pipe.hset(
        keys.admission, mapping={"served_step": int(served_step), "batch_size": int(batch_size)}
    )
    pipe.lpush(keys.admission_wake, 1)
    pipe.ltrim(keys.admission_wake, 0, 0)
    pipe.execute()


async def wait_admission(r: aioredis.Redis, keys: Keys, timeout_s: float) -> bool:
    """Feeder: block until the learner wakes it or ``timeout_s`` passed; True if woken."""
    got = await r.blpop([keys.admission_wake], timeout=max(0.01, timeout_s))
    return got is not None


def snapshot_sync(redis_url: str, run_id: str) -> dict[str, Any]:
    """:func:`snapshot` for synchronous callers (launcher, tests)."""

    async def go() -> dict[str, Any]:
        r = connect(redis_url)
        try:
            return await snapshot(r, Keys(run_id))
        finally:
            await r.aclose()

    return asyncio.run(go())


def format_line(a: dict[str, Any] | None) -> str:
    """One human line for ``ludic status`` / logs."""
    if not a:
        return "accounting: n/a"
    return (
        f"groups requested={a['groups_requested']} = trained {a['groups_trained']}"
        f" + dropped stale {a['groups_dropped_stale']}"
        f" + dropped incomplete {a['groups_dropped_incomplete']}"
        f" + dropped empty {a['groups_dropped_empty']}"
        f" + dead-lettered {a['groups_deadlettered']}"
        f" + in flight {a['groups_in_flight']} (observed {a['groups_in_flight_observed']})"
        f"; items trained twice={a['items_trained_twice']}"
        f"; {'consistent' if a['consistent'] else 'INCONSISTENT'}"
    )
