"""Weight-update validation, settings and the auth/version rules of the inference app.

No vLLM: the app is built around tests/fakes.py's TensorEngine, which holds the served
tensors and records every update it applies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save, save_file

from libludic.distributed.weight_sync import adapter_metadata
from services.common.settings import load_settings
from services.inference.app import create_app
from services.inference.metrics import InferenceMetrics
from services.inference.settings import InferenceSettings, SettingsError
from services.inference.validation import (
    ParamSpec,
    WeightValidationError,
    complete_partial,
    decode_adapter,
    decode_and_validate,
    module_of,
    parse_safetensors_header,
)
from tests.fakes import TensorEngine

REPO = Path(__file__).resolve().parents[2]
SHAPES = {
    "model.embed_tokens.weight": (10, 4),
    "model.norm.weight": (4,),
    "model.layers.0.self_attn.q_proj.weight": (4, 4),
    "model.layers.0.self_attn.k_proj.weight": (2, 4),
    "model.layers.0.input_layernorm.weight": (4,),
}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    save_file({k: torch.zeros(s) for k, s in SHAPES.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    return tmp_path


@pytest.fixture
def spec(model_dir: Path) -> ParamSpec:
    return ParamSpec.from_model_dir(model_dir)


def body(tensors: dict[str, torch.Tensor]) -> bytearray:
    return bytearray(save(tensors))


# ---------------------------------------------------------------------------- safetensors parsing


def test_spec_reads_checkpoint_headers_and_tied_alias(spec: ParamSpec) -> None:
    assert spec.shapes["model.norm.weight"] == (4,)
    assert spec.dtypes["model.norm.weight"] == frozenset(
        {torch.float32, torch.bfloat16, torch.float16}
    )
    assert spec.aliases == {"lm_head.weight": "model.embed_tokens.weight"}


def test_valid_body_decodes_zero_copy(spec: ParamSpec) -> None:
    buf = body({"model.norm.weight": torch.arange(4.0)})
    out = decode_and_validate(buf, spec)
    torch.testing.assert_close(out["model.norm.weight"], torch.arange(4.0))
    buf[-4:] = struct.pack("<f", 9.0)  # views share the buffer: no second copy
    assert out["model.norm.weight"][3].item() == 9.0


@pytest.mark.parametrize(
    "mangle, match",
    [
        (lambda b: b[:5], "8-byte header length"),
        (lambda b: b[:-3], "truncated|corrupt"),
        (lambda b: b[:8] + b"x" * (len(b) - 8), "not valid JSON|truncated"),
        (lambda b: struct.pack("<Q", 10**12) + b[8:], "truncated or not safetensors"),
        (lambda b: b + b"\0" * 8, "corrupt body"),
    ],
)
def test_corrupt_bodies_are_400(spec: ParamSpec, mangle: Any, match: str) -> None:
    good = bytes(body({"model.norm.weight": torch.ones(4)}))
    with pytest.raises(WeightValidationError, match=match) as ei:
        decode_and_validate(bytearray(mangle(good)), spec)
    assert ei.value.status == 400


def test_offsets_must_match_shape() -> None:
    header = json.dumps({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode()
    buf = struct.pack("<Q", len(header)) + header + b"\0" * 8
    with pytest.raises(WeightValidationError, match="needs 12") as ei:
        parse_safetensors_header(buf)
    assert ei.value.status == 400


@pytest.mark.parametrize(
    "tensors, match",
    [
        ({"model.nope.weight": torch.ones(4)}, "unknown parameter"),
        ({"model.norm.weight": torch.ones(5)}, r"shape \[5\] does not match the model's \[4\]"),
        ({"model.norm.weight": torch.ones(4, dtype=torch.float64)}, "dtype float64 not accepted"),
        ({"model.norm.weight": torch.tensor([1.0, float("nan"), 1.0, 1.0])}, "1 non-finite"),
        ({"model.norm.weight": torch.tensor([1.0, float("inf"), 1.0, 1.0])}, "1 non-finite"),
    ],
)
def test_bad_tensors_are_422(spec: ParamSpec, tensors: dict[str, torch.Tensor], match: str) -> None:
    with pytest.raises(WeightValidationError, match=match) as ei:
        decode_and_validate(body(tensors), spec)
    assert ei.value.status == 422


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_finite_values_whose_sum_overflows_are_accepted(
    spec: ParamSpec, dtype: torch.dtype
) -> None:
    """The finiteness check sums first; a sum that overflows to inf is not a non-finite value."""
    big = torch.finfo(dtype).max
    sent = torch.tensor([big, big, -1.0, 1.0], dtype=dtype)
    assert not bool(torch.isfinite(sent.sum()))
    got = decode_and_validate(body({"model.norm.weight": sent}), spec)
    torch.testing.assert_close(got["model.norm.weight"], sent)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_floating_parameters_accept_every_wire_dtype_and_are_cast_to_the_served_one(
    model_dir: Path, dtype: torch.dtype
) -> None:
    # an fp32 checkpoint served in bf16: an fp32 learner's update must not be refused
    spec = ParamSpec.from_model_dir(model_dir, served_dtype=torch.bfloat16)
    sent = torch.tensor([1.0, 0.5, 0.25, 3.0], dtype=dtype)
    got = decode_and_validate(body({"model.norm.weight": sent}), spec)
    served = spec.to_served(got)["model.norm.weight"]
    assert served.dtype == torch.bfloat16
    # these values are exact in every one of the three dtypes
    torch.testing.assert_close(served.float(), torch.tensor([1.0, 0.5, 0.25, 3.0]))


def test_to_served_keeps_tensors_already_in_the_served_dtype(model_dir: Path) -> None:
    spec = ParamSpec.from_model_dir(model_dir, served_dtype=torch.float32)
    t = torch.ones(4)
    assert spec.to_served({"model.norm.weight": t})["model.norm.weight"] is t


def test_partial_updates_are_completed_per_module(spec: ParamSpec) -> None:
    # q_proj alone: vLLM fuses q/k/v, so k_proj's current value must ride along.
    assert module_of("model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn"
    assert complete_partial(["model.layers.0.self_attn.q_proj.weight"], spec) == [
        "model.layers.0.self_attn.k_proj.weight"
    ]
    assert complete_partial(list(SHAPES), spec) is None


# ---------------------------------------------------------------------------- settings


def load(argv: list[str], env: dict[str, str]) -> InferenceSettings:
    """`ludic inference`'s loader: the one every service uses."""
    return load_settings(InferenceSettings, argv, service="inference", environ=env)


