"""Where a ToolAgent's episodes fail: the tool call or the answer after it.

Runs a config's first eval set (examples/tool_use/grpo.yaml by default: the calculator on
3-digit products) on a model with transformers, greedy or sampled, and counts each episode
as: no tool call; a call whose result is not the reference answer (operands mis-copied or a
malformed call); a right call followed by a wrong answer (the result mis-copied); a pass.
``--snapshot`` loads a learner weight snapshot (``runs/<name>/learner/snapshots/
step_*.safetensors``) over the model first.

    python scripts/tool_failures.py runs/tool-s2/sft                       # greedy, 200
    python scripts/tool_failures.py runs/tool-s2/sft --temperature 0.6 --k 8 --n 100
    python scripts/tool_failures.py runs/tool-s2/sft --snapshot runs/tool-s2/learner/snapshots/step_000200.safetensors
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
from pathlib import Path
from typing import Any

import yaml

from libludic.eval.sets import EvalSet
from libludic.inference.hf_client import HFChatClient
from libludic.registry import build_registries
from libludic.rollout.engine import RolloutEngine
from libludic.scoring.base import RewardInput
from libludic.scoring.tools import tool_result
from libludic.types import Rollout


def classify(ro: Rollout) -> str:
    """no_call, call_wrong, answer_wrong or pass (the tool step comes first)."""
    last = ro.steps[-1]
    if last.reward >= 1.0:
        return "pass"
    if not any(s.info.get("kind") == "tool_call" for s in ro.steps):
        return "no_call"
    # a right call: a tool returned the reference answer (the tool_result reward's test)
    return "answer_wrong" if tool_result(RewardInput.of(ro)) == 1.0 else "call_wrong"


async def run(a: argparse.Namespace) -> dict[str, Any]:
    doc = yaml.safe_load(Path(a.config).read_text())
    spec = dict(doc["up"]["eval_sets"][0])
    es = EvalSet.from_dict({**spec, "n": a.n, "k": a.k, "temperature": a.temperature}, "eval")
    reqs = es.sample_requests() if a.k > 0 else es.greedy_requests()
    client = HFChatClient(a.model, max_batch_size=64)
    if a.snapshot:
        from safetensors.torch import load_file

        client.model.load_state_dict(load_file(a.snapshot), strict=False)
    engine = RolloutEngine(*build_registries(client))
    gate = asyncio.Semaphore(64)

    async def one(req: Any, i: int) -> str:
        async with gate:
            (ro,) = await engine.run_episode(req, i, int(spec.get("max_steps", 2)))
            return classify(ro)

    kinds = await asyncio.gather(*(one(r, i) for r in reqs for i in range(r.num_episodes)))
    counts = collections.Counter(kinds)
    n = len(kinds)
    return {
        "episodes": n,
        **{k: counts.get(k, 0) for k in ("pass", "no_call", "call_wrong", "answer_wrong")},
        "call_right_rate": round((counts["pass"] + counts["answer_wrong"]) / n, 3),
        "pass_rate": round(counts["pass"] / n, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a model directory (the warm start, a final policy)")
    p.add_argument("--config", default="examples/tool_use/grpo.yaml")
    p.add_argument("--snapshot", default="", help="learner weights loaded over the model")
    p.add_argument("--n", type=int, default=200, help="held-out problems (env seeds 0..n-1)")
    p.add_argument("--k", type=int, default=0, help="sampled episodes a problem (0: greedy)")
    p.add_argument("--temperature", type=float, default=0.6)
    print(json.dumps(asyncio.run(run(p.parse_args()))))


if __name__ == "__main__":
    main()
