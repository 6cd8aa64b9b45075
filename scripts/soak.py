"""A soak of the embedded stack: `ludic up` with the demo's config and 4 actors for N minutes,
sampled every few seconds; every figure below must stay bounded and the run accounting must
hold at every sample.

    python scripts/soak.py                      # 10 minutes, 4 actors
    python scripts/soak.py --minutes 2          # what CI runs (tests/integration/test_soak.py)
    python scripts/soak.py --model DIR --out DIR

The run: ``examples/arith/grpo.yaml`` with ``up.actors`` 4, a freshly initialised small
model (``--model`` for another; no SFT: the soak measures resources, not learning), live
evaluation every 20 steps, a checkpoint every 2 steps (two kept), and as many steps as the
time allows; the soak stops it with SIGTERM, the way a user stops a run. Redis is a
redis-server the soak starts with the launcher's own arguments (append-only file, maxmemory
with noeviction) and hands to ``ludic up`` through ``LUDIC_REDIS_URL``, so both read it.

Figures per sample: the length of every stream (requests, rollouts, saw, deadletter), Redis
``used_memory`` and its key count (the de-dup markers, ``done:*``, apart), the resident set
of every process of the run (each service, vLLM's engine core, redis-server, ``ludic up``
itself), the bytes of the learner's checkpoints, and the accounting snapshot. (Logs, and the
learner's log of trained items, grow with the run by design: not judged.)

Bounded: the first third of the soak is warm-up; a figure is bounded when its maximum over
the last third is at most its maximum over the middle third times ``GROWTH`` plus a slack
(``SLACK``: 32 MiB of RSS, 256 keys, one checkpoint of disk; for a stream, the most its
backpressure lets it hold, ``stream_ceilings``: a queue swings up to that whenever its consumer
is the slower side, in any third of the soak). A figure that
keeps growing at a steady rate fails this at any length; its growth per hour (least squares
over the last two thirds) is printed either way. The de-dup markers are meant to grow until
they expire (``DONE_TTL_S``), and Redis memory and key count with them: those are judged by
the memory Redis would hold once the markers expire at the soak's rate, which must stay under
half of its maxmemory (``markers_steady_state``); the other keys must stay bounded. The accounting identity must
hold at every sample, with no item trained twice and no group dead-lettered. At the end:
``ludic up`` exits 130 on the SIGTERM and leaves no process of the run behind.

Output: a table of every figure, ``<out>/soak.json`` (every sample), and the last line
``SOAK ok ...`` (exit 0) or ``SOAK FAILED ...`` (exit 1) naming what failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from libludic.transport import accounting  # noqa: E402
from libludic.transport.keys import DONE_TTL_S, Keys  # noqa: E402
from services.launcher import procs, stack  # noqa: E402

GROWTH = 1.10
MIB = 1 << 20
SLACK = {"stream": 16, "rss": 32 * MIB, "keys": 256}


def dir_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def key_counts(r: redis.Redis, keys: Keys) -> tuple[int, int]:
    """(the run's keys, of which de-dup markers), from one SCAN."""
    prefix = keys.prefix.replace("{", "\\{").replace("}", "\\}")
    marker = f"{keys.prefix}:done:".encode()
    total = done = 0
    for k in r.scan_iter(match=f"{prefix}:*", count=1000):
        total += 1
        done += k.startswith(marker)
    return total, done


def sample(
    r: redis.Redis, url: str, keys: Keys, run_dir: Path, own: dict[int, str], t0: float
) -> dict[str, Any]:
    s: dict[str, Any] = {"t": time.monotonic() - t0}
    for name, key in keys.streams().items():
        s[f"stream/{name}"] = int(r.xlen(key))
    s["redis/used_memory"] = int(r.info("memory")["used_memory"])
    s["redis/keys"], s["redis/done_markers"] = key_counts(r, keys)
    s["redis/keys_other"] = s["redis/keys"] - s["redis/done_markers"]
    named = {p.pid: p.name for p in procs.of_run(keys.run_id)}
    named.update(own)  # redis-server and ludic up itself, which carry no LUDIC_RUN_ID
    for pid, name in named.items():
        rss = procs.rss_bytes(pid)
        if rss is not None:
            s[f"rss/{name}/{pid}"] = rss
    s["disk/checkpoints"] = sum(dir_bytes(d) for d in (run_dir / "learner").glob("step_*"))
    s["step"] = int(r.get(keys.learner_step) or 0)
    s["accounting"] = accounting.snapshot_sync(url, keys.run_id)
    return s


def stream_ceilings(cfg: Path, actors: int) -> dict[str, int]:
    """The most each stream's backpressure lets it hold, as the run's services read ``cfg``.
    A producer checks the backlog before it starts work and writes when the work ends, so a
    stream's ceiling is the backlog its producer waits below (its high-water mark) plus what
    its producers can have started before the backlog reached it:

    - requests: the feeder tops the stream up to ``high_water``, nothing in flight;
    - rollouts: each of the ``actors`` runs ``concurrency`` requests at once, each one group of
      ``group_size`` rollouts;
    - saw: the credit worker waits once per group, which writes at most one SAW item per step
      of each of its ``group_size`` rollouts (``actor.max_steps`` steps each).

    A stream swinging up to its ceiling is working, not growing."""
    from services.actor.settings import ActorSettings
    from services.common.settings import load_settings
    from services.credit.settings import CreditSettings
    from services.feeder.settings import FeederSettings

    env = {"LUDIC_CONFIG": str(cfg)}
    feeder = load_settings(FeederSettings, [], service="feeder", environ=env)
    actor = load_settings(ActorSettings, [], service="actor", environ=env)
    credit = load_settings(CreditSettings, [], service="credit", environ=env)
    group = feeder.group_size
    return {
        "stream/requests": feeder.high_water,
        "stream/rollouts": actor.rollouts_high_water + actors * actor.concurrency * group,
        "stream/saw": credit.saw_high_water + group * actor.max_steps,
    }


def slack_of(fig: str, checkpoint_bytes: int, ceilings: dict[str, int]) -> float:
    if fig.startswith("stream/"):
        return ceilings.get(fig, SLACK["stream"])
    if fig.startswith("rss/"):
        return SLACK["rss"]
    if fig.startswith("redis/"):
        return SLACK["keys"]
    return checkpoint_bytes  # disk/checkpoints: one more at the moment of a save


def slope(pts: list[tuple[float, float]]) -> float:
    """Least-squares growth per second of (t, value) points."""
    n = len(pts)
    if n < 2:
        return 0.0
    mt, mv = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
    var = sum((p[0] - mt) ** 2 for p in pts)
    return sum((p[0] - mt) * (p[1] - mv) for p in pts) / var if var else 0.0


# grow until their markers expire (DONE_TTL_S): judged by markers_steady_state instead
BY_TTL = ("redis/used_memory", "redis/keys", "redis/done_markers")


def markers_steady_state(samples: list[dict[str, Any]], minutes: float) -> dict[str, float]:
    """The de-dup markers grow with every committed input until they expire: at the soak's
    rate, Redis holds ``rate x DONE_TTL_S`` of them once the first expire. Their size is the
    growth of ``used_memory`` per marker over the last two thirds (everything else that
    grew is charged to them: an upper bound). Returns the rate, the bytes per marker and the
    projected ``used_memory`` then."""
    pts = [s for s in samples if s["t"] >= minutes * 60 / 3]
    rate = slope([(s["t"], s["redis/done_markers"]) for s in pts])
    mem = slope([(s["t"], s["redis/used_memory"]) for s in pts])
    per = mem / rate if rate > 0 else 0.0
    last = samples[-1]
    steady = last["redis/used_memory"] + rate * (DONE_TTL_S - last["t"]) * max(per, 0.0)
    return {"per_s": rate, "bytes_each": per, "steady_used_memory": steady}


def judge(
    samples: list[dict[str, Any]], minutes: float, ceilings: dict[str, int]
) -> list[dict[str, Any]]:
    """One row per figure: middle-third max, last-third max, growth per hour, bounded."""
    third = minutes * 60 / 3
    mid = [s for s in samples if third <= s["t"] < 2 * third]
    last = [s for s in samples if s["t"] >= 2 * third]
    figs = sorted({k for s in samples for k in s if "/" in k})
    ckpt = max((s.get("disk/checkpoints", 0) for s in mid), default=0) // 2  # two kept
    rows = []
    for fig in figs:
        m = [s[fig] for s in mid if fig in s]
        ls = [s[fig] for s in last if fig in s]
        if not m or not ls:  # a process that did not live through both windows
            continue
        growth = slope([(s["t"], s[fig]) for s in mid + last if fig in s])
        bound = max(m) * GROWTH + slack_of(fig, ckpt, ceilings)
        rows.append(
            {
                "figure": fig,
                "middle_max": max(m),
                "last_max": max(ls),
                "per_hour": growth * 3600,
                "bounded": None if fig in BY_TTL else max(ls) <= bound,
            }
        )
    return rows


def human(fig: str, v: float) -> str:
    if fig.startswith(("rss/", "disk/")) or fig == "redis/used_memory":
        return f"{v / MIB:.1f} MiB"
    return f"{v:.0f}"


def run_config(
    base: Path, out: Path, run_id: str, model: Path, actors: int, minutes: float
) -> Path:
    cfg = yaml.safe_load(base.read_text())
    cfg["run_id"] = run_id
    cfg["up"].update(
        name=run_id,
        runs_dir=str(out / "runs"),
        model=str(model),
        sft_steps=0,
        actors=actors,
        eval_mode="live",
        eval_every_steps=20,
        timeout_s=int(minutes * 60) + 900,
        prometheus=False,
    )
    cfg["learner"].update(num_steps=10**6, checkpoint_every=2, max_to_keep=2)
    p = out / "soak.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=10.0, help="soak length after start-up")
    ap.add_argument("--actors", type=int, default=4)
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--config", default=str(ROOT / "examples/arith/grpo.yaml"))
    ap.add_argument("--model", default="", help="model directory (default: a new small one)")
    ap.add_argument("--out", default="", help="work directory (default: a new temporary one)")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    a = ap.parse_args(argv)
    if a.minutes <= 0 or a.actors < 1 or a.interval <= 0:
        ap.error("--minutes and --interval must be > 0, --actors >= 1")
    out = Path(a.out or tempfile.mkdtemp(prefix="ludic-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    run_id = f"soak-{os.getpid()}"
    if a.model:
        model = Path(a.model)
    else:
        from libludic.models.tiny import init_model

        model = init_model(out / "model", size="small", seed=0)
    cfg = run_config(Path(a.config), out, run_id, model, a.actors, a.minutes)

    port = stack.free_port()
    url = f"redis://127.0.0.1:{port}/0"
    redis_proc = subprocess.Popen(
        stack.redis_spec(out / "redis", port).argv,
        stdout=open(out / "redis.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    up: subprocess.Popen[bytes] | None = None
    maxmemory = 0
    failures: list[str] = []
    samples: list[dict[str, Any]] = []
    try:
        stack.wait_redis(port)
        r = redis.Redis.from_url(url)
        keys = Keys(run_id)
        maxmemory = int(r.config_get("maxmemory")["maxmemory"])
        log = out / "up.log"
        up = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--config", str(cfg), "--no-live"],
            stdout=open(log, "wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "LUDIC_REDIS_URL": url, "PYTHONUNBUFFERED": "1"},
            cwd=ROOT,
        )
        print(f"soak: {run_id}, {a.actors} actors, {a.minutes:g} min, work dir {out}", flush=True)
        deadline = time.monotonic() + a.startup_timeout
        while int(r.get(keys.learner_step) or 0) < 1:  # start-up: model load, vLLM, eval
            if up.poll() is not None:
                raise SystemExit(f"ludic up exited {up.returncode}:\n{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise SystemExit(f"no learner step within {a.startup_timeout:g} s; see {log}")
            time.sleep(1)
        t0 = time.monotonic()
        run_dir = out / "runs" / run_id
        while time.monotonic() - t0 < a.minutes * 60:
            if up.poll() is not None:
                failures.append(f"ludic up exited {up.returncode} during the soak")
                break
            own = {redis_proc.pid: "redis-server", up.pid: "launcher"}
            s = sample(r, url, keys, run_dir, own, t0)
            samples.append(s)
            acct = s["accounting"]
            if not acct["consistent"]:
                failures.append(f"accounting inconsistent at {s['t']:.0f} s: {acct}")
            print(
                f"{s['t']:6.0f} s  step {s['step']:5d}  saw {s['stream/saw']:4d}  "
                f"redis {s['redis/used_memory'] / MIB:6.1f} MiB  keys {s['redis/keys']:7d}  "
                f"groups trained {acct['groups_trained']}",
                flush=True,
            )
            time.sleep(a.interval)
        final = accounting.snapshot_sync(url, run_id)
        if final["items_trained_twice"] or final["groups_deadlettered"]:
            failures.append(f"accounting: {accounting.format_line(final)}")
        up.send_signal(signal.SIGTERM)
        code = up.wait(120)
        if code != 130:
            failures.append(f"ludic up exited {code} on SIGTERM (expected 130)")
        time.sleep(1)
        left = {p.pid: p.name for p in procs.of_run(run_id)}
        if left:
            failures.append(f"processes left running after ludic up exited: {left}")
    finally:
        if up is not None and up.poll() is None:
            up.kill()
        redis_proc.terminate()
        redis_proc.wait(30)
    rows = judge(samples, a.minutes, stream_ceilings(cfg, a.actors))
    if not rows:
        failures.append("too few samples to judge (each third of the soak needs some)")
    print(f"\n{'figure':42s} {'middle max':>12s} {'last max':>12s} {'per hour':>12s}  bounded")
    for row in rows:
        f = row["figure"]
        print(
            f"{f:42s} {human(f, row['middle_max']):>12s} {human(f, row['last_max']):>12s} "
            f"{human(f, row['per_hour']):>12s}  "
            + {True: "yes", False: "NO", None: "by expiry (below)"}[row["bounded"]]
        )
        if row["bounded"] is False:
            failures.append(
                f"{f} grew: {human(f, row['middle_max'])} -> {human(f, row['last_max'])}"
            )
    markers: dict[str, float] = {}
    if rows:
        markers = markers_steady_state(samples, a.minutes)
        markers["maxmemory"] = maxmemory
        print(
            f"de-dup markers: {markers['per_s']:.1f}/s, {markers['bytes_each']:.0f} B each, "
            f"expire after {DONE_TTL_S} s: Redis then holds about "
            f"{markers['steady_used_memory'] / MIB:.0f} MiB (maxmemory {maxmemory / MIB:.0f} MiB)"
        )
        if markers["steady_used_memory"] > maxmemory / 2:
            failures.append(
                f"Redis memory: the de-dup markers alone would reach "
                f"{markers['steady_used_memory'] / MIB:.0f} MiB before they expire, over half "
                f"of maxmemory ({maxmemory / MIB:.0f} MiB)"
            )
    (out / "soak.json").write_text(
        json.dumps({"samples": samples, "rows": rows, "markers": markers}, indent=1)
    )
    steps = samples[-1]["step"] if samples else 0
    summary = f"minutes={a.minutes:g} actors={a.actors} steps={steps} samples={len(samples)}"
    if failures:
        print("SOAK FAILED " + summary + "\n  " + "\n  ".join(failures))
        return 1
    print(f"SOAK ok {summary} figures={len(rows)} all bounded, accounting consistent")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
