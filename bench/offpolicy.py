"""Off-policy corrections at a large lag: the demo at ``max_lag`` 4, with and without the
decoupled objective and with and without the train/inference mismatch correction.

Each variant runs ``ludic up`` from the same SFT warm start (built once) with the run config
as it is, except: ``max_head_offpolicyness`` and ``learner.max_lag`` = ``--lag`` (default 4:
batches generated up to four versions behind the trained weights) and the algorithm's
keyword arguments:

* ``plain``: the preset as configured (its clipped ratio taken against the actor's
  behaviour logprobs);
* ``decoupled``: ``use_decoupled_loss: true`` (AReaL's decoupled PPO: the ratio against the
  recomputed proximal policy, weighted by the behaviour importance weight capped at
  ``behav_imp_weight_cap``);
* ``mismatch``: ``mismatch_correction: tis`` (truncated importance sampling of the
  trainer/inference logprob ratio, token level, cap 2);

(The two do not combine: the decoupled weight is already a token-level correction against
the proximal policy; the loss refuses both at once.)

Every variant runs ``--reps`` times (default 3, alternating variants; the reps differ by
run id, so by their sampling seeds). Figures: the final held-out greedy pass rate (200
problems), its median and its spread (max - min) over the reps, and samples/s (one
definition: trained items per second of RL wall).

Last line: ``RESULT offpolicy ... ratio=<x>`` with ``ratio`` = median final pass rate of
``decoupled`` / that of ``plain`` (higher is better: above 1.0 the decoupled objective
learns more at this lag).

    python bench/offpolicy.py                # 3 variants x 3 reps (about 20 min on 2 cores)
    python bench/offpolicy.py --reps 1
    python bench/offpolicy.py --quick        # tiny model, a few steps (exercises the path)
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

VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "decoupled": {"use_decoupled_loss": True},
    "mismatch": {"mismatch_correction": "tis"},
}


def variant(cfg: dict[str, Any], lag: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(cfg)
    out["max_head_offpolicyness"] = lag
    out.setdefault("learner", {})["max_lag"] = lag
    algo = out.setdefault("algorithm", {})
    algo["kwargs"] = {**(algo.get("kwargs") or {}), **kwargs}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--config", default=str(ROOT / "examples/arith/grpo.yaml"))
    ap.add_argument("--lag", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    if a.lag < 0 or a.reps < 1:
        ap.error("--lag must be >= 0 and --reps >= 1")
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
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for rep in range(reps):
        for name, kwargs in VARIANTS.items():
            run_name = f"offpolicy-{name}-{rep}"
            t = time.monotonic()
            r = run_services(variant(cfg, a.lag, kwargs), run_name, work, sync=False)
            runs[name].append(r)
            print(
                f"{run_name}: pass rate {r['pass_before']:.3f} -> {r['pass_after']:.3f}, "
                f"{r['samples_per_s']:.1f} samples/s, stale {r['stale_fraction']:.3f} "
                f"({time.monotonic() - t:.0f} s)",
                flush=True,
            )
    print(f"\n## max_lag {a.lag}: final held-out pass rate over {reps} run(s) each")
    print("| variant | median | spread (max - min) | runs | samples/s (median) |")
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
    ratio = medians["decoupled"] / medians["plain"] if medians["plain"] > 0 else float("nan")
    print(
        "RESULT offpolicy "
        + " ".join(f"{n}_pass={m:.3f}" for n, m in medians.items())
        + f" lag={a.lag} ratio={ratio:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
