"""The services against a single-process GRPO loop doing the same work, in the same run.

Contestants, each from the same SFT warm start (built once) and the same run config (model,
task, batch, group, lr, steps, loss, optimizer, sampling):

* ``baseline``: one process, strictly sequential, no Redis, no HTTP: the library's
  ``RolloutBatchSource`` generates a batch in-process with ``HFChatClient`` (transformers,
  batched and KV-cached; it shares the Trainer's model, so there is nothing to publish),
  GRPO credit, then ``Trainer.train_step``; repeat.
* ``sync``: ``ludic up`` with ``max_head_offpolicyness: 0`` and ``learner.max_lag: 0``: the
  next batch is generated only once the last step's weights are served (nothing generated
  in vain; no overlap of generation and training).
* ``async``: ``ludic up`` as configured (``max_head_offpolicyness`` 1: one batch generated
  ahead of the served weights, overlapping the learner's step).

Workloads: ``demo`` (the config as it is: 8-token answers) and ``gen-heavy`` (the same
model and task with ``max_tokens: 64, ignore_eos: true``: every completion is 64 tokens, the
reward read from the integer before its first end-of-turn token, as the demo reads the whole
answer), where generation dominates the step.

Figures per run, with one definition each:

* samples/s: trained items per second of RL wall, evaluation excluded
  (``Trainer.rl_wall_s``: the time inside train steps; the services' learner reports it in
  ``learner_final.json``, the summary's ``samples_per_second``);
* time to target: RL wall (the same clock as samples/s, for every contestant) at the first
  curve point whose held-out pass rate reaches the target (default: the start's pass rate
  + 0.10); every contestant's curve is measured with
  the same greedy evaluation on weight snapshots taken every ``eval_every_steps`` steps,
  evaluated outside the RL wall (``up.eval_mode: deferred``; the baseline pauses its clock);
* final pass rate (held-out, greedy, 200 problems) and stale fraction (items dropped stale
  / items written).

The overlap bound ``(t_gen + t_train) / max(t_gen, t_train)`` is measured on the baseline
of each run (its generation and its training time): the most any pipelining of the two can
gain on the host it runs on at this batch size, before contention for the cores.

Full mode repeats each contestant ``--reps`` times (default 3), alternating, and reports
medians; rep ``k`` of the baseline seeds its sampling and its problems with ``k`` (the
services' reps differ by run id), so its reps are independent runs, not replays.
``--quick`` builds the tiny model, skips SFT and runs a few steps of the demo workload once
per contestant (exercises the path, measures nothing).

Last line: ``RESULT e2e ... ratio=<x>`` with ``ratio`` = median async samples/s / median
baseline samples/s on the demo workload (higher is better; 1.0 = as fast as one process).

    python bench/e2e.py                  # both workloads, 3 reps (about 40 min on 2 cores)
    python bench/e2e.py --workload demo  # one workload
    python bench/e2e.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from libludic.models.tiny import IM_END  # noqa: E402

GEN_HEAVY_TOKENS = 64
GEN_THREADS = int(os.environ.get("LUDIC_BASELINE_GEN_THREADS", "1"))
# the answer is what precedes the first end of turn: the text keeps special tokens
# (skip_special_tokens false), so an answer sampled past an ignored EOS is not read on into
# what follows it (with the EOS skipped, "42" + EOS + "17..." read as 4217)
ANSWER_BEFORE_EOS = {
    "kind": "regex",
    "pattern": r"^\s*(-?\d+)" + re.escape(IM_END),
    "error_reward": 0.0,
}


def workload(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    cfg = copy.deepcopy(cfg)
    if name == "gen-heavy":
        for task in cfg["feeder"]["tasks"]:
            task.setdefault("inference", {}).setdefault("sampling", {}).update(
                max_tokens=GEN_HEAVY_TOKENS, ignore_eos=True, skip_special_tokens=False
            )
            task["protocol"] = {"kind": "single_agent", "kwargs": {"parser": ANSWER_BEFORE_EOS}}
    return cfg


# ----------------------------------------------------------------------------- services


def run_services(cfg: dict[str, Any], name: str, work: Path, sync: bool) -> dict[str, Any]:
    cfg = copy.deepcopy(cfg)
    cfg["run_id"] = name
    cfg["up"].update(name=name, runs_dir=str(work), prometheus=False, eval_mode="deferred")
    if sync:
        cfg["max_head_offpolicyness"] = 0
        cfg["learner"]["max_lag"] = 0
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "LUDIC_REDIS_URL"}
    log = work / f"{name}.log"
    with open(log, "wb") as f:
        code = subprocess.call(
            [sys.executable, "-m", "services.cli", "up", "--config", str(path), "--no-live"],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
    if code != 0:
        sys.stderr.write(log.read_text(errors="replace")[-3000:])
        raise SystemExit(f"{name}: ludic up exited with {code}")
    s = json.loads((work / name / "summary.json").read_text())
    acct = s.get("accounting") or {}
    written = acct.get("items_written") or 0
    return {
        "samples_per_s": s["samples_per_second"],
        "rl_wall_s": s["rl_wall_seconds"],
        "pass_before": s["pass_rate_before"],
        "pass_after": s["pass_rate_after"],
        "curve": [
            (e["step"], e["rl_wall_s"], e["eval/pass_rate"])
            for e in s["evals"]
            if 0 < e["step"] < s["steps"]
        ],
        "stale_fraction": (acct.get("items_stale", 0) / written) if written else 0.0,
        "steps": s["steps"],
    }


# ----------------------------------------------------------------------------- baseline


def run_baseline(cfg: dict[str, Any], model_dir: Path, seed: int = 0) -> dict[str, Any]:
    """The single-process loop (see the module docstring); its own clock is the Trainer's
    RL wall, so in-loop evaluation is excluded exactly as for the services."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from libludic.inference.hf_client import HFChatClient
    from libludic.registry import build_registries
    from libludic.rollout.engine import RolloutEngine
    from libludic.training.batching.rollout_batch_source import RolloutBatchSource
    from libludic.training.trainer import Trainer, TrainerHooks
    from services.common.heldout import evaluate_client
    from services.common.settings import load_settings
    from services.feeder.settings import FeederSettings
    from services.feeder.worker import make_request, pick_task
    from services.learner.settings import LearnerSettings

    torch.manual_seed(seed)  # each rep its own sampling and problems, as the services' reps
    tmp = Path(tempfile.mkdtemp(prefix="ludic-baseline-"))
    cfg_path = tmp / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    # the services' own settings from the same run config (the environment left out)
    fs = load_settings(FeederSettings, ["--config", str(cfg_path)], service="feeder", environ={})
    ls = load_settings(LearnerSettings, ["--config", str(cfg_path)], service="learner", environ={})
    up = cfg["up"]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    algo = ls.spec.build()
    tcfg = ls.trainer_config()
    import dataclasses

    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    tcfg = dataclasses.replace(tcfg, model_device="cpu", pad_token_id=int(pad))
    client = HFChatClient(model=model, tokenizer=tok, max_batch_size=ls.batch_size)
    engine = RolloutEngine(*build_registries(client))
    seeds = iter(range(seed * 10**7, 10**9))
    groups = ls.batch_size // fs.group_size

    def requests() -> list[Any]:
        out = []
        for _ in range(groups):
            s = next(seeds)
            out.append(make_request(fs, pick_task(fs.parsed_tasks, s), s))
        return out

    source = RolloutBatchSource(
        engine=engine, request_fn=requests, algorithm=algo, max_steps=1, concurrency=ls.batch_size
    )
    gen = {"s": 0.0}
    inner = source.next_batch

    threads = torch.get_num_threads()

    async def timed_next_batch() -> Any:
        # generation (token by token, small ops) runs fastest on one intra-op thread here,
        # training (larger matmuls) on all of them: the single process uses each at its best
        t = time.perf_counter()
        torch.set_num_threads(GEN_THREADS)
        try:
            b = await inner()
        finally:
            torch.set_num_threads(threads)
        gen["s"] += time.perf_counter() - t
        return b

    source.next_batch = timed_next_batch  # type: ignore[method-assign]

    class Curve:
        concurrency = 64

        def __init__(self) -> None:
            self.points: list[tuple[float, float, float]] = []

        async def evaluate(self) -> dict[str, float]:
            res = await evaluate_client(
                client, up["eval_env"], up["eval_n"], up["eval_max_tokens"], up.get("eval_protocol")
            )
            self.points.append((float(tr.step), tr.rl_wall_s, res["eval/pass_rate"]))
            return res

    curve = Curve()
    tcfg = dataclasses.replace(tcfg, eval_every_n_steps=up.get("eval_every_steps") or None)
    tr = Trainer(
        model=model,
        algo=algo,
        batch_source=source,
        cfg=tcfg,
        evaluator=curve,
        hooks=TrainerHooks(on_log=None),  # no console line per step in the timed loop
    )

    async def go() -> dict[str, Any]:
        before = await evaluate_client(
            client, up["eval_env"], up["eval_n"], up["eval_max_tokens"], up.get("eval_protocol")
        )
        await tr.train(ls.num_steps)
        after = await evaluate_client(
            client, up["eval_env"], up["eval_n"], up["eval_max_tokens"], up.get("eval_protocol")
        )
        return {"before": before["eval/pass_rate"], "after": after["eval/pass_rate"]}

    res = asyncio.run(go())
    prof = {k: round(v / max(tr.step, 1), 4) for k, v in tr.time_totals.items()}
    print(f"baseline per step: {prof}", file=sys.stderr)
    t_gen = gen["s"]
    t_train = tr.rl_wall_s - t_gen
    return {
        "samples_per_s": tr.items_trained_total / tr.rl_wall_s,
        "rl_wall_s": tr.rl_wall_s,
        "pass_before": res["before"],
        "pass_after": res["after"],
        "curve": [p for p in curve.points if 0 < p[0] < tr.step],
        "stale_fraction": 0.0,
        "steps": tr.step,
        "t_gen": t_gen,
        "t_train": t_train,
        "overlap_bound": (t_gen + t_train) / max(t_gen, t_train, 1e-9),
    }


