"""Deterministic hostile stream entries: valid entries made with the real codec, then mutated.

``hostile(kind, n, seed)`` returns ``n`` :class:`Hostile` entries for one stream kind
(``requests``, ``rollouts``, ``saw``). Every entry says what must happen to it:

- ``DEADLETTER``: the consumer moves it to the dead-letter stream with a reason in
  ``reasons`` (truncated or undecodable bytes, wrong types, missing fields, wrong schema,
  non-finite numbers, ragged arrays, ids outside the vocabulary, absurd group meta, ...).
- ``PROCESSED``: the mutation leaves a valid entry (an extra unknown field, a greedy
  temperature, a group that declares more rollouts than ever come, token ids credit cannot
  judge): the consumer handles it like any other entry and never dead-letters it.
- ``EITHER``: random byte flips, and values whose validity is the environment's to judge
  (env kwargs): dead-lettered with any reason or processed, but exactly one of the two.

The mutations work on the decoded msgpack envelope (then re-packed) or on the raw bytes
(truncation, flips, msgpack headers that claim 2^31 elements, an entry over the codec's
64 MiB cap). Same ``(kind, n, seed)``, same entries.
"""

from __future__ import annotations

import copy
import os
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from libludic import transport as t
from libludic.requests import RolloutRequest
from libludic.saw import SampleAttachments, SAWItem
from libludic.tasks import TaskSpec
from libludic.types import Rollout, Step, TokenTrace

#: hostile entries per stream / bodies per route, and the seed (printed in the summary)
FUZZ_N = int(os.environ.get("LUDIC_FUZZ_N", "200"))
FUZZ_SEED = int(os.environ.get("LUDIC_FUZZ_SEED", "0"))

DEADLETTER, PROCESSED, EITHER = "deadletter", "processed", "either"
KINDS = ("requests", "rollouts", "saw")
IM_END = 258  # the tiny model: ids 0..258
VOCAB = 259
NAN, INF = float("nan"), float("inf")
CODEC = frozenset({"bad_msgpack", "bad_field", "missing_field"})
SHAPE = frozenset({"bad_field", "missing_field"})
NOT_A_TASK = frozenset({"not_a_task"})


@dataclass(frozen=True)
class Hostile:
    kind: str
    mutation: str
    payload: bytes
    fate: str
    reasons: frozenset[str] = frozenset()  # accepted dead-letter reasons (DEADLETTER only)


# ------------------------------------------------------------------------------ valid entries


#: the one task of the fuzzed actor's run: a valid request is one of it
TASK = {
    "name": "add1",
    "env": {"kind": "arithmetic", "kwargs": {"digits": 1}},
    "inference": {"sampling": {"max_tokens": 4}},
}


def valid_request(rid: str, seed: int = 0) -> RolloutRequest:
    return TaskSpec.from_dict(TASK).request(
        id=rid, env_seed=seed, sampling_seed=None, num_episodes=1, meta={"group_id": rid},
        same_env_seed=False,
    )  # fmt: skip


def valid_rollout(gid: str, i: int = 0, reward: float = 1.0, group_rollouts: int = 1) -> Rollout:
    tr = TokenTrace([257, 49, 43, 50], [51, IM_END], [-0.25, -0.5], temperature=1.0)
    step = Step(
        0, "1+2=", "3", None, reward, terminated=True, trace=tr, policy_version=0,
        info={"finish_reason": "stop"},
    )  # fmt: skip
    meta = {"group_id": gid, "request_id": gid, "group_rollouts": group_rollouts}
    return Rollout(id=f"{gid}-r{i}", steps=[step], meta=meta)


