"""``ludic eval``: the held-out evaluation of every eval set, every ``every_steps`` learner steps.

Watches the learner's ``ludic:{run}:learner_step`` and ``policy_version`` in Redis. At step
0 (when ``at_start``), then each time the step reaches the next multiple of
``every_steps``, and once more when the step has not moved for ``settle_s`` (the run's last
step), it waits up to ``version_wait_s`` for the inference service to serve the learner's
current policy version, then runs the same eval sets as ``ludic up``
(services/common/heldout.py; figures defined in libludic/eval/metrics.py) and exports

    ludic_eval_pass_rate            greedy pass rate of the first set's last evaluation
    ludic_eval_step                 learner step it belongs to
    ludic_eval_policy_version       version inference served during it
    ludic_eval_reward_mean, ludic_eval_duration_seconds, ludic_eval_runs_total,
    ludic_eval_errors_total{kind}
    ludic_eval_set_{pass_rate, reward_mean, episode_len_mean, parse_error_rate,
      illegal_rate, pass_at_k, mean_at_k, episodes}{set, role}   every set's figures
      (role "all", or each multi-agent role); ludic_eval_set_truncated_rate{set, role,
      reason}; ludic_eval_set_duration_seconds{set}

on ``metrics_port`` (9105), appends each result as one JSON line to ``output_file`` and
writes ``eval/<set>/<figure>`` TensorBoard scalars to ``tensorboard_dir`` when set.
Settings: the ``eval:`` section of the run config; unset ones (``sets``, ``env``,
``protocol``, ``n``, ``every_steps``, ``max_tokens``) fall back to the ``up:`` section's
``eval_sets``, ``eval_env``, ``eval_protocol``, ``eval_n``, ``eval_every_steps``,
``eval_max_tokens`` and then to ``ludic up``'s defaults, so one run config gives the same
evaluation under ``ludic up`` and under compose.
"""

from __future__ import annotations

import asyncio
import logging

from services.common.skeleton import service_main, serving
from services.eval.settings import EvalSettings
from services.eval.worker import (  # noqa: F401 (re-exported for callers of main)
    EvalService,
)

log = logging.getLogger("ludic.eval")


async def run(settings: EvalSettings, *, stop: asyncio.Event | None = None) -> EvalService:
    stop = stop or asyncio.Event()
    async with serving(
        settings.redis_url, settings.metrics_port, metrics_host=settings.metrics_host
    ) as (r, endpoint):
        svc = EvalService(settings, r, stop)
        endpoint.check = svc.health
        await svc.run()
    return svc


def main(argv: list[str] | None = None) -> int:
    return service_main(
        "eval",
        EvalSettings,
        run,
        argv,
        description=__doc__.split("\n")[0],
        started=lambda s: log.info(
            "evaluating %s: sets %s", s.inference_urls[0], [x.name for x in s.parsed_sets]
        ),
    )


if __name__ == "__main__":
    raise SystemExit(main())