def test_settings_precedence_flags_over_env_over_yaml(model_dir: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_id: r\ninference:\n  model_dir: {model_dir}\n  port: 7001\n  max_model_len: 64\n"
        "  seed: 3\nlearner:\n  batch_size: 8\n"
    )
    env = {"LUDIC_CONFIG": str(cfg), "LUDIC_PORT": "7002", "LUDIC_AUTH_TOKEN": "tok"}
    s = load(["--max-model-len", "128"], env)
    # seed from YAML; port from the environment over YAML; max_model_len from the flag
    assert (s.model_dir, s.seed, s.port, s.max_model_len) == (str(model_dir), 3, 7002, 128)
    assert s.auth_token == "tok" and s.public_dict()["auth_token"] == "<set>"


def test_model_dir_has_one_name_and_vllms_flag_as_an_alias(model_dir: Path) -> None:
    for argv, env in (
        (["--model-dir", str(model_dir)], {}),
        (["--model", str(model_dir)], {}),
        ([], {"LUDIC_MODEL_DIR": str(model_dir)}),
    ):
        assert load(argv, env).model_dir == str(model_dir)


def test_vllm_args_repeat_as_flags_and_split_on_whitespace_from_env_and_yaml(
    model_dir: Path, tmp_path: Path
) -> None:
    flags = ["--vllm-arg=--max-num-seqs=4", "--vllm-arg=--enable-prefix-caching"]
    s = load(["--model-dir", str(model_dir), *flags], {})
    assert s.vllm_args == ["--max-num-seqs=4", "--enable-prefix-caching"]
    env = {"LUDIC_MODEL_DIR": str(model_dir), "LUDIC_VLLM_ARGS": "--max-num-seqs 4 --x=a,b"}
    assert load([], env).vllm_args == ["--max-num-seqs", "4", "--x=a,b"]  # not split on ","
    cfg = tmp_path / "run.yaml"
    cfg.write_text('inference:\n  vllm_args: "--max-num-seqs 4"\n')
    env = {"LUDIC_MODEL_DIR": str(model_dir), "LUDIC_CONFIG": str(cfg)}
    assert load([], env).vllm_args == ["--max-num-seqs", "4"]


