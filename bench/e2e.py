"""The services against a single-process GRPO loop doing the same work, in the same run.

Contestants, each from the same SFT warm start (built once per workload's warm start) and
the same run config (model, task, batch, group, lr, steps, loss, optimizer, sampling):

* ``baseline``: one process, strictly sequential, no Redis, no HTTP: the library's
  ``RolloutBatchSource`` generates a batch in-process with ``HFChatClient`` (transformers,
  batched and KV-cached; it shares the Trainer's model, so there is nothing to publish),
  GRPO credit, then ``Trainer.train_step``; repeat. It runs the workload's tasks as the
  actors do (protocol, agent, context, ``actor.max_steps``), as many episodes at once as
  all actors together, with as many tool threads, and about ``learner.batch_size`` items
  a batch; tool waits overlap each other (``asyncio.to_thread``), never training.
* ``sync``: ``ludic up`` with ``max_head_offpolicyness: 0`` and ``learner.max_lag: 0``: the
  next batch is generated only once the last step's weights are served (nothing generated
  in vain; no overlap of generation and training).
* ``async``: ``ludic up`` as configured (``max_head_offpolicyness`` 1: one batch generated
  ahead of the served weights, overlapping the learner's step).

Workloads: ``demo`` (the config as it is: 8-token answers); ``gen-heavy`` (the same model
and task with ``max_tokens: 64, ignore_eos: true``: every completion is 64 tokens, the
reward read from the integer before its first end-of-turn token); ``ttt`` (tic-tac-toe
against the heuristic opponent, up to 5 model calls a game, ``context: latest``; warm start
on the env's reference moves; held out: greedy games, pass = a win); ``tools`` (2-digit
+/- with a ToolAgent whose calculator takes 200 ms a call, bench/agentic_tools.py; warm
start on tool-call demonstrations; held out: the eval split, played the same way).
``--workload``: one of them, ``both`` (demo, gen-heavy), ``agentic`` (ttt, tools), ``all``.

Figures per workload and contestant, each the median over reps, one definition each:

* samples/s: trained items (one per model call) per second of RL wall, evaluation
  excluded (``Trainer.throughput.rl_wall_s``: the time inside train steps; the services' learner
  reports it, the summary's ``samples_per_second``);
* time to target: RL wall at the first curve point (``eval_every_steps`` apart, then the
  end) whose held-out greedy pass rate (the first eval set's) reaches the target (default:
  the start's pass rate + 0.10); curves are evaluated on weight snapshots outside the RL
  wall (``up.eval_mode: deferred``; the baseline pauses its clock);
* pass rate before -> after: held-out greedy pass rate at the start and the end;
* stale fraction: items dropped stale / items written (0 for the baseline);
* overlap bound: ``(t_gen + t_train) / max(t_gen, t_train)`` of the baseline's generation
  and training time: the most pipelining the two can gain on this host;
* ratio: async samples/s / baseline samples/s (1.0 = as fast as one process).

Full mode: ``--reps`` (default 3) of each contestant, alternating; baseline rep ``k`` seeds
its sampling and problems with ``k``. ``--quick``: the tiny model, no SFT, a few steps of
the demo workload (or ``--workload``) once per contestant (exercises the path only).

Last line: ``RESULT e2e <workload>_<contestant>_samples_per_s=... <workload>_overlap_bound=...
ratio=<x>``, ``ratio`` the first workload's (demo by default); ttt and tools add
``_time_to_target_s`` (per contestant), ``_stale_fraction`` (sync, async) and ``ratio_<wl>``.

    python bench/e2e.py                     # demo + gen-heavy, 3 reps (~40 min on 2 cores)
    python bench/e2e.py --workload agentic  # ttt + tools
    python bench/e2e.py --quick --workload ttt
    python bench/e2e.py --workload tools --up spare_core_training=true  # an up: key changed
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from libludic.models.tiny import IM_END  # noqa: E402
from services.common.heldout import DEFAULTS as EVAL_DEFAULTS  # noqa: E402

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


# --workload NAME -> the workloads it runs
WORKLOAD_SETS = {
    "demo": ["demo"],
    "gen-heavy": ["gen-heavy"],
    "ttt": ["ttt"],
    "tools": ["tools"],
    "both": ["demo", "gen-heavy"],
    "agentic": ["ttt", "tools"],
    "all": ["demo", "gen-heavy", "ttt", "tools"],
}
AGENTIC = ("ttt", "tools")

TTT_ENV = {"kind": "tic_tac_toe", "kwargs": {"opponent_skill": 0.5}}
TTT_PROTOCOL = {"kind": "single_agent", "kwargs": {"context": "latest", "system_prompt": ""}}
TTT_SFT = {"kind": "env", "kwargs": {"env": {"kind": "tic_tac_toe", "kwargs": {"opening": 4}}}}
TTT_TOKENS = 4  # a cell number and EOS
TTT_STEPS = 5  # X moves at most 5 times
TTT_SEED_BASE = 1_000_000  # feeder.seed_base, as examples/tic_tac_toe/grpo.yaml
SLOW_TOOL = "bench.agentic_tools:calculator"  # 200 ms a call (bench/agentic_tools.py)
TOOL_ARITH = {"digits": 2, "ops": ["+", "-"]}
TOOL_SFT = {
    "kind": "tool",
    "kwargs": {"env": {"kind": "arithmetic", "kwargs": {**TOOL_ARITH, "split": "train"}}},
}
# the call <tool_call>{"name":"calculator",...}</tool_call> is ~76 bytes: a token each
TOOL_TOKENS = 96
TOOL_STEPS = 2  # the tool call, then the answer
TOOL_MODEL_LEN = 512  # both turns' prompts and replies
# the warm starts (full mode): fixed step counts, no target stop (the arithmetic demo's
# sft_target_pass_rate is a pass rate of answers; these tasks check moves and tool calls)
SFT_STEPS = {"ttt": 500, "tools": 300}


def tool_protocol(tool: str) -> dict[str, Any]:
    return {
        "kind": "single_agent",
        "kwargs": {"system_prompt": ""},  # the warm start's prompts carry none
        "agent": {"kind": "tool", "tools": [tool], "max_tool_rounds": 1, "describe_tools": False},
    }


def workload(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """The run config of workload ``name`` (module docstring) from the base config ``cfg``:
    its tasks, actor.max_steps, warm start and held-out set; model, batch, group, lr, steps,
    loss and staleness stay the base config's. An agentic held-out set has ``up.eval_n``
    problems."""
    cfg = copy.deepcopy(cfg)
    up = cfg["up"]
    if name == "gen-heavy":
        for task in cfg["feeder"]["tasks"]:
            task.setdefault("inference", {}).setdefault("sampling", {}).update(
                max_tokens=GEN_HEAVY_TOKENS, ignore_eos=True, skip_special_tokens=False
            )
            task["protocol"] = {"kind": "single_agent", "kwargs": {"parser": ANSWER_BEFORE_EOS}}
    elif name == "ttt":
        cfg["feeder"]["tasks"] = [
            {
                "name": "ttt",
                "env": TTT_ENV,
                "protocol": TTT_PROTOCOL,
                "inference": {"sampling": {"temperature": 1.0, "max_tokens": TTT_TOKENS}},
            }
        ]
        cfg["actor"]["max_steps"] = TTT_STEPS
        # the env has no split: training games start past the held-out seeds 0..n-1
        cfg["feeder"]["seed_base"] = TTT_SEED_BASE
        up.update(
            sft_task=TTT_SFT,
            eval_sets=[
                {
                    "name": "vs-heuristic",  # pass = a win against the seeded opponent
                    "env": TTT_ENV,
                    "protocol": TTT_PROTOCOL,
                    "n": up.get("eval_n", EVAL_DEFAULTS["eval_n"]),
                    "max_tokens": TTT_TOKENS,
                    "max_steps": TTT_STEPS,
                }
            ],
        )
    elif name == "tools":
        env = {"kind": "arithmetic", "kwargs": {**TOOL_ARITH, "split": "train"}}
        cfg["feeder"]["tasks"] = [
            {
                "name": "add-sub-tool",
                "env": env,
                "protocol": tool_protocol(SLOW_TOOL),
                "inference": {"sampling": {"temperature": 1.0, "max_tokens": TOOL_TOKENS}},
            }
        ]
        cfg["actor"]["max_steps"] = TOOL_STEPS
        cfg.setdefault("inference", {})["max_model_len"] = TOOL_MODEL_LEN
        cfg["learner"]["max_seq_len"] = TOOL_MODEL_LEN
        up.update(
            sft_task=TOOL_SFT,
            eval_sets=[
                {
                    "name": "add-sub-tool",
                    "env": {"kind": "arithmetic", "kwargs": {**TOOL_ARITH, "split": "eval"}},
                    # the registered calculator: the same results as the slow one, without
                    # its wait (evaluation is outside the RL wall; this keeps the bench short)
                    "protocol": tool_protocol("calculator"),
                    "n": up.get("eval_n", EVAL_DEFAULTS["eval_n"]),
                    "max_tokens": TOOL_TOKENS,
                    "max_steps": TOOL_STEPS,
                }
            ],
        )
    elif name != "demo":
        raise ValueError(f"unknown workload {name!r}; known: {sorted(WORKLOAD_SETS)}")
    if name in SFT_STEPS:
        up.update(sft_steps=SFT_STEPS[name], sft_target_pass_rate=0.0)
    # plain data, nothing shared with the constants above or between keys (no YAML anchors)
    out: dict[str, Any] = json.loads(json.dumps(cfg))
    return out


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
    # the repository root on every service's path: a task may name bench.agentic_tools:...
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
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
    from libludic.transport.accounting import items_per_group
    from services.actor.settings import ActorSettings
    from services.common.heldout import evaluate_sets_client
    from services.common.settings import load_settings
    from services.feeder.settings import FeederSettings
    from services.feeder.worker import make_request, pick_task
    from services.launcher.settings import UpSettings
    from services.learner.settings import LearnerSettings

    torch.manual_seed(seed)  # each rep its own sampling and problems, as the services' reps
    tmp = Path(tempfile.mkdtemp(prefix="ludic-baseline-"))
    cfg_path = tmp / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    # the services' own settings from the same run config (the environment left out)
    argv = ["--config", str(cfg_path)]
    fs = load_settings(FeederSettings, argv, service="feeder", environ={})
    ls = load_settings(LearnerSettings, argv, service="learner", environ={})
    acs = load_settings(ActorSettings, argv, service="actor", environ={})
    ups = load_settings(UpSettings, argv, service="up", environ={})
    sets = ups.parsed_eval_sets  # what ludic up evaluates, built by the same function
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    algo = ls.spec.build()
    tcfg = ls.trainer_config()
    import dataclasses

    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    tcfg = dataclasses.replace(tcfg, model_device="cpu", pad_token_id=int(pad))
    client = HFChatClient(model=model, tokenizer=tok, max_batch_size=ls.batch_size)
    engine = RolloutEngine(*build_registries(client))
    seeds = iter(range(fs.seed_base + seed * 10**7, fs.seed_base + 10**9))
    made = {"groups": 0, "items": 0}

    def requests() -> list[Any]:
        # about batch_size items, as the learner's batch: a multi-turn episode is one item
        # per model call, so as many groups as the items per group so far say (the feeder's
        # admission estimate; one item per episode before the first batch)
        per_group = items_per_group(made["items"], made["groups"], fs.group_size)
        out = []
        for _ in range(max(1, math.ceil(ls.batch_size / per_group))):
            s = next(seeds)
            out.append(make_request(fs, pick_task(fs.parsed_tasks, s), s))
        made["groups"] += len(out)
        return out

    # the services' episodes in flight: each actor runs `concurrency` requests, each with
    # min(episode_concurrency, group_size) episodes at once
    concurrency = ups.actors * acs.concurrency * min(acs.episode_concurrency, fs.group_size)
    # the services' tool threads: asyncio.to_thread's default executor in each actor process
    # (ThreadPoolExecutor's default size, Python 3.8-3.12: min(32, cores + 4)); one more for
    # HFChatClient's generation, which runs in the same pool (vLLM runs in its own process)
    threads = ups.actors * min(32, (os.cpu_count() or 1) + 4) + 1
    source = RolloutBatchSource(
        engine=engine,
        request_fn=requests,
        algorithm=algo,
        max_steps=acs.max_steps,
        concurrency=concurrency,
    )
    gen = {"s": 0.0}
    inner = source.next_batch

    torch_threads = torch.get_num_threads()

    async def timed_next_batch() -> Any:
        # generation (token by token, small ops) runs fastest on one intra-op thread here,
        # training (larger matmuls) on all of them: the single process uses each at its best
        t = time.perf_counter()
        torch.set_num_threads(GEN_THREADS)
        try:
            b = await inner()
        finally:
            torch.set_num_threads(torch_threads)
        gen["s"] += time.perf_counter() - t
        made["items"] += len(b.items)
        return b

    source.next_batch = timed_next_batch  # type: ignore[method-assign]

    class Curve:
        concurrency = 64

        def __init__(self) -> None:
            self.points: list[tuple[float, float, float]] = []

        async def evaluate(self) -> dict[str, float]:
            res = await evaluate_sets_client(client, sets)
            self.points.append((float(tr.step), tr.throughput.rl_wall_s, res["eval/pass_rate"]))
            return res

    curve = Curve()
    tcfg = dataclasses.replace(tcfg, eval_every_n_steps=ups.eval_every_steps or None)
    tr = Trainer(
        model=model,
        algo=algo,
        batch_source=source,
        cfg=tcfg,
        evaluator=curve,
        hooks=TrainerHooks(on_log=None),  # no console line per step in the timed loop
    )

    async def go() -> dict[str, Any]:
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(threads, thread_name_prefix="baseline")
        )
        before = await evaluate_sets_client(client, sets)
        await tr.train(ls.num_steps)
        after = await evaluate_sets_client(client, sets)
        return {"before": before["eval/pass_rate"], "after": after["eval/pass_rate"]}

    res = asyncio.run(go())
    prof = {k: round(v / max(tr.step, 1), 4) for k, v in tr.throughput.time_totals.items()}
    print(f"baseline per step: {prof}", file=sys.stderr)
    t_gen = gen["s"]
    t_train = tr.throughput.rl_wall_s - t_gen
    return {
        "samples_per_s": tr.throughput.items_trained_total / tr.throughput.rl_wall_s,
        "rl_wall_s": tr.throughput.rl_wall_s,
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


def medians(rs: list[dict[str, Any]], target: float) -> dict[str, float | None]:
    """One contestant's figures over its reps (module docstring), each the median."""
    return {
        "samples_per_s": med([r["samples_per_s"] for r in rs]),
        "time_to_target_s": med(
            [
                time_to(r["curve"] + [(r["steps"], r["rl_wall_s"], r["pass_after"])], target)
                for r in rs
            ]
        ),
        "pass_before": med([r["pass_before"] for r in rs]),
        "pass_after": med([r["pass_after"] for r in rs]),
        "stale_fraction": med([r["stale_fraction"] for r in rs]),
    }


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
        m = medians(rs, target)
        sps = [r["samples_per_s"] for r in rs]
        print(
            f"| {who} | {fmt(m['samples_per_s'], '.1f')} | {fmt(m['time_to_target_s'], '.1f')} | "
            f"{fmt(m['pass_before'], '.3f')} -> {fmt(m['pass_after'], '.3f')} | "
            f"{fmt(m['stale_fraction'], '.3f')} | "
            f"{', '.join(f'{x:.1f}' for x in sps)} |"
        )
    b = runs["baseline"]
    print(
        f"overlap bound (t_gen + t_train) / max: {fmt(med([r['overlap_bound'] for r in b]), '.2f')}"
        f" (baseline t_gen {fmt(med([r['t_gen'] for r in b]), '.1f')} s, t_train "
        f"{fmt(med([r['t_train'] for r in b]), '.1f')} s)"
    )


