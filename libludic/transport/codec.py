"""The msgpack wire codec: envelopes, packed token arrays, encode/decode of requests,
rollouts and SAWItems; ``CodecError`` on anything malformed.

An entry is ``{"id": item_id, "d": payload}``; ``payload`` is msgpack of
``{"schema_version": SCHEMA_VERSION, "kind": k, "body": {...}}`` with ``k`` one of
``rollout_request``, ``rollout``, ``saw_item``. Token ids travel as msgpack ``bin`` of
little-endian int32 bytes, logprobs as float32 bytes, masks as uint8 bytes -- never lists
of Python ints. Unpacking uses ``raw=False`` (strings must be valid UTF-8),
``strict_map_key=True`` (map keys are str/bytes only), rejects every ext type and caps
the buffer size. Anything that does not decode to the expected shape raises
:class:`CodecError` with a machine-readable ``reason``. No pickle anywhere.
"""

from __future__ import annotations

import functools
import logging
import math
import struct
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import msgpack
import numpy as np

from libludic.fingerprint import fingerprint_problem
from libludic.requests import RolloutRequest
from libludic.saw import PendingBatchStage, SampleAttachments, SAWItem
from libludic.types import Rollout

log = logging.getLogger("libludic.transport")

SCHEMA_VERSION = 1
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
KIND_REQUEST = "rollout_request"
KIND_ROLLOUT = "rollout"
KIND_SAW = "saw_item"
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_U8 = np.dtype("u1")
# a list of Python numbers packs 3x faster through a cached little-endian struct.Struct than
# through array.array or np.asarray (bench/transport.py), and bytes 8x faster via bytearray
_STRUCT_CODE = {_I32: "i", _F32: "f"}


@functools.lru_cache(maxsize=256)
def _struct_for(code: str, n: int) -> struct.Struct:
    return struct.Struct(f"<{n}{code}")


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


def pack_msg(obj: Any) -> bytes:
    try:
        return cast(bytes, msgpack.packb(obj, use_bin_type=True, datetime=False))
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(
            f"cannot encode {type(obj).__name__} for the wire: {e}; meta/info values must be "
            "str/int/float/bool/None/bytes or lists/dicts of them"
        ) from e


def unpack_msg(data: Any) -> Any:
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


def pack_array(values: Sequence[Any] | np.ndarray | None, dtype: np.dtype) -> bytes | None:
    """Little-endian bytes of ``values`` as ``dtype``; ValueError when a value does not fit."""
    if values is None:
        return None
    try:
        if isinstance(values, np.ndarray):
            if values.dtype != dtype and not np.can_cast(values.dtype, dtype, "same_kind"):
                raise TypeError(f"array of {values.dtype} cannot be sent as {dtype}")
            if values.dtype.kind in "iu" and values.size and dtype.kind in "iu":
                info = np.iinfo(dtype)
                lo, hi = int(values.min()), int(values.max())
                if lo < info.min or hi > info.max:
                    raise OverflowError(f"values in [{lo}, {hi}] outside [{info.min}, {info.max}]")
            return values.astype(dtype, copy=False).tobytes()
        if dtype == _U8:
            return bytes(bytearray(values))  # ValueError outside 0..255, TypeError for floats
        code = _STRUCT_CODE.get(dtype)
        if code is not None:
            return _struct_for(code, len(values)).pack(*values)
        return np.asarray(values, dtype=dtype).tobytes()
    except (OverflowError, ValueError) as e:
        raise ValueError(f"value does not fit {dtype}: {e}") from e
    except (TypeError, struct.error) as e:
        raise ValueError(f"cannot pack as {dtype}: {e}") from e


def _check_packed(raw: Any, dtype: np.dtype, what: str) -> bytes:
    if not isinstance(raw, bytes):
        raise CodecError(
            "bad_field", f"{what} must be packed {dtype} bytes, got {type(raw).__name__}"
        )
    if len(raw) % dtype.itemsize:
        raise CodecError(
            "bad_field", f"{what} has {len(raw)} bytes, not a multiple of {dtype.itemsize}"
        )
    return raw


def unpack_array(raw: Any, dtype: np.dtype, what: str) -> list[Any] | None:
    """Packed bytes -> a list of Python numbers (None stays None)."""
    if raw is None:
        return None
    out: list[Any] = np.frombuffer(_check_packed(raw, dtype, what), dtype=dtype).tolist()
    return out


def unpack_ndarray(raw: Any, dtype: np.dtype, what: str) -> np.ndarray | None:
    """Packed bytes -> a read-only 1-D array over them, no copy (None stays None)."""
    if raw is None:
        return None
    return np.frombuffer(_check_packed(raw, dtype, what), dtype=dtype)


def envelope(kind: str, body: dict[str, Any]) -> bytes:
    return pack_msg({"schema_version": SCHEMA_VERSION, "kind": kind, "body": body})


def _open(data: Any, kind: str) -> dict[str, Any]:
    obj = unpack_msg(data)
    if not isinstance(obj, dict):
        raise CodecError("bad_msgpack", f"top level is {type(obj).__name__}, expected a map")
    if "schema_version" not in obj:
        raise CodecError("missing_field", "schema_version")
    v = obj["schema_version"]
    if type(v) is not int or v != SCHEMA_VERSION:  # True and 1.0 equal 1 in Python
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


