"""Where a run's time goes: a learner step and an actor request, broken down, plus the CPU
each process used, on the run config you give (default: the demo).

Runs ``ludic up --config CONFIG`` (curve evaluation off: it is not part of a step), samples
the CPU seconds of every process of the run from /proc once a second, and at the end reads
the services' own accounts of their time:

* learner (``learner_final.json`` ``step_profile``: ``Trainer.throughput.time_totals``): per step,
  waiting for items, training (forward, backward, optimizer), publishing (snapshot +
  waiting for the previous publish), and the whole step;
* actors (their ``actor profile`` log line): per request, generating every episode
  (inference + env) and committing; their time waiting for work;
* credit (its ``credit profile`` line): per group, credit + encode + commit;
* inference: the swap's generation pause and the in-place reload in the worker (its log);
* CPU while training: each kind of process's CPU seconds between the learner's first and
  last step, per second of that window (1.00 = one core busy all the time).

With ``--py-spy`` (``pip install py-spy``) it also records the learner, an actor and the
inference processes (API server, EngineCore, worker) for 10 s in the middle of the run and prints their hottest functions.

Last line: ``RESULT profile ... ratio=<x>`` with ``ratio`` = training time / step time of
the learner (higher is better; 1.0 = the learner never waits for items or publishing).

    python bench/step_profile.py                 # the demo config, 60 steps
    python bench/step_profile.py --quick         # tiny model, 10 steps
    python bench/step_profile.py --py-spy
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROLES = (
    ("VLLM::Worker", "vllm worker"),
    ("VLLM::EngineCore", "vllm engine core"),
    ("services.cli inference", "inference api"),
    ("services.cli learner", "learner"),
    ("services.cli actor", "actor"),
    ("services.cli credit", "credit"),
    ("services.cli feeder", "feeder"),
    ("services.cli up", "launcher"),
    ("redis-server", "redis"),
)


SPIED = ("learner", "actor", "inference api", "vllm engine core", "vllm worker")


def role(cmdline: str) -> str | None:
    for needle, name in ROLES:
        if needle in cmdline:
            return name
    return None


def cpu_sampler(
    run_id: str,
    stop: threading.Event,
    out: dict[int, tuple[str, float]],
    history: list[tuple[float, dict[int, tuple[str, float]]]],
) -> None:
    """pid -> (role, CPU seconds) of every process of this run (found by its environment, or
    for vLLM's processes, whose title overwrites their environment, by their parent), and a
    copy of it every second in ``history`` with its wall time."""
    tick = os.sysconf("SC_CLK_TCK")
    needle = f"LUDIC_RUN_ID={run_id}".encode()
    while not stop.is_set():
        for d in sorted(
            Path("/proc").iterdir(), key=lambda d: int(d.name) if d.name.isdigit() else 0
        ):
            if not d.name.isdigit():
                continue
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                r = role(cmd)
                if r is None:
                    continue
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
                ours = needle in (d / "environ").read_bytes() or int(stat[1]) in out
                if r != "launcher" and not ours:
                    continue  # another run's process (or the machine's own redis)
                out[int(d.name)] = (r, (int(stat[11]) + int(stat[12])) / tick)
            except (OSError, IndexError, ValueError):
                continue
        history.append((time.time(), dict(out)))
        stop.wait(1.0)


def rl_window_cpu(
    history: list[tuple[float, dict[int, tuple[str, float]]]], learner_log: Path
) -> tuple[float, dict[str, float]] | None:
    """(seconds, role -> CPU seconds) between the learner's first and last trained step, from
    the samples nearest those times: what each service costs while training runs."""
    stamps = [
        time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
        for m in re.finditer(
            r"^(\S+ \S+),(\d+) INFO libludic.training.trainer: step \d+ ",
            learner_log.read_text(),
            re.M,
        )
    ]
    if len(stamps) < 2 or len(history) < 2:
        return None
    a = min(history, key=lambda h: abs(h[0] - stamps[0]))
    b = min(history, key=lambda h: abs(h[0] - stamps[-1]))
    if b[0] - a[0] < 1:
        return None
    by_role: collections.Counter[str] = collections.Counter()
    for pid, (r, secs) in b[1].items():
        by_role[r] += secs - a[1].get(pid, (r, 0.0))[1]
    return b[0] - a[0], dict(by_role)


def py_spy(pid: int, seconds: int, path: Path) -> None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    subprocess.run(
        [
            exe,
            "record",
            "-p",
            str(pid),
            "-d",
            str(seconds),
            "-r",
            "100",
            "-f",
            "raw",
            "-o",
            str(path),
            "--nonblocking",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )


def hottest(path: Path, n: int = 12) -> list[tuple[float, str]]:
    """Inclusive share of samples per function (py-spy raw output)."""
    if not path.exists():
        return []
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        k = int(count)
        total += k
        names = set()
        for f in stack.split(";"):
            # "func (path/file.py:line)" -> "func (file.py)": one entry per function
            m = re.match(r"(.*) \((?:.*/)?([^/:]+)(?::\d+)?\)$", f.strip())
            names.add(f"{m.group(1)} ({m.group(2)})" if m else f.strip())
        for name in names:
            if name and not name.startswith(
                (
                    "<module>",
                    "_run",
                    "run ",
                    "Runner.",
                    "BaseEventLoop",
                    "Handle._run",
                    "main ",
                    "service_main",
                )
            ):
                incl[name] += k
    return [(v / max(total, 1), k) for k, v in incl.most_common(n)]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default=str(ROOT / "examples/arith/grpo.yaml"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--py-spy",
        action="store_true",
        help="record the learner, an actor and the inference processes for 10 s",
    )
    a = ap.parse_args()
    cfg = yaml.safe_load(Path(a.config).read_text())
    work = Path(tempfile.mkdtemp(prefix="ludic-profile-"))
    name = "profile"
    cfg["run_id"] = name
    cfg["up"].update(name=name, runs_dir=str(work), eval_every_steps=0, prometheus=False)
    cfg["learner"]["num_steps"] = a.steps
    if a.quick:
        from libludic.models.tiny import init_model

        cfg["up"].update(
            model=str(init_model(work / "tiny", size="tiny")), sft_steps=0, actors=1, eval_n=16
        )
        cfg["learner"].update(num_steps=10, batch_size=16)
    path = work / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "LUDIC_REDIS_URL"}
    env["LUDIC_DUMPABLE"] = "1"  # py-spy attaches as the same user
    cpu: dict[int, tuple[str, float]] = {}
    history: list[tuple[float, dict[int, tuple[str, float]]]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=cpu_sampler, args=(name, stop, cpu, history), daemon=True)
    sampler.start()
    log = work / "up.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--config", str(path), "--no-live"],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
        if a.py_spy:
            learner_log = work / name / "logs" / "learner.log"
            while proc.poll() is None and not re.search(
                r"step (\d+) loss", learner_log.read_text() if learner_log.exists() else ""
            ):
                time.sleep(1)
            time.sleep(5)
            pids = {r: pid for pid, (r, _) in cpu.items() if r in SPIED}
            threads = [
                threading.Thread(target=py_spy, args=(pid, 10, work / f"{r}.spy"))
                for r, pid in pids.items()
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        code = proc.wait()
    stop.set()
    sampler.join(5)
    if code != 0:
        sys.stderr.write(log.read_text(errors="replace")[-3000:])
        raise SystemExit(f"ludic up exited with {code}")
    run = work / name
    final = json.loads((run / "learner" / "learner_final.json").read_text())
    prof = final.get("step_profile") or {}
    summary = json.loads((run / "summary.json").read_text())
    logs = run / "logs"
    actor = [
        re.search(
            r"generate ([\d.]+) s, commit ([\d.]+) s; waiting for work ([\d.]+) s", p.read_text()
        )
        for p in sorted(logs.glob("actor-*.log"))
    ]
    credit = re.search(r"per group ([\d.]+) s", (logs / "credit.log").read_text())
    swaps = re.findall(
        r"generation paused ([\d.]+) s, reload in the worker ([\d.]+) s",
        (logs / "inference.log").read_text(),
    )
    print(f"\nprofile of {final['step']} steps ({a.config}), run dir {run}")
    print(f"samples/s {summary['samples_per_second']} (RL wall {summary['rl_wall_seconds']} s)")
    print(
        "learner, mean per step: "
        + ", ".join(f"{k.removesuffix('_s')} {v * 1000:.1f} ms" for k, v in prof.items())
    )
    spare = final.get("spare_core")
    if spare:
        print(
            f"spare-core training thread on cores {spare['cores']}: {spare['micro_batches']} "
            f"micro-batches trained, {spare['taken_back']} taken back by the learner's thread"
            + (f"; stopped: {spare['stopped']}" if spare["stopped"] else "")
        )
    gen = [float(m.group(1)) for m in actor if m]
    com = [float(m.group(2)) for m in actor if m]
    if gen:
        print(
            f"actors, mean per request: generate {statistics.mean(gen) * 1000:.1f} ms, commit "
            f"{statistics.mean(com) * 1000:.2f} ms; waiting for work "
            f"{', '.join(m.group(3) + ' s' for m in actor if m)}"
        )
    if credit:
        print(f"credit, per group: {float(credit.group(1)) * 1000:.2f} ms")
    if swaps:
        pause = statistics.median(float(p) for p, _ in swaps)
        reload_ = statistics.median(float(r) for _, r in swaps)
        print(
            f"inference swaps: median pause {pause * 1000:.1f} ms, median in-place reload "
            f"{reload_ * 1000:.1f} ms ({len(swaps)} swaps)"
        )
    by_role: collections.Counter[str] = collections.Counter()
    for r, secs in cpu.values():
        by_role[r] += secs
    print(
        "CPU seconds by process (whole run: start-up included; the launcher's include the SFT "
        "warm start and the before/after evaluations): "
        + ", ".join(f"{r} {s:.1f}" for r, s in by_role.most_common())
    )
    window = rl_window_cpu(history, logs / "learner.log")
    if window:
        secs, roles = window
        print(
            f"CPU while training ({secs:.0f} s from the first to the last step; 1.00 = one core "
            "busy all the time): "
            + ", ".join(
                f"{r} {v / secs:.2f}" for r, v in sorted(roles.items(), key=lambda kv: -kv[1])
            )
        )
    for r in SPIED:
        top = hottest(work / f"{r}.spy")
        if top:
            print(f"py-spy {r} (share of 10 s of samples):")
            for share, fn in top:
                print(f"  {share * 100:5.1f}%  {fn}")
    ratio = prof.get("train_s", 0.0) / max(prof.get("step_wall_s", 0.0), 1e-9)
    print(
        f"RESULT profile samples_per_s={summary['samples_per_second']} "
        f"wait_ms={prof.get('batch_wait_s', 0) * 1000:.1f} train_ms={prof.get('train_s', 0) * 1000:.1f} "
        f"publish_ms={prof.get('publish_wait_s', 0) * 1000:.1f} "
        f"step_ms={prof.get('step_wall_s', 0) * 1000:.1f} ratio={ratio:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
