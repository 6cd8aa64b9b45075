"""``ludic up --config FILE``: the whole stack as local processes, one command.

Order: model (built and/or SFT warm-started if asked) -> embedded redis-server (unless
LUDIC_REDIS_URL is set) -> inference -> held-out eval "before" -> feeder, credit,
N actors, learner -> live view until the learner finishes its ``num_steps`` -> eval
"after" -> stop everything -> ``<run>/summary.json``, ``<run>/curves.png`` and the final
policy (the one "after" evaluated) as a Hugging Face model directory ``<run>/final/``.
A random auth token is shared by inference and learner; each service logs to
``<run>/logs/<name>.log``. Ctrl-C / SIGTERM stop every service (process groups) and
exit 130; a service that dies early stops the run with its last log lines.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import yaml

from services.common.secrets import keep_secrets_in
from services.common.settings import load_settings, log_settings, setup_logging
from services.launcher.config import UpSettings
from services.launcher.run import (  # noqa: F401 (re-exported for callers of main)
    Interrupted,
    Run,
    prepare_model,
)

log = logging.getLogger("ludic.launcher")


def main(argv: list[str] | None = None) -> int:
    keep_secrets_in()  # it generates the run's auth token and hands it to the services
    s = load_settings(UpSettings, argv, service="up", description=__doc__ or "")
    setup_logging(s.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the evals' per-request lines
    if not s.config_path:
        print(
            "ludic up: give the run config with --config FILE (e.g. examples/arith/grpo.yaml)",
            file=sys.stderr,
        )
        return 2
    cfg = yaml.safe_load(Path(s.config_path).read_text()) or {}
    from libludic.training.algorithm import AlgorithmSpec

    try:  # fail before starting anything: credit and learner would refuse it minutes later
        AlgorithmSpec.from_mapping(cfg.get("algorithm"))
    except ValueError as e:
        print(f"ludic up: {s.config_path}: {e}", file=sys.stderr)
        return 2
    s.config_path = str(Path(s.config_path).resolve())
    log_settings(log, "up", s)
    try:
        return Run(s, cfg).execute()
    except subprocess.SubprocessError as e:
        log.error("%s", e)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