def baseline_subprocess(
    cfg: dict[str, Any], model_dir: Path, work: Path, name: str, seed: int
) -> dict[str, Any]:
    """The baseline in a fresh process (one torch thread pool, no state from other runs);
    it uses both cores, as a single process would."""
    cfg_path, out = work / f"{name}.yaml", work / f"{name}.json"
    cfg_path.write_text(yaml.safe_dump(cfg))
    code = subprocess.call(
        [
            sys.executable,
            __file__,
            "--_baseline",
            str(cfg_path),
            str(model_dir),
            str(out),
            str(seed),
        ],
        cwd=ROOT,
    )
    if code != 0:
        raise SystemExit(f"{name}: the baseline exited with {code}")
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------- report


def time_to(curve: list[Any], target: float) -> float | None:
    for _step, wall, rate in curve:
        if rate >= target:
            return float(wall)
    return None


def med(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(wl: str, runs: dict[str, list[dict[str, Any]]], target: float) -> None:
    print(
        f"\n## workload {wl} (medians of {len(next(iter(runs.values())))} run(s); target "
        f"pass rate {target:.3f})"
    )
    print(
        "| contestant | samples/s | time to target (s) | pass rate before -> after | "
        "stale fraction | runs (samples/s) |"
    )
    print("|---|---|---|---|---|---|")
    for who, rs in runs.items():
        sps = [r["samples_per_s"] for r in rs]
        tt = [
            time_to(r["curve"] + [(r["steps"], r["rl_wall_s"], r["pass_after"])], target)
            for r in rs
        ]
        print(
            f"| {who} | {fmt(med(sps), '.1f')} | {fmt(med(tt), '.1f')} | "
            f"{fmt(med([r['pass_before'] for r in rs]), '.3f')} -> "
            f"{fmt(med([r['pass_after'] for r in rs]), '.3f')} | "
            f"{fmt(med([r['stale_fraction'] for r in rs]), '.3f')} | "
            f"{', '.join(f'{x:.1f}' for x in sps)} |"
        )
    b = runs["baseline"]
    print(
        f"overlap bound (t_gen + t_train) / max: {fmt(med([r['overlap_bound'] for r in b]), '.2f')}"
        f" (baseline t_gen {fmt(med([r['t_gen'] for r in b]), '.1f')} s, t_train "
        f"{fmt(med([r['t_train'] for r in b]), '.1f')} s)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--config", default=str(ROOT / "examples/arith/grpo.yaml"))
    ap.add_argument("--workload", choices=["demo", "gen-heavy", "both"], default="both")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--target", type=float, default=None, help="pass-rate target (default: before + 0.10)"
    )
    ap.add_argument("--_baseline", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._baseline:
        cfg_path, model_dir, out, seed = a._baseline
        res = run_baseline(yaml.safe_load(Path(cfg_path).read_text()), Path(model_dir), int(seed))
        Path(out).write_text(json.dumps(res))
        return 0

    cfg = yaml.safe_load(Path(a.config).read_text())
    work = Path(tempfile.mkdtemp(prefix="ludic-e2e-"))
    workloads = ["demo", "gen-heavy"] if a.workload == "both" else [a.workload]
    reps = a.reps
    if a.quick:
        from libludic.models.tiny import init_model

        model = init_model(work / "tiny", size="tiny")
        cfg["up"].update(
            model=str(model), sft_steps=0, actors=1, eval_n=16, eval_every_steps=2, timeout_s=300
        )
        cfg["learner"].update(num_steps=4, batch_size=16)
        workloads, reps = ["demo"], 1
    else:
        from services.launcher.settings import UpSettings
        from services.launcher.worker import prepare_model

        s = UpSettings(
            **{k: v for k, v in cfg["up"].items() if k in UpSettings.__dataclass_fields__}
        )
        s.name, s.runs_dir = "shared", str(work)
        model = prepare_model(s, work / "shared")
        cfg["up"].update(model=str(model), sft_steps=0)
    print(f"e2e: model {model}, work dir {work}", flush=True)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for wl in workloads:
        wcfg = workload(cfg, wl)
        runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "sync": [], "async": []}
        for rep in range(reps):  # alternating: one of each per round
            for who in runs:
                name = f"e2e-{wl}-{who}-{rep}"
                t = time.monotonic()
                if who == "baseline":
                    r = baseline_subprocess(wcfg, Path(model), work, name, seed=rep)
                else:
                    r = run_services(wcfg, name, work, sync=(who == "sync"))
                runs[who].append(r)
                print(
                    f"{name}: {r['samples_per_s']:.1f} samples/s, pass rate "
                    f"{r['pass_before']:.3f} -> {r['pass_after']:.3f}, stale "
                    f"{r['stale_fraction']:.3f} ({time.monotonic() - t:.0f} s)",
                    flush=True,
                )
        results[wl] = runs
    out: dict[str, Any] = {}
    for wl, runs in results.items():
        start = med([r["pass_before"] for rs in runs.values() for r in rs]) or 0.0
        target = a.target if a.target is not None else start + 0.10
        table(wl, runs, target)
        for who, rs in runs.items():
            out[f"{wl}_{who}"] = med([r["samples_per_s"] for r in rs])
        out[f"{wl}_overlap"] = med([r["overlap_bound"] for r in runs["baseline"]])
    (work / "results.json").write_text(json.dumps({"out": out, "runs": results}, indent=1))
    first = workloads[0]
    ratio = (out[f"{first}_async"] or 0) / max(1e-9, out[f"{first}_baseline"] or 0)
    fields = " ".join(
        f"{k.replace('-', '_')}_samples_per_s={v:.1f}"
        if "overlap" not in k
        else f"{k.replace('-', '_')}_bound={v:.2f}"
        for k, v in out.items()
        if v is not None
    )
    print(f"RESULT e2e {fields} ratio={ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
