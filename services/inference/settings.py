"""Settings of ``ludic inference``, loaded like every service's by
``services.common.settings.load_settings`` (defaults < the run config's ``inference:`` section,
``--config``/``LUDIC_CONFIG`` < ``LUDIC_*`` environment < flags; ``--help`` shows each default).

One name per knob: the model directory is ``model_dir`` (``--model-dir``, ``--model`` as in
vLLM, ``LUDIC_MODEL_DIR``, the variable the learner reads too); the bearer token comes from
``LUDIC_AUTH_TOKEN`` or the file ``auth_token_file`` names, never from the YAML (a file that
may be committed); ``vllm_args`` passes flags through to vLLM (``--vllm-arg``, repeatable).
A bad value raises ``SettingsError`` (a ``ValueError``) whose message is the one line the
service skeleton prints before exiting 2.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from services.common.settings import AUTH_TOKEN_WHERE, secret, secret_from_file


class SettingsError(ValueError):
    """A configuration problem, phrased as one line naming the value and the fix."""


DTYPES = frozenset({"auto", "float32", "bfloat16", "float16", "half", "float"})
LOGPROBS_MODES = frozenset({"processed_logprobs", "raw_logprobs"})
UPDATE_MODES = frozenset({"keep", "wait"})
CPU_LINEAR_MODES = frozenset({"auto", "plain", "packed"})


@dataclass
class InferenceSettings:
    RETIRED_ENV: ClassVar[dict[str, str]] = {
        "LUDIC_INFERENCE_CONFIG": "set LUDIC_CONFIG (or --config) to the run config instead; "
        "inference reads its inference: section like every service",
    }

    model_dir: str = field(
        default="",
        metadata={
            "help": "model directory (HF layout, safetensors weights; required)",
            "flags": ("--model",),
        },
    )
    host: str = field(default="0.0.0.0", metadata={"help": "API address"})
    port: int = field(default=8000, metadata={"help": "API and weight port"})
    # /metrics on a port of its own (with /health), so a NetworkPolicy can admit Prometheus
    # to it alone; None: /metrics is served on the API port (`ludic up`, loopback only)
    metrics_port: int | None = field(
        default=None, metadata={"help": "port of /metrics alone (default: on the API port)"}
    )
    metrics_host: str = field(default="0.0.0.0", metadata={"help": "address of the metrics port"})
    served_model_name: str | None = field(
        default=None, metadata={"help": "the API's model name (default: the model path)"}
    )
    auth_token: str | None = secret("bearer token of the weight endpoints", AUTH_TOKEN_WHERE)
    auth_token_file: str | None = field(
        default=None, metadata={"help": "file holding the bearer token (else LUDIC_AUTH_TOKEN)"}
    )
    insecure_no_auth: bool = field(
        default=False,
        metadata={"help": "accept weight updates without a token (local experiments only)"},
    )
    # The generation and read routes (/v1/completions, /v1/chat/completions, /v1/models,
    # /v1/policy_version) take this bearer token (or the weight token) once it is set; the
    # actors and the eval service send theirs (LUDIC_API_KEY, the same variable). Unset: those
    # routes are open to whoever reaches the port (a warning at start-up). /health stays open.
    api_key: str | None = secret(
        "bearer token of the generation routes",
        "set LUDIC_API_KEY, or name a file holding it with api_key_file (--api-key-file)",
    )
    api_key_file: str | None = field(
        default=None, metadata={"help": "file holding the generation token (else LUDIC_API_KEY)"}
    )
    # Bounds of one generation request, checked before vLLM sees it: a body over
    # max_request_bytes is refused (413) before it is parsed; n over max_n and max_tokens
    # over max_tokens_limit get 400 (None: the model's context bounds max_tokens, vLLM's own
    # check); past max_concurrent_requests in flight a request gets 429 with Retry-After.
    max_request_bytes: int = field(
        default=8 << 20, metadata={"help": "largest generation request body (413 beyond)"}
    )
    max_n: int = field(default=256, metadata={"help": "largest n (completions per request)"})
    max_tokens_limit: int | None = field(
        default=None,
        metadata={"help": "largest max_tokens of a request (default: the model's context)"},
    )
    max_concurrent_requests: int = field(
        default=1024, metadata={"help": "generation requests in flight at once (429 beyond)"}
    )
    # Served dtype. Default: the learner's parameter dtype (fp32), so served logprobs equal a
    # training-side forward to ~5e-7 nats; "bfloat16" is faster but off by up to ~5e-3.
    # "auto" is vLLM's rule (an fp32 checkpoint is served in 16 bits).
    dtype: str = field(
        default="float32", metadata={"help": f"served dtype, one of {sorted(DTYPES)}"}
    )
    # What `logprobs`/`top_logprobs` report: "processed_logprobs" = log-probabilities of the
    # distribution actually sampled (after temperature, top-k/top-p, penalties); vLLM's
    # default "raw_logprobs" is the untempered distribution. Prompt logprobs are raw in both.
    logprobs_mode: str = field(
        default="processed_logprobs",
        metadata={
            "help": "processed_logprobs (the sampled, tempered distribution) or raw_logprobs"
        },
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "longest prompt + completion (default: the model's)"}
    )
    gpu_memory_utilization: float = field(
        default=0.85, metadata={"help": "share of GPU memory vLLM may use"}
    )
    tensor_parallel_size: int = field(default=1, metadata={"help": "GPUs per replica"})
    # False (vLLM's default): the model is compiled (torch.compile; CUDA graphs on GPUs) at
    # start-up, ~10 s more with a warm cache (~25 s cold) on a 2-core CPU. On that machine
    # it serves 64 samples of 8 tokens with 2.0 CPU-ms each instead of 2.8 (eager), with the
    # same logprobs (tests/integration/test_served_logprobs.py runs compiled). True: eager.
    enforce_eager: bool = field(
        default=False, metadata={"help": "run the model eagerly (default: compiled at start-up)"}
    )
    seed: int = field(default=0, metadata={"help": "vLLM's sampling seed"})
    max_weight_bytes: int = field(
        default=64 * 1024**3, metadata={"help": "larger weight-update bodies get 413"}
    )
    # LoRA adapters (learner lora_publish: adapter): vLLM's LoRA support on, each adapter
    # published to /v1/adapter served as a new version on top of the checkpoint's weights
    max_lora_rank: int = field(
        default=0,
        metadata={
            "help": "serve LoRA adapters published to /v1/adapter up to this rank (0: off; "
            "full-weight updates to /v1/weights are then refused)"
        },
    )
    health_cache_s: float = field(default=5.0, metadata={"help": "how long /health reuses a probe"})
    probe_timeout_s: float = field(default=30.0, metadata={"help": "longest /health probe"})
    # How a weight update treats requests in flight: "keep" (default) freezes them, swaps
    # the weights and lets them go on under the new ones (their KV recomputed; tokens
    # already sampled keep the logprobs they were sampled with); "wait" lets them finish
    # on the old weights first (the pause then lasts as long as the longest request).
    update_mode: str = field(
        default="keep",
        metadata={"help": "keep (in-flight requests go on under new weights) or wait (drain)"},
    )
    drain_timeout_s: float = field(
        default=600.0, metadata={"help": "update_mode=wait: longest wait for in-flight requests"}
    )
    collective_timeout_s: float = field(
        default=600.0, metadata={"help": "longest wait of a collective weight update"}
    )
    # where an update is staged for the vLLM workers to read during the swap (None: the
    # system temp dir); it needs room for one copy of the served weights
    weight_staging_dir: str | None = field(
        default=None, metadata={"help": "where updates are staged (default: the temp dir)"}
    )
    graceful_shutdown_s: float = field(
        default=30.0, metadata={"help": "on SIGTERM, how long in-flight requests may finish"}
    )
    # How long vLLM's EngineCore and worker processes spin (busy-wait) for the next message
    # before sleeping; None = 0 on CPU machines (spinning takes the cores generation and
    # training need), vLLM's own 1 s on GPUs. See services/inference/vllm_plugin.py.
    engine_idle_spin_s: float | None = field(
        default=None,
        metadata={"help": "vLLM engine/worker busy-wait before sleeping (default: 0 on CPU)"},
    )
    engine_idle_poll_ms: int = field(
        default=20, metadata={"help": "longest sleep between checks once spinning stopped"}
    )
    # CPU only: how vLLM's linear layers multiply. "plain" keeps each weight as it is and
    # multiplies with torch's linear, so a weight update is a copy into those tensors;
    # "packed" is vLLM's own (a oneDNN copy of each weight, rebuilt on every update);
    # "auto" is plain for float32 and packed otherwise. See services/inference/vllm_plugin.py.
    cpu_linear: str = field(
        default="auto", metadata={"help": "CPU only: plain, packed or auto (plain for float32)"}
    )
    log_level: str = field(default="info", metadata={"help": "log level"})
    vllm_args: list[str] = field(
        default_factory=list,
        metadata={
            "help": "extra vLLM engine flag (e.g. --vllm-arg=--max-num-seqs=64); a string "
            "from the environment or YAML splits on whitespace",
            "flags": ("--vllm-arg",),
            "repeat": True,
            "words": True,
        },
    )

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise SettingsError(
                "no model: pass --model-dir DIR (or --model) or set LUDIC_MODEL_DIR"
            )
        d = Path(self.model_dir)
        if not d.is_dir():
            raise SettingsError(
                f"model directory {self.model_dir!r} does not exist; pass --model-dir DIR"
            )
        if not (d / "config.json").exists():
            raise SettingsError(
                f"{self.model_dir!r} has no config.json; point --model-dir at an HF model "
                "directory (e.g. one written by `ludic model init DIR`)"
            )
        if not any(d.glob("*.safetensors")):
            raise SettingsError(f"{self.model_dir!r} has no *.safetensors weights")
        self.auth_token = _token(self.auth_token, self.auth_token_file, "LUDIC_AUTH_TOKEN")
        self.api_key = _token(self.api_key, self.api_key_file, "LUDIC_API_KEY")
        for name in ("max_request_bytes", "max_n", "max_concurrent_requests"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise SettingsError(
                f"max_tokens_limit={self.max_tokens_limit} must be >= 1 (or unset: the context)"
            )
        if not 0 < self.port < 65536:
            raise SettingsError(f"port {self.port} out of range 1..65535")
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise SettingsError(f"metrics_port {self.metrics_port} out of range 1..65535")
        if self.metrics_port == self.port:
            raise SettingsError(
                f"metrics_port {self.metrics_port} is the API port: pick another, or leave it "
                "unset to serve /metrics on the API port"
            )
        if self.max_weight_bytes <= 0:
            raise SettingsError("max_weight_bytes must be > 0")
        if self.max_lora_rank < 0:
            raise SettingsError(f"max_lora_rank={self.max_lora_rank} must be >= 0 (0: off)")
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
        d["api_key"] = "<set>" if self.api_key else None
        return d


def _token(value: str | None, path: str | None, env: str) -> str | None:
    what = "auth token" if env == "LUDIC_AUTH_TOKEN" else "api key"
    try:
        return secret_from_file(value, path, env, what)
    except ValueError as e:
        raise SettingsError(str(e)) from e
