"""Off-policy corrections at a large lag: the demo at ``max_lag`` 4, with and without the
decoupled objective and with and without the train/inference mismatch correction.

Each arm runs ``ludic up`` from the same SFT warm start (built once) with the run config
as it is, except: ``max_head_offpolicyness`` and ``learner.max_lag`` = ``--lag`` (default 4:
batches generated up to four versions behind the trained weights) and the algorithm:

* ``plain``: the preset as configured (its clipped ratio taken against the actor's
  behaviour logprobs);
* ``decoupled``: ``use_decoupled_loss: true`` (AReaL's decoupled PPO: the ratio against the
  recomputed proximal policy, weighted by the behaviour importance weight capped at
  ``behav_imp_weight_cap``);
* ``mismatch``: ``mismatch_correction: tis`` (truncated importance sampling of the
  trainer/inference logprob ratio, token level, cap 2);
* ``plain-mb2`` and ``decoupled-mb2``: ``plain`` and ``decoupled`` with
  ``ppo_n_minibatches: 2`` (two optimizer steps per batch). With one step per batch the
  proximal policy is the policy being trained, so the decoupled ratio is exactly 1 and only
  its behaviour weight acts; from a second minibatch on the clipped ratio moves off 1 and
  the clipping acts too.

The 2 x 2 design's fourth cell, decoupled with the mismatch correction, does not exist: the
decoupled weight already is a token-level correction of the behaviour/proximal gap (masked
importance sampling at ``behav_imp_weight_cap``), and the loss refuses both at once. So
"with and without the decoupled objective" is ``decoupled`` against ``plain``, "with and
without the mismatch correction" ``mismatch`` against ``plain``.

Every arm runs ``--reps`` times (default 3, alternating arms; the reps differ by run id,
so by their sampling seeds); ``--arms`` picks some. Figures: the final held-out greedy pass
rate (200 problems), its median and its spread (max - min) over the reps, and samples/s
(one definition: trained items per second of RL wall).

Last line: ``RESULT offpolicy ... ratio=<x>`` with ``ratio`` = median final pass rate of
``decoupled`` / that of ``plain`` (higher is better: above 1.0 the decoupled objective
learns more at this lag), and the other arms' medians.

    python bench/offpolicy.py                # 5 arms x 3 reps: 15 runs of the demo
    python bench/offpolicy.py --arms plain,decoupled,mismatch --reps 3
    python bench/offpolicy.py --quick        # tiny model, 4 steps, 1 rep (exercises the path)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from e2e import run_services  # noqa: E402

# each arm: the algorithm section's changes ("kwargs": the preset's arguments; the other
# keys: the optimisation options beside them)
ARMS: dict[str, dict[str, Any]] = {
    "plain": {},
    "decoupled": {"kwargs": {"use_decoupled_loss": True}},
    "mismatch": {"kwargs": {"mismatch_correction": "tis"}},
    "plain-mb2": {"ppo_n_minibatches": 2},
    "decoupled-mb2": {"ppo_n_minibatches": 2, "kwargs": {"use_decoupled_loss": True}},
}


def variant(cfg: dict[str, Any], lag: int, arm: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(cfg)
    out["max_head_offpolicyness"] = lag
    out.setdefault("learner", {})["max_lag"] = lag
    algo = out.setdefault("algorithm", {})
    for k, v in arm.items():
        algo[k] = {**(algo.get("kwargs") or {}), **v} if k == "kwargs" else v
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--config", default=str(ROOT / "examples/arith/grpo.yaml"))
    ap.add_argument("--lag", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    a = ap.parse_args()
    if a.lag < 0 or a.reps < 1:
        ap.error("--lag must be >= 0 and --reps >= 1")
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    if not arms or any(x not in ARMS for x in arms):
        ap.error(f"--arms {a.arms!r}: choose among {list(ARMS)}")
    cfg = yaml.safe_load(Path(a.config).read_text())
    work = Path(tempfile.mkdtemp(prefix="ludic-offpolicy-"))
    reps = a.reps
    if a.quick:
        from libludic.models.tiny import init_model

        model = init_model(work / "tiny", size="tiny")
        cfg["up"].update(
            model=str(model), sft_steps=0, actors=1, eval_n=16, eval_every_steps=2, timeout_s=300
        )
        cfg["learner"].update(num_steps=4, batch_size=16)
        reps = 1
    else:
        from services.launcher.settings import UpSettings
        from services.launcher.worker import prepare_model

        s = UpSettings(
            **{k: v for k, v in cfg["up"].items() if k in UpSettings.__dataclass_fields__}
        )
        s.name, s.runs_dir = "shared", str(work)
        model = prepare_model(s, work / "shared")
        cfg["up"].update(model=str(model), sft_steps=0)
    print(f"offpolicy: model {model}, lag {a.lag}, work dir {work}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in arms}
    for rep in range(reps):
        for name in arms:
            run_name = f"offpolicy-{name}-{rep}"
            t = time.monotonic()
            r = run_services(variant(cfg, a.lag, ARMS[name]), run_name, work, sync=False)
            runs[name].append(r)
            print(
                f"{run_name}: pass rate {r['pass_before']:.3f} -> {r['pass_after']:.3f}, "
                f"{r['samples_per_s']:.1f} samples/s, stale {r['stale_fraction']:.3f} "
                f"({time.monotonic() - t:.0f} s)",
                flush=True,
            )
    print(f"\n## max_lag {a.lag}: final held-out pass rate over {reps} run(s) each")
    print("| arm | median | spread (max - min) | runs | samples/s (median) |")
    print("|---|---|---|---|---|")
    medians: dict[str, float] = {}
    for name, rs in runs.items():
        after = [r["pass_after"] for r in rs]
        medians[name] = statistics.median(after)
        print(
            f"| {name} | {medians[name]:.3f} | {max(after) - min(after):.3f} | "
            f"{', '.join(f'{x:.3f}' for x in after)} | "
            f"{statistics.median(r['samples_per_s'] for r in rs):.1f} |"
        )
    plain, decoupled = medians.get("plain"), medians.get("decoupled")
    ratio = decoupled / plain if plain and decoupled is not None else float("nan")
    print(
        "RESULT offpolicy "
        + " ".join(f"{n.replace('-', '_')}_pass={m:.3f}" for n, m in medians.items())
        + f" lag={a.lag} ratio={ratio:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
