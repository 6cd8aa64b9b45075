"""`ludic up` survives its workers crashing, and dies without leaving anything behind.

One run (checkpoints every 2 steps, the learner as two torchrun ranks) has, once training
is under way, a SIGKILL of an actor, of credit, of the feeder, then of one learner rank, of
redis-server and of the inference server, then a SIGTERM of one learner rank: each is
restarted (torchrun stops the surviving rank and exits, the learner resumes from its
newest checkpoint, redis reloads its append-only file, inference is republished the
learner's weights) and the run reaches its step count with the accounting consistent, no group lost and no item trained twice. A
second run does the same with SIGTERM, one learner process, and vLLM's engine core.
Another ``ludic up`` is itself killed with SIGKILL: every service it started stops
(PR_SET_PDEATHSIG). Two more are stopped by SIGKILL and by SIGTERM of ``ludic up``, then
continued with ``ludic up --resume``. Each completed run is checked twice: by the
accounting in Redis and by the learner's own log of the items its weights were trained on
(every item counted trained is there, once). The session ends by printing the fault
matrix (tests/conftest.py): fault, recovery seconds, groups lost, items trained twice.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter
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
    running; and, independently, the learner's log of the steps its weights hold lists
    every item the accounting counts trained, once. Returns the summary."""
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == steps
    a = s["accounting"]
    assert a["consistent"], a
    assert a["items_trained_twice"] == 0 and a["groups_deadlettered"] == 0, a
    log = (run_dir / "learner" / "trained_items.jsonl").read_text().splitlines()
    entries = [json.loads(x) for x in log]
    assert [e["step"] for e in entries] == list(range(1, steps + 1))
    ids = [i for e in entries for i in e["items"]]
    assert len(ids) == len(set(ids)) == a["items_trained"], (len(ids), len(set(ids)), a)
    learner_log = (run_dir / "logs" / "learner.log").read_text(errors="replace")
    assert "resumed from" in learner_log
    time.sleep(1)
    assert procs_of_run(run_id) == [], "services left running after ludic up exited"
    return s


def table_rows(run: str, s: dict, faults: list[tuple[str, str]]) -> list[tuple[str, ...]]:
    """One row per fault (description, service restarted for it, in the order they were
    made): the service's n-th recovery time from the summary for its n-th fault."""
    a = s["accounting"]
    lost = str(a["groups_deadlettered"] + (0 if a["consistent"] else 1))
    seen: dict[str, int] = {}
    rows = []
    for fault, svc in faults:
        n = seen.get(svc, 0)
        seen[svc] = n + 1
        times = s["recovery_seconds"].get(svc, [])
        assert len(times) > n, f"no recovery recorded for {fault}: {s['recovery_seconds']}"
        rows.append((run, fault, f"{times[n]:.1f}", lost, str(a["items_trained_twice"])))
    return rows