def result_line(
    results: dict[str, dict[str, list[dict[str, Any]]]], targets: dict[str, float]
) -> str:
    """``RESULT e2e`` with the figures of the module docstring; ``ratio=`` last."""
    fields: list[str] = []
    ratios: dict[str, float] = {}
    for wl, runs in results.items():
        key = wl.replace("-", "_")
        m = {who: medians(rs, targets[wl]) for who, rs in runs.items()}
        for who, mw in m.items():
            if mw["samples_per_s"] is not None:
                fields.append(f"{key}_{who}_samples_per_s={mw['samples_per_s']:.1f}")
        if wl in AGENTIC:
            for who, mw in m.items():
                if mw["time_to_target_s"] is not None:
                    fields.append(f"{key}_{who}_time_to_target_s={mw['time_to_target_s']:.1f}")
            for who in ("sync", "async"):
                if m[who]["stale_fraction"] is not None:
                    fields.append(f"{key}_{who}_stale_fraction={m[who]['stale_fraction']:.3f}")
        bound = med([r["overlap_bound"] for r in runs["baseline"]])
        if bound is not None:
            fields.append(f"{key}_overlap_bound={bound:.2f}")
        ratios[wl] = (m["async"]["samples_per_s"] or 0) / max(
            1e-9, m["baseline"]["samples_per_s"] or 0
        )
    fields += [f"ratio_{wl}={ratios[wl]:.2f}" for wl in AGENTIC if wl in ratios]
    first = next(iter(results))
    return f"RESULT e2e {' '.join(fields)} ratio={ratios[first]:.2f}"


