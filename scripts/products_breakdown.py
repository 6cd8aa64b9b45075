"""Which held-out products a model gets right: one-digit or two-digit operands, per entry
and per distinct problem.

Reads examples/reasoning_gym/grpo.yaml's evaluation (reasoning-gym's ``products``, the eval
split, env seeds ``0..eval_n-1``, its prompt template and parser), runs each model greedily
with transformers (the chat template, ``eval_max_tokens`` new tokens), scores the parsed
integer with the dataset's ``score_answer`` and prints, per model, the pass rate over the
entries, right/entries by operand size, and right/distinct problems (a question counted
once). vLLM's greedy figures in ``summary.json`` can differ by a few entries (its kernels).

    python scripts/products_breakdown.py runs/models/smollm2-135m-instruct runs/<run>/final
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from libludic.envs.reasoning_gym import ReasoningGymEnv

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "reasoning_gym" / "grpo.yaml"


def size(question: str) -> str:
    a, b = (int(x) for x in re.findall(r"(\d+) \* (\d+)", question)[0])
    return "1x1" if max(a, b) < 10 else "2x2" if min(a, b) > 9 else "mixed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", help="model directories (from_pretrained)")
    ap.add_argument("--batch", type=int, default=50)
    args = ap.parse_args()
    up = yaml.safe_load(CONFIG.read_text())["up"]
    env = ReasoningGymEnv(**up["eval_env"]["kwargs"])
    parser = re.compile(up["eval_protocol"]["kwargs"]["parser"]["pattern"])
    obs, entries = [], []
    for seed in range(up["eval_n"]):
        o, _ = env.env_reset(seed=seed)
        obs.append(o)
        entries.append(env.entry)
    for path in args.models:
        tok = AutoTokenizer.from_pretrained(path)
        tok.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        right: collections.Counter[str] = collections.Counter()
        n: collections.Counter[str] = collections.Counter()
        distinct: dict[str, bool] = {}
        for i in range(0, len(obs), args.batch):
            prompts = [
                tok.apply_chat_template(
                    [{"role": "user", "content": o}], tokenize=False, add_generation_prompt=True
                )
                for o in obs[i : i + args.batch]
            ]
            enc = tok(prompts, return_tensors="pt", padding=True)
            with torch.no_grad():
                out = model.generate(
                    **enc,
                    max_new_tokens=up["eval_max_tokens"],
                    do_sample=False,
                    pad_token_id=tok.eos_token_id,
                )
            replies = tok.batch_decode(
                out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True
            )
            for reply, entry in zip(replies, entries[i : i + args.batch], strict=True):
                m = parser.search(reply)
                ok = m is not None and env.source.dataset.score_answer(m.group(1), entry) == 1.0
                kind = size(entry["question"])
                n[kind] += 1
                right[kind] += ok
                distinct[entry["question"]] = ok
        by = ", ".join(f"{k} {right[k]}/{n[k]}" for k in sorted(n))
        print(
            f"{path}: entries {sum(right.values()) / len(obs):.3f} ({by}); "
            f"distinct {sum(distinct.values())}/{len(distinct)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
