"""The inference server's CPU per generated token: the rollout's request against vLLM's usual
token-by-token text.

Starts one real ``ludic inference`` server (vLLM, compiled as shipped) on the ``small``
model, then sends rounds of the actors' traffic: ``--groups`` concurrent chat requests of
``n=8`` choices (one GRPO group each), ``--tokens`` tokens per choice (``ignore_eos``),
temperature 1, seeded, chosen-token logprobs and token ids. Two request shapes, alternating
round by round under the same conditions:

* ``per_token``: vLLM's usual request shape (``top_logprobs: 1``, logprob entries naming
  tokens by text): vLLM detokenizes every token for the text and for each logprob
  entry;
* ``rollout``: the request ``OpenAIChatClient`` sends for a rollout (no alternatives, tokens
  named by id): the server runs it without per-token detokenization and decodes each
  choice's text once (services/inference/token_text.py).

Figure per shape: CPU seconds of the server's processes (API server, EngineCore, worker;
from /proc) per 1,000 generated tokens, median over rounds; wall seconds per round beside
it. On a machine whose cores are shared, CPU seconds are what generation takes from
training; wall time also moves with whatever else runs.

Last line: ``RESULT generation ... ratio=<x>`` with ``ratio`` = per_token CPU per token /
rollout CPU per token (higher is better; 1.0 = no saving).

    python bench/generation.py            # 5 rounds of each shape
    python bench/generation.py --quick    # 1 round of each
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "integration"))

from services.launcher.stack import free_port  # noqa: E402


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every descendant still running."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            stat = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(stat[11]) + int(stat[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total


SHAPES: dict[str, dict[str, Any]] = {
    "per_token": {"top_logprobs": 1, "return_tokens_as_token_ids": False},
    "rollout": {"return_tokens_as_token_ids": True},
}


async def one_round(url: str, shape: str, groups: int, tokens: int, seed: int) -> int:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:

        async def group(g: int) -> int:
            body = {
                "messages": [{"role": "user", "content": f"{10 + g}+{20 + seed % 50}="}],
                "n": 8,
                "max_tokens": tokens,
                "ignore_eos": True,
                "temperature": 1.0,
                "seed": seed * 1000 + g * 8,
                "logprobs": True,
                "return_token_ids": True,
                **SHAPES[shape],
            }
            r = await client.post(url + "/v1/chat/completions", json=body)
            r.raise_for_status()
            return sum(len(c["token_ids"]) for c in r.json()["choices"])

        return sum(await asyncio.gather(*(group(g) for g in range(groups))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round of each shape")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--groups", type=int, default=16, help="concurrent n=8 requests")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per choice")
    ap.add_argument("--model", default="", help="model dir (default: a fresh small model)")
    args = ap.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from inference_server import InferenceServer

    from libludic.models.tiny import init_model

    tmp = Path(tempfile.mkdtemp(prefix="ludic-bench-generation-"))
    model_dir = Path(args.model) if args.model else init_model(tmp / "small", size="small")
    srv = InferenceServer(model_dir, free_port(), None, tmp / "server.log", compiled=True)
    t0 = time.perf_counter()
    srv.start()
    print(f"vLLM start-up {time.perf_counter() - t0:.1f} s (not counted)", flush=True)
    assert srv.proc is not None
    cpu_per_k: dict[str, list[float]] = {s: [] for s in SHAPES}
    wall: dict[str, list[float]] = {s: [] for s in SHAPES}
    try:
        for shape in SHAPES:  # warm-up: compiled graphs for these batch sizes
            asyncio.run(one_round(srv.url, shape, args.groups, args.tokens, seed=0))
        for r in range(rounds):
            for shape in SHAPES if r % 2 == 0 else reversed(list(SHAPES)):
                c0, w0 = tree_cpu_s(srv.proc.pid), time.perf_counter()
                n = asyncio.run(one_round(srv.url, shape, args.groups, args.tokens, seed=r + 1))
                dt, dc = time.perf_counter() - w0, tree_cpu_s(srv.proc.pid) - c0
                cpu_per_k[shape].append(dc / n * 1000)
                wall[shape].append(dt)
                print(
                    f"round {r + 1} {shape:9s} {n} tokens  wall {dt:.2f} s  "
                    f"server CPU {dc:.2f} s ({dc / n * 1000:.3f} s per 1k tokens)",
                    flush=True,
                )
    finally:
        srv.stop()
    med = {s: statistics.median(v) for s, v in cpu_per_k.items()}
    wmed = {s: statistics.median(v) for s, v in wall.items()}
    ratio = med["per_token"] / med["rollout"]
    print(
        f"RESULT generation groups={args.groups} tokens={args.tokens} "
        f"per_token_cpu_s_per_1k={med['per_token']:.3f} rollout_cpu_s_per_1k={med['rollout']:.3f} "
        f"per_token_wall_s={wmed['per_token']:.2f} rollout_wall_s={wmed['rollout']:.2f} "
        f"ratio={ratio:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
