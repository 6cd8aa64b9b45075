"""Prometheus metrics of ``ludic learner`` (served by rank 0 on port 9103) and the step logger
that writes each step's stats to the run's trackers (W&B, TensorBoard, SwanLab)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from services.learner.tracker import TrackerConfig

log = logging.getLogger("ludic.learner")

STEP = Gauge("ludic_learner_step", "Optimizer steps taken")
LOSS = Gauge("ludic_learner_loss", "Loss of the last step")
GRAD_NORM = Gauge("ludic_learner_grad_norm", "Pre-clip global gradient norm of the last step")
LR = Gauge("ludic_learner_lr", "Learning rate of the last step")
TOKENS_PER_S = Gauge(
    "ludic_learner_tokens_per_second", "Tokens trained per second of RL wall (since start)"
)
SAMPLES_PER_S = Gauge(
    "ludic_learner_samples_per_second",
    "Items trained per second of RL wall, evaluation excluded (since start; Trainer.train_step)",
)
RL_WALL = Gauge("ludic_learner_rl_wall_seconds", "RL wall: seconds inside train steps")
BATCH_WAIT = Gauge(
    "ludic_learner_batch_wait_fraction",
    "Share of the recent step time spent waiting for items (moving average); rises when "
    "generation cannot keep up (scale actors up), falls to 0 when items pile up",
)
REWARD_MEAN = Gauge("ludic_learner_reward_mean", "Mean rollout reward of the last batch")
STALE_DROPPED = Counter(
    "ludic_learner_stale_dropped_total",
    "Items dropped (acked, never trained) for exceeding max_lag",
)
ITEMS_TRAINED = Counter("ludic_learner_items_trained_total", "Items trained")
TRAIN_SIGNAL = Gauge(
    "ludic_learner_train_signal",
    "The last step's loss statistics (the loss's stat_keys: entropy, clip fraction, approx KL, "
    "ratio and importance-weight means and maxima, the served/trained logprob gap and "
    "mismatch KL, ...) and the batch's advantage mean and std (adv_mean, adv_std)",
    ["signal"],
)
# the Trainer's step stats of the whole batch exported as train signals beside the loss's
STEP_SIGNALS = ("adv_mean", "adv_std")
NONFINITE_SKIPPED = Counter(
    "ludic_learner_nonfinite_steps_skipped_total",
    "Steps whose loss or gradient was not finite: the update was skipped, weights unchanged",
)
_nonfinite_seen = 0
PUBLISH_SECONDS = Histogram(
    "ludic_learner_publish_seconds",
    "Wall time of a weight publish (gather + push)",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
PUBLISH_BYTES = Counter(
    "ludic_learner_publish_bytes_total",
    "Bytes of the published bodies (http plane; full or merged weights, or LoRA adapters)",
)
PUBLISH_WAIT_SECONDS = Histogram(
    "ludic_learner_publish_wait_seconds",
    "Time a step spent on publishing (snapshot + waiting for the previous publish)",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
PUBLISHES = Counter("ludic_learner_publishes_total", "Publishes by outcome", ["outcome"])
REPUBLISHES = Counter(
    "ludic_learner_republishes_total",
    "Publishes without a step because a replica served older weights (e.g. it restarted)",
)
REPLICA_ACKED = Gauge(
    "ludic_learner_replica_acked_version",
    "Last policy version each replica acknowledged",
    ["replica"],
)
PUBLISH_FAILURES = Counter(
    "ludic_learner_publish_failures_total", "Failed publishes per replica", ["replica"]
)
POLICY_VERSION = Gauge("ludic_learner_policy_version", "Learner's published policy version")
UNCOMMITTED = Gauge(
    "ludic_learner_uncommitted_items", "Trained items not acked yet (waiting for a checkpoint)"
)
CHECKPOINTS = Counter("ludic_learner_checkpoints_total", "Checkpoints saved")

# Run accounting (libludic/transport/accounting.py): read from Redis at every learner status write, so
# they are gauges even where the name says _total (the counts live in Redis, across restarts).
RUN_GROUPS = {
    name: Gauge(f"ludic_run_{name}_total", f"Groups (feeder requests) {what}, whole run")
    for name, what in (
        ("groups_requested", "requested"),
        ("groups_trained", "with >= 1 item trained, all items resolved"),
        ("groups_dropped_stale", "whose items were all dropped stale"),
        ("groups_dropped_incomplete", "dropped by credit: too few rollouts at the timeout"),
        ("groups_dropped_empty", "with no item (no rollout, or all samples filtered)"),
        ("groups_deadlettered", "dead-lettered (request or credit error)"),
    )
}
RUN_ZERO_VARIANCE = Gauge(
    "ludic_run_groups_zero_variance_total",
    "Groups dynamic sampling dropped (all rewards equal; part of groups_dropped_empty), whole run",
)
RUN_ITEMS_DEADLETTERED = Gauge(
    "ludic_run_items_deadlettered_total",
    "Items the learner dead-lettered, whole run: unusable (no step could train them, e.g. "
    "longer than max_seq_len), past max_deliveries or undecodable",
)
RUN_IN_FLIGHT = Gauge(
    "ludic_run_groups_in_flight", "Groups requested and not finished (requested - the rest)"
)
RUN_IN_FLIGHT_OBSERVED = Gauge(
    "ludic_run_groups_in_flight_observed",
    "Groups observed in flight: requests backlog + groups in rollouts + groups with open items",
)
RUN_CONSISTENT = Gauge("ludic_run_accounting_consistent", "1 while derived == observed in flight")
TRAINED_TWICE = Gauge(
    "ludic_learner_items_trained_twice_total", "Items counted trained more than once (must be 0)"
)


#: run accounting figures logged with every step (TensorBoard / wandb name -> accounting key)
RUN_STEP_SIGNALS = {"run/dynamic_sampling_dropped_total": "groups_zero_variance"}


def export_accounting(a: dict[str, Any]) -> None:
    for name, g in RUN_GROUPS.items():
        g.set(a[name])
    RUN_ZERO_VARIANCE.set(a.get("groups_zero_variance", 0))
    RUN_ITEMS_DEADLETTERED.set(a.get("items_deadlettered", 0))
    RUN_IN_FLIGHT.set(a["groups_in_flight"])
    RUN_IN_FLIGHT_OBSERVED.set(a["groups_in_flight_observed"])
    RUN_CONSISTENT.set(1 if a["consistent"] else 0)
    TRAINED_TWICE.set(a["items_trained_twice"])


def on_replica_result(replica: str, version: int | None, why: str | None) -> None:
    if version is not None:
        REPLICA_ACKED.labels(replica=replica).set(version)
    else:
        PUBLISH_FAILURES.labels(replica=replica).inc()


class WaitAverage:
    """Exponential moving averages of wait and step time; ``add`` returns wait / step.
    ``alpha`` 0.2: about the last 5 steps count."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.wait: float | None = None
        self.step: float | None = None

    def add(self, wait_s: float, step_s: float) -> float:
        a = self.alpha
        self.wait = wait_s if self.wait is None else (1 - a) * self.wait + a * wait_s
        self.step = step_s if self.step is None else (1 - a) * self.step + a * step_s
        return 0.0 if self.step <= 0 else min(1.0, self.wait / self.step)