def valid_saw(item_id: str, seed: int = 0) -> SAWItem:
    rng = random.Random(seed)
    state = [rng.randrange(97, 123) for _ in range(rng.randint(3, 8))]
    act = [rng.randrange(48, 58) for _ in range(rng.randint(1, 4))] + [IM_END]
    ids = state + act
    return SAWItem(
        input_ids=ids,
        attention_mask=[1] * len(ids),
        action_mask=[0] * len(state) + [1] * len(act),
        weight=rng.choice([1.0, -0.5, 0.75]),
        meta={"item_id": item_id, "reward": rng.random(), "group_id": item_id},
        attachments=SampleAttachments(
            actor_logprobs=[0.0] * len(state) + [-5.5] * len(act),
            policy_version=0,
            temperature=1.0,
        ),
    )


def encode_valid(kind: str, name: str, seed: int = 0) -> bytes:
    if kind == "requests":
        return t.encode_request(valid_request(name, seed))
    if kind == "rollouts":
        return t.encode_rollout(valid_rollout(name, reward=float(seed % 2)))
    return t.encode_saw_item(valid_saw(name, seed))


# ------------------------------------------------------------------------------ helpers

Env = dict[str, Any]  # the decoded envelope {"schema_version", "kind", "body"}


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def _unpack(payload: bytes) -> Env:
    return msgpack.unpackb(payload, raw=False)  # type: ignore[no-any-return]