# ----------------------------------------------------------------------------- main


def start_models(cfgs: dict[str, dict[str, Any]], work: Path, quick: bool) -> dict[str, Path]:
    """Workload -> its starting policy: in full mode each distinct warm start (the up.sft_*
    keys) built once and shared by every contestant and rep of the workloads that use it;
    with ``quick`` the tiny model, no SFT, for all."""
    if quick:
        from libludic.models.tiny import init_model

        tiny = init_model(work / "tiny", size="tiny")
        return {wl: tiny for wl in cfgs}
    from services.launcher.settings import UpSettings
    from services.launcher.worker import prepare_model

    built: dict[str, Path] = {}
    out: dict[str, Path] = {}
    for wl, cfg in cfgs.items():
        up = cfg["up"]
        key = json.dumps({k: v for k, v in up.items() if k.startswith("sft_")}, sort_keys=True)
        if key not in built:
            s = UpSettings(**{k: v for k, v in up.items() if k in UpSettings.__dataclass_fields__})
            s.name, s.runs_dir = f"warm-start-{len(built)}", str(work)
            built[key] = prepare_model(s, work / s.name)
        out[wl] = built[key]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--config", default=str(ROOT / "examples/arith/grpo.yaml"))
    ap.add_argument(
        "--workload",
        choices=list(WORKLOAD_SETS),
        default=None,
        help="default: both (demo with --quick)",
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--target", type=float, default=None, help="pass-rate target (default: before + 0.10)"
    )
    ap.add_argument(
        "--up",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set up.KEY (a YAML value) for every workload, e.g. spare_core_training=false",
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
    workloads = WORKLOAD_SETS[a.workload or ("demo" if a.quick else "both")]
    reps = a.reps
    if a.quick:
        cfg["up"].update(actors=1, eval_n=16, eval_every_steps=2, timeout_s=300)
        cfg["learner"].update(num_steps=4, batch_size=16)
        reps = 1
    cfgs = {wl: workload(cfg, wl) for wl in workloads}
    for kv in a.up:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            ap.error(f"--up {kv!r}: use KEY=VALUE")
        for wcfg in cfgs.values():
            wcfg["up"][key] = yaml.safe_load(value)
    models = start_models(cfgs, work, a.quick)
    for wl, wcfg in cfgs.items():
        wcfg["up"].update(model=str(models[wl]), sft_steps=0)
    print(f"e2e: models {sorted({str(m) for m in models.values()})}, work dir {work}", flush=True)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for wl, wcfg in cfgs.items():
        runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "sync": [], "async": []}
        for rep in range(reps):  # alternating: one of each per round
            for who in runs:
                name = f"e2e-{wl}-{who}-{rep}"
                t = time.monotonic()
                if who == "baseline":
                    r = baseline_subprocess(wcfg, models[wl], work, name, seed=rep)
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
    targets: dict[str, float] = {}
    for wl, runs in results.items():
        start = med([r["pass_before"] for rs in runs.values() for r in rs]) or 0.0
        targets[wl] = a.target if a.target is not None else start + 0.10
        table(wl, runs, targets[wl])
    (work / "results.json").write_text(json.dumps({"targets": targets, "runs": results}, indent=1))
    print(result_line(results, targets))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