WAIT_AVERAGE = WaitAverage()


def export_step(stats: dict[str, float], signals: tuple[str, ...] = ()) -> None:
    """The step's figures as metrics; ``signals``: the loss's stat keys, exported as
    ``ludic_learner_train_signal{signal=...}`` ("loss" has its own gauge), and so are the
    step stats ``STEP_SIGNALS`` (the batch's advantage mean and std)."""
    global _nonfinite_seen
    for k in signals:  # the Trainer reports them as "loss/<key>", combined over micro-batches
        v = stats.get(f"loss/{k}")
        if k != "loss" and v is not None:
            TRAIN_SIGNAL.labels(signal=k).set(float(v))
    for k in STEP_SIGNALS:
        if k in stats:
            TRAIN_SIGNAL.labels(signal=k).set(float(stats[k]))
    skipped = int(stats.get("nonfinite_skipped_total", 0))
    if skipped > _nonfinite_seen:
        NONFINITE_SKIPPED.inc(skipped - _nonfinite_seen)
        _nonfinite_seen = skipped
    STEP.set(stats["step"])
    LOSS.set(stats.get("loss", 0.0))
    GRAD_NORM.set(stats.get("grad_norm", 0.0))
    LR.set(stats.get("lr", 0.0))
    TOKENS_PER_S.set(stats.get("tokens_per_s", 0.0))
    SAMPLES_PER_S.set(stats.get("samples_per_s", 0.0))
    RL_WALL.set(stats.get("rl_wall_s", 0.0))
    BATCH_WAIT.set(WAIT_AVERAGE.add(stats.get("batch_wait_s", 0.0), stats.get("step_wall_s", 0.0)))
    REWARD_MEAN.set(stats.get("reward_mean", 0.0))
    ITEMS_TRAINED.inc(stats.get("batch_items", 0.0))
    if "publish_wait_s" in stats:
        PUBLISH_WAIT_SECONDS.observe(stats["publish_wait_s"])