def test_auth_token_comes_from_the_environment_or_a_file_never_the_yaml(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    base = {"LUDIC_MODEL_DIR": str(model_dir)}
    assert load(["--auth-token-file", str(token)], base).auth_token == "s3cret"
    assert load([], {**base, "LUDIC_AUTH_TOKEN_FILE": str(token)}).auth_token == "s3cret"
    with pytest.raises(SettingsError, match="both give a value, and they differ"):
        load(["--auth-token-file", str(token)], {**base, "LUDIC_AUTH_TOKEN": "other"})
    with pytest.raises(SystemExit):
        load(["--help"], base)
    help_ = capsys.readouterr().out
    assert "--auth-token-file" in help_ and "--auth-token " not in help_  # a command line is public
    assert "LUDIC_AUTH_TOKEN:" in help_  # listed with the environment-only settings
    for text in ("inference:\n  auth_token: s3cret\n", "auth_token: s3cret\n"):
        cfg = tmp_path / "run.yaml"
        cfg.write_text(text)
        with pytest.raises(ValueError, match="never read from a config file.*auth_token_file"):
            load([], {**base, "LUDIC_CONFIG": str(cfg)})


@pytest.mark.parametrize(
    "argv, env, match",
    [
        ([], {}, "no model: pass --model-dir"),
        (["--model", "/nope"], {}, "does not exist"),
        ([], {"LUDIC_MODEL_DIR": "/nope"}, "does not exist"),
        (["--auth-token-file", "/nope/token"], {"LUDIC_MODEL_DIR": "MODEL"}, "cannot read auth"),
    ],
)
def test_settings_errors_name_the_fix(
    model_dir: Path, argv: list[str], env: dict[str, str], match: str
) -> None:
    env = {k: v.replace("MODEL", str(model_dir)) for k, v in env.items()}
    with pytest.raises(SettingsError, match=match):
        load(argv, env)


def test_yaml_unknown_key_in_the_inference_section_is_rejected(
    model_dir: Path, tmp_path: Path
) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"inference:\n  model_dir: {model_dir}\n  portt: 1\n")
    with pytest.raises(ValueError, match="unknown key.*portt.*'inference'"):
        load([], {"LUDIC_CONFIG": str(cfg)})


def test_the_retired_inference_config_variable_is_an_error_naming_ludic_config(
    model_dir: Path, tmp_path: Path
) -> None:
    env = {"LUDIC_MODEL_DIR": str(model_dir), "LUDIC_INFERENCE_CONFIG": str(tmp_path / "x.yaml")}
    retired = "LUDIC_INFERENCE_CONFIG is set but no longer read: set LUDIC_CONFIG"
    with pytest.raises(ValueError, match=retired):
        load([], env)