def test_crashed_workers_and_learner_are_restarted_and_the_run_completes(
    tmp_path, tiny_model_dir, fault_table
):
    run_id = f"faults-{os.getpid()}"
    cfg = config(
        tmp_path, tiny_model_dir, run_id, num_steps=20, eval_n=0, actors=2, learner_nproc=2
    )
    learner_section(cfg, checkpoint_every=2, trained_log=True)
    log = tmp_path / "up.log"
    proc = ludic_up(cfg, log)
    run_dir = tmp_path / "runs" / run_id
    faults: list[tuple[str, str]] = []  # (what was done, the service restarted for it)
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
            faults.append((f"SIGKILL {name}", name))
        # then one at a time, each once the run has made progress since the last: one rank of
        # the learner (between two checkpoints or just after one), Redis, the inference API
        # server, and a SIGTERM of one learner rank (every rank stops: the stop is agreed
        # between ranks; the launcher restarts the job, which had not reached its step count)
        for svc, sig in (
            ("learner", signal.SIGKILL),
            ("redis-server", signal.SIGKILL),
            ("inference", signal.SIGKILL),
            ("learner", signal.SIGTERM),
        ):
            start = trained_steps(run_dir)
            wait(
                lambda s=start: trained_steps(run_dir) >= s + 2,
                proc,
                log,
                240,
                f"progress before stopping {svc}",
            )
            pid = service_pid(proc.pid, svc)
            assert pid is not None, svc
            what = f"{sig.name} {svc}"
            if svc == "learner":  # torchrun: stop one of its ranks, not the agent
                ranks = child_pids(pid, b"learner")
                assert len(ranks) == 2, f"torchrun {pid} runs ranks {ranks}, not 2"
                pid = ranks[-1]
                what = f"{sig.name} learner rank 1 of 2 (torchrun)"
            os.kill(pid, sig)
            faults.append((what, "redis" if svc == "redis-server" else svc))
        finished(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
    s = recovered(run_dir, run_id, 20)
    want = Counter(name for _, name in faults)
    # each was restarted (the learner once more if a publish to the restarting inference
    # server failed at a step it then could not leave unserved)
    assert all(s["restarts"].get(n, 0) >= c for n, c in want.items()), (want, s["restarts"])
    fault_table += table_rows("2-rank", s, faults)


def engine_core_pid(up_pid: int) -> int | None:
    """The pid of vLLM's engine core process under the inference service of ``up_pid``."""
    api = service_pid(up_pid, "inference")
    if api is None:
        return None
    return next((p.pid for p in procs.children(api) if b"EngineCore" in b" ".join(p.argv)), None)


def test_services_stopped_by_sigterm_and_a_killed_engine_core_are_restarted(
    tmp_path, tiny_model_dir, fault_table
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
    faults: list[tuple[str, str]] = []
    try:
        wait(lambda: trained_steps(run_dir) >= 2, proc, log, 420, "the learner's step 2")
        for svc, consumer in (("actor", "actor-0"), ("credit", None), ("feeder", None)):
            pid = service_pid(proc.pid, svc, consumer)
            assert pid is not None, svc
            os.kill(pid, signal.SIGTERM)
            stopped.append(consumer or svc)
            faults.append((f"SIGTERM {consumer or svc}", consumer or svc))
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
                faults.append(("SIGKILL vLLM engine core", "inference"))
                continue
            pid = service_pid(proc.pid, svc)
            assert pid is not None, svc
            os.kill(pid, signal.SIGTERM)
            name = "redis" if svc == "redis-server" else svc
            stopped.append(name)
            faults.append(
                (
                    f"SIGTERM {svc} (single-process learner)"
                    if svc == "learner"
                    else f"SIGTERM {svc}",
                    name,
                )
            )
        finished(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
    s = recovered(run_dir, run_id, 60)
    # each stopped service was restarted (the learner once more if a publish to the
    # restarting inference server failed at a step it then could not leave unserved)
    assert all(s["restarts"].get(n, 0) >= stopped.count(n) for n in stopped), s["restarts"]
    assert s["samples_per_second"], "the summary's samples/s must cover the resumed learner"
    fault_table += table_rows("sigterm", s, faults)


def test_a_killed_ludic_up_leaves_no_service_running(tmp_path, tiny_model_dir, fault_table):
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
    fault_table.append(("upkill", "SIGKILL ludic up: every service gone", "-", "-", "-"))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_stopped_run_is_resumed_to_its_step_count(tmp_path, tiny_model_dir, fault_table, sig):
    """SIGKILL (no clean-up: its services die with it) or SIGTERM (it stops them and exits
    130) of `ludic up` after step 3 (checkpoint at step 2), then `ludic up --resume`: the
    learner starts from its checkpoint, Redis from its append-only file, and the run reaches
    its 8 steps with the accounting consistent and nothing trained twice."""
    run_id = f"resume-{sig.name.lower()}-{os.getpid()}"
    cfg = config(tmp_path, tiny_model_dir, run_id, num_steps=8, eval_n=0)
    learner_section(cfg, checkpoint_every=2, trained_log=True)
    log = tmp_path / "up.log"
    proc = ludic_up(cfg, log)
    run_dir = tmp_path / "runs" / run_id
    try:
        wait(lambda: trained_steps(run_dir) >= 3, proc, log, 420, "the learner's step 3")
    finally:
        proc.send_signal(sig)
        code = proc.wait(120)
    assert code == (130 if sig == signal.SIGTERM else -signal.SIGKILL)
    assert wait_gone(run_id) == [], f"services outlived a {sig.name} of ludic up"
    assert not (run_dir / "summary.json").exists()
    reached = trained_steps(run_dir)
    log2 = tmp_path / "resume.log"
    t0 = time.monotonic()
    proc = ludic_up(None, log2, "--resume", run_id, "--runs-dir", str(tmp_path / "runs"))
    wait(lambda: trained_steps(run_dir) > reached, proc, log2, 420, "a step past the stop")
    recovery = time.monotonic() - t0
    finished(proc, log2)
    assert f"resuming run {run_id}" in log2.read_text(errors="replace")
    s = recovered(run_dir, run_id, 8)
    a = s["accounting"]
    fault_table.append(
        (
            "resume",
            f"{sig.name} ludic up, then --resume (stopped at step {reached})",
            f"{recovery:.1f}",
            str(a["groups_deadlettered"]),
            str(a["items_trained_twice"]),
        )
    )
