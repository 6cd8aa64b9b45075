"""The wire codec: round trips, packed arrays, and one rejection test per malformed kind."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from libludic import transport as t
from libludic.inference.request import InferenceSpec
from libludic.inference.sampling import SamplingConfig
from libludic.requests import EnvSpec, ProtocolSpec, RolloutRequest
from libludic.saw import SampleAttachments, SAWItem
from libludic.types import Rollout, Step, TokenTrace


def make_request() -> RolloutRequest:
    return RolloutRequest(
        env=EnvSpec("arithmetic", {"digits": 2, "ops": ["+", "-"]}),
        protocol=ProtocolSpec("single_agent", {"parser": None}),
        env_seed=7,
        sampling_seed=7000,
        inference=InferenceSpec(sampling=SamplingConfig(temperature=1.0, max_tokens=8)),
        num_episodes=4,
        meta={"group_id": "g7", "task": "add"},
        same_env_seed=True,
    )


def make_rollout(n_prompt: int = 12, n_completion: int = 5) -> Rollout:
    rng = np.random.default_rng(0)
    lp = (-rng.random(n_completion) * 3).astype(np.float32).tolist()
    tr = TokenTrace(
        prompt_token_ids=list(range(n_prompt)),
        completion_token_ids=[258, 65, 2**31 - 1, 0, 1][:n_completion],
        completion_logprobs=lp,
        temperature=0.6,
    )
    steps = [
        Step(
            0,
            "12+34=",
            "46",
            None,
            1.0,
            terminated=True,
            info={"parse_error": False, "finish_reason": "stop"},
            trace=tr,
            policy_version=3,
        ),
        Step(1, "x", "y", "z", -0.5, trace=None, policy_version=None, agent_id="b"),
    ]
    return Rollout(steps=steps, meta={"group_id": "g7", "request_id": "r1", "env_seed": 7})


def make_item(n: int = 16) -> SAWItem:
    n_state = n // 2
    return SAWItem(
        input_ids=list(range(100, 100 + n)),
        attention_mask=[1] * n,
        action_mask=[0] * n_state + [1] * (n - n_state),
        weight=-0.25,
        meta={"item_id": "r1:0", "group_id": "g7", "reward": 1.0},
        attachments=SampleAttachments(
            actor_logprobs=[0.0] * n_state + [-0.5] * (n - n_state),
            ref_logprobs=None,
            policy_version=3,
            temperature=0.6,
        ),
    )


def test_request_round_trip() -> None:
    req = make_request()
    assert t.decode_request(t.encode_request(req)) == req


def test_rollout_round_trip_with_packed_traces() -> None:
    ro = make_rollout()
    data = t.encode_rollout(ro)
    back = t.decode_rollout(data)
    assert back.to_dict() == ro.to_dict()  # logprobs were float32 already: exact
    assert back.steps[0].trace.temperature == 0.6  # type: ignore[union-attr]
    # token arrays travel as bin of little-endian int32, not as msgpack int lists
    raw = msgpack.unpackb(data, raw=False)
    trace = raw["body"]["steps"][0]["trace"]
    assert isinstance(trace["prompt_token_ids"], bytes) and len(trace["prompt_token_ids"]) == 12 * 4
    assert (
        isinstance(trace["completion_logprobs"], bytes)
        and len(trace["completion_logprobs"]) == 5 * 4
    )
    assert raw["schema_version"] == t.SCHEMA_VERSION and raw["kind"] == "rollout"


def test_float64_logprobs_round_to_float32() -> None:
    ro = make_rollout()
    ro.steps[0].trace.completion_logprobs = [-0.1234567891234] * 5  # type: ignore[union-attr]
    back = t.decode_rollout(t.encode_rollout(ro))
    # float32 keeps ~7 significant digits: |err| <= 2^-24 * 0.123 ~ 7e-9
    assert back.steps[0].trace.completion_logprobs == pytest.approx(
        [-0.1234567891234] * 5, abs=1e-8
    )  # type: ignore[union-attr]


def test_saw_item_round_trip_and_size() -> None:
    it = make_item(4096)
    data = t.encode_saw_item(it)
    back = t.decode_saw_item(data)
    assert back.to_dict() == it.to_dict()
    assert back.attachments.temperature == 0.6
    # 4096 tokens: 4 B ids + 1 B + 1 B masks + 4 B logprobs = 10 B/token, plus a small header
    assert 4096 * 10 <= len(data) < 4096 * 10 + 420


def test_decoded_saw_items_hold_packed_arrays_and_collate_like_lists() -> None:
    from libludic.training.collate import collate

    items = [make_item(n) for n in (7, 12, 3)]
    items[1].attachments.ref_logprobs = [-0.5] * 12
    items[0].attachments.ref_logprobs = [-0.25] * 7
    items[2].attachments.ref_logprobs = [0.0] * 3
    back = [t.decode_saw_item(t.encode_saw_item(it)) for it in items]
    ids = back[0].input_ids
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int32 and not ids.flags.writeable
    assert back[0].num_action_tokens == items[0].num_action_tokens
    got, want = collate(back, pad_token_id=9), collate(items, pad_token_id=9)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k
    # an item decoded from the wire encodes to the same bytes
    assert t.encode_saw_item(back[1]) == t.encode_saw_item(items[1])


def test_arrays_pack_with_range_and_kind_checks() -> None:
    assert t.pack_array(np.array([1, 2], dtype=np.int64), np.dtype("<i4")) == t.pack_array(
        [1, 2], np.dtype("<i4")
    )
    with pytest.raises(ValueError, match="int32"):
        t.pack_array(np.array([2**31], dtype=np.int64), np.dtype("<i4"))
    with pytest.raises(ValueError, match="int32"):
        t.pack_array(np.array([0.5]), np.dtype("<i4"))  # floats are not token ids
    with pytest.raises(ValueError, match="int32"):
        t.pack_array([0.5], np.dtype("<i4"))
    with pytest.raises(ValueError, match="uint8"):
        t.pack_array([256], np.dtype("u1"))
    with pytest.raises(ValueError, match="uint8"):
        t.pack_array([0.5], np.dtype("u1"))
    with pytest.raises(ValueError, match="float32"):
        t.pack_array([1e40], np.dtype("<f4"))  # would be inf on the wire
    assert t.pack_array([1, True, np.int64(7)], np.dtype("u1")) == b"\x01\x01\x07"
    assert np.frombuffer(t.pack_array([-1.5, 2], np.dtype("<f4")), "<f4").tolist() == [-1.5, 2.0]


def test_token_id_out_of_int32_range_is_an_encode_error() -> None:
    it = make_item(4)
    it.input_ids[0] = 2**31
    with pytest.raises(ValueError, match="int32"):
        t.encode_saw_item(it)


# ---- rejections: each malformed kind -> CodecError(reason) ----------------------------


def _env(body: object, *, version: object = t.SCHEMA_VERSION, kind: str = "rollout") -> bytes:
    return msgpack.packb({"schema_version": version, "kind": kind, "body": body}, use_bin_type=True)


def test_rejects_bad_msgpack() -> None:
    with pytest.raises(t.CodecError) as ei:
        t.decode_rollout(b"\xc1\xff not msgpack")
    assert ei.value.reason == "bad_msgpack"


def test_rejects_truncated_payload() -> None:
    data = t.encode_rollout(make_rollout())
    with pytest.raises(t.CodecError, match="bad_msgpack"):
        t.decode_rollout(data[:-7])


def test_rejects_trailing_bytes() -> None:
    with pytest.raises(t.CodecError, match="bad_msgpack"):
        t.decode_request(t.encode_request(make_request()) + b"\x00")


def test_rejects_non_bytes_payload() -> None:
    with pytest.raises(t.CodecError, match="bad_msgpack"):
        t.decode_request(None)


def test_rejects_top_level_not_a_map() -> None:
    with pytest.raises(t.CodecError, match="expected a map"):
        t.decode_request(msgpack.packb([1, 2, 3]))


def test_rejects_ext_types() -> None:
    data = msgpack.packb({"schema_version": 1, "kind": "rollout", "body": msgpack.ExtType(5, b"x")})
    with pytest.raises(t.CodecError, match="ext type 5"):
        t.decode_rollout(data)


def test_rejects_invalid_utf8() -> None:
    # a str header (0xa2, 2 bytes) holding invalid UTF-8: raw=False refuses it
    data = b"\x81\xa2\xff\xfe\x01"
    with pytest.raises(t.CodecError, match="bad_msgpack"):
        t.decode_rollout(data)


def test_rejects_non_string_map_keys() -> None:
    data = msgpack.packb({1: 2})
    with pytest.raises(t.CodecError, match="bad_msgpack"):
        t.decode_rollout(data)


def test_rejects_unknown_schema_version() -> None:
    with pytest.raises(t.CodecError) as ei:
        t.decode_rollout(_env(make_rollout().to_dict(), version=99))
    assert ei.value.reason == "unknown_schema_version"
    assert "99" in str(ei.value)


def test_rejects_missing_schema_version() -> None:
    data = msgpack.packb({"kind": "rollout", "body": {}})
    with pytest.raises(t.CodecError) as ei:
        t.decode_rollout(data)
    assert ei.value.reason == "missing_field"


def test_rejects_wrong_kind() -> None:
    with pytest.raises(t.CodecError) as ei:
        t.decode_rollout(t.encode_request(make_request()))
    assert ei.value.reason == "wrong_kind"


def test_rejects_missing_body() -> None:
    data = msgpack.packb({"schema_version": t.SCHEMA_VERSION, "kind": "rollout"})
    with pytest.raises(t.CodecError, match="missing_field"):
        t.decode_rollout(data)


@pytest.mark.parametrize("drop", ["steps", "id"])
def test_rejects_rollout_missing_field(drop: str) -> None:
    d = msgpack.unpackb(t.encode_rollout(make_rollout()), raw=False)["body"]
    del d[drop]
    with pytest.raises(t.CodecError) as ei:
        t.decode_rollout(_env(d))
    assert ei.value.reason == "missing_field" and drop in ei.value.detail


def test_rejects_request_missing_env() -> None:
    d = make_request().to_dict()
    del d["env"]
    with pytest.raises(t.CodecError, match="missing_field"):
        t.decode_request(_env(d, kind="rollout_request"))


@pytest.mark.parametrize("drop", ["input_ids", "action_mask", "weight"])
def test_rejects_saw_missing_field(drop: str) -> None:
    d = msgpack.unpackb(t.encode_saw_item(make_item()), raw=False)["body"]
    del d[drop]
    with pytest.raises(t.CodecError, match="missing_field"):
        t.decode_saw_item(_env(d, kind="saw_item"))


def test_rejects_token_ids_as_int_list() -> None:
    d = msgpack.unpackb(t.encode_saw_item(make_item()), raw=False)["body"]
    d["input_ids"] = list(range(16))  # token ids travel as packed arrays only
    with pytest.raises(t.CodecError, match="bad_field"):
        t.decode_saw_item(_env(d, kind="saw_item"))


def test_rejects_ragged_packed_array() -> None:
    d = msgpack.unpackb(t.encode_saw_item(make_item()), raw=False)["body"]
    d["input_ids"] = d["input_ids"][:-1]  # 63 bytes: not a multiple of 4
    with pytest.raises(t.CodecError, match="not a multiple of 4"):
        t.decode_saw_item(_env(d, kind="saw_item"))


def test_rejects_misaligned_lengths() -> None:
    d = msgpack.unpackb(t.encode_saw_item(make_item()), raw=False)["body"]
    d["action_mask"] = d["action_mask"][:-1]
    with pytest.raises(t.CodecError, match="bad_field"):
        t.decode_saw_item(_env(d, kind="saw_item"))


def test_rejects_wrong_weight_type() -> None:
    d = msgpack.unpackb(t.encode_saw_item(make_item()), raw=False)["body"]
    d["weight"] = "high"
    with pytest.raises(t.CodecError, match="bad_field"):
        t.decode_saw_item(_env(d, kind="saw_item"))


def test_rejects_steps_not_a_list() -> None:
    d = msgpack.unpackb(t.encode_rollout(make_rollout()), raw=False)["body"]
    d["steps"] = {"a": 1}
    with pytest.raises(t.CodecError, match="bad_field"):
        t.decode_rollout(_env(d))


def test_unencodable_meta_names_the_fix() -> None:
    ro = make_rollout()
    ro.meta["obj"] = object()
    with pytest.raises(ValueError, match="meta/info values"):
        t.encode_rollout(ro)


def test_keys_are_namespaced_with_a_hash_tag() -> None:
    k = t.Keys("run1")
    assert k.requests == "ludic:{run1}:requests"
    assert k.policy_version == "ludic:{run1}:policy_version"
    assert k.heartbeat("actor", "a1") == "ludic:{run1}:heartbeat:actor:a1"
    with pytest.raises(ValueError, match="LUDIC_RUN_ID"):
        t.Keys("bad:id")


@pytest.mark.parametrize("where", ["weight", "reward", "actor_logprobs", "ref_logprobs"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_numbers_are_refused_on_both_sides_of_the_wire(where: str, value: float) -> None:
    it = make_item(6)
    it.attachments.ref_logprobs = [0.0] * 6
    clean = t.encode_saw_item(it)
    if where == "weight":
        it.weight = value
    elif where == "reward":
        it.meta["reward"] = value
    else:
        getattr(it.attachments, where)[4] = value
    with pytest.raises(ValueError, match="non-finite"):
        t.encode_saw_item(it)  # the credit stage refuses to send it
    # a producer that skips the check: the learner's decode refuses it (dead-lettered)
    body = msgpack.unpackb(clean, raw=False)["body"]
    if where == "weight":
        body["weight"] = value
    elif where == "reward":
        body["meta"]["reward"] = value
    else:
        arr = np.frombuffer(body["attachments"][where], dtype="<f4").copy()
        arr[4] = value
        body["attachments"][where] = arr.tobytes()
    with pytest.raises(t.CodecError, match="non-finite") as e:
        t.decode_saw_item(_env(body, kind="saw_item"))
    assert e.value.reason == "bad_field"


@pytest.mark.parametrize("version", [True, 1.0])
def test_schema_version_must_be_the_integer_itself(version: object) -> None:
    # True == 1.0 == 1 in Python: a plain comparison would accept both
    data = msgpack.packb({"schema_version": version, "kind": "rollout", "body": {}})
    with pytest.raises(t.CodecError) as ei:
        t.decode_rollout(data)
    assert ei.value.reason == "unknown_schema_version"


@pytest.mark.parametrize("n", [2**31, 2**63 - 1])
def test_request_claiming_too_many_episodes_is_a_codec_error(n: int) -> None:
    # the actor lists a request's episodes up front: 2^31 of them exhausted its memory
    body = make_request().to_dict() | {"num_episodes": n}
    with pytest.raises(t.CodecError, match=r"num_episodes=\d+ must be in \[1, 65536\]") as ei:
        t.decode_request(
            msgpack.packb({"schema_version": 1, "kind": "rollout_request", "body": body})
        )
    assert ei.value.reason == "bad_field"


@pytest.mark.parametrize("temp", [float("nan"), float("inf")])
def test_non_finite_temperature_is_never_sent_nor_read(temp: float) -> None:
    # the learner divides the item's logits by it: a NaN loss for the whole batch
    item = make_item()
    item.attachments.temperature = temp
    with pytest.raises(ValueError, match="non-finite temperature"):
        t.encode_saw_item(item)
    env = msgpack.unpackb(t.encode_saw_item(make_item()))
    env["body"]["attachments"]["temperature"] = temp
    with pytest.raises(t.CodecError, match="non-finite temperature") as ei:
        t.decode_saw_item(msgpack.packb(env, use_bin_type=True))
    assert ei.value.reason == "bad_field"


def test_a_pending_batch_stage_travels_typed_and_is_checked_once() -> None:
    """credit's group-stage-only stamp (PendingBatchStage) round-trips as a typed field; an
    item written before the field (meta keys) decodes to the same; a malformed stamp is a
    codec error (dead-lettered at read), never an item that fails a step."""
    from libludic.saw import PendingBatchStage

    item = make_item(8)
    item.pending = PendingBatchStage(3, -0.25)
    back = t.decode_saw_item(t.encode_saw_item(item))
    assert back.pending == item.pending and "rollout_items" not in back.meta
    legacy = make_item(8)
    legacy.meta.update(pending_batch_stage="scalerl", rollout_items=3, episode_weight=-0.25)
    back = t.decode_saw_item(t.encode_saw_item(legacy))
    assert back.pending == item.pending and "pending_batch_stage" not in back.meta
    assert t.decode_saw_item(t.encode_saw_item(make_item(8))).pending is None
    bad = make_item(8)
    bad.pending = PendingBatchStage(0)
    with pytest.raises(t.CodecError, match="rollout_items=0 is not a positive integer"):
        t.decode_saw_item(t.encode_saw_item(bad))


def test_the_credit_fingerprint_travels_in_the_body_and_is_checked_at_read() -> None:
    """SAWItem.credited_by (libludic.fingerprint) round-trips; an unstamped item stays
    unstamped; a value that is not a fingerprint is a codec error (dead-lettered)."""
    item = make_item(8)
    item.credited_by = "scalerl:0123456789ab"
    assert t.decode_saw_item(t.encode_saw_item(item)).credited_by == "scalerl:0123456789ab"
    assert t.decode_saw_item(t.encode_saw_item(make_item(8))).credited_by is None
    for bad_stamp in ("scalerl", "scalerl:XYZ", 7):
        bad = make_item(8)
        bad.credited_by = bad_stamp  # type: ignore[assignment]
        with pytest.raises(t.CodecError, match="credited_by="):
            t.decode_saw_item(t.encode_saw_item(bad))
