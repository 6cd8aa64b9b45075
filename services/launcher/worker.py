"""``ludic up``'s run: ``prepare_model`` (build / SFT warm start) and ``Run`` (start the
services, evaluate, supervise, report). ``main.py`` is the command line."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import yaml

from libludic.models.tiny import init_model
from libludic.sft.tasks import make_task
from libludic.transport import Keys, accounting
from services.common.eval_tensorboard import UP_EVENTS_DIR, write_scalars
from services.common.heldout import evaluate_served, evaluate_snapshot, split
from services.common.redis_acl import ADMIN, RunUsers
from services.common.secrets import SecretFiles
from services.common.settings import read_yaml, secret_from_file
from services.launcher import cpus, stack
from services.launcher.deadletters import (
    NO_TASK,
    DeadLetterTally,
    TaskFailureWatch,
    first_reason,
)
from services.launcher.live import LiveView
from services.launcher.report import write_report
from services.launcher.resolved import Resolved
from services.launcher.settings import UpSettings
from services.launcher.supervisor import ServiceError, ServiceSpec, Supervisor

log = logging.getLogger("ludic.up")
LUDIC = [sys.executable, "-m", "services.cli"]


class Interrupted(BaseException):
    """SIGINT / SIGTERM of ``ludic up``. A BaseException so that no ``except Exception`` on
    the way (a live evaluation runs library code that catches errors) swallows the stop;
    ``monitor`` also re-raises it from ``_STOP`` at every turn, should anything still catch
    it (asyncio drops what a plain callback raises)."""


_STOP: list[str] = []  # the stop signals received, newest last
TASK_CHECK_EVERY_S = 5.0  # between two looks at the actors' per-task outcomes


def _on_signal(signum: int, frame: Any) -> None:
    _STOP.append(signal.Signals(signum).name)
    raise Interrupted(_STOP[-1])


def prepare_model(s: UpSettings, run_dir: Path) -> Path:
    """The starting policy: given, or built, then SFT'd when sft_steps > 0."""
    if s.model:
        base = Path(s.model)
        if not (base / "config.json").exists():
            raise FileNotFoundError(
                f"up.model={s.model} has no config.json; write it with `ludic model import "
                "SOURCE DIR` (a pretrained model) or `ludic model init DIR`, or leave up.model "
                "empty to build the tiny one"
            )
    else:
        base = run_dir / "model"
        if not (base / "config.json").exists():
            log.info("building %s model in %s", s.init_size, base)
            init_model(base, size=s.init_size, seed=s.init_seed)
    if s.sft_steps <= 0:
        return base
    out = run_dir / "sft"
    marker = out / "sft_done.json"
    want = {
        "base": str(base),
        "steps": s.sft_steps,
        "batch_size": s.sft_batch_size,
        "lr": s.sft_lr,
        "lr_schedule": s.sft_lr_schedule,
        "seed": s.sft_seed,
        "target_pass_rate": s.sft_target_pass_rate,
        "check_every": s.sft_check_every,
        "task": "" if s.sft_data else s.sft_task,
        "data": s.sft_data,
    }
    if marker.exists() and json.loads(marker.read_text()).get("args") == want:
        log.info("reusing SFT warm start in %s", out)
        return out
    stop = (
        f", stop at train pass rate {s.sft_target_pass_rate}" if s.sft_target_pass_rate > 0 else ""
    )
    log.info(
        "SFT warm start: %d steps x %d (lr %g %s, seed %d%s) -> %s",
        s.sft_steps,
        s.sft_batch_size,
        s.sft_lr,
        s.sft_lr_schedule,
        s.sft_seed,
        stop,
        out,
    )
    # the Trainer and transformers (seconds to import) for a warm start only
    from libludic.sft.run import run_sft

    check = None
    if s.sft_data:
        if s.sft_target_pass_rate > 0:
            raise ValueError(
                f"up.sft_target_pass_rate={s.sft_target_pass_rate} needs a task's check; "
                f"up.sft_data={s.sft_data} brings none (set it to 0, or use up.sft_task)"
            )
        data = Path(s.sft_data)
        if not data.is_file():
            raise FileNotFoundError(f"up.sft_data={s.sft_data}: no such file")
    else:
        task = make_task(s.sft_task)
        data = task.data_in(out, s.sft_steps * s.sft_batch_size)
        check = task.check
    res = run_sft(
        base,
        out,
        data,
        steps=s.sft_steps,
        batch_size=s.sft_batch_size,
        lr=s.sft_lr,
        log_every=max(1, s.sft_steps // 6),
        lr_schedule=s.sft_lr_schedule,
        seed=s.sft_seed,
        check=check,
        target_pass_rate=s.sft_target_pass_rate,
        check_every=s.sft_check_every,
    )
    marker.write_text(
        json.dumps({"args": want, "train_s": res["train_s"], "steps_run": res["steps_run"]})
    )
    return out


SAVED_CONFIG = "run.yaml"  # the config a run started with, for ``ludic up --resume``
PID_FILE = "up.pid"  # the pid of the ``ludic up`` running the run
# settings of how this invocation runs, not of the run itself: never saved
_NOT_SAVED = ("config_path", "resume", "fresh", "live", "log_level", "run_id")


def running_launcher(run_dir: Path) -> int | None:
    """The pid of the ``ludic up`` still running the run in ``run_dir``, if any."""
    try:
        pid = int((run_dir / PID_FILE).read_text().strip())
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    # `ludic up ...` (the console script) or `python -m services.cli up ...`
    entry = b"services.cli" in cmd or any(os.path.basename(a) == b"ludic" for a in cmd)
    return pid if pid != os.getpid() and b"up" in cmd and entry else None


def torchrun(argv: list[str]) -> bool:
    return "torch.distributed.run" in argv


class Run:
    def __init__(self, s: UpSettings, resolved: Resolved | None = None) -> None:
        """``resolved``: the learner's and feeder's settings (``Resolved.of(s)`` when not
        given)."""
        self.s = s
        self.services = Resolved.of(s) if resolved is None else resolved
        self.run_dir = Path(s.runs_dir) / s.name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.sup = Supervisor(
            self.run_dir,
            max_restarts=s.max_restarts,
            watchdog_timeout_s=s.watchdog_timeout_s,
            watchdog_interval_s=s.watchdog_interval_s,
            restart_startup_s=s.startup_timeout_s,
        )
        self.run_id = s.run_id or f"{s.name}-{int(time.time())}"
        self.redis_users: RunUsers | None = None  # the embedded Redis's (start_redis)
        self.redis_port = 0
        self.token = secrets.token_hex(24)  # the weight routes' (inference, learner)
        # the generation routes' (inference, actors, this process's evaluations and probes)
        self.api_key = secrets.token_hex(24)
        # the secrets of a service that cannot take a descriptor (a torchrun learner)
        self.secret_files: SecretFiles | None = None
        self.metrics: dict[str, str] = {}  # service -> /metrics URL
        self.curve: list[dict[str, float]] = []
        self.last_learner: dict[str, float] = {}
        self.evals: list[dict[str, float]] = []
        self.accounting: dict[str, Any] | None = None
        self.publish: dict[str, Any] = {}  # from learner_final.json
        self.learner_rl: dict[str, Any] = {}  # the learner's RL wall and samples/s
        self.curve_eval_s = 0.0  # seconds of curve evaluations (live or deferred)
        self.cpu_plan: cpus.CpuPlan | None = None
        self.error: str | None = None  # why the monitor stopped a failed run
        self.resuming = bool(s.resume)
        self.total_steps = self.services.num_steps  # for the live view's ETA
        self.task_watch = TaskFailureWatch(s.deadletter_stop_after)
        # the learner's dead letters by reason: the live view's and summary.json's counts
        self.deadletters = DeadLetterTally(Keys(self.run_id))

    def save_config(self) -> None:
        """``<run>/run.yaml``: the run config with its run id and every ``up:`` setting this
        run uses (flags and environment included), what ``ludic up --resume`` reads."""
        cfg = read_yaml(self.s.config_path) if self.s.config_path else {}
        cfg["run_id"] = self.run_id
        up = {k: v for k, v in dataclasses.asdict(self.s).items() if k not in _NOT_SAVED}
        cfg["up"] = {**(cfg.get("up") or {}), **up}
        tmp = self.run_dir / (SAVED_CONFIG + ".tmp")
        tmp.write_text(yaml.safe_dump(cfg, sort_keys=False))
        tmp.replace(self.run_dir / SAVED_CONFIG)

    def start(self, spec: ServiceSpec) -> None:
        """Start a service on the cores the CPU plan gives it (launcher/cpus.py)."""
        if self.cpu_plan is not None:
            spec = dataclasses.replace(spec, cpus=self.cpu_plan.for_service(spec.name))
        self.sup.start(spec)

    def plan_cpus(self) -> None:
        learner_cores = self.s.learner_nproc * self.s.learner_threads
        gpu = self.s.cpu_pinning == "auto" and cpus.cuda_visible()
        self.cpu_plan, why = cpus.plan_cpus(
            self.s.cpu_pinning, learner_cores, cpus.usable_cores(), gpu
        )
        log.info("%s", why)

    def env(self, **extra: Any) -> dict[str, str]:
        base = {
            "LUDIC_CONFIG": str(self.s.config_path),
            "LUDIC_RUN_ID": self.run_id,
            # the services' /metrics and /health: for this process and its Prometheus only
            "LUDIC_METRICS_HOST": "127.0.0.1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
        base.update({k: str(v) for k, v in extra.items()})
        return base

    def start_redis(self) -> None:
        url = secret_from_file(
            os.environ.get("LUDIC_REDIS_URL"),
            os.environ.get("LUDIC_REDIS_URL_FILE"),
            "LUDIC_REDIS_URL",
            "redis_url",
        )
        if url:
            self.redis_url = url
            return
        port = stack.free_port()
        data = self.run_dir / "redis"
        if self.s.fresh and data.exists():
            shutil.rmtree(data)
        # a user per role with passwords of this process's own (a resumed run makes new
        # ones), the default user off: nothing else on the machine that can reach loopback
        # can read or write the run's streams, and no service can do more than its role
        # (services/common/redis_acl.py); this process keeps the admin user
        self.redis_users = RunUsers(self.run_id)
        self.redis_port = port
        self.start(stack.redis_spec(data, port, users=self.redis_users))
        self.redis_url = self.redis_users.url(ADMIN, "127.0.0.1", port)
        stack.wait_redis(port, url=self.redis_url)

    def redis_url_for(self, service: str) -> str:
        """The Redis URL of ``service`` (``actor-3`` is an actor): its role's user on the
        embedded Redis; the given LUDIC_REDIS_URL as it is for an external one."""
        if self.redis_users is None:
            return self.redis_url
        role = service.split("-")[0]
        return self.redis_users.url(role, "127.0.0.1", self.redis_port)

    def start_services(self, model_dir: Path) -> None:
        ip = stack.free_port()
        self.inference_url = f"http://127.0.0.1:{ip}"
        self.metrics["inference"] = f"{self.inference_url}/metrics"
        self.start(self.inference_spec(model_dir, ip))
        self.sup.wait_healthy("inference", self.s.startup_timeout_s)

    def inference_spec(self, model_dir: Path, port: int) -> ServiceSpec:
        """`ludic inference` on ``port``; like every service it reads the run config's
        ``inference:`` section from LUDIC_CONFIG (``self.env``)."""
        host = ["--host", "127.0.0.1", "--port", str(port)]
        return ServiceSpec(
            "inference",
            LUDIC + ["inference", "--model-dir", str(model_dir), *host],
            env=self.env(),
            secrets={"LUDIC_AUTH_TOKEN_FILE": self.token, "LUDIC_API_KEY_FILE": self.api_key},
            keep_env=tuple(self.s.keep_env),
            health_url=f"http://127.0.0.1:{port}/health",
            # a restarted server serves the starting weights as version 0: actors' admission
            # holds generation until the learner, idle for items, republishes its version
            restart=True,
        )

    def eval_snapshots(self, model_dir: Path) -> None:
        """Deferred curve: evaluate every snapshot the learner saved, in this process, after
        the RL phase, on every eval set; ``wall_s`` is when the learner had trained that step,
        ``rl_wall_s`` its RL wall then (the Trainer's time inside train steps: the clock of
        samples/s)."""
        index = self.run_dir / "learner" / "snapshots" / "snapshots.jsonl"
        if not index.exists():
            return
        sets = self.s.parsed_eval_sets
        for line in index.read_text().splitlines():
            snap = json.loads(line)
            t = time.monotonic()
            res = evaluate_snapshot(
                model_dir, index.parent / snap["path"], sets, snap["policy_version"]
            )
            res.update(
                step=float(snap["step"]),
                wall_s=snap["time"] - self.rl_t0_wall,
                rl_wall_s=float(snap.get("rl_wall_s", snap["time"] - self.rl_t0_wall)),
                eval_s=time.monotonic() - t,
            )
            self.evals.append(res)
            self.curve_eval_s += res["eval_s"]
            names = [s.name for s in sets]
            write_scalars(self.run_dir / UP_EVENTS_DIR, split(res, names), snap["step"])
            log.info(
                "eval curve (step %d, deferred): pass rate %s",
                snap["step"],
                ", ".join(f"{n} {res.get(f'eval/{n}/pass_rate', float('nan')):.3f}" for n in names),
            )

    def eval_now(self, label: str, step: int) -> dict[str, float] | None:
        """Every eval set against inference's current weights (services/common/heldout.py):
        ``eval/<set>/<figure>`` and the first set's ``eval/<figure>``, appended to
        ``self.evals`` and written as TensorBoard scalars at ``step``."""
        sets = self.s.parsed_eval_sets
        if not sets:
            return None
        t = time.monotonic()
        res = evaluate_served(self.inference_url, sets, self.api_key)
        rl_t0 = getattr(self, "rl_t0", None)
        res.update(
            step=float(step),
            wall_s=0.0 if rl_t0 is None else time.monotonic() - rl_t0,
            eval_s=time.monotonic() - t,
        )
        if label == "curve":
            self.curve_eval_s += res["eval_s"]
        self.evals.append(res)
        names = [s.name for s in sets]
        write_scalars(self.run_dir / UP_EVENTS_DIR, split(res, names), step)
        log.info(
            "eval %s (step %d, version %d): pass rate %s",
            label,
            step,
            int(res["eval/policy_version"]),
            ", ".join(f"{n} {res[f'eval/{n}/pass_rate']:.3f}" for n in names),
        )
        return res

    def start_workers(self, model_dir: Path) -> None:
        def add(
            name: str,
            argv: list[str],
            critical: bool = True,
            may_finish: bool = False,
            finished: Callable[[], bool] | None = None,
            restart: bool = False,
            restart_env: dict[str, str] | None = None,
            secrets: dict[str, str] | None = None,
            keep_env: tuple[str, ...] = (),
            **env: Any,
        ) -> None:
            mp = stack.free_port()
            self.metrics[name] = f"http://127.0.0.1:{mp}/metrics"
            # one torch thread per worker: with vLLM on the same cores, spinning OpenMP threads
            # make small models ~50x slower (DEVELOPERS.md)
            threads = self.s.learner_threads if name == "learner" else 1
            handed = {"LUDIC_REDIS_URL_FILE": self.redis_url_for(name), **(secrets or {})}
            if torchrun(argv):  # its agent closes every descriptor it inherits: files
                env.update(self.write_secret_files(name, handed))
                handed = {}
            self.start(
                ServiceSpec(
                    name,
                    argv,
                    env=self.env(LUDIC_METRICS_PORT=mp, OMP_NUM_THREADS=threads, **env),
                    secrets=handed,
                    keep_env=(*self.s.keep_env, *keep_env),
                    health_url=f"http://127.0.0.1:{mp}/health",  # the service's own check
                    critical=critical,
                    may_finish=may_finish,
                    finished=finished,
                    restart=restart,
                    restart_env=restart_env or {},
                )
            )

        # stateless workers over consumer groups: a restarted one takes over its pending entries
        add("feeder", LUDIC + ["feeder"], restart=True)
        add("credit", LUDIC + ["credit"], restart=True)
        for i in range(self.s.actors):
            add(
                f"actor-{i}",
                LUDIC + ["actor"],
                critical=False,
                restart=True,
                secrets={"LUDIC_API_KEY_FILE": self.api_key},
                LUDIC_INFERENCE_URLS=self.inference_url,
                LUDIC_CONSUMER=f"actor-{i}",
            )
        learner = LUDIC + ["learner"]
        if self.s.learner_nproc > 1:
            learner = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={self.s.learner_nproc}",
                "-m",
                "services.cli",
                "learner",
            ]
        learner_env: dict[str, Any] = {}
        if self.s.eval_mode == "deferred" and self.s.eval_n > 0 and self.s.eval_every_steps > 0:
            learner_env["LUDIC_SNAPSHOT_EVERY"] = self.s.eval_every_steps
            if not self.resuming:  # a resumed run keeps its snapshots from before the stop
                shutil.rmtree(self.run_dir / "learner" / "snapshots", ignore_errors=True)
        if self.resuming:  # from the newest checkpoint at once, not only after a crash
            learner_env["LUDIC_RESUME"] = "true"
        spare = cpus.spare_cores(
            self.cpu_plan,
            self.s.learner_nproc,
            self.s.spare_core_training,
            self.services.learner_spare_cores,
            synchronous=self.services.synchronous,
        )
        if spare:
            learner_env["LUDIC_SPARE_CORES"] = ",".join(str(c) for c in spare)
        # with checkpoints a crashed learner resumes from its newest one and replays the items
        # it had not committed; without, its weights since the start would be lost: fatal
        add(
            "learner",
            learner,
            may_finish=True,
            finished=self.learner_done,
            restart=self.services.checkpoints,
            restart_env={"LUDIC_RESUME": "true"},
            secrets={"LUDIC_AUTH_TOKEN_FILE": self.token},
            keep_env=("WANDB_API_KEY",),  # its metrics' W&B run (services/learner/metrics.py)
            LUDIC_INFERENCE_URLS=self.inference_url,
            LUDIC_MODEL_DIR=str(model_dir),
            LUDIC_OUTPUT_DIR=str(self.run_dir / "learner"),
            **learner_env,
        )
        for name in self.metrics:
            if name not in ("inference",):
                self.sup.wait_healthy(name, self.s.startup_timeout_s)
        if self.s.prometheus:
            self.write_prometheus()

    def write_secret_files(self, service: str, handed: dict[str, str]) -> dict[str, str]:
        """``handed`` (``{"LUDIC_REDIS_URL_FILE": url}``) as files of this run's private
        directory (services/common/secrets.py, ``SecretFiles``, removed when the run ends):
        ``{variable: path}``."""
        if self.secret_files is None:
            self.secret_files = SecretFiles(prefix=f"ludic-{self.run_id}-")
        return {
            var: self.secret_files.write(f"{service}-{var.lower()}", value)
            for var, value in handed.items()
        }

    def write_prometheus(self) -> Path:
        targets: dict[str, list[str]] = {}
        for name, url in self.metrics.items():
            job = name.split("-")[0]
            targets.setdefault(job, []).append(url.split("//")[1].split("/")[0])
        path = self.run_dir / "prometheus.yml"
        path.write_text(stack.prometheus_config(targets))
        log.info("wrote Prometheus scrape config %s", path)
        if self.s.prometheus_server:
            exe = shutil.which("prometheus")
            if exe is None:
                raise FileNotFoundError(
                    "up.prometheus_server needs Debian's `prometheus` (make system-deps)"
                )
            port = stack.free_port()
            self.prometheus_url = f"http://127.0.0.1:{port}"
            self.start(
                ServiceSpec(
                    "prometheus",
                    [
                        exe,
                        f"--config.file={path}",
                        f"--storage.tsdb.path={self.run_dir / 'prometheus-data'}",
                        f"--web.listen-address=127.0.0.1:{port}",
                    ],
                    health_url=f"{self.prometheus_url}/-/ready",
                    critical=False,
                )
            )
            self.sup.wait_healthy("prometheus", 60)
            (self.run_dir / "prometheus_url").write_text(self.prometheus_url)
        return path

    def failing_task(self) -> str | None:
        """Why the run must stop because a task's requests are all dead-lettered (None: no
        task is failing): every actor's per-task counters, then the first reason."""
        actors = {n: u for n, u in self.metrics.items() if n.startswith("actor-")}
        self.task_watch.update({n: stack.scrape(u) for n, u in actors.items()})
        failing = self.task_watch.failing()
        if not failing:
            return None
        task, n = failing[0]
        r = redis.Redis.from_url(self.redis_url, socket_timeout=5)
        try:
            reason = first_reason(r, Keys(self.run_id), task)
        except redis.RedisError as e:
            reason = f"(the dead-letter stream could not be read: {e})"
        finally:
            r.close()
        what = (
            "requests that are no task of the actors' run config"
            if task == NO_TASK
            else (f"task {task!r}")
        )
        return (
            f"{what}: its last {n} requests were all dead-lettered, none committed since "
            f"(up.deadletter_stop_after={self.s.deadletter_stop_after}); first reason: {reason}"
        )

    def count_deadletters(self) -> None:
        """Count the learner's dead letters written since the last look. A Redis that does
        not answer leaves the counts as they were (logged): the next look reads on from
        where this one stopped."""
        r = redis.Redis.from_url(self.redis_url, socket_timeout=5)
        try:
            self.deadletters.update(r)
        except redis.RedisError as e:
            log.warning("the dead-letter stream could not be read (counts kept): %s", e)
        finally:
            r.close()

    def monitor(self) -> int:
        live = LiveView(
            self, enabled=self.s.live if self.s.live is not None else sys.stdout.isatty()
        )
        next_eval = self.s.eval_every_steps
        tasks_checked_at = time.monotonic()
        with live:
            while True:
                if _STOP:  # a stop whose exception something caught on the way
                    raise Interrupted(_STOP[-1])
                if time.monotonic() - self.t0 > self.s.timeout_s:
                    self.error = f"run timed out after {self.s.timeout_s:.0f}s (up.timeout_s)"
                    log.error("%s", self.error)
                    return 1
                dead = self.sup.restart_exited()  # what exited for good
                if "learner" in dead:
                    code = dead["learner"]
                    if code == 0 and not self.learner_done():
                        self.error = (
                            "the learner was stopped from outside ludic up (SIGTERM or SIGINT) "
                            "before its num_steps and cannot resume: checkpoints are off "
                            "(learner.checkpoint_every); the run is incomplete"
                        )
                        log.error("%s", self.error)
                        return 1
                    if code != 0:
                        self.error = f"learner exited with code {code} (its log: {self.run_dir}/logs/learner.log)"
                        log.error(
                            "learner exited with code %s:\n%s",
                            code,
                            self.sup.log_tail("learner", 30),
                        )
                    return 0 if code == 0 else 1
                for name, code in dead.items():
                    if self.sup.specs[name].critical:
                        raise ServiceError(
                            f"{name} exited with code {code}:\n{self.sup.log_tail(name, 30)}"
                        )
                if time.monotonic() - tasks_checked_at >= TASK_CHECK_EVERY_S:
                    tasks_checked_at = time.monotonic()
                    self.count_deadletters()
                    failing = self.failing_task()
                    if failing is not None:
                        self.error = failing
                        log.error("stopping the run: %s", failing)
                        live.update()
                        return 1
                actors = [n for n in self.sup.procs if n.startswith("actor-")]
                if actors and all(n in dead for n in actors):
                    raise ServiceError(
                        f"every actor exited for good (up.max_restarts={self.s.max_restarts}); "
                        f"last lines of {actors[-1]}:\n{self.sup.log_tail(actors[-1], 30)}"
                    )
                m = stack.scrape(self.metrics["learner"])
                if m:
                    self.last_learner = m
                    step = int(m.get("ludic_learner_step", 0))
                    if not self.curve or self.curve[-1]["step"] != step:
                        self.curve.append(
                            {
                                "step": float(step),
                                "wall_s": time.monotonic() - self.rl_t0,
                                "reward_mean": m.get("ludic_learner_reward_mean", float("nan")),
                                "loss": m.get("ludic_learner_loss", float("nan")),
                            }
                        )
                    if (
                        self.s.eval_mode == "live"
                        and self.s.eval_every_steps > 0
                        and step >= next_eval
                    ):
                        self.eval_now("curve", step)
                        next_eval = step + self.s.eval_every_steps
                live.update()
                time.sleep(1.0)

    def learner_done(self) -> bool:
        """Whether the learner's last exit was the end of its work (learner_final.json's
        reason "done": num_steps reached or its source finished), not a stop by a signal."""
        p = self.run_dir / "learner" / "learner_final.json"
        try:
            return json.loads(p.read_text()).get("reason") == "done"
        except (OSError, ValueError):
            return False

    def read_learner_final(self) -> None:
        """Take the learner's exit counters over the last scrape (which can miss the end)."""
        p = self.run_dir / "learner" / "learner_final.json"
        if not p.exists():
            return
        f = json.loads(p.read_text())
        self.last_learner.update(
            {
                "ludic_learner_step": float(f["step"]),
                "ludic_learner_policy_version": float(f["policy_version"]),
                "ludic_learner_items_trained_total": float(f["items_trained"]),
                "ludic_learner_stale_dropped_total": float(f["stale_dropped"]),
            }
        )
        self.learner_rl = {
            "rl_wall_seconds": f.get("rl_wall_seconds"),
            "samples_per_second": f.get("samples_per_second"),
        }
        self.publish = {
            "publish_failures": int(f.get("publish_failures", 0)),
            "final_policy_served": f.get("final_policy_served"),
            "last_publish_error": f.get("last_publish_error") or None,
        }

    def keep_final_policy(self) -> Path:
        """Move the learner's exit weights (``<run>/learner/final``, the policy "after" was
        evaluated on: the learner saves them after its last publish) to ``<run>/final``."""
        src, dst = self.run_dir / "learner" / "final", self.run_dir / "final"
        if not (src / "config.json").exists():
            raise ServiceError(
                f"the learner exited 0 but wrote no final policy to {src}; see {self.run_dir}/logs/learner.log"
            )
        src.replace(dst)
        log.info("final policy saved to %s (AutoModelForCausalLM.from_pretrained)", dst)
        return dst

    def report_failure(self, before: dict[str, float] | None, error: str) -> None:
        """``summary.json`` for a run ludic up stopped on an error (with ``error`` and what
        the learner had reported), so a failed run leaves its reason where a finished one
        leaves its figures. Best effort: the services may be half up, Redis among them, so
        the accounting is not read; a failure to write is logged, never raised over
        ``error``."""
        try:
            self.read_learner_final()
            write_report(self, before, None, ok=False, error=error)
        except Exception as e:  # the run's own error is the one to report
            log.error("could not write %s/summary.json: %s", self.run_dir, e)

    def execute(self) -> int:
        self.t0 = time.monotonic()
        code = 1
        before: dict[str, float] | None = None
        _STOP.clear()
        old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            (self.run_dir / PID_FILE).write_text(str(os.getpid()))
            if self.resuming:
                log.info("resuming run %s from %s", self.s.name, self.run_dir)
            else:
                self.save_config()
            model_dir = prepare_model(self.s, self.run_dir)
            self.t0 = time.monotonic()  # wall time of the RL run (SFT excluded, reported apart)
            final = self.run_dir / "learner" / "learner_final.json"
            if final.exists():
                final.unlink()
            for stale in (self.run_dir / "final", self.run_dir / "learner" / "final"):
                shutil.rmtree(stale, ignore_errors=True)
            if (
                self.s.fresh
            ):  # an earlier run's checkpoints: a restarted learner must not resume them
                for ck in (self.run_dir / "learner").glob("step_*"):
                    shutil.rmtree(ck, ignore_errors=True)
            self.plan_cpus()
            self.start_redis()
            self.start_services(model_dir)
            before = self.eval_now("before", 0)
            self.start_workers(model_dir)
            self.rl_t0, self.rl_t0_wall = time.monotonic(), time.time()
            code = self.monitor()
            self.rl_t1 = time.monotonic()
            self.read_learner_final()
            self.accounting = accounting.snapshot_sync(self.redis_url, self.run_id)
            self.count_deadletters()
            if code == 0 and self.s.eval_mode == "deferred":
                self.eval_snapshots(model_dir)
            after = (
                self.eval_now("after", int(self.last_learner.get("ludic_learner_step", 0)))
                if code == 0
                else None
            )
            write_report(self, before, after, ok=code == 0, error=self.error)
            if code == 0:
                self.keep_final_policy()
        except Interrupted as e:
            log.warning("%s: stopping every service", e)
            code = 130
        except (ServiceError, FileNotFoundError, ValueError) as e:
            log.error("%s", e)
            code = 1
            self.report_failure(before, str(e))
        except Exception as e:  # a bug of ludic up's own: the run still ends with its reason
            log.exception("ludic up failed")
            code = 1
            self.report_failure(before, f"{type(e).__name__}: {e}")
        finally:
            self.sup.shutdown()
            if self.secret_files is not None:
                self.secret_files.close()
            (self.run_dir / PID_FILE).unlink(missing_ok=True)
            for s, h in old.items():
                signal.signal(s, h)
        return code
