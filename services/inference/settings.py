"""Settings of ``ludic inference``: flags > LUDIC_* environment > YAML file > defaults.

Everything is resolved and checked in ``load_settings(argv)``; a bad value raises
``SettingsError`` whose message is the one line the service skeleton prints before exiting 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.settings import coerce


class SettingsError(ValueError):
    """A configuration problem, phrased as one line naming the value and the fix."""


DTYPES = frozenset({"auto", "float32", "bfloat16", "float16", "half", "float"})
LOGPROBS_MODES = frozenset({"processed_logprobs", "raw_logprobs"})
UPDATE_MODES = frozenset({"keep", "wait"})
CPU_LINEAR_MODES = frozenset({"auto", "plain", "packed"})


@dataclass
class InferenceSettings:
    model: str  # model directory (HF layout, safetensors weights)
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_name: str | None = None  # default: the model path, as vLLM does
    auth_token: str | None = field(default=None, repr=False)
    insecure_no_auth: bool = False
    # Served dtype. Default: the learner's parameter dtype (fp32), so served logprobs equal a
    # training-side forward to ~5e-7 nats; "bfloat16" is faster but off by up to ~5e-3.
    # "auto" is vLLM's rule (an fp32 checkpoint is served in 16 bits).
    dtype: str = "float32"
    # What `logprobs`/`top_logprobs` report: "processed_logprobs" = log-probabilities of the
    # distribution actually sampled (after temperature, top-k/top-p, penalties); vLLM's
    # default "raw_logprobs" is the untempered distribution. Prompt logprobs are raw in both.
    logprobs_mode: str = "processed_logprobs"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.85
    tensor_parallel_size: int = 1
    # False (vLLM's default): the model is compiled (torch.compile; CUDA graphs on GPUs) at
    # start-up, ~10 s more with a warm cache (~25 s cold) on a 2-core CPU. On that machine
    # it serves 64 samples of 8 tokens with 2.0 CPU-ms each instead of 2.8 (eager), with the
    # same logprobs (tests/integration/test_served_logprobs.py runs compiled). True: eager.
    enforce_eager: bool = False
    seed: int = 0
    max_weight_bytes: int = 64 * 1024**3  # refuse larger bodies with 413
    health_cache_s: float = 5.0
    probe_timeout_s: float = 30.0
    # How a weight update treats requests in flight: "keep" (default) freezes them, swaps
    # the weights and lets them go on under the new ones (their KV recomputed; tokens
    # already sampled keep the logprobs they were sampled with); "wait" lets them finish
    # on the old weights first (the pause then lasts as long as the longest request).
    update_mode: str = "keep"
    drain_timeout_s: float = 600.0  # update_mode=wait: max wait for in-flight requests
    collective_timeout_s: float = 600.0
    # where an update is staged for the vLLM workers to read during the swap (None: the
    # system temp dir); it needs room for one copy of the served weights
    weight_staging_dir: str | None = None
    graceful_shutdown_s: float = 30.0
    # How long vLLM's EngineCore and worker processes spin (busy-wait) for the next message
    # before sleeping; None = 0 on CPU machines (spinning takes the cores generation and
    # training need), vLLM's own 1 s on GPUs. See services/inference/vllm_plugin.py.
    engine_idle_spin_s: float | None = None
    engine_idle_poll_ms: int = 20  # longest sleep between checks once spinning stopped
    # CPU only: how vLLM's linear layers multiply. "plain" keeps each weight as it is and
    # multiplies with torch's linear, so a weight update is a copy into those tensors;
    # "packed" is vLLM's own (a oneDNN copy of each weight, rebuilt on every update);
    # "auto" is plain for float32 and packed otherwise. See services/inference/vllm_plugin.py.
    cpu_linear: str = "auto"
    log_level: str = "info"
    vllm_args: list[str] = field(default_factory=list)  # passed through to vLLM's parser

    def __post_init__(self) -> None:
        if not self.model:
            raise SettingsError("no model: pass --model DIR or set LUDIC_MODEL_DIR")
        d = Path(self.model)
        if not d.is_dir():
            raise SettingsError(f"model directory {self.model!r} does not exist; pass --model DIR")
        if not (d / "config.json").exists():
            raise SettingsError(
                f"{self.model!r} has no config.json; point --model at an HF model directory "
                "(e.g. one written by `ludic model init DIR`)"
            )
        if not any(d.glob("*.safetensors")):
            raise SettingsError(f"{self.model!r} has no *.safetensors weights")
        if not 0 < self.port < 65536:
            raise SettingsError(f"port {self.port} out of range 1..65535")
        if self.max_weight_bytes <= 0:
            raise SettingsError("max_weight_bytes must be > 0")
        if self.tensor_parallel_size < 1:
            raise SettingsError("tensor_parallel_size must be >= 1")
        if self.dtype not in DTYPES:
            raise SettingsError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.engine_idle_spin_s is not None and self.engine_idle_spin_s < 0:
            raise SettingsError(f"engine_idle_spin_s={self.engine_idle_spin_s} must be >= 0")
        if self.engine_idle_poll_ms < 0:
            raise SettingsError(f"engine_idle_poll_ms={self.engine_idle_poll_ms} must be >= 0")
        if self.cpu_linear not in CPU_LINEAR_MODES:
            raise SettingsError(
                f"cpu_linear {self.cpu_linear!r} is not one of {sorted(CPU_LINEAR_MODES)}"
            )
        if self.update_mode not in UPDATE_MODES:
            raise SettingsError(
                f"update_mode {self.update_mode!r} is not one of {sorted(UPDATE_MODES)}"
            )
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise SettingsError(
                f"logprobs_mode {self.logprobs_mode!r} is not one of {sorted(LOGPROBS_MODES)}; "
                "importance ratios need processed_logprobs (the sampled distribution)"
            )

    @property
    def weight_updates_allowed(self) -> bool:
        return bool(self.auth_token) or self.insecure_no_auth

    def public_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["auth_token"] = "<set>" if self.auth_token else None
        return d


_FIELDS = {f.name: f for f in dataclasses.fields(InferenceSettings)}
_HINTS = typing.get_type_hints(InferenceSettings)


def _coerce(name: str, raw: Any) -> Any:
    """Environment/YAML value -> the field's type (the services' shared ``coerce``; errors
    name the key). ``vllm_args`` from a string splits on whitespace, as on a command line."""
    if name == "vllm_args" and isinstance(raw, str):
        return raw.split()
    try:
        return coerce(name, _HINTS[name], raw)
    except ValueError as e:
        raise SettingsError(str(e)) from e


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ludic inference",
        description="vLLM inference service with versioned in-place weight updates",
    )
    p.add_argument("--config", help="YAML file with any of the settings below (snake_case keys)")
    p.add_argument("--model", help="model directory (env LUDIC_MODEL_DIR)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--served-model-name")
    p.add_argument(
        "--auth-token-file", help="file holding the bearer token (else LUDIC_AUTH_TOKEN)"
    )
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        default=None,
        help="accept weight updates without a token (local experiments only)",
    )
    p.add_argument("--dtype", help="served dtype (default float32 = the training dtype)")
    p.add_argument(
        "--logprobs-mode",
        help="processed_logprobs (default: the sampled, tempered distribution) or raw_logprobs",
    )
    p.add_argument("--max-model-len", type=int)
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the model eagerly (default: compiled at start-up, vLLM's default)",
    )
    p.add_argument("--gpu-memory-utilization", type=float)
    p.add_argument("--tensor-parallel-size", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--max-weight-bytes", type=int)
    p.add_argument(
        "--update-mode", help="keep (in-flight requests go on under new weights) or wait (drain)"
    )
    p.add_argument("--drain-timeout-s", type=float)
    p.add_argument(
        "--engine-idle-spin-s",
        type=float,
        help="vLLM engine/worker busy-wait before sleeping (default: 0 on CPU, vLLM's on GPU)",
    )
    p.add_argument("--engine-idle-poll-ms", type=int, help="longest idle sleep (default 20)")
    p.add_argument(
        "--cpu-linear",
        help="CPU only: plain (torch linear; an update is a copy), packed (vLLM's oneDNN "
        "copies, rebuilt per update) or auto (plain for float32; the default)",
    )
    p.add_argument("--log-level")
    p.add_argument(
        "--vllm-arg",
        action="append",
        dest="vllm_args",
        help="extra vLLM engine flag, repeatable (e.g. --vllm-arg=--max-num-seqs=64)",
    )
    return p


def load_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> InferenceSettings:
    env = os.environ if environ is None else environ
    args = _build_parser().parse_args(list(argv or []))
    values: dict[str, Any] = {}

    cfg_path = args.config or env.get("LUDIC_INFERENCE_CONFIG")
    if cfg_path:
        import yaml

        try:
            data = yaml.safe_load(Path(cfg_path).read_text()) or {}
        except FileNotFoundError as e:
            raise SettingsError(f"config file {cfg_path!r} does not exist") from e
        except yaml.YAMLError as e:
            raise SettingsError(f"config file {cfg_path!r} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise SettingsError(f"config file {cfg_path!r} must hold a mapping")
        data = data.get("inference", data)
        unknown = sorted(set(data) - set(_FIELDS) - {"auth_token_file"})
        if unknown:
            raise SettingsError(
                f"config file {cfg_path!r}: unknown key(s) {unknown}; known: {sorted(_FIELDS)}"
            )
        for k, v in data.items():
            if k == "auth_token_file":
                values["auth_token"] = _read_token(v)
            elif k != "auth_token":  # never from a file that may be committed
                values[k] = _coerce(k, v)

    for name in _FIELDS:
        key = "LUDIC_" + name.upper()
        if key in env and name != "model":
            values[name] = _coerce(name, env[key])
    if env.get("LUDIC_MODEL_DIR"):
        values["model"] = env["LUDIC_MODEL_DIR"]
    if env.get("LUDIC_AUTH_TOKEN"):
        values["auth_token"] = env["LUDIC_AUTH_TOKEN"]

    for name in _FIELDS:
        v = getattr(args, name, None)
        if v is not None:
            values[name] = v
    if args.auth_token_file:
        values["auth_token"] = _read_token(args.auth_token_file)

    values.setdefault("model", "")
    return InferenceSettings(**values)


def _read_token(path: str) -> str:
    try:
        tok = Path(path).read_text().strip()
    except OSError as e:
        raise SettingsError(f"cannot read auth token file {path!r}: {e.strerror}") from e
    if not tok:
        raise SettingsError(f"auth token file {path!r} is empty")
    return tok
