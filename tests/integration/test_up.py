"""`ludic up` end to end on the tiny model: real redis-server, vLLM, actors, credit, learner.

One run completes (exit 0, summary.json, curves.png, nothing left running); another is
scraped by a real Prometheus server (Debian's `prometheus`) and then stopped with SIGTERM.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from services.launcher import procs

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.up]


def config(
    tmp_path: Path,
    model: Path,
    run_id: str,
    num_steps: int,
    kwargs: dict | None = None,
    **up: object,
) -> Path:
    cfg = {
        "run_id": run_id,
        "up": {
            "name": run_id,
            "runs_dir": str(tmp_path / "runs"),
            "model": str(model),
            "actors": 1,
            "eval_n": 16,
            "eval_every_steps": 2,
            "timeout_s": 400,
            "startup_timeout_s": 240,
            **up,
        },
        "inference": {"max_model_len": 256},
        "algorithm": {"name": "grpo", "group_size": 4, "kwargs": kwargs or {}},
        "feeder": {
            "high_water": 4,
            "tasks": [
                {
                    "env": {"kind": "arithmetic", "kwargs": {"split": "train"}},
                    "inference": {"sampling": {"temperature": 1.0, "max_tokens": 4}},
                }
            ],
        },
        "max_head_offpolicyness": 1,
        "actor": {"concurrency": 2, "max_steps": 1},
        "learner": {"batch_size": 8, "num_steps": num_steps, "max_lag": 2, "lr": 1e-4},
    }
    p = tmp_path / f"{run_id}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def procs_of_run(run_id: str) -> list[int]:
    """Pids whose environment carries this run's LUDIC_RUN_ID (every service we start)."""
    return [p.pid for p in procs.of_run(run_id)]


def ludic_up(cfg: Path | None, log: Path, *flags: str) -> subprocess.Popen[bytes]:
    """`ludic up --config cfg flags...` (no --config when cfg is None, e.g. --resume)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LUDIC_REDIS_URL", None)
    config = ["--config", str(cfg)] if cfg is not None else []
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", *config, *flags, "--no-live"],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )


def finished(
    proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 600, also: Path | None = None
) -> str:
    """Wait for `ludic up` to exit 0 (it is killed after ``timeout_s``) and return its log;
    any other ending fails with the log's tail (and ``also``'s, e.g. the learner's log)."""
    code = None
    try:
        code = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text(errors="replace")
    extra = also.read_text(errors="replace")[-3000:] if also is not None and also.exists() else ""
    assert code == 0, f"ludic up exited {code}:\n{text[-4000:]}\n{extra}"
    return text


SECRET_VARS = (b"LUDIC_AUTH_TOKEN", b"LUDIC_API_KEY", b"LUDIC_REDIS_URL")


def handed_secret(pid: int, path: bytes) -> bytes | None:
    """What the secret file a service's ``*_FILE`` variable names holds: its sealed memfd
    (``/dev/fd/<n>``, read as root through ``/proc/<pid>/fd/<n>``) or a file; None where it
    is not one (a process that inherited the variable but not the descriptor)."""
    p = path.decode()
    if p.startswith("/dev/fd/"):
        p = f"/proc/{pid}/fd/{p[len('/dev/fd/') :]}"
        try:
            if not os.readlink(p).startswith("/memfd:"):
                return None
        except OSError:
            return None
    try:
        return Path(p).read_bytes().strip()
    except OSError:
        return None


