"""TrainerConfig: every knob of the Trainer, validated at construction.

``model_device`` defaults to "cuda" (the spec's default); on a machine without CUDA the
Trainer falls back to CPU with a warning instead of failing. ``mixed_precision_dtype``
("bf16" by default) turns on autocast on CUDA; on CPU autocast stays off unless
``cpu_autocast=True`` (CPU bf16 matmuls are slower than fp32 on most CPUs).

Fields beyond the spec table (LoRA, ``cpu_autocast``, ``seed``) default to off.

The spec's other spellings (``learning_rate`` for ``lr``, ``runtime_device``) are accepted
as libludic/training/compat.py describes; ``lr`` is the one stored field (``to_dict`` and
the optimizer use it).
"""

from __future__ import annotations

from dataclasses import InitVar, asdict, dataclass
from typing import Any

import torch

from libludic.training.compat import DEFAULT_LR, check_runtime_device, resolve_learning_rate
from libludic.training.schedule import check_schedule, lr_factor

MIXED_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
LORA_PUBLISH = ("merged", "adapter")


OPTIMIZERS = ("adam", "sgd")  # TrainerConfig.optimizer_type


@dataclass
class TrainerConfig:
    model_device: str = "cuda"
    runtime_device: str | None = None  # the spec's serving device: None or model_device (compat)
    lr: float = DEFAULT_LR
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    # the learning-rate schedule (libludic/training/schedule.py), AReaL's names and defaults;
    # total_steps is its horizon in optimizer steps (None: no horizon, constant only)
    lr_scheduler_type: str = "constant"
    warmup_steps_proportion: float = 0.001
    min_lr_ratio: float = 0.0
    total_steps: int | None = None
    max_grad_norm: float | None = 1.0
    # optimizer steps per trainer step: the batch is split into this many minibatches (AReaL's
    # name; its default is 4, ours 1: one step per batch, as the spec's presets assume)
    ppo_n_minibatches: int = 1
    # recompute each layer's activations in the backward pass instead of keeping them:
    # less memory for long sequences, ~1 more forward of time (AReaL's name; its default is
    # True, ours False: the demo's sequences are short)
    gradient_checkpointing: bool = False
    max_seq_len: int = 1024
    micro_token_budget: int = 8192  # padded B * T_max tokens per micro-batch
    # the least number of micro-batches a step's items are split into (AReaL's mb_spec.n_mbs
    # beside max_tokens_per_mb): the largest is halved until there are this many
    min_micro_batches: int = 1
    # CPU cores a second training thread may use at idle priority (SCHED_IDLE), taking
    # micro-batches when those cores have nothing else to run (libludic/training/spare_core.py);
    # empty: none. Used on CPU with one rank and no gradient checkpointing; `ludic up` gives it
    # the generation cores when it pins the learner to a core of its own.
    spare_cores: tuple[int, ...] = ()
    # with spare cores: the least number of micro-batches a step's items are split into
    spare_core_micro_batches: int = 4
    sync_every_steps: int = 1  # publish weights every N optimizer steps
    # send a publish in the background while the next step trains (at most one in flight);
    # False: every publish is awaited where it is started
    async_publish: bool = True
    mixed_precision_dtype: str | None = "bf16"  # "bf16" | "fp16" | "fp32" | None
    cast_logits_to_fp32: bool = True
    max_lag: int | None = None  # drop items sampled > max_lag versions ago
    log_every: int = 1
    pad_token_id: int = 0
    eval_at_start: bool = False
    eval_every_n_steps: int | None = None
    eval_concurrency: int = 32
    # --- beyond the spec table ---
    # consecutive failed publishes (PublishError) tolerated: training goes on with the old
    # version served; at this many in a row the Trainer raises PublishFailed
    max_publish_failures: int = 5
    cpu_autocast: bool = False  # allow autocast on CPU (mixed_precision_dtype must be set)
    # the optimizer (AReaL's optimizer.type): "adam" (AdamW: lr, betas, eps, weight_decay)
    # or "sgd" (plain SGD: lr, weight_decay). A checkpoint resumes only with the same type
    optimizer_type: str = "adam"
    # the critic's learning rate (AReaL's critic.optimizer.lr), when the algorithm trains one
    # (make_ppo); None: the policy's lr. Its optimizer is optimizer_type with the settings above
    critic_lr: float | None = None
    # every dropout of the policy off while training (AReaL's name and default): dropout
    # layers and transformers' attention dropout (policies.disable_dropout), LoRA's included
    disable_dropout: bool = False
    lora_rank: int | None = None  # LoRA via peft when set
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    # what a LoRA publish carries: "merged" full weights (W + B A * alpha / r under the base
    # names) or the "adapter" tensors alone (peft names; the replica applies them itself)
    lora_publish: str = "merged"
    # the spec example's name for lr; init-only, stored in lr (compat)
    learning_rate: InitVar[float | None] = None

    def __post_init__(self, learning_rate: float | None) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"TrainerConfig.{name}={getattr(self, name)!r} {why}")

        self.lr = resolve_learning_rate(self.lr, learning_rate)
        try:
            torch.device(self.model_device)
        except (RuntimeError, TypeError) as e:
            raise bad("model_device", "is not a torch device (use 'cuda', 'cuda:1', 'cpu')") from e
        check_runtime_device(self.runtime_device, self.model_device)
        if not self.lr > 0:
            raise bad("lr", "must be > 0")
        if self.weight_decay < 0:
            raise bad("weight_decay", "must be >= 0")
        betas = tuple(float(b) for b in self.betas)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise bad("betas", "must be two floats in [0, 1)")
        self.betas = (betas[0], betas[1])
        if not self.eps > 0:
            raise bad("eps", "must be > 0")
        try:
            check_schedule(
                self.lr_scheduler_type,
                self.total_steps,
                self.warmup_steps_proportion,
                self.min_lr_ratio,
            )
        except ValueError as e:
            raise ValueError(f"TrainerConfig.{e}") from None
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise bad("max_grad_norm", "must be > 0 or None (no clipping)")
        if self.ppo_n_minibatches < 1:
            raise bad("ppo_n_minibatches", "must be >= 1")
        if self.max_seq_len < 2:
            raise bad("max_seq_len", "must be >= 2")
        if self.micro_token_budget < 1:
            raise bad("micro_token_budget", "must be >= 1")
        self.spare_cores = tuple(int(c) for c in self.spare_cores)
        if any(c < 0 for c in self.spare_cores):
            raise bad("spare_cores", "must be CPU core numbers (>= 0)")
        if isinstance(self.min_micro_batches, bool) or self.min_micro_batches < 1:
            raise bad("min_micro_batches", "must be >= 1")
        if self.spare_core_micro_batches < 1:
            raise bad("spare_core_micro_batches", "must be >= 1")
        if self.sync_every_steps < 1:
            raise bad("sync_every_steps", "must be >= 1")
        if (
            self.mixed_precision_dtype is not None
            and self.mixed_precision_dtype not in MIXED_PRECISION
        ):
            raise bad("mixed_precision_dtype", f"must be one of {sorted(MIXED_PRECISION)} or None")
        if self.max_lag is not None and self.max_lag < 0:
            raise bad("max_lag", "must be >= 0 or None (keep everything)")
        if self.log_every < 1:
            raise bad("log_every", "must be >= 1")
        if self.pad_token_id < 0:
            raise bad("pad_token_id", "must be >= 0")
        if self.eval_every_n_steps is not None and self.eval_every_n_steps < 1:
            raise bad("eval_every_n_steps", "must be >= 1 or None")
        if self.eval_concurrency < 1:
            raise bad("eval_concurrency", "must be >= 1")
        if self.max_publish_failures < 1:
            raise bad("max_publish_failures", "must be >= 1")
        if self.critic_lr is not None and not self.critic_lr > 0:
            raise bad("critic_lr", "must be > 0 or None (the policy's lr)")
        if self.optimizer_type not in OPTIMIZERS:
            raise bad("optimizer_type", f"must be one of {list(OPTIMIZERS)}")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise bad("lora_rank", "must be >= 1 or None")
        if self.lora_publish not in LORA_PUBLISH:
            raise bad("lora_publish", f"must be one of {list(LORA_PUBLISH)}")
        if self.lora_publish == "adapter" and self.lora_rank is None:
            raise bad("lora_publish", "publishes LoRA adapters: set lora_rank, or use merged")
        self.lora_target_modules = tuple(self.lora_target_modules)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0 for the first)."""
        return self.lr * lr_factor(
            step,
            self.lr_scheduler_type,
            self.total_steps,
            self.warmup_steps_proportion,
            self.min_lr_ratio,
        )

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return (
            None
            if self.mixed_precision_dtype is None
            else MIXED_PRECISION[self.mixed_precision_dtype]
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(self.betas)
        d["lora_target_modules"] = list(self.lora_target_modules)
        return d
