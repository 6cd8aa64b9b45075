"""Fuzz tier, weight routes: hostile bodies to ``POST /v1/weights``,
``/v1/weights/collective/init``, ``/v1/weights/collective/update`` and ``/v1/adapter`` of
the inference app
(``create_app`` around a fake engine that holds the tiny model's tensors, no vLLM).

Every body is answered with its case's 4xx (never 5xx), the served tensors and
``GET /v1/policy_version`` are unchanged afterwards, and a valid update still lands (the
lock was never left held). ``LUDIC_FUZZ_N`` bodies per route, ``LUDIC_FUZZ_SEED``.
"""

from __future__ import annotations

import json
import random
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hostile import FUZZ_N, FUZZ_SEED  # noqa: E402

from libludic.distributed.weight_sync import PEFT_PREFIX  # noqa: E402
from services.inference.app import create_app  # noqa: E402
from services.inference.settings import InferenceSettings  # noqa: E402
from services.inference.validation import ParamSpec  # noqa: E402
from tests.fakes import TensorEngine  # noqa: E402

pytestmark = pytest.mark.fuzz
TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_BYTES = 1 << 20
NORM = "model.norm.weight"


def raw(header: Any, data: bytes, *, text: str | None = None) -> bytes:
    h = (text if text is not None else json.dumps(header)).encode()
    return struct.pack("<Q", len(h)) + h + data


def weight_cases(shape: tuple[int, ...], rng: random.Random) -> list[tuple[str, bytes, int]]:
    """(name, body, status) for POST /v1/weights with a good token and version."""
    n = int(torch.Size(shape).numel())
    good = save({NORM: torch.ones(shape)})
    data = b"\0" * (4 * n)
    entry = {"dtype": "F32", "shape": list(shape), "data_offsets": [0, 4 * n]}
    cut = rng.randrange(1, len(good))
    return [
        ("empty body", b"", 400),
        ("7 bytes", b"\x01" * 7, 400),
        (f"truncated at {cut}", good[:cut], 400),
        ("header claims 2^63 bytes", struct.pack("<Q", 2**63) + good[8:], 400),
        ("header not JSON", raw(None, data, text="{not json"), 400),
        ("header a list", raw([1, 2], data), 400),
        ("header not UTF-8", raw(None, data, text="") [:8] + b"\xff\xfe" + data, 400),
        ("duplicate names", raw(None, data + data, text=(
            f'{{"{NORM}": {json.dumps(entry)}, "{NORM}": '
            f'{json.dumps(dict(entry, data_offsets=[4 * n, 8 * n]))}}}')), 400),
        ("overlapping offsets", raw({NORM: entry, "model.x": dict(entry, data_offsets=[4, 4 * n + 4])}, data + b"\0" * 4), 400),
        ("gap before data", raw({NORM: dict(entry, data_offsets=[4, 4 * n + 4])}, b"\0" * (4 * n + 4)), 400),
        ("trailing bytes", raw({NORM: entry}, data + b"\0" * 4), 400),
        ("offsets reversed", raw({NORM: dict(entry, data_offsets=[4 * n, 0])}, data), 400),
        ("offsets strings", raw({NORM: dict(entry, data_offsets=["0", str(4 * n)])}, data), 400),
        ("offsets past the body", raw({NORM: dict(entry, data_offsets=[0, 2**40])}, data), 400),
        ("shape negative", raw({NORM: dict(entry, shape=[-n])}, data), 400),
        ("shape strings", raw({NORM: dict(entry, shape=[str(n)])}, data), 400),
        ("shape huge", raw({NORM: dict(entry, shape=[2**62, 2**62])}, data), 400),
        ("dtype unknown", raw({NORM: dict(entry, dtype="F8_E4M3")}, data), 422),
        ("dtype a list", raw({NORM: dict(entry, dtype=["F32"])}, data), 422),
        ("dtype a map", raw({NORM: dict(entry, dtype={"F32": 1})}, data), 422),
        ("entry not an object", raw({NORM: [1, 2]}, data), 400),
        ("4300-digit int", raw(None, data, text=f'{{"{NORM}": {{"dtype": "F32", "shape": [{"9" * 5000}]}}}}'), 400),
        ("nested 100k deep", raw(None, data, text="[" * 100_000 + "]" * 100_000), 400),
        ("no tensors", raw({"__metadata__": {"a": "b"}}, b""), 422),
        ("unknown name", save({"model.nope.weight": torch.ones(shape)}), 422),
        ("wrong shape", save({NORM: torch.ones(n + 1)}), 422),
        ("float64", save({NORM: torch.ones(shape, dtype=torch.float64)}), 422),
        ("int64 for a float", save({NORM: torch.ones(shape, dtype=torch.int64)}), 422),
        ("NaN", save({NORM: torch.full(shape, float("nan"))}), 422),
        ("-inf", save({NORM: torch.full(shape, float("-inf"))}), 422),
        ("over the cap", save({NORM: torch.ones(shape)}) + b"\0" * MAX_BYTES, 413),
    ]  # fmt: skip