@pytest.mark.parametrize(
    "config", sorted(p.relative_to(REPO).as_posix() for p in REPO.glob("examples/*/*.yaml"))
)
def test_shipped_run_configs_reach_inference_only_through_its_section(
    model_dir: Path, config: str
) -> None:
    """Top-level keys naming a field apply to every service; none of a shipped run config's
    top-level keys may name an inference setting by accident (compose and the chart mount
    examples/arith/grpo.yaml's kind of file)."""
    import yaml

    data = yaml.safe_load((REPO / config).read_text())
    s = load([], {"LUDIC_MODEL_DIR": str(model_dir), "LUDIC_CONFIG": str(REPO / config)})
    changed = {
        f.name: getattr(s, f.name)
        for f in dataclasses.fields(InferenceSettings)
        if getattr(s, f.name) != getattr(InferenceSettings(model_dir=str(model_dir)), f.name)
    }
    assert changed == (data.get("inference") or {})


# ---------------------------------------------------------------------------- app rules (fake engine)


def client(model_dir: Path, spec: ParamSpec, **kw: Any) -> tuple[TestClient, TensorEngine]:
    """The real app around a TensorEngine serving ``model_dir``'s tensors (tests/fakes.py)."""
    eng = TensorEngine(spec, load_file(str(model_dir / "model.safetensors")))
    settings = InferenceSettings(model_dir=str(model_dir), **kw)
    return TestClient(create_app(settings, engine=eng)), eng


GOOD = bytes(save({"model.norm.weight": torch.ones(4)}))


def test_update_ok_and_version_rules(model_dir: Path, spec: ParamSpec) -> None:
    c, eng = client(model_dir, spec, auth_token="s3cret")
    h = {"Authorization": "Bearer s3cret"}
    r = c.post("/v1/weights?version=3", content=GOOD, headers=h)
    assert r.status_code == 200 and r.json()["policy_version"] == 3
    assert r.headers["X-Ludic-Policy-Version"] == "3"
    assert c.get("/v1/policy_version").json() == {"policy_version": 3, "dtype": None}
    for v in (3, 2, 0):
        r = c.post(f"/v1/weights?version={v}", content=GOOD, headers=h)
        assert r.status_code == 409 and "not greater" in r.json()["detail"]
    assert eng.updates == [3] and sorted(eng.last) == ["model.norm.weight"]


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic s3cret", "s3cret"])
def test_wrong_or_missing_token_is_401(
    model_dir: Path, spec: ParamSpec, header: str | None
) -> None:
    c, eng = client(model_dir, spec, auth_token="s3cret")
    h = {"Authorization": header} if header else {}
    assert c.post("/v1/weights?version=1", content=GOOD, headers=h).status_code == 401
    assert c.post("/v1/weights/collective/init", json={}, headers=h).status_code == 401
    assert eng.updates == [] and eng.version == 0


def test_no_token_configured_refuses_updates(model_dir: Path, spec: ParamSpec) -> None:
    c, eng = client(model_dir, spec)
    r = c.post("/v1/weights?version=1", content=GOOD)
    assert r.status_code == 403 and "LUDIC_AUTH_TOKEN" in r.json()["detail"]
    c2, eng2 = client(model_dir, spec, insecure_no_auth=True)
    assert c2.post("/v1/weights?version=1", content=GOOD).status_code == 200
    assert eng.updates == [] and eng2.version == 1


def test_invalid_body_never_reaches_the_engine(model_dir: Path, spec: ParamSpec) -> None:
    c, eng = client(model_dir, spec, insecure_no_auth=True)
    bad = bytes(save({"model.norm.weight": torch.full((4,), float("nan"))}))
    assert c.post("/v1/weights?version=1", content=bad).status_code == 422
    assert c.post("/v1/weights?version=1", content=GOOD[:-1]).status_code == 400
    assert c.post("/v1/weights?version=-1", content=GOOD).status_code == 422
    assert eng.updates == [] and eng.version == 0


def test_body_over_limit_is_413(model_dir: Path, spec: ParamSpec) -> None:
    c, eng = client(model_dir, spec, insecure_no_auth=True, max_weight_bytes=16)
    assert c.post("/v1/weights?version=1", content=GOOD).status_code == 413
    assert eng.updates == []


