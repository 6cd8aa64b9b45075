"""LearnerSettings: flags > ``LUDIC_*`` env > YAML (``learner:`` section, or top-level keys
that name a field, e.g. a shared ``checkpoint:`` block) > defaults.

TrainerConfig fields are reachable two ways: the common ones as flat settings (``lr``,
``micro_token_budget``, ...) and any field through the nested ``trainer:`` mapping;
``checkpoint:`` is a CheckpointConfig mapping (``output_dir``, ``every_n_steps``,
``max_to_keep``) beside ``output_dir`` / ``checkpoint_every`` / ``max_to_keep``. Where both
name one setting (:data:`LearnerSettings.NESTED`), the value from the higher source wins
(``--lr`` beats a YAML ``trainer: {lr: ...}``), and both in one source is an error.

The algorithm is the run's top-level ``algorithm:`` section ({name, group_size, kwargs}),
the same one the credit worker reads; a ``learner.algorithm`` copy is an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from libludic import staleness
from libludic.training.checkpoint import CheckpointConfig
from libludic.training.config import TrainerConfig
from libludic.training.presets import AlgorithmSpec
from services.common.settings import AUTH_TOKEN_WHERE, SAW_HIGH_WATER, load_settings, secret

PLANES = ("http", "collective")


def check_ack_window(checkpoint_every: int, batch_size: int, saw_high_water: int) -> None:
    """With checkpoints on, the learner acks items only at a checkpoint: up to
    ``checkpoint_every * batch_size`` trained items stay in the saw stream. Credit pauses while
    the stream holds ``saw_high_water`` items (its backpressure), so a larger window never
    fills: the learner waits for items credit will not write. Refuse that run config."""
    held = checkpoint_every * batch_size
    if saw_high_water > 0 and held > saw_high_water:
        raise ValueError(
            f"learner checkpoint_every={checkpoint_every} x batch_size={batch_size} = {held} items "
            f"stay un-acked between checkpoints, more than credit.saw_high_water={saw_high_water} "
            "(credit stops writing at that backlog, so the run would stall); lower "
            "checkpoint_every or raise credit.saw_high_water"
        )


@dataclass
class LearnerSettings:
    # mapping field -> {its key: the flat field naming the same setting}
    # credit's setting, read where credit reads it (its section of the run config, or
    # LUDIC_SAW_HIGH_WATER), for the ack-window check below
    FROM_SECTIONS: ClassVar[dict[str, tuple[str, str]]] = {
        "saw_high_water": ("credit", "saw_high_water")
    }
    NESTED: ClassVar[dict[str, dict[str, str]]] = {
        "trainer": {
            "lr": "lr",
            "learning_rate": "lr",
            "weight_decay": "weight_decay",
            "max_grad_norm": "max_grad_norm",
            "micro_token_budget": "micro_token_budget",
            "max_seq_len": "max_seq_len",
            "sync_every_steps": "sync_every_steps",
            "mixed_precision_dtype": "mixed_precision",
            "lora_rank": "lora_rank",
            "log_every": "log_every",
            "max_lag": "max_lag",
            "max_publish_failures": "max_publish_failures",
            "model_device": "device",
            "spare_cores": "spare_cores",
        },
        "checkpoint": {
            "output_dir": "output_dir",
            "every_n_steps": "checkpoint_every",
            "max_to_keep": "max_to_keep",
        },
    }
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata={"help": "Redis URL"})
    run_id: str = field(default="default", metadata={"help": "run namespace of the Redis keys"})
    model_dir: str = field(default="", metadata={"help": "HF model directory to train (required)"})
    output_dir: str = field(
        default="", metadata={"help": "checkpoints and the trained-items log ('' = none)"}
    )
    inference_urls: list[str] = field(
        default_factory=list,
        metadata={
            "help": "inference base URLs; a host with several addresses = one replica each "
            "(empty: publishing off)"
        },
    )
    auth_token: str | None = secret("bearer token for /v1/weights", AUTH_TOKEN_WHERE)
    auth_token_file: str | None = field(default=None, metadata={"help": "file holding the token"})
    publish_plane: str = field(default="http", metadata={"help": "http | collective"})
    publish_dtype: str = field(
        default="auto",
        metadata={
            "help": "dtype of published floating weights (http plane): auto = what the "
            "replicas serve, none = as trained, or float32|bfloat16|float16"
        },
    )
    collective_master_address: str = field(
        default="", metadata={"help": "address replicas reach the learner at (collective plane)"}
    )
    collective_master_port: int = field(default=0, metadata={"help": "0 = a free port"})
    collective_backend: str = field(default="", metadata={"help": "gloo | nccl ('' = by device)"})
    algorithm: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "the run's algorithm {name, group_size, kwargs}: the top-level algorithm: "
            "section (JSON here)"
        },
    )
    batch_size: int = field(
        default=64, metadata={"help": "SAWItems per optimizer step (all ranks)"}
    )
    num_steps: int = field(
        default=0, metadata={"help": "stop after this optimizer step (0 = never)"}
    )
    max_lag: int | None = field(
        default=None,
        metadata={
            "help": "drop items more than max_lag versions behind the learner (null off); "
            "see libludic/staleness.py"
        },
    )
    lr: float = field(default=1e-5, metadata={"help": "AdamW learning rate"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping (0 = off)"})
    micro_token_budget: int = field(
        default=8192, metadata={"help": "padded tokens per micro-batch"}
    )
    max_seq_len: int = field(default=1024, metadata={"help": "longer items are left-truncated"})
    spare_cores: list[int] = field(
        default_factory=list,
        metadata={
            "help": "CPU cores a second training thread may use at idle priority "
            "(libludic/training/spare_core.py; ludic up sets it); empty: none"
        },
    )
    sync_every_steps: int = field(default=1, metadata={"help": "publish every N steps"})
    mixed_precision: str = field(default="bf16", metadata={"help": "bf16 | fp32 (CUDA autocast)"})
    lora_rank: int = field(default=0, metadata={"help": "LoRA rank (0 = full fine-tuning)"})
    trainer: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "any TrainerConfig field (a flat one from a higher source wins)"},
    )
    checkpoint_every: int = field(default=0, metadata={"help": "checkpoint every N steps (0 off)"})
    snapshot_every: int = field(
        default=0,
        metadata={
            "help": "save the weights every N steps to output_dir/snapshots (for evaluation "
            "after the run; 0 off)"
        },
    )
    max_to_keep: int = field(default=2, metadata={"help": "checkpoints kept"})
    checkpoint: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "CheckpointConfig mapping (a flat one from a higher source wins)"},
    )
    resume: bool = field(default=False, metadata={"help": "continue from the newest checkpoint"})
    trained_log: bool = field(
        default=False,
        metadata={
            "help": "append each step's item ids to output_dir/trained_items.jsonl (audit/debug)"
        },
    )
    consumer: str = field(default="learner-0", metadata={"help": "stable consumer name on saw"})
    block_ms: int = field(default=1000, metadata={"help": "XREADGROUP block time"})
    max_deliveries: int = field(
        default=3,
        metadata={
            "help": "a SAW item re-read after this many deliveries (the learner stopped that "
            "often holding it, e.g. a step raising on it) is dead-lettered with its batch-mates"
        },
    )
    publish_timeout_s: float = field(default=120.0, metadata={"help": "per attempt per replica"})
    publish_total_timeout_s: float = field(default=300.0, metadata={"help": "whole publish"})
    publish_attempts: int = field(default=3, metadata={"help": "attempts per replica per publish"})
    max_publish_failures: int = field(
        default=5, metadata={"help": "consecutive failed publishes before the learner exits 1"}
    )
    replica_check_s: float = field(
        default=10.0,
        metadata={
            "help": "while waiting for items, seconds between checks that every inference "
            "replica serves the learner's version (a restarted one is republished to); 0: off"
        },
    )
    health_stall_s: float = field(
        default=1800.0,
        metadata={
            "help": "/health fails when no step started or finished and no read for items "
            "happened for this long (a hung step or collective)"
        },
    )
    metrics_port: int = field(
        default=9103, metadata={"help": "/metrics and /health, rank 0 (0 off)"}
    )
    log_every: int = field(default=1, metadata={"help": "console line every N steps"})
    tensorboard_dir: str = field(default="", metadata={"help": "TensorBoard event dir ('' off)"})
    device: str = field(default="cuda", metadata={"help": "cuda | cpu (cuda falls back to cpu)"})
    seed: int = field(default=0, metadata={"help": "torch/python/numpy seed"})
    log_level: str = field(default="INFO", metadata={"help": "logging level"})
    saw_high_water: int = field(
        default=SAW_HIGH_WATER,
        metadata={
            "help": "credit's saw backlog bound (credit.saw_high_water): checkpoint_every x "
            "batch_size must fit under it"
        },
    )

    def __post_init__(self) -> None:
        self.spec = AlgorithmSpec.from_mapping(self.algorithm)
        staleness.check_bound("learner max_lag", self.max_lag)
        if self.max_deliveries < 1:
            raise ValueError(f"learner max_deliveries={self.max_deliveries} must be >= 1")
        if self.publish_plane not in PLANES:
            raise ValueError(
                f"learner publish_plane={self.publish_plane!r}; use http or collective"
            )
        if self.batch_size < 1:
            raise ValueError(f"learner batch_size={self.batch_size} must be >= 1")
        if self.num_steps < 0:
            raise ValueError(f"learner num_steps={self.num_steps} must be >= 0 (0 = forever)")
        if self.max_publish_failures < 1:
            raise ValueError(
                f"learner max_publish_failures={self.max_publish_failures} must be >= 1"
            )
        if self.checkpoint_every < 0:
            raise ValueError(f"learner checkpoint_every={self.checkpoint_every} must be >= 0")
        if self.resume and not self.checkpoint_config():
            raise ValueError(
                "--resume needs checkpoints: set output_dir (or checkpoint.output_dir) and "
                "checkpoint_every > 0"
            )
        self.trainer_config()  # validate now, with the field named in the error
        ck = self.checkpoint_config()
        if ck is not None:
            check_ack_window(ck.every_n_steps, self.batch_size, self.saw_high_water)

    # ------------------------------------------------------------------ derived configs

    def token(self) -> str | None:
        if self.auth_token:
            return self.auth_token
        if self.auth_token_file:
            p = Path(self.auth_token_file)
            if not p.exists():
                raise ValueError(f"auth_token_file {p} does not exist")
            return p.read_text().strip() or None
        return None

    def trainer_config(self) -> TrainerConfig:
        # learning_rate: TrainerConfig's init-only alias of lr (the spec uses both names)
        known = {f.name for f in dataclasses.fields(TrainerConfig)} | {"learning_rate"}
        unknown = sorted(set(self.trainer) - known)
        if unknown:
            raise ValueError(
                f"learner trainer: unknown TrainerConfig key(s) {unknown}; known: {sorted(known)}"
            )
        over = dict(self.trainer)
        if "learning_rate" in over:
            if "lr" in over:
                raise ValueError(
                    "learner trainer: both lr and learning_rate are set; they name the same "
                    "setting, keep one"
                )
            over["lr"] = over.pop("learning_rate")
        # the flat settings under their TrainerConfig names (NESTED is the one map of both)
        kw: dict[str, Any] = {
            key: getattr(self, name)
            for key, name in self.NESTED["trainer"].items()
            if key != "learning_rate"
        }
        # the flat forms write "off" as 0 / "", TrainerConfig as None
        kw["max_grad_norm"] = kw["max_grad_norm"] if kw["max_grad_norm"] > 0 else None
        kw["mixed_precision_dtype"] = kw["mixed_precision_dtype"] or None
        kw["lora_rank"] = kw["lora_rank"] or None
        kw["total_steps"] = self.num_steps or None  # the lr schedule's horizon
        kw["spare_cores"] = tuple(kw["spare_cores"])
        kw.update(over)
        return TrainerConfig(**kw)

    def checkpoint_config(self) -> CheckpointConfig | None:
        d: dict[str, Any] = {
            key: getattr(self, name) for key, name in self.NESTED["checkpoint"].items()
        }
        d.update(self.checkpoint)
        # every_n_steps == 0 means checkpointing is off (CheckpointConfig's convention): items
        # then commit after each step. Returning a config here would make the learner hold
        # every item un-acked until a checkpoint that never comes, and credit's backpressure
        # (saw_high_water) would then stall the pipeline for good.
        if not d.get("output_dir") or not d.get("every_n_steps"):
            return None
        return CheckpointConfig(**d)


def load(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> LearnerSettings:
    return load_settings(
        LearnerSettings,
        argv,
        service="learner",
        description="FSDP2 learner: saw stream -> Trainer -> publish to inference",
        environ=environ,
    )
