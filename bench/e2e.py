"""Synchronous vs asynchronous RL through the real stack (`ludic up`), same budget.

Runs the demo config twice, changing only the staleness bound: ``max_lag=0`` (actors
wait for every new policy version; the learner drops anything older: synchronous RL)
and ``max_lag=4`` (actors keep sampling up to 4 versions behind: asynchronous). Both
start from the same SFT warm start (built once). Prints samples/s, time to reach the
pass-rate target, final held-out pass rate, and the async/sync samples/s ratio.

    python bench/e2e.py            # the demo budget (examples/arith/grpo.yaml)
    python bench/e2e.py --quick    # tiny model, a few steps: exercises the path, not learning

--quick cannot finish in 60 s on a 2-core machine: each run starts vLLM (20-70 s).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def run(cfg: dict[str, Any], name: str, work: Path, max_lag: int) -> dict[str, Any]:
    cfg = json.loads(json.dumps(cfg))
    cfg["run_id"] = name
    cfg["up"].update(name=name, runs_dir=str(work), prometheus=False)
    cfg["actor"]["max_lag"] = max_lag
    cfg["learner"]["max_lag"] = max_lag
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "LUDIC_REDIS_URL"}
    log = work / f"{name}.log"
    with open(log, "wb") as f:
        code = subprocess.call([sys.executable, "-m", "services.cli", "up", "--config", str(path), "--no-live"],
                               stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if code != 0:
        sys.stderr.write(log.read_text(errors="replace")[-3000:])
        raise SystemExit(f"{name}: ludic up exited with {code}")
    return json.loads((work / name / "summary.json").read_text())


def time_to(summary: dict[str, Any], target: float) -> float | None:
    for e in summary["evals"]:
        if e["eval/pass_rate"] >= target:
            return e["wall_s"]
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--config", default=str(ROOT / "examples/arith/grpo.yaml"))
    ap.add_argument("--target", type=float, default=None, help="pass-rate target (default: before + 0.10)")
    a = ap.parse_args()
    cfg = yaml.safe_load(Path(a.config).read_text())
    work = Path(tempfile.mkdtemp(prefix="ludic-e2e-"))
    if a.quick:
        from libludic.models.tiny import init_model

        model = init_model(work / "tiny", size="tiny")
        cfg["up"].update(model=str(model), sft_steps=0, actors=1, eval_n=32, eval_every_steps=2, timeout_s=300)
        cfg["learner"].update(num_steps=4, batch_size=16)
        cfg["feeder"].update(high_water=4)
    else:
        # one SFT warm start shared by both runs
        from services.launcher.config import UpSettings
        from services.launcher.main import prepare_model

        s = UpSettings(**{k: v for k, v in cfg["up"].items() if k in UpSettings.__dataclass_fields__})
        s.name, s.runs_dir = "shared", str(work)
        cfg["up"].update(model=str(prepare_model(s, work / "shared")), sft_steps=0)
    results = {}
    for label, lag in (("sync", 0), ("async", 4)):
        results[label] = run(cfg, f"e2e-{label}", work, lag)
    target = a.target if a.target is not None else results["sync"]["pass_rate_before"] + 0.10
    for label, s in results.items():
        tt = time_to(s, target)
        print(f"{label:>5} (max_lag={0 if label == 'sync' else 4}): samples/s {s['samples_per_second']} "
              f"pass rate {s['pass_rate_before']:.3f} -> {s['pass_rate_after']:.3f} "
              f"time to {target:.2f}: {'-' if tt is None else f'{tt:.0f}s'} steps {s['steps']} "
              f"stale dropped {s['stale_dropped']} wall {s['rl_wall_seconds']}s")
    sync, asyn = results["sync"], results["async"]
    ratio = (asyn["samples_per_second"] or 0) / max(1e-9, sync["samples_per_second"] or 0)
    print(f"RESULT e2e sync_samples_per_s={sync['samples_per_second']} async_samples_per_s={asyn['samples_per_second']} "
          f"sync_pass_rate={sync['pass_rate_after']:.3f} async_pass_rate={asyn['pass_rate_after']:.3f} "
          f"ratio={ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
