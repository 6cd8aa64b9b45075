"""A learner of two torchrun "nodes" on this machine, as the Helm chart runs ``learner.nodes``
pods: one FSDP2 job (gloo) joined by c10d rendezvous on loopback, killed, then resumed.

Each node is its own ``torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d
--rdzv_endpoint 127.0.0.1:PORT`` with its own ``--output-dir``, as pods with their own
volumes: torchrun orders the nodes by ``--local_addr`` (the chart passes each pod's DNS
name), so node A (127.0.0.1) holds rank 0, and only rank 0 writes and reads checkpoints.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from learner_items import push_sync, random_items, redis_state_sync  # noqa: E402
from test_learner import (  # noqa: E402
    REPO,
    assert_trained_alike,
    env,
    final_model,
    learner_cmd,
    reference_training,
    trained_log,
)

from services.launcher import procs  # noqa: E402

try:  # tests/ is on sys.path under pytest's default import mode
    from conftest import free_port  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    from tests.conftest import free_port

pytestmark = pytest.mark.integration
RUN = "nodes"
BATCH, STEPS, EVERY = 4, 6, 3
LR = 1e-2


def start_node(
    addr: str, port: int, redis_url: str, model: Path, out: Path, log: Path, *extra: str
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", RUN,
        "--local_addr", addr, "-m", "services.cli",
        *learner_cmd(redis_url, RUN, model, "--output-dir", str(out)),
        "--batch-size", str(BATCH), "--num-steps", str(STEPS),
        "--checkpoint-every", str(EVERY), "--lr", str(LR), "--algorithm", '{"name": "grpo"}',
        *extra,
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, cwd=REPO, env=env(), stdout=open(log, "wb"), stderr=subprocess.STDOUT
    )


def kill9(node: subprocess.Popen[bytes]) -> None:
    """SIGKILL a node's torchrun agent and its rank (torchrun starts ranks in sessions of
    their own): a machine lost."""
    ranks = [p.pid for p in procs.children(node.pid)]
    for pid in [node.pid, *ranks]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    node.wait(30)
    deadline = time.monotonic() + 30
    while any(procs.rss_bytes(pid) is not None for pid in ranks):
        assert time.monotonic() < deadline, f"ranks {ranks} outlived SIGKILL"
        time.sleep(0.1)


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


def test_two_nodes_train_checkpoint_die_and_resume_as_one_job(
    redis_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """24 items, 6 steps of 4 (2 per rank), checkpoints every 3 steps. The two nodes train
    steps 1-4 (checkpoint at 3 on node A's volume; step 4's items pending) and are both
    killed with SIGKILL; started again with --resume, rank 0 reads step 3 and broadcasts it
    (node B's volume holds no checkpoint), the job retrains step 4 and trains 5-6. Every
    item is trained exactly once, in the stream's batches of 4, and the final weights equal
    one process training those batches. Rank 0 serves /metrics on its node; node B's rank
    serves /health on its own (its pod's probes) with no metrics of its own."""
    items = random_items(BATCH * STEPS, seed=5)
    push_sync(redis_server.url, RUN, items[: 4 * BATCH])
    out_a, out_b = tmp_path / "node-a", tmp_path / "node-b"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    port, metrics = free_port(), [free_port(), free_port()]
    nodes = [
        start_node(
            "127.0.0.1", port, redis_server.url, tiny_model_dir, out_a, logs[0],
            "--metrics-port", str(metrics[0]),
        ),
        start_node(
            "127.0.0.2", port, redis_server.url, tiny_model_dir, out_b, logs[1],
            "--metrics-port", str(metrics[1]),
        ),
    ]  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while redis_state_sync(redis_server.url, RUN)["learner_step"] < 4:
            for n, log in zip(nodes, logs):
                assert n.poll() is None, tail(log)
            assert time.monotonic() < deadline, "the job did not reach step 4\n" + tail(logs[0])
            time.sleep(0.2)
        st = redis_state_sync(redis_server.url, RUN)
        # steps 1-3 acked by the checkpoint at 3; step 4's items pending
        assert st["pending"] == BATCH and st["xlen"] == BATCH
        a, b = (f"http://127.0.0.1:{m}" for m in metrics)
        assert httpx.get(a + "/health", timeout=10).status_code == 200
        assert httpx.get(b + "/health", timeout=10).status_code == 200
        assert "ludic_learner_step 4.0" in httpx.get(a + "/metrics", timeout=10).text
        assert "ludic_learner" not in httpx.get(b + "/metrics", timeout=10).text
    finally:
        for n in nodes:
            kill9(n)
    assert [x["step"] for x in trained_log(out_a)] == [1, 2, 3, 4]
    assert (out_a / "step_000000003").is_dir()
    assert not list(out_b.glob("step_*"))  # rank 0 alone checkpoints

    push_sync(redis_server.url, RUN, items[4 * BATCH :])
    port = free_port()
    nodes = [
        start_node("127.0.0.1", port, redis_server.url, tiny_model_dir, out_a, logs[0], "--resume"),
        start_node("127.0.0.2", port, redis_server.url, tiny_model_dir, out_b, logs[1], "--resume"),
    ]
    try:
        for n, log in zip(nodes, logs):
            assert n.wait(240) == 0, tail(log)
    finally:
        for n in nodes:
            if n.poll() is None:
                kill9(n)
    assert "resumed from" in logs[0].read_text()  # rank 0's log: step 3 from node A's volume
    assert not list(out_b.glob("step_*"))

    log = trained_log(out_a)
    batches = [items[i : i + BATCH] for i in range(0, len(items), BATCH)]
    assert Counter(i for x in log for i in x["items"]) == Counter(it.item_id for it in items)
    assert [sorted(x["items"]) for x in log] == [sorted(it.item_id for it in b) for b in batches]
    st = redis_state_sync(redis_server.url, RUN)
    assert st["xlen"] == 0 and st["pending"] == 0 and st["learner_step"] == STEPS
    # 2 ranks resumed from a checkpoint == 1 process on the same 6 batches, up to float
    # rounding of the reduction order (the same check as the 2-rank test in test_learner)
    ref = reference_training(tiny_model_dir, batches, lr=LR)
    assert_trained_alike(final_model(out_a, STEPS), ref)