def _f32(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def _i32(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def _set(env: Env, path: str, value: Any) -> Env:
    """A copy of ``env`` with ``body.<path>`` (dots, ints index lists) set, or removed when
    ``value`` is :data:`_DROP`."""
    out = copy.deepcopy(env)
    node: Any = out["body"]
    keys: list[Any] = [int(k) if k.isdigit() else k for k in path.split(".")]
    for k in keys[:-1]:
        node = node[k]
    if value is _DROP:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return out


_DROP = object()

# (mutation name, path under body, value, fate, reasons): per kind, the field-level cases
Case = tuple[str, str, Any, str, frozenset[str]]

WRONG_TYPES: list[Any] = ["abc", 1.5, [1, 2], {"x": 1}, True, None, b"\x00\x01"]

REQUEST_CASES: list[Case] = [
    ("missing id", "id", _DROP, DEADLETTER, SHAPE),
    ("missing env", "env", _DROP, DEADLETTER, SHAPE),
    ("env not a map", "env", "arithmetic", DEADLETTER, SHAPE),
    ("env kind missing", "env.kind", _DROP, DEADLETTER, SHAPE),
    # what a request may run is bounded by the run's tasks: anything else is not_a_task
    ("unknown env", "env.kind", "no_such_env", DEADLETTER, NOT_A_TASK),
    ("env import path", "env.kind", "os:system", DEADLETTER, NOT_A_TASK),
    ("env outside the package", "env.kind", "tests.import_marker:Env", DEADLETTER, NOT_A_TASK),
    ("env kwargs wrong", "env.kwargs", {"digits": "many"}, DEADLETTER, NOT_A_TASK),
    ("env kwargs unknown", "env.kwargs", {"bogus": 1}, DEADLETTER, NOT_A_TASK),
    ("num_episodes 0", "num_episodes", 0, DEADLETTER, SHAPE),
    ("num_episodes -1", "num_episodes", -1, DEADLETTER, SHAPE),
    ("num_episodes str", "num_episodes", "abc", DEADLETTER, SHAPE),
    ("num_episodes 2^31", "num_episodes", 2**31, DEADLETTER, SHAPE),
    ("num_episodes 2^63-1", "num_episodes", 2**63 - 1, DEADLETTER, SHAPE),
    ("meta a list", "meta", [1, 2], DEADLETTER, SHAPE),
    ("protocol not a map", "protocol", 7, DEADLETTER, SHAPE),
    ("unknown protocol", "protocol.kind", "nope", DEADLETTER, NOT_A_TASK),
    ("agent kind", "protocol.agent", {"kind": "nope"}, DEADLETTER, NOT_A_TASK),
    ("agent import path", "protocol.agent", {"kind": "subprocess:Popen"}, DEADLETTER, NOT_A_TASK),
    ("reward function", "reward", {"functions": [{"kind": "os:system"}]}, DEADLETTER, NOT_A_TASK),
    ("agent not a map", "protocol.agent", "tool", DEADLETTER, SHAPE),
    ("sampling unknown key", "inference.sampling", {"bogus": 1}, DEADLETTER, SHAPE),
    ("inference not a map", "inference", [1], DEADLETTER, SHAPE),
    ("extra field", "zzz_extra", {"a": [1, 2, 3]}, PROCESSED, frozenset()),
]

ROLLOUT_CASES: list[Case] = [
    ("missing id", "id", _DROP, DEADLETTER, SHAPE),
    ("missing steps", "steps", _DROP, DEADLETTER, SHAPE),
    ("steps a map", "steps", {"0": 1}, DEADLETTER, SHAPE),
    ("step not a map", "steps.0", 3, DEADLETTER, SHAPE),
    ("step reward str", "steps.0.reward", "abc", DEADLETTER, SHAPE),
    ("step reward missing", "steps.0.reward", _DROP, DEADLETTER, SHAPE),
    ("step index str", "steps.0.index", "x", DEADLETTER, SHAPE),
    ("trace not a map", "steps.0.trace", [1], DEADLETTER, SHAPE),
    ("trace ids a list", "steps.0.trace.completion_token_ids", [51, 258], DEADLETTER, SHAPE),
    ("trace ids odd bytes", "steps.0.trace.prompt_token_ids", b"\x01\x02\x03", DEADLETTER, SHAPE),
    ("trace logprobs str", "steps.0.trace.completion_logprobs", "x", DEADLETTER, SHAPE),
    ("trace temperature str", "steps.0.trace.temperature", "hot", DEADLETTER, SHAPE),
    ("meta a list", "meta", [1], DEADLETTER, SHAPE),
    # credit cannot build a finite item from these: the group is dead-lettered
    ("reward NaN", "steps.0.reward", NAN, DEADLETTER, frozenset({"credit_error", "bad_field"})),
    ("reward inf", "steps.0.reward", INF, DEADLETTER, frozenset({"credit_error", "bad_field"})),
    (
        "logprobs NaN",
        "steps.0.trace.completion_logprobs",
        _f32([NAN, -0.5]),
        DEADLETTER,
        frozenset({"credit_error", "bad_field"}),
    ),
    (
        "logprobs ragged",
        "steps.0.trace.completion_logprobs",
        _f32([-0.25, -0.5, -1.0]),
        DEADLETTER,
        frozenset({"credit_error", "bad_field"}),
    ),
    (
        "temperature NaN",
        "steps.0.trace.temperature",
        NAN,
        DEADLETTER,
        frozenset({"credit_error", "bad_field"}),
    ),
    ("group_rollouts str", "meta.group_rollouts", "abc", DEADLETTER, frozenset({"bad_field"})),
    ("group_rollouts 0", "meta.group_rollouts", 0, DEADLETTER, frozenset({"bad_field"})),
    ("group_rollouts -1", "meta.group_rollouts", -1, DEADLETTER, frozenset({"bad_field"})),
    ("group_rollouts 2^40", "meta.group_rollouts", 2**40, DEADLETTER, frozenset({"bad_field"})),
    ("group_rollouts bool", "meta.group_rollouts", True, DEADLETTER, frozenset({"bad_field"})),
    ("group_rollouts float", "meta.group_rollouts", 1.5, DEADLETTER, frozenset({"bad_field"})),
    # valid but odd: credit has no vocabulary (the learner refuses such items), a group that
    # waits for a second rollout that never comes is dropped at its timeout, extras ignored
    ("negative token ids", "steps.0.trace.completion_token_ids", _i32([-5, -1]), PROCESSED, frozenset()),
    ("out-of-vocab ids", "steps.0.trace.completion_token_ids", _i32([10**6, 2**31 - 1]), PROCESSED, frozenset()),
    ("group_rollouts 2", "meta.group_rollouts", 2, PROCESSED, frozenset()),
    ("extra field", "zzz_extra", [1, {"b": None}], PROCESSED, frozenset()),
]  # fmt: skip

SAW_UNUSABLE = frozenset({"unusable_item"})
BAD_FIELD = frozenset({"bad_field"})
SAW_CASES: list[Case] = [
    ("missing input_ids", "input_ids", _DROP, DEADLETTER, SHAPE),
    ("missing weight", "weight", _DROP, DEADLETTER, SHAPE),
    ("input_ids a list", "input_ids", [1, 2, 3], DEADLETTER, SHAPE),
    ("input_ids odd bytes", "input_ids", b"\x01\x02\x03\x04\x05", DEADLETTER, SHAPE),
    ("weight str", "weight", "1.0", DEADLETTER, SHAPE),
    ("weight bool", "weight", True, DEADLETTER, SHAPE),
    ("weight NaN", "weight", NAN, DEADLETTER, frozenset({"bad_field"})),
    ("weight -inf", "weight", -INF, DEADLETTER, frozenset({"bad_field"})),
    ("reward NaN", "meta.reward", NAN, DEADLETTER, frozenset({"bad_field"})),
    ("reward inf", "meta.reward", INF, DEADLETTER, frozenset({"bad_field"})),
    ("reward str", "meta.reward", "abc", DEADLETTER, SAW_UNUSABLE),
    ("reward list", "meta.reward", [1.0], DEADLETTER, SAW_UNUSABLE),
    ("meta a list", "meta", [1], DEADLETTER, SHAPE),
    ("attachments a list", "attachments", [1], DEADLETTER, SHAPE),
    ("policy_version str", "attachments.policy_version", "0", DEADLETTER, SHAPE),
    ("policy_version float", "attachments.policy_version", 0.5, DEADLETTER, SHAPE),
    ("temperature str", "attachments.temperature", "hot", DEADLETTER, SHAPE),
    ("temperature NaN", "attachments.temperature", NAN, DEADLETTER, frozenset({"bad_field"})),
    ("temperature inf", "attachments.temperature", INF, DEADLETTER, frozenset({"bad_field"})),
    # the typed batch-stage stamp: checked by the codec, its algorithm by the learner's
    (
        "pending stage foreign",
        "pending_batch_stage",
        {"algorithm": "scalerl", "rollout_items": 1},
        DEADLETTER,
        SAW_UNUSABLE,
    ),
    ("pending stage not a map", "pending_batch_stage", "scalerl", DEADLETTER, BAD_FIELD),
    (
        "rollout_items str",
        "pending_batch_stage",
        {"algorithm": "grpo", "rollout_items": "abc"},
        DEADLETTER,
        BAD_FIELD,
    ),
    (
        "rollout_items 0",
        "pending_batch_stage",
        {"algorithm": "grpo", "rollout_items": 0},
        DEADLETTER,
        BAD_FIELD,
    ),
    (
        "episode_weight NaN",
        "pending_batch_stage",
        {"algorithm": "grpo", "rollout_items": 1, "episode_weight": NAN},
        DEADLETTER,
        BAD_FIELD,
    ),
    # written before the typed field (meta keys): read as the same stamp
    ("legacy pending stage", "meta.pending_batch_stage", "scalerl", DEADLETTER, BAD_FIELD),
    ("temperature 0 (greedy)", "attachments.temperature", 0.0, PROCESSED, frozenset()),
    ("policy_version nil", "attachments.policy_version", None, PROCESSED, frozenset()),
    ("policy_version -7", "attachments.policy_version", -7, PROCESSED, frozenset()),
    ("weight 0", "weight", 0.0, PROCESSED, frozenset()),
    ("extra field", "zzz_extra", {"k": [1, 2]}, PROCESSED, frozenset()),
    ("extra meta", "meta.zzz", [None, 1.5], PROCESSED, frozenset()),
]


def _saw_array_cases(env: Env) -> list[tuple[str, Env, str, frozenset[str]]]:
    """Array-level SAW mutations that depend on the item's length."""
    body = env["body"]
    ids = list(struct.unpack(f"<{len(body['input_ids']) // 4}i", body["input_ids"]))
    n = len(ids)
    lp = list(struct.unpack(f"<{n}f", body["attachments"]["actor_logprobs"]))
    out: list[tuple[str, Env, str, frozenset[str]]] = []
    neg = ids[:]
    neg[0] = -3
    out.append(("negative token id", _set(env, "input_ids", _i32(neg)), DEADLETTER, SAW_UNUSABLE))
    oov = ids[:]
    oov[-1] = VOCAB
    out.append(("token id = vocab", _set(env, "input_ids", _i32(oov)), DEADLETTER, SAW_UNUSABLE))
    huge = ids[:]
    huge[1] = 2**31 - 1
    out.append(("token id 2^31-1", _set(env, "input_ids", _i32(huge)), DEADLETTER, SAW_UNUSABLE))
    out.append(
        (
            "actor_logprobs ragged",
            _set(env, "attachments.actor_logprobs", _f32(lp[:-1])),
            DEADLETTER,
            frozenset({"bad_field"}),
        )
    )
    out.append(
        (
            "attention_mask ragged",
            _set(env, "attention_mask", bytes([1] * (n + 2))),
            DEADLETTER,
            frozenset({"bad_field"}),
        )
    )
    out.append(
        (
            "ref_logprobs ragged",
            _set(env, "attachments.ref_logprobs", _f32([0.0] * (n + 1))),
            DEADLETTER,
            SAW_UNUSABLE,
        )
    )
    bad_lp = lp[:]
    bad_lp[-1] = NAN
    out.append(
        (
            "actor_logprobs NaN",
            _set(env, "attachments.actor_logprobs", _f32(bad_lp)),
            DEADLETTER,
            frozenset({"bad_field"}),
        )
    )
    out.append(
        (
            "ref_logprobs inf",
            _set(env, "attachments.ref_logprobs", _f32([-INF] * n)),
            DEADLETTER,
            frozenset({"bad_field"}),
        )
    )
    out.append(
        (
            "empty item",
            _set(_set(_set(_set(env, "input_ids", b""), "attention_mask", b""), "action_mask", b""),
                 "attachments.actor_logprobs", b""),
            DEADLETTER,
            SAW_UNUSABLE,
        )
    )  # fmt: skip
    out.append(("no action token", _set(env, "action_mask", bytes(n)), DEADLETTER, SAW_UNUSABLE))
    return out


def _raw_cases(kind_name: str) -> list[tuple[str, bytes]]:
    """Bytes whose msgpack headers claim 2^31 (or 2^32 - 1) elements or bytes."""
    head = (
        b"\x83" + _pack("schema_version") + _pack(t.SCHEMA_VERSION) + _pack("kind")
        + _pack(kind_name) + _pack("body")
    )  # fmt: skip
    return [
        ("map32 claims 2^31 entries", head + b"\xdf\x80\x00\x00\x00" + _pack("id") + _pack("x")),
        ("array32 claims 2^31 items", b"\xdd\x80\x00\x00\x00\x01\x02"),
        ("bin32 claims 4 GiB", head + b"\x81" + _pack("input_ids") + b"\xc6\xff\xff\xff\xff\x00"),
        ("str32 claims 2^31 bytes", head + b"\x81" + _pack("id") + b"\xdb\x80\x00\x00\x00ab"),
        ("top-level nil", b"\xc0"),
        ("top-level list", _pack([t.SCHEMA_VERSION, kind_name, {}])),
        ("ext type", _pack(msgpack.ExtType(5, b"\x00" * 8))),
        ("trailing garbage", b""),  # filled in with a valid payload + junk below
        ("empty payload", b""),
    ]


_KIND_NAME = {"requests": t.KIND_REQUEST, "rollouts": t.KIND_ROLLOUT, "saw": t.KIND_SAW}
_CASES = {"requests": REQUEST_CASES, "rollouts": ROLLOUT_CASES, "saw": SAW_CASES}


def oversized(kind: str) -> Hostile:
    """One entry past the codec's ``MAX_PAYLOAD_BYTES`` (a valid envelope with a huge meta)."""
    env = _unpack(encode_valid(kind, "oversized"))
    env["body"]["meta"] = {"blob": b"\x00" * (t.MAX_PAYLOAD_BYTES + 1)}
    return Hostile(kind, "oversized entry", _pack(env), DEADLETTER, frozenset({"bad_msgpack"}))


def hostile(kind: str, n: int, seed: int) -> list[Hostile]:
    """``n`` hostile entries of stream ``kind``, deterministic in ``seed``. Each comes from
    its own valid base entry (ids ``h<i>``), so group ids never collide with valid ones."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; use one of {KINDS}")
    rng = random.Random(f"{kind}:{seed}")
    kname = _KIND_NAME[kind]
    out: list[Hostile] = []

    def envelope_case(env: Env) -> tuple[str, Env, str, frozenset[str]]:
        roll = rng.randrange(6)
        if roll == 0:
            v = rng.choice([0, 2, 99, -1, "1", None, [1], 2**63 - 1, True, 1.0])
            e = dict(env, schema_version=v)
            return f"schema_version={v!r}", e, DEADLETTER, frozenset({"unknown_schema_version"})
        if roll == 1:
            e = {k: v for k, v in env.items() if k != "schema_version"}
            return "no schema_version", e, DEADLETTER, frozenset({"missing_field"})
        if roll == 2:
            other = rng.choice([k for k in _KIND_NAME.values() if k != kname] + ["", 7])
            return f"kind={other!r}", dict(env, kind=other), DEADLETTER, frozenset({"wrong_kind"})
        if roll == 3:
            v = rng.choice(WRONG_TYPES)
            return f"body={v!r}", dict(env, body=v), DEADLETTER, frozenset({"missing_field"})
        if roll == 4:
            e = {k: v for k, v in env.items() if k != "body"}
            return "no body", e, DEADLETTER, frozenset({"missing_field"})
        field_name = rng.choice(sorted(env["body"]))
        v = rng.choice(WRONG_TYPES)
        # a wrong type where the codec coerces (str(id), bool(flag), optional nil) is valid
        return f"body.{field_name}={v!r}", _set(env, field_name, v), EITHER, frozenset()

    for i in range(n):
        base = encode_valid(kind, f"h{i}", seed=i)
        env = _unpack(base)
        roll = rng.random()
        if roll < 0.15:  # truncated bytes: never a complete msgpack object
            cut = rng.randrange(len(base))
            out.append(
                Hostile(kind, f"truncated at {cut}", base[:cut], DEADLETTER, frozenset({"bad_msgpack"}))
            )  # fmt: skip
        elif roll < 0.30:  # flipped bytes: anything may come out
            buf = bytearray(base)
            for _ in range(rng.randint(1, 4)):
                buf[rng.randrange(len(buf))] ^= rng.randrange(1, 256)
            out.append(Hostile(kind, "flipped bytes", bytes(buf), EITHER))
        elif roll < 0.40:
            name, raw = rng.choice(_raw_cases(kname))
            if name == "trailing garbage":
                raw = base + b"\xc1\x00"
            out.append(Hostile(kind, name, raw, DEADLETTER, frozenset({"bad_msgpack"})))
        elif roll < 0.55:
            name, e, fate, reasons = envelope_case(env)
            out.append(Hostile(kind, name, _pack(e), fate, reasons))
        else:
            cases: list[tuple[str, Callable[[], Env], str, frozenset[str]]] = [
                (m, (lambda p=p, v=v, env=env: _set(env, p, v)), f, r)
                for m, p, v, f, r in _CASES[kind]
            ]
            if kind == "saw":
                cases += [(m, (lambda e=e: e), f, r) for m, e, f, r in _saw_array_cases(env)]
            name, make, fate, reasons = rng.choice(cases)
            out.append(Hostile(kind, name, _pack(make()), fate, reasons))
    return out