def test_collective_update_validates_metadata(model_dir: Path, spec: ParamSpec) -> None:
    c, eng = client(model_dir, spec, insecure_no_auth=True)
    meta = {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1], [1]]}
    assert c.post("/v1/weights/collective/update?version=1", json=meta).status_code == 422
    meta = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[4]]}
    r = c.post("/v1/weights/collective/update?version=1", json=meta)
    assert r.status_code == 400 and "collective/init" in r.json()["detail"]
    bad_init = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "rank": 2}
    assert c.post("/v1/weights/collective/init", json=bad_init).status_code == 422
    assert eng.updates == []


def test_health_and_metrics_without_vllm(model_dir: Path, spec: ParamSpec) -> None:
    c, _ = client(model_dir, spec, auth_token="t")
    assert c.get("/health").json()["status"] == "ok"
    c.post("/v1/weights?version=1", content=GOOD, headers={"Authorization": "Bearer t"})
    text = c.get("/metrics").text
    assert "ludic_inference_weight_bytes_received_total" in text
    assert "ludic_inference_policy_version 1.0" in text


def test_chunked_prefill_is_off_by_default_on_cpu_only() -> None:
    from services.inference.worker import platform_default_args

    assert platform_default_args([], is_cpu=True) == ["--no-enable-chunked-prefill"]
    assert platform_default_args([], is_cpu=False) == []
    # the user's choice, either way, wins
    for flag in (
        "--enable-chunked-prefill",
        "--no-enable-chunked-prefill",
        "--enable-chunked-prefill=true",
    ):
        assert platform_default_args(["--max-num-seqs=8", flag], is_cpu=True) == [
            "--max-num-seqs=8",
            flag,
        ]


@pytest.mark.parametrize("failure", ["engine core died", "rollback failed"])
async def test_watch_engine_stops_the_server_once_the_engine_cannot_serve(failure: str) -> None:
    from services.inference.main import DEAD_ENGINE_GRACE_S, engine_failure, watch_engine

    class Llm:
        errored = False

    class Engine:
        llm = Llm()
        broken: str | None = None

    class Config:
        timeout_graceful_shutdown = 30

    class Server:
        should_exit = False
        config = Config()

    engine, server = Engine(), Server()
    task = asyncio.create_task(watch_engine(engine, server, every_s=0.01))
    await asyncio.sleep(0.05)
    assert not task.done() and not server.should_exit  # a live engine keeps it serving
    if failure == "engine core died":
        engine.llm.errored = True
    else:
        engine.broken = "restoring v3 failed too"
    await asyncio.wait_for(task, 1.0)
    assert server.should_exit
    # nothing to drain from a dead engine: the restart is not held for the graceful timeout
    assert server.config.timeout_graceful_shutdown == DEAD_ENGINE_GRACE_S < 30
    assert engine_failure(engine) in ("the vLLM engine died", "restoring v3 failed too")


