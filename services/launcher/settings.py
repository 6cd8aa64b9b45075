"""`ludic up` settings: the ``up:`` section of the run config.

The run config is one YAML file shared by every service: top-level ``run_id`` (and any
key naming a field of every service), then one section per service (``inference:``,
``actor:``, ``credit:``, ``feeder:``, ``learner:``) read by that service's own loader,
and ``up:`` for the launcher itself. The launcher passes the file to each service as
``LUDIC_CONFIG`` and overrides what it owns (ports, model directory) through ``LUDIC_*``
environment variables; the secrets it hands over (Redis URL, tokens) reach a service as
files whose paths ``LUDIC_*_FILE`` variables name (services/launcher/supervisor.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from libludic.sft.tasks import task_spec
from services.common import heldout
from services.common.heldout import protocol_spec
from services.launcher.cpus import PINNING_MODES


@dataclass
class UpSettings:
    name: str = field(default="run", metadata={"help": "run name: files go to <runs_dir>/<name>"})
    runs_dir: str = field(default="runs", metadata={"help": "parent directory of run directories"})
    run_id: str = field(
        default="",
        metadata={
            "help": "namespace of the run's Redis keys, given to every service (top-level "
            "key; empty: <name>-<start time>)"
        },
    )
    model: str = field(
        default="", metadata={"help": "starting policy dir (empty: build one with init_size)"}
    )
    init_size: str = field(
        default="small", metadata={"help": "size for `ludic model init` when model is empty"}
    )
    init_seed: int = field(default=0, metadata={"help": "seed of the built model"})
    sft_steps: int = field(default=0, metadata={"help": "SFT warm-start steps before RL (0: none)"})
    sft_batch_size: int = field(default=64, metadata={"help": "SFT batch size"})
    sft_lr: float = field(default=1e-3, metadata={"help": "SFT learning rate"})
    sft_lr_schedule: str = field(
        default="constant", metadata={"help": "SFT lr schedule: constant | linear (to 0)"}
    )
    sft_seed: int = field(default=0, metadata={"help": "SFT seed (data order and torch RNG)"})
    sft_target_pass_rate: float = field(
        default=0.0,
        metadata={"help": "stop SFT at this train-split greedy pass rate (0: run sft_steps)"},
    )
    sft_check_every: int = field(
        default=5, metadata={"help": "SFT steps between sft_target_pass_rate checks"}
    )
    sft_task: Any = field(
        default="arithmetic",
        metadata={
            "help": "SFT data and checks: a task kind or {kind, kwargs} "
            "(libludic/sft/tasks.py: arithmetic, or env with any env that states "
            "its reference completion)"
        },
    )
    sft_data: str = field(
        default="",
        metadata={
            "help": "SFT data as a JSONL file of prompt/completion pairs, instead of "
            "sft_task's (no target stop: sft_target_pass_rate must be 0)"
        },
    )
    actors: int = field(default=2, metadata={"help": "actor processes"})
    learner_nproc: int = field(default=1, metadata={"help": "learner ranks (>1: torchrun, FSDP2)"})
    learner_threads: int = field(
        default=1,
        metadata={"help": "torch intra-op threads of each learner rank (OMP_NUM_THREADS)"},
    )
    cpu_pinning: str = field(
        default="auto",
        metadata={
            "help": "auto: without a GPU, the learner gets learner_nproc x learner_threads "
            "cores of its own and every other service the rest (services/launcher/cpus.py); "
            "off: the kernel places every process"
        },
    )
    spare_core_training: bool | None = field(
        default=None,
        metadata={
            "help": "with the learner pinned (cpu_pinning auto, one rank, no GPU): a second "
            "training thread on the generation cores at idle priority, training in their "
            "idle time (libludic/training/spare_core.py). Default: on for synchronous RL "
            "(max_head_offpolicyness 0: generation idles while the learner trains), off "
            "otherwise; true or false to choose"
        },
    )
    eval_env: dict[str, Any] = field(
        default_factory=lambda: copy.deepcopy(heldout.DEFAULTS["eval_env"]),
        metadata={
            "help": "env of the held-out evaluation ({kind, kwargs}) when eval_sets is empty"
        },
    )
    eval_protocol: dict[str, Any] | None = field(
        default=None,
        metadata={
            "help": "protocol of the held-out evaluation ({kind, kwargs[, agent]}, like a feeder "
            "task's): give it the task's parser when the task's env prompts a chat model; "
            "null: single_agent with the identity parser"
        },
    )
    eval_n: int = field(
        default=heldout.DEFAULTS["eval_n"],
        metadata={
            "help": "held-out problems (env seeds 0..n-1) of the one set eval_env makes when "
            "eval_sets is empty; 0: no evaluation at all (eval_sets included)"
        },
    )
    eval_every_steps: int = field(
        default=heldout.DEFAULTS["eval_every_steps"],
        metadata={"help": "learner steps between curve evaluations"},
    )
    eval_max_tokens: int = field(
        default=heldout.DEFAULTS["eval_max_tokens"],
        metadata={"help": "max tokens of an eval answer"},
    )
    eval_sets: list[dict[str, Any]] = field(
        default_factory=lambda: copy.deepcopy(heldout.DEFAULTS["eval_sets"]),
        metadata={
            "help": "eval sets, each {name, env: {kind, kwargs}, protocol, n, max_tokens, "
            "max_steps (turns, default 1), k (samples per problem for pass@k/mean@k, default "
            "0: greedy only), temperature (of the samples, default 1.0), pass_threshold "
            "(default 1.0)} (libludic/eval/sets.py); empty: one set 'heldout' of eval_env, "
            "eval_protocol, eval_n and eval_max_tokens"
        },
    )
    eval_mode: str = field(
        default="live",
        metadata={
            "help": "curve evaluations: live (against inference while training runs: costs "
            "its CPU share) or deferred (the learner saves a weight snapshot every "
            "eval_every_steps; they are evaluated after the RL phase, which they then take "
            "nothing from)"
        },
    )
    max_restarts: int = field(
        default=5,
        metadata={
            "help": "restarts in a row of an exited actor, credit or feeder (with doubling "
            "back-off from 1 s) before the run gives up on it"
        },
    )
    watchdog_timeout_s: float = field(
        default=120.0,
        metadata={
            "help": "a live service whose health probe (HTTP 200; a PING for redis) has failed this long "
            "(after its first pass) is SIGKILLed and restarted, or fails the run if it may not "
            "be; 0: off. Keep it above the longest a healthy service goes unanswered: "
            "inference's probe gives up after 30 s, the learner saves checkpoints on its event "
            "loop (services/launcher/watchdog.py)"
        },
    )
    watchdog_interval_s: float = field(
        default=5.0, metadata={"help": "seconds between two watchdog probes of a service"}
    )
    timeout_s: float = field(default=1800.0, metadata={"help": "wall-clock limit of the whole run"})
    deadletter_stop_after: int = field(
        default=10,
        metadata={
            "help": "stop the run when one task has had this many requests dead-lettered in a "
            "row, none of its requests committed since (services/launcher/deadletters.py; "
            "0: off)"
        },
    )
    startup_timeout_s: float = field(
        default=300.0,
        metadata={
            "help": "limit for a service to become healthy, at start and after a restart (a "
            "restart not healthy by then is killed and restarted again, with the watchdog on)"
        },
    )
    prometheus: bool = field(
        default=False, metadata={"help": "write <run>/prometheus.yml for the services"}
    )
    prometheus_server: bool = field(
        default=False, metadata={"help": "also run Debian's prometheus on a free loopback port"}
    )
    live: bool | None = field(
        default=None, metadata={"help": "rich live view (default: when stdout is a TTY)"}
    )
    fresh: bool = field(
        default=True, metadata={"help": "start from an empty Redis (the embedded one)"}
    )
    resume: str = field(
        default="",
        metadata={
            "help": "continue the stopped run of this name (in runs_dir): its saved config "
            "(<run>/run.yaml), its Redis state and the learner's newest checkpoint; needs "
            "learner.checkpoint_every > 0"
        },
    )
    keep_env: list[str] = field(
        default_factory=list,
        metadata={
            "help": "secret-bearing variables of this environment every service inherits "
            "(e.g. HF_TOKEN for a gated dataset); a service gets no other "
            "(libludic/secret_env.py); a string from the environment or YAML splits on "
            "whitespace",
            "repeat": True,
            "words": True,
        },
    )
    config_path: str | None = field(default=None, metadata={"help": "set from --config"})
    log_level: str = field(default="INFO", metadata={"help": "logging level"})

    def __post_init__(self) -> None:
        if self.deadletter_stop_after < 0:
            raise ValueError(
                f"up.deadletter_stop_after={self.deadletter_stop_after} must be >= 0 (0: off)"
            )
        if self.max_restarts < 0:
            raise ValueError(f"up.max_restarts={self.max_restarts} must be >= 0")
        if self.watchdog_timeout_s < 0:
            raise ValueError(
                f"up.watchdog_timeout_s={self.watchdog_timeout_s} must be >= 0 (0 turns the "
                "watchdog off)"
            )
        if self.watchdog_interval_s <= 0:
            raise ValueError(
                f"up.watchdog_interval_s={self.watchdog_interval_s} must be > 0 (to turn the "
                "watchdog off, set up.watchdog_timeout_s: 0)"
            )
        if self.cpu_pinning not in PINNING_MODES:
            raise ValueError(
                f"up.cpu_pinning={self.cpu_pinning!r}; use one of {sorted(PINNING_MODES)}"
            )
        protocol_spec(self.eval_protocol, "up.eval_protocol")
        # what every evaluation runs (nothing when eval_n is 0), each set built once here
        self.parsed_eval_sets = (
            heldout.eval_sets(
                self.eval_sets,
                self.eval_env,
                self.eval_protocol,
                self.eval_n,
                self.eval_max_tokens,
                sets_key="up.eval_sets",
                prefix="up.eval_",
            )
            if self.eval_n > 0
            else []
        )
        try:
            task_spec(self.sft_task)
        except ValueError as e:
            raise ValueError(f"up.sft_task: {e}") from e
        if self.eval_mode not in EVAL_MODES:
            raise ValueError(f"up.eval_mode={self.eval_mode!r}; use one of {sorted(EVAL_MODES)}")


EVAL_MODES = frozenset({"live", "deferred"})