def test_weight_routes_refuse_hostile_bodies(tiny_model_dir: Path, fuzz_summary: list[Any]) -> None:
    rng = random.Random(f"weights:{FUZZ_SEED}")
    spec = ParamSpec.from_model_dir(tiny_model_dir)
    tensors = load_file(str(tiny_model_dir / "model.safetensors"))
    reference = {k: v.clone() for k, v in tensors.items()}
    eng = TensorEngine(spec, tensors)
    settings = InferenceSettings(
        model_dir=str(tiny_model_dir), auth_token=TOKEN, max_weight_bytes=MAX_BYTES,
        collective_timeout_s=5.0,  # an init body that passed would wait this long, then 502
    )  # fmt: skip
    client = TestClient(create_app(settings, engine=eng), raise_server_exceptions=False)
    cases = weight_cases(spec.shapes[NORM], rng)
    good = save({NORM: torch.full(spec.shapes[NORM], 2.0)})
    rows: dict[str, list[int]] = {}
    problems: list[str] = []

    def post(route: str, name: str, want: int, **kw: Any) -> None:
        got = client.post(route, **kw).status_code
        row = rows.setdefault(route.split("?")[0], [0, 0, 0, 0])
        row[0] += 1
        ok = 400 <= got < 500 and (want == -1 or got == want)
        row[1] += 400 <= got < 500
        row[2] += got < 400
        row[3] += got >= 500
        if not ok:
            problems.append(f"{route} {name}: {got}, want {want if want != -1 else '4xx'}")

    for _ in range(FUZZ_N):
        roll = rng.random()
        if roll < 0.1:
            hdr = rng.choice(
                [
                    {},
                    {"Authorization": "Bearer wrong"},
                    {"Authorization": TOKEN},
                    {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": "Bearer "},
                ]
            )
            post("/v1/weights?version=1", f"auth {hdr}", 401, content=good, headers=hdr)
        elif roll < 0.2:
            v = rng.choice(["1e23", "-1", "abc", str(2**53), str(10**30), "", "1.5", "0x10"])
            post(f"/v1/weights?version={v}", f"version {v!r}", 422, content=good, headers=AUTH)
        elif roll < 0.25:
            post(
                "/v1/weights?version=0", "version 0 (not greater)", 409, content=good, headers=AUTH
            )
        elif roll < 0.35:  # a Content-Length that lies (the body is checked, not trusted)
            cl, want = rng.choice(
                [(str(len(good) * 1000), 400), (str(2**40), 413), ("-5", 400), ("abc", 400),
                 (str(len(good) - 1), 400)]
            )  # fmt: skip
            post("/v1/weights?version=1", f"Content-Length {cl}", want, content=good,
                 headers={**AUTH, "Content-Length": cl})  # fmt: skip
        else:
            name, body, want = rng.choice(cases)
            post("/v1/weights?version=1", name, want, content=body, headers=AUTH)
    for _ in range(FUZZ_N):  # the collective plane's JSON: schema errors, or no group yet
        meta = {"names": [NORM], "dtypes": ["float32"], "shapes": [list(spec.shapes[NORM])]}
        init = {"master_address": "127.0.0.1", "master_port": 29500, "world_size": 2, "rank": 1}
        kind = rng.choice(["init", "update"])
        base = init if kind == "init" else meta
        field = rng.choice(sorted(base))
        value = rng.choice(["", -1, 0, 2**70, 1e400, None, [], {}, "x" * 10_000, True])
        body: Any = dict(base, **{field: value})
        mutation = f"{field}={str(value)[:20]!r}"
        if rng.random() < 0.2:
            body, mutation = rng.choice(
                [("{not json", "bad JSON"), ("[1, 2]", "a list"), ("", "empty"),
                 (json.dumps(dict(base, extra=1)), "extra field"), ("\xff", "not UTF-8")]
            )  # fmt: skip
        content = body if isinstance(body, str) else json.dumps(body)
        route = f"/v1/weights/collective/{kind}" + ("?version=1" if kind == "update" else "")
        # a well-formed update without a group is 400; anything else here is a schema 422
        post(route, mutation, -1, content=content.encode(), headers=AUTH)
    assert not problems, "\n".join(problems[:30])
    assert client.get("/v1/policy_version").json()["policy_version"] == 0
    for k, v in reference.items():
        torch.testing.assert_close(eng.served[k], v, rtol=0, atol=0)
    # still serving updates: the lock was never left held, a valid body lands
    r = client.post("/v1/weights?version=1", content=good, headers=AUTH)
    assert r.status_code == 200 and client.get("/v1/policy_version").json()["policy_version"] == 1
    assert bool((eng.served[NORM] == 2.0).all())
    for route, (sent, refused, done, crashes) in rows.items():
        fuzz_summary.append((f"POST {route}", sent, refused, done, crashes))


#: values each adapter config field must refuse (rank: this server's max_lora_rank is 4)
BAD_CONFIG: dict[str, list[Any]] = {
    "r": ["", -1, 0, 5, 2**70, 1.5, 1e400, None, [], {}, True, "4"],
    "lora_alpha": ["", "16", 1e400, -1e400, None, [], {}, True],
    "target_modules": ["", "q_proj", None, [], {}, [1], [None], True, 3],
}


def test_adapter_route_refuses_hostile_bodies(
    tiny_model_dir: Path, fuzz_summary: list[Any]
) -> None:
    """``POST /v1/adapter`` of a server with ``max_lora_rank`` 4: the hostile safetensors
    bodies above and adapters with one thing wrong (config, a name, a shape, a value) are
    all 4xx, nothing is served; then a valid adapter lands as version 1."""
    rng = random.Random(f"adapter:{FUZZ_SEED}")
    spec = ParamSpec.from_model_dir(tiny_model_dir)
    eng = TensorEngine(spec, load_file(str(tiny_model_dir / "model.safetensors")))
    settings = InferenceSettings(
        model_dir=str(tiny_model_dir), auth_token=TOKEN, max_weight_bytes=MAX_BYTES,
        max_lora_rank=4,
    )  # fmt: skip
    client = TestClient(create_app(settings, engine=eng), raise_server_exceptions=False)
    q = "model.layers.0.self_attn.q_proj"
    out, inp = spec.shapes[f"{q}.weight"]
    cfg = {"r": 4, "lora_alpha": 16.0, "target_modules": ["q_proj"]}
    good = {f"{PEFT_PREFIX}{q}.lora_A.weight": torch.ones(4, inp),
            f"{PEFT_PREFIX}{q}.lora_B.weight": torch.ones(out, 4)}  # fmt: skip

    def adapter(tensors: dict[str, torch.Tensor], config: Any) -> bytes:
        meta = {"ludic_adapter_config": config if isinstance(config, str) else json.dumps(config)}
        return bytes(save(tensors, meta))

    def hostile() -> tuple[str, bytes]:
        roll = rng.random()
        if roll < 0.4:
            name, body, _ = rng.choice(weight_cases(spec.shapes[NORM], rng))
            return name, body
        if roll < 0.7:
            field, bad_values = rng.choice(sorted(BAD_CONFIG.items()))
            value = rng.choice(bad_values)
            if rng.random() < 0.2:
                return "config not JSON", adapter(good, rng.choice(["{", "[1]", "", "null"]))
            return f"{field}={value!r:.20}", adapter(good, dict(cfg, **{field: value}))
        k = rng.choice(sorted(good))
        bad = dict(good)
        what = rng.choice(["name", "shape", "nan", "lone", "dtype"])
        if what == "name":
            bad[rng.choice([k.replace("lora_", "lorax_"), k.removeprefix(PEFT_PREFIX),
                            f"{PEFT_PREFIX}model.norm.lora_A.weight"])] = bad.pop(k)  # fmt: skip
        elif what == "shape":
            bad[k] = torch.ones(bad[k].shape[0] + 1, bad[k].shape[1])
        elif what == "nan":
            bad[k] = torch.full(bad[k].shape, float("nan"))
        elif what == "lone":
            del bad[k]
        else:
            bad[k] = bad[k].to(torch.float64)
        return f"adapter {what} of {k.rsplit('.', 2)[-2]}", adapter(bad, cfg)

    sent = refused = crashes = 0
    problems: list[str] = []
    for _ in range(FUZZ_N):
        name, body = hostile()
        got = client.post("/v1/adapter?version=1", content=body, headers=AUTH).status_code
        sent += 1
        refused += 400 <= got < 500
        crashes += got >= 500
        if not 400 <= got < 500:
            problems.append(f"/v1/adapter {name}: {got}, want 4xx")
    assert not problems, "\n".join(problems[:30])
    assert eng.adapters == [] and client.get("/v1/policy_version").json()["policy_version"] == 0
    r = client.post("/v1/adapter?version=1", content=adapter(good, cfg), headers=AUTH)
    assert r.status_code == 200, r.text
    assert eng.adapters == [(1, cfg)]
    fuzz_summary.append(("POST /v1/adapter", sent, refused, sent - refused - crashes, crashes))
