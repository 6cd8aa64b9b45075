"""`ludic up` survives its workers crashing, and dies without leaving anything behind.

One run (checkpoints every 2 steps, the learner as two torchrun ranks) has, once training
is under way, a SIGKILL of an actor, of credit, of the feeder, then of one learner rank, of
redis-server and of the inference server: each is restarted (torchrun stops the surviving
rank and exits, the learner resumes from its newest checkpoint, redis reloads its
append-only file, inference is republished the learner's weights) and the run reaches its
step count with the accounting consistent, no group lost and no item trained twice. A
second run does the same with SIGTERM, one learner process, and vLLM's engine core.
Another ``ludic up`` is itself killed with SIGKILL: every service it started stops
(PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_up import config, finished, ludic_up, procs_of_run  # noqa: E402

from services.launcher import procs  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.faults]


def service_pid(up_pid: int, service: str, consumer: str | None = None) -> int | None:
    """The pid of `ludic <service>` started by the `ludic up` process ``up_pid``."""
    for p in procs.children(up_pid):
        if p.name == service and (consumer is None or p.env_has("LUDIC_CONSUMER", consumer)):
            return p.pid
    return None


def child_pids(parent: int, word: bytes) -> list[int]:
    """The pids of the children of ``parent`` with ``word`` among their argv (torchrun's
    ranks)."""
    return sorted(p.pid for p in procs.children(parent) if word in p.argv)


def trained_steps(run_dir: Path) -> int:
    p = run_dir / "learner" / "trained_items.jsonl"
    return len(p.read_text().splitlines()) if p.exists() else 0


def wait(cond, proc, log: Path, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, (
            f"ludic up exited while waiting for {what}:\n" + log.read_text(errors="replace")[-4000:]
        )
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def learner_section(cfg: Path, **learner: object) -> None:
    """Set keys of the config's ``learner:`` section."""
    import yaml

    data = yaml.safe_load(cfg.read_text())
    data["learner"].update(learner)
    cfg.write_text(yaml.safe_dump(data))