def test_api_port_is_bound_before_vllm_starts_and_a_taken_port_fails_fast() -> None:
    """main() binds the port first (vLLM's start-up opens many ephemeral sockets that could
    take a port chosen earlier); a port already in use fails at once, not after vLLM loads."""
    import socket

    from services.inference.main import listen

    sock = listen("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        with pytest.raises(OSError):
            listen("127.0.0.1", port)
    finally:
        sock.close()
    assert isinstance(sock, socket.socket)


def test_only_a_bf16_cpu_engine_is_warmed_up_before_serving() -> None:
    from services.inference.worker import needs_warmup

    assert needs_warmup(True, torch.bfloat16)
    assert not needs_warmup(True, torch.float32) and not needs_warmup(False, torch.bfloat16)


class FlakyLlm:
    """The AsyncLLM calls LudicEngine.swap makes; the worker reload fails ``fail`` times (kept
    here: only this file drives LudicEngine itself, below the app's engine surface)."""

    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.calls: list[str] = []

    def generate(self, *a: Any, **k: Any) -> Any:
        raise AssertionError("not used")

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[float]:
        self.calls.append("reload")
        if self.fail > 0:
            self.fail -= 1
            raise RuntimeError("worker reload failed")
        return [0.01]

    async def pause_generation(self, mode: str = "wait", clear_cache: bool = False) -> None:
        self.calls.append(f"pause:{mode}")

    async def resume_generation(self) -> None:
        self.calls.append("resume")

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        self.calls.append("reset")

    async def update_weight_version(self, v: str) -> None:
        self.calls.append(f"version:{v}")


@pytest.mark.parametrize("mode", ["keep", "wait"])
@pytest.mark.parametrize("fail", [1, 2])
async def test_a_failed_reload_rolls_back_or_stops_the_server(
    model_dir: Path, spec: ParamSpec, mode: str, fail: int, tmp_path: Path
) -> None:
    from services.inference.main import engine_failure
    from services.inference.worker import LudicEngine, SwapError

    staging = tmp_path / "staging"
    staging.mkdir()
    settings = InferenceSettings(
        model_dir=str(model_dir), update_mode=mode, weight_staging_dir=str(staging)
    )
    llm = FlakyLlm(fail)
    e = LudicEngine(settings, llm, None, spec, InferenceMetrics())
    async with e.lock:
        with pytest.raises(SwapError) as ei:
            await e.swap(1, {"model.norm.weight": torch.ones(4)})
    assert e.version == 0  # never labelled with the version it failed to load
    assert list(staging.iterdir()) == []  # staged files removed either way
    if fail == 1:  # the rollback reload worked: serving the old weights goes on
        assert "previous weights restored" in str(ei.value) and e.broken is None
        assert engine_failure(e) is None
        assert llm.calls[-1] == ("resume" if mode == "wait" else "reload")
    else:  # neither old nor new weights: generation stopped, the server exits non-zero
        assert ei.value.status == 500 and "shutting down" in str(ei.value)
        assert "restoring v0 failed too" in (engine_failure(e) or "")
        assert llm.calls[-1] == "pause:abort" and "resume" not in llm.calls


def _header_body(header: dict[str, Any], data_len: int) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + b"\0" * data_len


@pytest.mark.parametrize(
    "header, data_len, match",
    [
        (  # the same tensor twice: json.loads would silently keep the last one
            '{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
            '"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
            8,
            "named twice",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
            },
            8,
            "overlaps",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
            },
            12,
            "gap",
        ),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, 8, "gap"),
    ],
    ids=["duplicate", "overlap", "gap", "leading-gap"],
)
def test_header_validator_refuses_what_the_loader_would(
    header: Any, data_len: int, match: str
) -> None:
    if isinstance(header, str):
        raw = header.encode()
        buf = struct.pack("<Q", len(raw)) + raw + b"\0" * data_len
    else:
        buf = _header_body(header, data_len)
    with pytest.raises(WeightValidationError, match=match) as ei:
        parse_safetensors_header(buf)
    assert ei.value.status == 400


def test_policy_versions_beyond_2_53_are_refused(model_dir: Path, spec: ParamSpec) -> None:
    c, eng = client(model_dir, spec, insecure_no_auth=True)
    assert c.post("/v1/weights?version=100000000000000000000000", content=GOOD).status_code == 422
    assert c.post(f"/v1/weights?version={2**53}", content=GOOD).status_code == 422
    assert c.post(f"/v1/weights?version={2**53 - 1}", content=GOOD).status_code == 200
    assert eng.version == 2**53 - 1


