"""LearnerSettings: flags > ``LUDIC_*`` env > YAML (``learner:`` section, or top-level keys
that name a field, e.g. a shared ``checkpoint:`` block) > defaults.

One name per TrainerConfig field: the common ones are flat settings (``lr``,
``micro_token_budget``, ``device`` for ``model_device``, ``mixed_precision`` for
``mixed_precision_dtype``, ...: :data:`FLAT_TRAINER`), the optimisation options are the run's
``algorithm:`` section (``lr_scheduler_type``, ``warmup_steps_proportion``, ``min_lr_ratio``,
``ppo_n_minibatches``, ``gradient_checkpointing``: algorithm_spec.TRAINER_OPTIONS), the schedule's
horizon ``total_steps`` is ``num_steps``, and the nested ``trainer:`` mapping holds the rest
(``betas``, ``eps``, ``pad_token_id``, ...). A field given under another name is an error
naming the one to use. ``checkpoint:`` is a CheckpointConfig mapping (``output_dir``,
``every_n_steps``, ``max_to_keep``) beside ``output_dir`` / ``checkpoint_every`` /
``max_to_keep``; where both name one setting (:data:`LearnerSettings.NESTED`), the value
from the higher source wins, and both in one source is an error.

The algorithm is the run's top-level ``algorithm:`` section ({name, group_size, kwargs} and
the optimisation options), the same one the credit worker reads; a ``learner.algorithm``
copy is an error. The experiment trackers (W&B, TensorBoard, SwanLab) are the run's top-level
``tracker:`` section (services/learner/tracker.py, parsed into ``trackers``);
``tensorboard_dir`` is the alias of its ``tensorboard.path``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from libludic import staleness
from libludic.training.algorithm_spec import TRAINER_OPTIONS, AlgorithmSpec
from libludic.training.checkpoint import CheckpointConfig
from libludic.training.config import TrainerConfig
from services.common.settings import (
    AUTH_TOKEN_WHERE,
    SAW_HIGH_WATER,
    RedisService,
    check_ack_window,
    check_service_algorithm,
    load_settings,
    secret,
)
from services.learner.tracker import parse_tracker

PLANES = ("http", "collective")
ATTN_IMPLS = ("", "sdpa", "eager", "flash_attention_2")  # LearnerSettings.attn_impl

#: TrainerConfig field -> the learner setting that is its one name
FLAT_TRAINER = {
    "lr": "lr",
    "weight_decay": "weight_decay",
    "max_grad_norm": "max_grad_norm",
    "micro_token_budget": "micro_token_budget",
    "max_seq_len": "max_seq_len",
    "sync_every_steps": "sync_every_steps",
    "mixed_precision_dtype": "mixed_precision",
    "lora_rank": "lora_rank",
    "lora_publish": "lora_publish",
    "log_every": "log_every",
    "max_lag": "max_lag",
    "max_publish_failures": "max_publish_failures",
    "model_device": "device",
    "spare_cores": "spare_cores",
    "total_steps": "num_steps",
}


def _where_instead(key: str) -> str | None:
    """Where a TrainerConfig field given in ``learner.trainer`` is set instead (None: there)."""
    if key == "learning_rate":  # TrainerConfig's init-only alias of lr
        return "learner.lr"
    if key in FLAT_TRAINER:
        return f"learner.{FLAT_TRAINER[key]}"
    if key in TRAINER_OPTIONS:
        return f"algorithm.{key} (the top-level algorithm: section)"
    return None


@dataclass
class LearnerSettings(RedisService):
    # mapping field -> {its key: the flat field naming the same setting}
    # credit's setting, read where credit reads it (its section of the run config, or
    # LUDIC_SAW_HIGH_WATER), for the ack-window check below
    FROM_SECTIONS: ClassVar[dict[str, tuple[str, str]]] = {
        "saw_high_water": ("credit", "saw_high_water")
    }
    NESTED: ClassVar[dict[str, dict[str, str]]] = {
        "checkpoint": {
            "output_dir": "output_dir",
            "every_n_steps": "checkpoint_every",
            "max_to_keep": "max_to_keep",
        },
    }
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
    attn_impl: str = field(
        default="",
        metadata={
            "help": "attention implementation of the trained model (AReaL's attn_impl): sdpa, "
            "eager or flash_attention_2 (a GPU with flash-attn); empty: transformers' default"
        },
    )
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
            "help": "the run's algorithm {name, group_size, kwargs} and its optimisation "
            "options (lr_scheduler_type, warmup_steps_proportion, min_lr_ratio, "
            "ppo_n_minibatches, gradient_checkpointing): the top-level algorithm: section "
            "(JSON here)"
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
    max_seq_len: int = field(
        default=1024,
        metadata={
            "help": "tokens of an item (prompt + reply): a longer prompt is cut from the left, "
            "an item whose reply does not fit is dead-lettered (unusable_item); ludic up "
            "checks every task against it at start-up"
        },
    )
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
    lora_publish: str = field(
        default="merged",
        metadata={
            "help": "LoRA publishes: merged (full weights W + B A * alpha/r, any replica) | "
            "adapter (the LoRA tensors alone, http plane, to replicas started with "
            "max_lora_rank >= lora_rank)"
        },
    )
    trainer: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "TrainerConfig fields without a name of their own here or in algorithm: "
            "(betas, eps, pad_token_id, cast_logits_to_fp32, lora_alpha, ...)"
        },
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
    tensorboard_dir: str = field(
        default="",
        metadata={"help": "TensorBoard event dir, alias of tracker.tensorboard.path ('' off)"},
    )
    tracker: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "experiment trackers, the top-level tracker: section: wandb {mode "
            "disabled|online|offline, project, entity, name, job_type, group, notes, tags, "
            "id_suffix, wandb_base_url}, tensorboard {path}, swanlab {mode "
            "disabled|cloud|local|offline, project, name, logdir} (services/learner/tracker.py; "
            "JSON here)"
        },
    )
    config_path: str | None = field(
        default=None,
        metadata={
            "help": "the run config file, set from --config / LUDIC_CONFIG (the trackers "
            "record its sections as their run's config)"
        },
    )
    device: str = field(default="cuda", metadata={"help": "cuda | cpu (cuda falls back to cpu)"})
    seed: int = field(default=0, metadata={"help": "torch/python/numpy seed"})
    saw_high_water: int = field(
        default=SAW_HIGH_WATER,
        metadata={
            "help": "credit's saw backlog bound (credit.saw_high_water): checkpoint_every x "
            "batch_size must fit under it"
        },
    )

    def __post_init__(self) -> None:
        self.spec = AlgorithmSpec.from_mapping(self.algorithm)
        check_service_algorithm(self.spec, "learner")
        self.trackers = parse_tracker(self.tracker, tensorboard_dir=self.tensorboard_dir)
        staleness.check_bound("learner max_lag", self.max_lag)
        if self.max_deliveries < 1:
            raise ValueError(f"learner max_deliveries={self.max_deliveries} must be >= 1")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(
                f"learner attn_impl={self.attn_impl!r}; use one of {list(ATTN_IMPLS)} "
                "('' for transformers' default)"
            )
        if self.publish_plane not in PLANES:
            raise ValueError(
                f"learner publish_plane={self.publish_plane!r}; use http or collective"
            )
        if self.lora_publish == "adapter" and self.publish_plane != "http":
            raise ValueError(
                "learner lora_publish=adapter sends the adapters over the http plane; set "
                "publish_plane: http, or lora_publish: merged for the collective plane"
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
        """TrainerConfig from the flat settings (:data:`FLAT_TRAINER`), the algorithm's
        optimisation options and ``trainer:`` (the fields with no other name)."""
        for key in self.trainer:
            instead = _where_instead(key)
            if instead is not None:
                raise ValueError(
                    f"learner.trainer.{key}: set it as {instead}, its one name "
                    "(one name per setting)"
                )
        known = {f.name for f in dataclasses.fields(TrainerConfig)}
        unknown = sorted(set(self.trainer) - known)
        if unknown:
            own = sorted(k for k in known if _where_instead(k) is None)
            raise ValueError(
                f"learner.trainer: unknown TrainerConfig key(s) {unknown}; known: {own}"
            )
        kw: dict[str, Any] = {key: getattr(self, name) for key, name in FLAT_TRAINER.items()}
        # the flat forms write "off" as 0 / "", TrainerConfig as None
        kw["max_grad_norm"] = kw["max_grad_norm"] if kw["max_grad_norm"] > 0 else None
        kw["mixed_precision_dtype"] = kw["mixed_precision_dtype"] or None
        kw["lora_rank"] = kw["lora_rank"] or None
        kw["total_steps"] = kw["total_steps"] or None  # the lr schedule's horizon; 0: none
        kw["spare_cores"] = tuple(kw["spare_cores"])
        kw.update(self.spec.trainer_options())
        kw.update(self.trainer)
        if kw["lr_scheduler_type"] != "constant" and kw["total_steps"] is None:
            raise ValueError(
                f"algorithm.lr_scheduler_type={kw['lr_scheduler_type']!r} decays over the "
                "run: set learner.num_steps (its horizon; 0 trains until stopped), or use "
                "lr_scheduler_type: constant"
            )
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
