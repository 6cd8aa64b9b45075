"""The one place for the wire: Redis keys, stream names, the msgpack codec, stream consumers.

A package: ``keys`` (key and stream names), ``codec`` (msgpack envelopes), ``connection``
(connect, the retry/backoff policy), ``consumer`` (streams, ``StreamConsumer``: read, claim,
commit, dead-letter), ``state`` (policy version, learner step, admission, heartbeats, lease),
and above them ``accounting`` (where every group of a run is; ``AccountedConsumer``).
Everything public but accounting is re-exported here: ``from libludic import transport;
transport.Keys``.

Data flow (one consumer group per stream)::

    feeder --XADD--> requests --[actors]--> rollouts --[credit]--> saw --[learner]-->
                        \\___________________ deadletter <_______________/

Keys (all of one run share the Redis Cluster hash tag ``{run_id}``, so the Lua scripts
below may touch several of them atomically)::

    ludic:{run_id}:requests | rollouts | saw | deadletter      streams
    ludic:{run_id}:policy_version                              learner's published version
    ludic:{run_id}:learner_step                                learner's optimizer step
    ludic:{run_id}:admission                                   served_step, batch_size (learner)
    ludic:{run_id}:admission:wake                              list: "room may have opened"
    ludic:{run_id}:feeder:seed                                 next env seed (INCRBY)
    ludic:{run_id}:heartbeat:{role}:{consumer}                 liveness, SET ... EX ttl
    ludic:{run_id}:lease:{role}                                singleton lease (credit)
    ludic:{run_id}:acct, acct:*                             run accounting (libludic/transport/accounting.py)
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

from libludic.transport.codec import (  # noqa: F401
    KIND_REQUEST,
    KIND_ROLLOUT,
    KIND_SAW,
    MAX_PAYLOAD_BYTES,
    SCHEMA_VERSION,
    CodecError,
    decode_request,
    decode_rollout,
    decode_saw_item,
    encode_request,
    encode_rollout,
    encode_saw_item,
    envelope,
    pack_array,
    pack_msg,
    unpack_array,
    unpack_msg,
)
from libludic.transport.connection import (  # noqa: F401
    REDIS_DOWN_ERRORS,
    as_str,
    backoff_sleep,
    connect,
    retry_redis,
    stop_retrying,
    wait_event,
)
from libludic.transport.consumer import (  # noqa: F401
    Entry,
    StreamConsumer,
    backlog,
    deadletters_sync,
    ensure_group,
    recent_fields,
    stream_info,
    stream_lengths,
    stream_lengths_sync,
    wait_below,
    xadd,
)
from libludic.transport.keys import (  # noqa: F401
    GROUP_ACTORS,
    GROUP_CREDIT,
    GROUP_LEARNER,
    STREAM_GROUPS,
    Keys,
    consumer_name,
)
from libludic.transport.state import (  # noqa: F401
    AdmissionController,
    Lease,
    alive,
    beat,
    get_int,
    get_policy_version,
    set_learner_step,
    set_policy_version,
)

__all__ = [
    "stream_lengths_sync",
    "deadletters_sync",
    "recent_fields",
    "stream_info",
    "stream_lengths",
    "pack_msg",
    "unpack_msg",
    "AdmissionController",
    "CodecError",
    "Entry",
    "GROUP_ACTORS",
    "GROUP_CREDIT",
    "GROUP_LEARNER",
    "KIND_REQUEST",
    "KIND_ROLLOUT",
    "KIND_SAW",
    "Keys",
    "Lease",
    "MAX_PAYLOAD_BYTES",
    "REDIS_DOWN_ERRORS",
    "SCHEMA_VERSION",
    "STREAM_GROUPS",
    "StreamConsumer",
    "alive",
    "as_str",
    "backlog",
    "backoff_sleep",
    "beat",
    "connect",
    "consumer_name",
    "decode_request",
    "decode_rollout",
    "decode_saw_item",
    "encode_request",
    "encode_rollout",
    "encode_saw_item",
    "ensure_group",
    "envelope",
    "get_int",
    "get_policy_version",
    "pack_array",
    "retry_redis",
    "stop_retrying",
    "set_learner_step",
    "set_policy_version",
    "unpack_array",
    "wait_below",
    "wait_event",
    "xadd",
]