def wait_gone(run_id: str, timeout_s: float = 60) -> list[int]:
    """The run's processes still alive after ``timeout_s`` (vLLM's engine shuts down on the
    SIGTERM it gets when ludic up dies)."""
    deadline = time.monotonic() + timeout_s
    while procs_of_run(run_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    return procs_of_run(run_id)


def recovered(run_dir: Path, run_id: str, steps: int) -> dict:
    """A run that lost nothing: its step count, the accounting consistent, no item trained
    twice, no group dead-lettered, the learner resumed from a checkpoint, nothing left
    running. Returns the summary."""
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == steps
    a = s["accounting"]
    assert a["consistent"], a
    assert a["items_trained_twice"] == 0 and a["groups_deadlettered"] == 0, a
    learner_log = (run_dir / "logs" / "learner.log").read_text(errors="replace")
    assert "resumed from" in learner_log
    time.sleep(1)
    assert procs_of_run(run_id) == [], "services left running after ludic up exited"
    return s


def test_crashed_workers_and_learner_are_restarted_and_the_run_completes(tmp_path, tiny_model_dir):
    run_id = f"faults-{os.getpid()}"
    cfg = config(
        tmp_path, tiny_model_dir, run_id, num_steps=16, eval_n=0, actors=2, learner_nproc=2
    )
    learner_section(cfg, checkpoint_every=2, trained_log=True)
    log = tmp_path / "up.log"
    proc = ludic_up(cfg, log)
    run_dir = tmp_path / "runs" / run_id
    killed: dict[str, int] = {}
    try:
        wait(lambda: trained_steps(run_dir) >= 2, proc, log, 420, "the learner's step 2")
        for svc, consumer, name in (
            ("actor", "actor-0", "actor-0"),
            ("credit", None, "credit"),
            ("feeder", None, "feeder"),
        ):
            pid = service_pid(proc.pid, svc, consumer)
            assert pid is not None, name
            os.kill(pid, signal.SIGKILL)
            killed[name] = pid
        # then one at a time, each once the run has made progress since the last: one rank of
        # the learner (between two checkpoints or just after one), Redis, the inference API
        # server
        for svc in ("learner", "redis-server", "inference"):
            start = trained_steps(run_dir)
            wait(
                lambda s=start: trained_steps(run_dir) >= s + 2,
                proc,
                log,
                240,
                f"progress before killing {svc}",
            )
            pid = service_pid(proc.pid, svc)
            assert pid is not None, svc
            if svc == "learner":  # torchrun: kill one of its ranks, not the agent
                ranks = child_pids(pid, b"learner")
                assert len(ranks) == 2, f"torchrun {pid} runs ranks {ranks}, not 2"
                pid = ranks[-1]
            os.kill(pid, signal.SIGKILL)
            killed["redis" if svc == "redis-server" else svc] = pid
        finished(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
    s = recovered(run_dir, run_id, 16)
    assert {n: s["restarts"].get(n) for n in killed} == {n: 1 for n in killed}, s["restarts"]


def engine_core_pid(up_pid: int) -> int | None:
    """The pid of vLLM's engine core process under the inference service of ``up_pid``."""
    api = service_pid(up_pid, "inference")
    if api is None:
        return None
    return next((p.pid for p in procs.children(api) if b"EngineCore" in b" ".join(p.argv)), None)


def test_services_stopped_by_sigterm_and_a_killed_engine_core_are_restarted(
    tmp_path, tiny_model_dir
):
    """SIGTERM (a clean stop, exit 0, from outside ``ludic up``) of an actor, credit and the
    feeder, then one at a time of the learner, vLLM's engine core (SIGKILL), Redis and
    inference: a service that stopped before its work was done is restarted like a crashed
    one (the learner's exit 0 is not the end of the run unless it reached its step count),
    and the run completes having lost nothing."""
    run_id = f"sigterm-{os.getpid()}"
    # the tiny model trains ~5 steps/s once inference is back: steps to spare after the last
    # stop, so the run cannot end before it lands
    cfg = config(tmp_path, tiny_model_dir, run_id, num_steps=60, eval_n=0, actors=2)
    learner_section(cfg, checkpoint_every=2, trained_log=True)
    log = tmp_path / "up.log"
    proc = ludic_up(cfg, log)
    run_dir = tmp_path / "runs" / run_id
    stopped: list[str] = []
    try:
        wait(lambda: trained_steps(run_dir) >= 2, proc, log, 420, "the learner's step 2")
        for svc, consumer in (("actor", "actor-0"), ("credit", None), ("feeder", None)):
            pid = service_pid(proc.pid, svc, consumer)
            assert pid is not None, svc
            os.kill(pid, signal.SIGTERM)
            stopped.append(consumer or svc)
        for svc in ("learner", "engine core", "redis-server", "inference"):
            start = trained_steps(run_dir)
            wait(
                lambda s=start: trained_steps(run_dir) >= s + 2,
                proc,
                log,
                240,
                f"progress before stopping {svc}",
            )
            if svc == "engine core":
                pid = engine_core_pid(proc.pid)
                assert pid is not None, "no engine core process under the inference service"
                os.kill(pid, signal.SIGKILL)  # inference goes down with its engine
                stopped.append("inference")
                continue
            pid = service_pid(proc.pid, svc)
            assert pid is not None, svc
            os.kill(pid, signal.SIGTERM)
            stopped.append("redis" if svc == "redis-server" else svc)
        finished(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
    s = recovered(run_dir, run_id, 60)
    # each stopped service was restarted (the learner once more if a publish to the
    # restarting inference server failed at a step it then could not leave unserved)
    assert all(s["restarts"].get(n, 0) >= stopped.count(n) for n in stopped), s["restarts"]
    assert s["samples_per_second"], "the summary's samples/s must cover the resumed learner"


def test_a_killed_ludic_up_leaves_no_service_running(tmp_path, tiny_model_dir):
    run_id = f"upkill-{os.getpid()}"
    cfg = config(tmp_path, tiny_model_dir, run_id, num_steps=100000, eval_n=0)
    learner_section(cfg, trained_log=True)
    log = tmp_path / "up.log"
    proc = ludic_up(cfg, log)
    run_dir = tmp_path / "runs" / run_id
    try:
        wait(lambda: trained_steps(run_dir) >= 1, proc, log, 420, "the learner's first step")
        assert (
            len(procs_of_run(run_id)) >= 5
        )  # redis, inference (+ engine), feeder, credit, actor, learner
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    left = wait_gone(run_id)
    what = {}
    for pid in left:
        try:
            what[pid] = (
                Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
            )
        except OSError:
            pass
    for pid in left:  # do not leak them into the rest of the suite
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert left == [], f"services outlived a SIGKILL of ludic up: {what}"


def test_a_killed_run_is_resumed_to_its_step_count(tmp_path, tiny_model_dir):
    """SIGKILL of `ludic up` after step 3 (checkpoint at step 2), then `ludic up --resume`:
    the learner starts from its checkpoint, Redis from its append-only file, and the run
    reaches its 8 steps with the accounting consistent and nothing trained twice."""
    run_id = f"resume-{os.getpid()}"
    cfg = config(tmp_path, tiny_model_dir, run_id, num_steps=8, eval_n=0)
    learner_section(cfg, checkpoint_every=2, trained_log=True)
    log = tmp_path / "up.log"
    proc = ludic_up(cfg, log)
    run_dir = tmp_path / "runs" / run_id
    try:
        wait(lambda: trained_steps(run_dir) >= 3, proc, log, 420, "the learner's step 3")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert wait_gone(run_id) == [], "services outlived a SIGKILL of ludic up"
    assert not (run_dir / "summary.json").exists()
    log2 = tmp_path / "resume.log"
    proc = ludic_up(None, log2, "--resume", run_id, "--runs-dir", str(tmp_path / "runs"))
    finished(proc, log2)
    assert f"resuming run {run_id}" in log2.read_text(errors="replace")
    recovered(run_dir, run_id, 8)