T = TypeVar("T")


def _build(what: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except CodecError:
        raise
    except KeyError as e:
        raise CodecError("missing_field", f"{what}: {e.args[0]}") from e
    except (TypeError, ValueError, AttributeError, IndexError) as e:
        raise CodecError("bad_field", f"{what}: {type(e).__name__}: {e}") from e


def encode_request(req: RolloutRequest) -> bytes:
    return envelope(KIND_REQUEST, req.to_dict())


def decode_request(data: Any) -> RolloutRequest:
    body = _open(data, KIND_REQUEST)

    # what the request names is checked by the actor against its run's tasks, not here
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
    return envelope(KIND_ROLLOUT, d)


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


def _nonfinite_scalar(item: SAWItem) -> str | None:
    if not math.isfinite(item.weight):
        return f"weight={item.weight}"
    temp = item.attachments.temperature  # the learner divides the item's logits by it
    if temp is not None and not math.isfinite(temp):
        return f"temperature={temp}"
    reward = item.meta.get("reward")
    if isinstance(reward, float) and not math.isfinite(reward):
        return f"meta.reward={reward}"
    return None


def _nonfinite_array(name: str, lp: Any) -> str | None:
    if lp is not None and not np.isfinite(lp).all():
        return f"{name} holds a non-finite value"
    return None


def encode_saw_item(item: SAWItem) -> bytes:
    """ValueError for what the learner must never train on: a non-finite weight, reward,
    temperature or logprob (one such item turns every parameter into NaN after the optimizer step)."""
    att = item.attachments
    packed = {
        name: pack_array(getattr(att, name), _F32) for name in ("actor_logprobs", "ref_logprobs")
    }
    # the packed float32 values are checked: what the learner will read, overflow included
    bad = _nonfinite_scalar(item)
    for name, raw in packed.items():
        bad = bad or _nonfinite_array(name, None if raw is None else np.frombuffer(raw, _F32))
    if bad is not None:
        raise ValueError(f"SAWItem {item.item_id!r}: non-finite {bad}")
    body: dict[str, Any] = {
        "input_ids": pack_array(item.input_ids, _I32),
        "attention_mask": pack_array(item.attention_mask, _U8),
        "action_mask": pack_array(item.action_mask, _U8),
        "weight": float(item.weight),
        "meta": dict(item.meta),
        "attachments": {
            **packed,
            "policy_version": att.policy_version,
            "temperature": att.temperature,
        },
    }
    if item.pending is not None:
        body["pending_batch_stage"] = item.pending.to_dict()
    if item.credited_by is not None:
        body["credited_by"] = item.credited_by
    return envelope(KIND_SAW, body)


def _required_array(raw: Any, dtype: np.dtype, what: str) -> np.ndarray:
    out = unpack_ndarray(raw, dtype, what)
    if out is None:
        raise TypeError(f"{what} must be packed {dtype} bytes, got nil")
    return out


# how an item said its batch stage was pending before the typed field: read, then dropped
_LEGACY_PENDING = ("pending_batch_stage", "rollout_items", "episode_weight")


def _pending_stage(raw: Any, meta: dict[str, Any]) -> PendingBatchStage | None:
    """The typed batch-stage stamp (or the meta keys of an item written before it), checked:
    a malformed one is a TypeError (the item is dead-lettered, never trained)."""
    if raw is None and "pending_batch_stage" in meta:
        raw = {k: meta.get(k) for k in _LEGACY_PENDING[1:]}
    for k in _LEGACY_PENDING:
        meta.pop(k, None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise TypeError(f"pending_batch_stage must be a map, got {type(raw).__name__}")
    pending = PendingBatchStage.from_dict(raw)
    why = pending.problem()
    if why is not None:
        raise TypeError(why)
    return pending


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
        pending = _pending_stage(body.get("pending_batch_stage"), meta)
        credited_by = body.get("credited_by")
        if credited_by is not None and (why := fingerprint_problem(credited_by)) is not None:
            raise TypeError(why)
        # the token arrays stay packed: read-only numpy views of the received bytes, which
        # collate copies straight into the batch tensors (no Python number per token)
        return SAWItem(
            input_ids=_required_array(body["input_ids"], _I32, "input_ids"),
            attention_mask=_required_array(body["attention_mask"], _U8, "attention_mask"),
            action_mask=_required_array(body["action_mask"], _U8, "action_mask"),
            weight=float(weight),
            meta=meta,
            attachments=SampleAttachments(
                actor_logprobs=unpack_ndarray(att.get("actor_logprobs"), _F32, "actor_logprobs"),
                ref_logprobs=unpack_ndarray(att.get("ref_logprobs"), _F32, "ref_logprobs"),
                policy_version=pv,
                temperature=_opt_number(att.get("temperature"), "temperature"),
            ),
            pending=pending,
            credited_by=credited_by,
        )

    item = _build("SAWItem", build)
    att = item.attachments
    bad = (
        _nonfinite_scalar(item)
        or _nonfinite_array("actor_logprobs", att.actor_logprobs)
        or _nonfinite_array("ref_logprobs", att.ref_logprobs)
    )
    if bad is not None:
        raise CodecError("bad_field", f"SAWItem {item.item_id!r}: non-finite {bad}")
    return item
