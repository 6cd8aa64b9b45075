"""`ludic demo`: arithmetic episodes end to end against a locally built model, in one process.

A command-line tool beside ``ludic status``, not a service and not library code: it wires
the library's engine, registries and in-process client together the way a user's script
would (`make demo` is the whole stack instead: ``ludic up`` on examples/arith/grpo.yaml).

Builds the tiny model if needed (runs/<name>/model), runs grouped arithmetic episodes
through the RolloutEngine with the in-process transformers backend, and prints a table
of rollouts and rewards. The model is untrained, so expect rewards of 0: this shows the
rollout side working (prompts, token ids, logprobs, policy versions), not learning.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from libludic.inference.hf_client import HFChatClient
from libludic.inference.request import InferenceSpec
from libludic.inference.sampling import SamplingConfig
from libludic.models.tiny import init_model
from libludic.registry import build_registries
from libludic.requests import EnvSpec, RolloutRequest
from libludic.rollout.engine import RolloutEngine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ludic demo", description=__doc__)
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--size", default="tiny")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    a = p.parse_args(argv)
    console = Console()
    model_dir = Path(a.run_dir) / "model"
    if not (model_dir / "config.json").exists():
        console.print(f"building {a.size} model in {model_dir} ...")
        init_model(model_dir, size=a.size)
    client = HFChatClient(model_dir)
    engine = RolloutEngine(*build_registries(client))
    spec = InferenceSpec(sampling=SamplingConfig(temperature=1.0, max_tokens=8))
    reqs = [
        RolloutRequest(
            env=EnvSpec("arithmetic"),
            env_seed=g,
            sampling_seed=100 * g,
            num_episodes=a.group_size,
            same_env_seed=True,
            inference=spec,
            meta={"group_id": f"g{g}"},
        )
        for g in range(a.groups)
    ]
    t0 = time.perf_counter()
    rollouts = asyncio.run(engine.generate_rollouts(reqs, max_steps=1, concurrency=32))
    dt = time.perf_counter() - t0
    table = Table(title=f"{len(rollouts)} arithmetic rollouts in {dt:.1f}s")
    for col in (
        "group",
        "question",
        "answer",
        "model said",
        "tokens",
        "mean logprob",
        "version",
        "reward",
    ):
        table.add_column(col)
    for r in rollouts:
        s = r.steps[0]
        tr = s.trace
        lps = (tr.completion_logprobs or []) if tr else []
        table.add_row(
            str(r.group_id),
            s.prev_obs,
            str(s.info.get("answer")),
            repr(s.action[:16]),
            str(len(tr.completion_token_ids) if tr else 0),
            f"{sum(lps) / max(1, len(lps)):.2f}",
            str(s.policy_version),
            f"{s.reward:.1f}",
        )
    console.print(table)
    mean = sum(r.total_reward for r in rollouts) / len(rollouts)
    console.print(f"mean reward {mean:.3f} over {len(rollouts)} rollouts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
