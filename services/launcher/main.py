"""``ludic up --config FILE``: the whole stack as local processes, one command.

Order: the run config checked (every service's settings, every task's item lengths against
``learner.max_seq_len``: services/launcher/seqlen.py) -> model (built and/or SFT
warm-started if asked) -> embedded redis-server (unless
LUDIC_REDIS_URL is set) -> inference -> held-out eval "before" -> feeder, credit,
N actors, learner -> live view until the learner finishes its ``num_steps`` -> eval
"after" -> stop everything -> ``<run>/summary.json``, ``<run>/curves.png`` and the final
policy (the one "after" evaluated) as a Hugging Face model directory ``<run>/final/``.
A random auth token is shared by inference and learner; each service logs to
``<run>/logs/<name>.log``. Ctrl-C / SIGTERM stop every service (process groups) and
exit 130; a service that dies early stops the run with its last log lines.

``ludic up --resume NAME`` continues a stopped run (Ctrl-C, a killed ``ludic up``, a crashed
machine): the config the run started with (``<run>/run.yaml``, written at its start with
every ``up:`` setting it ran with), its embedded Redis (append-only file: the streams,
pending entries and accounting) and the learner's newest checkpoint (weights, optimizer,
step, stream position; the learner publishes them before any actor generates). Training
goes on to the same ``learner.num_steps``. Flags given with ``--resume`` override the saved
``up:`` settings; other services' settings come from the saved file.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from services.common.secrets import keep_secrets_in
from services.common.settings import load_settings, log_settings, setup_logging
from services.launcher import seqlen
from services.launcher.resolved import Resolved
from services.launcher.settings import UpSettings
from services.launcher.worker import (  # noqa: F401 (re-exported for callers of main)
    SAVED_CONFIG,
    Interrupted,
    Run,
    prepare_model,
    running_launcher,
)

log = logging.getLogger("ludic.launcher")


def main(argv: list[str] | None = None) -> int:
    keep_secrets_in()  # it generates the run's auth token and hands it to the services
    s = load_settings(UpSettings, argv, service="up", description=__doc__ or "")
    setup_logging(s.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the evals' per-request lines
    if not s.config_path and not s.resume:
        print(
            "ludic up: give the run config with --config FILE (e.g. examples/arith/grpo.yaml), "
            "or --resume NAME to continue a stopped run",
            file=sys.stderr,
        )
        return 2
    if s.resume:
        resumed = resume_settings(s, list(sys.argv[1:] if argv is None else argv))
        if isinstance(resumed, str):
            print(f"ludic up --resume {s.resume}: {resumed}", file=sys.stderr)
            return 2
        s = resumed
    assert s.config_path is not None
    cfg_path = Path(s.config_path)
    try:  # fail before starting anything: a service would refuse the config minutes later
        resolved = Resolved.of(s)
        # and before a warm start: items that cannot fit the learner would be cut or dropped
        for line in seqlen.check_run(s, resolved, Resolved.actor(s).max_steps):
            if line.warn:
                log.warning("item length: %s", line)
            else:
                log.info("item length: %s", line)
    except (ValueError, FileNotFoundError) as e:
        print(f"ludic up: {s.config_path}: {e}", file=sys.stderr)
        return 2
    if s.resume and not resolved.checkpoints:
        print(
            f"ludic up --resume {s.resume}: the run kept no learner checkpoints "
            "(learner.checkpoint_every is 0): its weights since the start are gone; start "
            "it again instead",
            file=sys.stderr,
        )
        return 2
    s.config_path = str(cfg_path.resolve())
    log_settings(log, "up", s)
    try:
        return Run(s, resolved).execute()
    except subprocess.SubprocessError as e:
        log.error("%s", e)
        return 1


def resume_settings(s: UpSettings, argv: list[str]) -> UpSettings | str:
    """The settings of the run ``s.resume`` names: its saved config, then ``argv``'s flags;
    or why it cannot be resumed."""
    if s.config_path:
        return "a resumed run uses the config it started with (<run>/run.yaml); drop --config"
    run_dir = Path(s.runs_dir) / s.resume
    saved = run_dir / SAVED_CONFIG
    if not saved.exists():
        return (
            f"no run {s.resume!r} to resume in {s.runs_dir} ({saved} is missing; a run "
            "writes it when it starts)"
        )
    live = running_launcher(run_dir)
    if live is not None:
        return f"the run is still going (ludic up, pid {live}): stop it first"
    out = load_settings(UpSettings, [*argv, "--config", str(saved)], service="up")
    out.name, out.runs_dir, out.fresh = s.resume, s.runs_dir, False
    out.config_path = str(saved.resolve())
    return out


if __name__ == "__main__":
    raise SystemExit(main())