def test_mutating_routes_check_the_token_before_reading_the_body(
    model_dir: Path, spec: ParamSpec
) -> None:
    c, _ = client(model_dir, spec, auth_token="s3cret")
    for route in (
        "/v1/weights/collective/init",
        "/v1/weights/collective/update?version=1",
        "/v1/weights?version=1",
    ):
        r = c.post(route, content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 401, route
    h = {"Authorization": "Bearer s3cret", "Content-Type": "application/json"}
    assert c.post("/v1/weights/collective/init", content=b"{not json", headers=h).status_code == 422


class _Req:
    def __init__(self, declared: int | None, chunks: list[bytes]) -> None:
        self.headers = {} if declared is None else {"content-length": str(declared)}
        self.chunks = chunks

    async def stream(self) -> Any:
        for c in self.chunks:
            yield c


async def test_a_declared_length_is_checked_not_allocated() -> None:
    import tracemalloc

    from fastapi import HTTPException

    from services.inference.context import read_body_once

    tracemalloc.start()
    try:
        with pytest.raises(HTTPException) as ei:  # claims 2 GiB, sends 10 bytes
            await read_body_once(_Req(2 << 30, [b"x" * 10]), 4 << 30)  # type: ignore[arg-type]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ei.value.status_code == 400 and "truncated" in ei.value.detail
    assert peak < 64 << 20  # never the declared 2 GiB
    with pytest.raises(HTTPException) as ei:
        await read_body_once(_Req(100, [b"x"]), 10, "max_weight_bytes")  # type: ignore[arg-type]
    assert ei.value.status_code == 413 and "max_weight_bytes=10" in ei.value.detail
    with pytest.raises(HTTPException) as ei:  # no Content-Length: capped while streaming
        await read_body_once(_Req(None, [b"x" * 6, b"x" * 6]), 10)  # type: ignore[arg-type]
    assert ei.value.status_code == 413
    chunks = [bytes([i]) * 700_000 for i in range(5)]  # grows past the first buffer
    got = await read_body_once(_Req(None, chunks), 10 << 20)  # type: ignore[arg-type]
    assert bytes(got) == b"".join(chunks)
    got = await read_body_once(_Req(3_500_000, chunks), 10 << 20)  # type: ignore[arg-type]
    assert bytes(got) == b"".join(chunks)


@pytest.mark.parametrize(
    "header, status",
    [
        ('{"a": {"dtype": "F32", "shape": [' + "9" * 5000 + "]}}", 400),  # > 4300 digits
        ("[" * 100_000 + "]" * 100_000, 400),  # past the recursion limit
        ('{"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}', 422),  # unhashable
        ('{"a": {"dtype": {"F32": 1}, "shape": [1], "data_offsets": [0, 4]}}', 422),
    ],
    ids=["huge-int", "deep-nesting", "dtype-list", "dtype-map"],
)
def test_headers_json_cannot_parse_or_hash_are_refused_not_500(header: str, status: int) -> None:
    raw = header.encode()
    with pytest.raises(WeightValidationError) as ei:
        parse_safetensors_header(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    assert ei.value.status == status


def test_collective_bodies_with_infinity_or_lax_types_are_422(
    model_dir: Path, spec: ParamSpec
) -> None:
    c, eng = client(model_dir, spec, insecure_no_auth=True, collective_timeout_s=1.0)
    h = {"Content-Type": "application/json"}
    init = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "rank": 1}
    meta = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[4]]}
    for route, body in [
        # Infinity in the 422's echo of the input made the JSON response fail: a 500
        ("/v1/weights/collective/init", json.dumps(init | {"rank": float("inf")})),
        ("/v1/weights/collective/update?version=1", json.dumps(meta | {"names": float("nan")})),
        # these validated and opened a rendezvous that waited collective_timeout_s for peers
        ("/v1/weights/collective/init", json.dumps(init | {"rank": True})),
        ("/v1/weights/collective/init", json.dumps(init | {"world_size": 2**70})),
        ("/v1/weights/collective/init", json.dumps(init | {"master_address": "x" * 10_000})),
    ]:
        r = c.post(route, content=body.encode(), headers=h)
        assert r.status_code == 422, (route, body[:80], r.status_code)
    assert eng.updates == []


