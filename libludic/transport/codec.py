"""The msgpack wire codec: envelopes, packed token arrays, encode/decode of requests,
rollouts and SAWItems; ``CodecError`` on anything malformed (see the package docstring)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import msgpack
import numpy as np

from libludic.rollout.request import RolloutRequest
from libludic.training.types import SampleAttachments, SAWItem
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
    out: list[Any] = np.frombuffer(raw, dtype=dtype).tolist()
    return out


def envelope(kind: str, body: dict[str, Any]) -> bytes:
    return pack_msg({"schema_version": SCHEMA_VERSION, "kind": kind, "body": body})


def _open(data: Any, kind: str) -> dict[str, Any]:
    obj = unpack_msg(data)
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
    return envelope(KIND_SAW, body)


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
