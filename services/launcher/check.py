"""``ludic check --config FILE``: everything a run config names, built once, in seconds.

Loads every service's settings from the file as that service would (feeder, actor, credit,
learner, the launcher's ``up:``, and ``eval:`` when present), so each builds what it names:
every task of ``feeder.tasks`` (env reset with a seed, protocol, agent, tools, parser run on
a sample reply, context, reward functions: libludic/tasks.py ``check_task``), the held-out
evaluation's env and protocol, the algorithm with its credit assigner and loss, and every
task's item lengths against ``learner.max_seq_len`` (services/launcher/seqlen.py: a
``warn`` line for an episode that may not fit). No model is loaded (the run's tokenizer is,
to count prompts) and nothing is started. Exit 0 with one line per task, or 2 with the
first error, which names the config key, the value and the choices. ``ludic up`` and the feeder,
actor and eval services run the same checks when they start.
"""

from __future__ import annotations

import argparse
import sys
import time

from libludic.tasks import check_task, parse_tasks
from services.common.settings import load_settings, read_yaml
from services.launcher import seqlen
from services.launcher.resolved import Resolved, service_environ
from services.launcher.settings import UpSettings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ludic check", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="the run config (YAML)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        cfg = read_yaml(args.config)
        up = load_settings(
            UpSettings, ["--config", args.config], service="up", environ=service_environ(None)
        )
        resolved = Resolved.of(up)
        others = Resolved.others(up)
        lines = []
        for i, task in enumerate(parse_tasks(resolved.feeder.tasks, "feeder.tasks")):
            took = check_task(task, f"feeder.tasks[{i}]")
            agent = task.protocol.agent.kind if task.protocol.agent is not None else "plain"
            rewards = (
                ", rewards " + "+".join(f.name for f in task.reward.functions)
                if task.reward is not None and task.reward.functions
                else ""
            )
            lines.append(
                f"ok  feeder.tasks[{i}] {task.name}: env {task.env.kind}, protocol "
                f"{task.protocol.kind}, agent {agent}{rewards} ({took:.2f} s)"
            )
        for es in up.parsed_eval_sets if up.eval_n > 0 else ():
            lines.append(
                f"ok  eval set {es.name}: env {es.env.get('kind')}, n {es.n}, max_steps "
                f"{es.max_steps}" + (f", k {es.k} at temperature {es.temperature}" if es.k else "")
            )
        if "eval" in others:
            lines.append("ok  eval service settings")
        for line in seqlen.check_run(up, resolved, Resolved.actor(up).max_steps):
            lines.append(f"{'warn' if line.warn else 'ok '} length {line}")
        algo = cfg.get("algorithm") or {}
        lines.append(
            f"ok  algorithm {algo.get('name', 'grpo')} (group_size "
            f"{resolved.feeder.group_size}); learner, credit, actor, feeder settings"
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"ludic check: {args.config}: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    print(f"{args.config}: ok ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