def logged_stats(stats: dict[str, float], accounting: dict[str, Any] | None) -> dict[str, float]:
    """What :class:`StepLogger` writes for a step: the Trainer's step stats and the run
    accounting's :data:`RUN_STEP_SIGNALS` as read after the step (the credit stage's
    figures, such as the groups dynamic sampling dropped, reach the learner only there)."""
    out = dict(stats)
    if accounting is not None:
        for name, key in RUN_STEP_SIGNALS.items():
            if key in accounting:
                out[name] = float(accounting[key])
    return out


class StepLogger:
    """Every step's stats (:func:`logged_stats`) to each tracker the run's ``tracker:``
    section turns on (tracker.py): ``wandb.log`` and ``swanlab.log`` at the step, and one
    TensorBoard scalar per key and step. A tracker's package is imported only when it is on
    (the settings refused a start without it). ``config``: what the trackers record as their
    run's config (tracker.run_config); ``output_dir``: the learner's, under which W&B and
    SwanLab keep their local files. (The console line is the Trainer's, every ``log_every``
    steps.)"""

    def __init__(
        self,
        trackers: TrackerConfig,
        *,
        run_id: str = "default",
        config: Mapping[str, Any] | None = None,
        output_dir: str = "",
    ) -> None:
        config = dict(config or {})
        self.wandb: Any = None
        if trackers.wandb.on:
            import wandb  # optional dependency: only with tracker.wandb on

            dir_ = None
            if output_dir:
                Path(output_dir).mkdir(parents=True, exist_ok=True)
                dir_ = output_dir
            kw = trackers.wandb.init_kwargs(run_id, config, dir_)
            if trackers.wandb.wandb_base_url:
                kw["settings"] = wandb.Settings(base_url=trackers.wandb.wandb_base_url)
            wandb.init(**kw)
            self.wandb = wandb
            log.info(
                "wandb: mode %s, project %s, run %s (id %s)",
                kw["mode"],
                kw["project"],
                kw["name"],
                kw["id"],
            )
        self.swanlab: Any = None
        if trackers.swanlab.on:
            import swanlab  # optional dependency: only with tracker.swanlab on

            kw = trackers.swanlab.init_kwargs(run_id, config, output_dir)
            swanlab.init(**kw)
            self.swanlab = swanlab
            log.info("swanlab: mode %s, project %s", kw["mode"], kw["project"])
        self.tb: Any = None
        if trackers.tensorboard.path:
            from torch.utils.tensorboard import SummaryWriter  # optional (tensorboard)

            self.tb = SummaryWriter(trackers.tensorboard.path)
            log.info("tensorboard: events in %s", trackers.tensorboard.path)

    def step(self, stats: dict[str, float]) -> None:
        step = int(stats["step"])
        if self.wandb is not None:
            self.wandb.log(stats, step=step)
        if self.swanlab is not None:
            self.swanlab.log(stats, step=step)
        if self.tb is not None:
            for k, v in stats.items():
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.swanlab is not None:
            self.swanlab.finish()
