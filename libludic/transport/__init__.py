"""The one place for the wire: Redis keys, stream names, the msgpack codec, stream consumers.

A package: ``keys`` (key and stream names), ``codec`` (msgpack envelopes), ``connection``
(connect, the retry/backoff policy), ``consumer`` (streams, ``StreamConsumer``: read, claim,
commit, dead-letter), ``state`` (policy version, learner step, admission, heartbeats, lease),
and above them ``accounting`` (where every group of a run is; ``AccountedConsumer``).
Everything public but accounting is re-exported here: ``from libludic import transport;
transport.Keys``. Each module's docstring holds its part of the contract: the key layout
(``keys``), the envelope and what decoding refuses (``codec``), delivery and backpressure
(``consumer``), reconnects (``connection``).

Data flow (one consumer group per stream)::

    feeder --XADD--> requests --[actors]--> rollouts --[credit]--> saw --[learner]-->
                        \\___________________ deadletter <_______________/

Delivery: at-least-once in, exactly-once effect out; no pickle anywhere. Redis runs with
``appendonly yes``; the choice of ``appendfsync`` (``always`` or ``everysec``) and what a
crash can lose under each: DEVELOPERS.md, "Redis".
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
    deadletters_after_sync,
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
    "deadletters_after_sync",
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