def run_secrets(run_id: str, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> set[bytes]:
    """The secrets ``ludic up`` generated for this run, read where its services read them,
    the files their ``*_FILE`` variables name (root may read them; the services are
    non-dumpable): the weight token, the generation token and the embedded Redis's passwords
    (one per role). No process of the run may hold one of them as a value in its
    environment."""
    deadline = time.monotonic() + timeout_s
    found: set[bytes] = set()
    while len(found) < 4:
        assert proc.poll() is None and time.monotonic() < deadline, f"secrets seen: {len(found)}"
        for p in procs.of_run(run_id):
            for kv in p.environ.split(b"\0"):
                key, _, value = kv.partition(b"=")
                assert not (key in SECRET_VARS and value), f"{p.name} ({p.pid}) holds {key!r}"
                if key not in tuple(v + b"_FILE" for v in SECRET_VARS) or not value:
                    continue
                data = handed_secret(p.pid, value)
                if data and key == b"LUDIC_REDIS_URL_FILE" and b"@" in data:
                    found.add(data.split(b"@")[0].rsplit(b":", 1)[1])  # redis://<user>:<pw>@
                elif data and key != b"LUDIC_REDIS_URL_FILE":
                    found.add(data)
        time.sleep(0.5)
    assert all(len(x) >= 32 for x in found), "generated secrets are 48 hex characters"
    return found


def leaked(root: Path, secret_values: set[bytes]) -> list[str]:
    """Every file under ``root`` (logs, summary, saved config, checkpoints, Redis's files...)
    that holds one of ``secret_values``."""
    out = []
    for f in root.rglob("*"):
        if f.is_file() and not f.is_symlink():
            data = f.read_bytes()
            out += [f"{f.relative_to(root)}" for v in secret_values if v in data]
    return out


def test_up_completes_writes_summary_and_leaves_nothing_running(tmp_path, tiny_model_dir):
    run_id = f"up-{os.getpid()}"
    cfg = config(tmp_path, tiny_model_dir, run_id, num_steps=3)
    proc = ludic_up(cfg, tmp_path / "up.log")
    generated = run_secrets(run_id, proc)
    finished(proc, tmp_path / "up.log")
    run_dir = tmp_path / "runs" / run_id
    # no secret in any artefact of the run: every log line, the summary, the saved config
    assert (run_dir / "logs" / "redis.log").exists() and (run_dir / "run.yaml").exists()
    assert leaked(tmp_path, generated) == []
    s = json.loads((run_dir / "summary.json").read_text())
    for k in (
        "pass_rate_before",
        "pass_rate_after",
        "steps",
        "samples_trained",
        "stale_dropped",
        "wall_seconds",
        "samples_per_second",
    ):
        assert k in s, k
    assert 0.0 <= s["pass_rate_before"] <= 1.0 and 0.0 <= s["pass_rate_after"] <= 1.0
    assert s["steps"] >= 3 and s["samples_trained"] >= 3 * 8
    # the learner published: the final eval ran on a newer policy than the first
    assert s["evals"][-1]["eval/policy_version"] > s["evals"][0]["eval/policy_version"]
    assert (run_dir / "curves.png").stat().st_size > 1000
    assert (run_dir / "logs" / "learner.log").exists() and (
        run_dir / "prometheus.yml"
    ).exists() is False
    time.sleep(1)
    assert procs_of_run(run_id) == [], "services left running after ludic up exited"


@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="Debian's prometheus is not installed (make system-deps installs it)",
)
def test_prometheus_scrapes_the_stack_and_sigterm_stops_everything(tmp_path, tiny_model_dir):
    run_id = f"prom-{os.getpid()}"
    cfg = config(
        tmp_path,
        tiny_model_dir,
        run_id,
        num_steps=100000,
        prometheus=True,
        prometheus_server=True,
        eval_n=0,
    )
    proc = ludic_up(cfg, tmp_path / "up.log")
    run_dir = tmp_path / "runs" / run_id
    try:
        generated = run_secrets(run_id, proc)
        deadline = time.monotonic() + 420
        while not (run_dir / "prometheus_url").exists():
            assert proc.poll() is None, (tmp_path / "up.log").read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "stack did not come up"
            time.sleep(1)
        prom = (run_dir / "prometheus_url").read_text().strip()
        scrape = yaml.safe_load((run_dir / "prometheus.yml").read_text())
        jobs = {j["job_name"] for j in scrape["scrape_configs"]}
        assert {"inference", "learner", "actor", "credit", "feeder"} <= jobs
        value = None
        while time.monotonic() < deadline:
            r = httpx.get(
                f"{prom}/api/v1/query", params={"query": "ludic_learner_step"}, timeout=5
            ).json()
            if r["status"] == "success" and r["data"]["result"]:
                value = float(r["data"]["result"][0]["value"][1])
                if value >= 1:
                    break
            time.sleep(2)
        assert value is not None and value >= 1, "Prometheus never scraped a learner step >= 1"
        # every service's target is scraped successfully (Prometheus says why if not)
        targets = []
        while time.monotonic() < deadline:
            targets = httpx.get(f"{prom}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
            if targets and all(t["health"] == "up" for t in targets):
                break
            time.sleep(2)
        bad = {
            t["labels"]["job"]: (t["health"], t["lastError"])
            for t in targets
            if t["health"] != "up"
        }
        assert not bad, bad
        assert {t["labels"]["job"] for t in targets} >= {
            "inference",
            "learner",
            "actor",
            "credit",
            "feeder",
        }
        # no secret in any metric name, label or value of any service
        for t in targets:
            page = httpx.get(t["scrapeUrl"], timeout=10).content
            assert b"ludic_" in page and not [v for v in generated if v in page], t["scrapeUrl"]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    assert code == 130
    time.sleep(1)
    assert procs_of_run(run_id) == [], "services left running after SIGTERM"


def test_a_run_whose_policy_never_reached_inference_fails(tmp_path, tiny_model_dir):
    """Every publish refused (inference takes no weight body over 1 byte: 413): the learner
    trains its steps, but the policy it trained was never served, so `ludic up` exits 1 and
    the summary says so (publish failures counted, final_policy_served false)."""
    run_id = f"unserved-{os.getpid()}"
    cfg_path = config(tmp_path, tiny_model_dir, run_id, num_steps=2, eval_every_steps=0)
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["inference"]["max_weight_bytes"] = 1
    # generation must not wait for a served version that never comes
    cfg["max_head_offpolicyness"] = None
    cfg["learner"].update(max_lag=None, max_publish_failures=100)
    cfg_path.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "up.log"
    proc = ludic_up(cfg_path, log)
    try:
        code = proc.wait(480)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text(errors="replace")
    assert code == 1, f"ludic up exited {code}:\n{text[-4000:]}"
    summary = tmp_path / "runs" / run_id / "summary.json"
    assert summary.exists(), f"no summary.json; ludic up's log:\n{text[-6000:]}"
    s = json.loads(summary.read_text())
    # the run failed because the learner found its policy never served, not for another reason
    assert (s["error"] or "").startswith("learner exited with code 1"), (
        f"{s['error']}\n{text[-6000:]}"
    )
    assert s["ok"] is False and s["final_policy_served"] is False, s
    assert s["steps"] == 2 and s["publish_failures"] >= 2, s
    learner_log = (tmp_path / "runs" / run_id / "logs" / "learner.log").read_text()
    assert "was never served" in learner_log and "413" in learner_log
    time.sleep(1)
    assert procs_of_run(run_id) == [], "services left running after ludic up exited"