# ---------------------------------------------------------------------------- LoRA adapters

Q, K = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"
P = "base_model.model."
ADAPTER_CFG = {"r": 2, "lora_alpha": 8.0, "target_modules": ["q_proj", "k_proj"]}


def adapter(
    tensors: dict[str, torch.Tensor] | None = None, cfg: dict[str, Any] | None = None
) -> bytearray:
    """A rank-2 adapter of q_proj [4, 4] and k_proj [2, 4]: A [r, in], B [out, r]."""
    if tensors is None:
        tensors = {
            f"{P}{Q}.lora_A.weight": torch.ones(2, 4),
            f"{P}{Q}.lora_B.weight": torch.ones(4, 2),
            f"{P}{K}.lora_A.weight": torch.ones(2, 4),
            f"{P}{K}.lora_B.weight": torch.ones(2, 2),
        }
    meta = adapter_metadata(ADAPTER_CFG if cfg is None else cfg) if cfg != {} else None
    return bytearray(save(tensors, meta))


def test_an_adapter_decodes_with_its_config(spec: ParamSpec) -> None:
    tensors, cfg = decode_adapter(adapter(), spec, max_rank=2)
    assert cfg == ADAPTER_CFG
    assert tensors[f"{P}{K}.lora_B.weight"].shape == (2, 2)


@pytest.mark.parametrize(
    "tensors, cfg, match",
    [
        (None, {}, "peft config"),
        (None, {**ADAPTER_CFG, "r": 3}, r"r=3 must be an int in 1..2"),
        (None, {**ADAPTER_CFG, "lora_alpha": "8"}, "lora_alpha"),
        (None, {**ADAPTER_CFG, "target_modules": []}, "target_modules"),
        ({f"{P}{Q}.lora_A.weight": torch.ones(2, 3)}, None, r"rank 2 needs \[2, 4\]"),
        ({f"{P}{Q}.lora_A.weight": torch.ones(2, 4)}, None, "lack lora_A or lora_B"),
        ({f"{P}model.norm.lora_A.weight": torch.ones(2, 4)}, None, "not a LoRA tensor"),
        ({f"{Q}.lora_A.weight": torch.ones(2, 4)}, None, "not a LoRA tensor"),
        (
            {
                f"{P}{Q}.lora_A.weight": torch.full((2, 4), float("nan")),
                f"{P}{Q}.lora_B.weight": torch.ones(4, 2),
            },
            None,
            "non-finite",
        ),
    ],
    ids=["no-config", "rank", "alpha", "targets", "shape", "lone", "vector", "prefix", "nan"],
)
def test_bad_adapters_are_422(
    spec: ParamSpec, tensors: dict[str, torch.Tensor] | None, cfg: Any, match: str
) -> None:
    with pytest.raises(WeightValidationError, match=match) as ei:
        decode_adapter(adapter(tensors, cfg), spec, max_rank=2)
    assert ei.value.status == 422


def test_a_replica_takes_either_full_weights_or_adapters(model_dir: Path, spec: ParamSpec) -> None:
    """max_lora_rank 0 (default): /v1/adapter is refused; > 0: /v1/weights is (an adapter
    would be applied over merged weights), each naming the setting that fixes it."""
    h = {"Authorization": "Bearer s3cret"}
    c, eng = client(model_dir, spec, auth_token="s3cret")
    r = c.post("/v1/adapter?version=1", content=bytes(adapter()), headers=h)
    assert r.status_code == 400 and "max_lora_rank" in r.json()["detail"]
    c, eng = client(model_dir, spec, auth_token="s3cret", max_lora_rank=2)
    r = c.post("/v1/weights?version=1", content=GOOD, headers=h)
    assert r.status_code == 400 and "/v1/adapter" in r.json()["detail"]
    assert c.post("/v1/adapter?version=1", content=bytes(adapter())).status_code == 401
    assert eng.updates == [] and eng.version == 0
