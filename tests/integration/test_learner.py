"""``ludic learner`` end to end: real redis-server, real torchrun (gloo, 2 ranks), a real
``ludic inference`` (vLLM) for the publish path; the fault tests publish to the inference
app around a fake engine (tests/fakes.py: ``ServedApp``, ``TensorEngine``).

Run alone when vLLM is involved (one vLLM server at a time: two compete for a CPU host's
cores):
``pytest -m integration tests/integration/test_learner.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from inference_server import InferenceServer  # noqa: E402
from learner_items import make_item, push_sync, random_items, redis_state_sync  # noqa: E402

from libludic.distributed.publisher import (  # noqa: E402
    HttpPolicyPublisher,
    PublishError,
    ReplicaSet,
    RetryPolicy,
)
from tests.fakes import ServedApp, TensorEngine  # noqa: E402

try:  # tests/ is on sys.path under pytest's default import mode
    from conftest import free_port  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    from tests.conftest import free_port

pytestmark = pytest.mark.integration
NORM = "model.norm.weight"  # a tensor of the tiny model, for publishes of one tensor
REPO = Path(__file__).resolve().parents[2]
TOKEN = "learner-test-token"
PROMPT = b"hello world"


def learner_cmd(redis_url: str, run_id: str, model_dir: Path, *args: str) -> list[str]:
    return [
        "learner", "--redis-url", redis_url, "--run-id", run_id, "--model-dir", str(model_dir),
        "--device", "cpu", "--metrics-port", "0", "--block-ms", "200", "--trained-log", *args,
    ]  # fmt: skip


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    for k in [k for k in e if k.startswith("LUDIC_")]:
        del e[k]
    return e


def trained_log(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "trained_items.jsonl").read_text().splitlines()]


def final_model(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / f"step_{step:09d}" / "model.safetensors"))


def assert_trained_alike(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    """``got`` (data-parallel ranks) and ``ref`` (one process) trained on the same batches.

    Elementwise within rtol 1e-3 / atol 2e-4, except for at most 1 element in 10,000: the
    ranks sum their gradients in another order than one process does, and AdamW divides each
    update by the root of its second moment, so where a gradient is near 0 that rounding is
    scaled up (seen on a CPU with AMX, two nodes resumed from a checkpoint after 6 steps at lr
    1e-2: 5 of 329,216 elements past the tolerance, the largest by 3.8e-4). A difference in
    training moves most elements: one step lost, one trained twice, or two swapped put 90-96%
    of them past it. ``got`` may hold more tensors (a tied head saved under its own name)."""
    assert got.keys() >= ref.keys(), sorted(ref.keys() - got.keys())
    bad, total, worst = 0, 0, (0.0, "")
    for k in ref:
        assert torch.isfinite(got[k]).all(), f"{k}: non-finite weights"
        diff = (got[k].float() - ref[k].float()).abs()
        far = diff > 2e-4 + 1e-3 * ref[k].float().abs()
        bad, total = bad + int(far.sum()), total + diff.numel()
        if diff.numel() and float(diff.max()) > worst[0]:
            worst = (float(diff.max()), k)
    summary = f"{bad} of {total} elements differ; the largest by {worst[0]:.3g} ({worst[1]})"
    assert bad <= total // 10_000, summary


async def run_learner_inprocess(**kw: Any) -> Any:
    from services.learner import main as learner_main
    from services.learner.settings import LearnerSettings

    s = LearnerSettings(device="cpu", metrics_port=0, block_ms=200, trained_log=True, **kw)
    return await learner_main.run(s)


def wait_for_no_vllm(timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (
            subprocess.run(["pgrep", "-f", "services.inference"], capture_output=True).returncode
            != 0
        ):
            return
        time.sleep(5)
    pytest.skip("another vLLM kept running; one vLLM server at a time on a CPU host")


def greedy(url: str) -> tuple[list[int], int]:
    r = httpx.post(
        url + "/v1/completions",
        json={
            "prompt": PROMPT.decode(),
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,
            "ignore_eos": True,
        },
        timeout=120,
    )
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["token_ids"], int(body["policy_version"])


def reference_training(
    model_dir: Path, batches: list[list[Any]], lr: float
) -> dict[str, torch.Tensor]:
    """Single-process Trainer on the whole batches: what the 2-rank FSDP2 run must equal."""
    from transformers import AutoModelForCausalLM

    from libludic.saw import SAWBatch
    from libludic.training.config import TrainerConfig
    from libludic.training.presets import make_grpo
    from libludic.training.trainer import Trainer

    class Source:
        def __init__(self) -> None:
            self.i = 0

        async def next_batch(self) -> SAWBatch:
            self.i += 1
            return SAWBatch(items=batches[self.i - 1])

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tr = Trainer(
        model=model,
        algo=make_grpo(),
        batch_source=Source(),
        cfg=TrainerConfig(model_device="cpu", lr=lr, pad_token_id=256),
    )
    for _ in batches:
        asyncio.run(tr.train_step())
    return tr.full_state_dict()


# ---------------------------------------------------------------------------- (a)


def test_torchrun_two_ranks_trains_publishes_to_vllm_and_resumes_over_collective(
    redis_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """2 ranks (FSDP2, gloo) train 2 steps of 4 items from the saw stream and publish v1, v2
    over HTTP into a real vLLM: its version and greedy output change, Redis says v2, the
    stream is fully acked, and the weights equal a single-process Trainer on the same
    batches. Then a --resume run over the collective plane re-publishes the checkpoint (v3)
    before training step 3 (v4)."""
    wait_for_no_vllm()
    srv = InferenceServer(tiny_model_dir, free_port(), TOKEN, tmp_path / "inference.log")
    srv.start()
    try:
        before, v0 = greedy(srv.url)
        assert v0 == 0
        items = [
            make_item(f"g{i}:0", PROMPT, b"1234567"[i % 4 :], weight=1.0 + 0.25 * i)
            for i in range(12)
        ]
        push_sync(redis_server.url, "ra", items[:8])
        out = tmp_path / "out"
        base = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "-m",
            "services.cli",
        ]
        args = learner_cmd(
            redis_server.url,
            "ra",
            tiny_model_dir,
            "--inference-urls",
            srv.url,
            "--batch-size",
            "4",
            "--num-steps",
            "2",
            "--lr",
            "5e-2",
            "--algorithm",
            '{"name": "grpo"}',
            "--output-dir",
            str(out),
            "--checkpoint-every",
            "2",
            "--publish-total-timeout-s",
            "120",
        )
        e = env()
        e["LUDIC_AUTH_TOKEN"] = TOKEN
        p = subprocess.run(
            base + args, cwd=REPO, env=e, capture_output=True, text=True, timeout=240
        )
        assert p.returncode == 0, p.stderr[-4000:]
        after, v = greedy(srv.url)
        assert v == 2
        assert after != before, "greedy output did not change after two published updates"
        st = redis_state_sync(redis_server.url, "ra")
        assert st["policy_version"] == 2 and st["learner_step"] == 2
        assert st["xlen"] == 0 and st["pending"] == 0

        # FSDP2 data parallel == single process on the whole batch (float rounding aside)
        log = trained_log(out)
        assert [len(x["items"]) for x in log] == [4, 4]
        assert sorted(i for x in log for i in x["items"]) == sorted(it.item_id for it in items[:8])
        ref = reference_training(tiny_model_dir, [items[:4], items[4:8]], lr=5e-2)
        assert_trained_alike(final_model(out, 2), ref)

        # resume (2 ranks) over the collective plane: re-publish v3, train step 3, publish v4
        push_sync(redis_server.url, "ra", items[8:])
        args = learner_cmd(
            redis_server.url,
            "ra",
            tiny_model_dir,
            "--inference-urls",
            srv.url,
            "--batch-size",
            "4",
            "--num-steps",
            "3",
            "--lr",
            "5e-2",
            "--algorithm",
            '{"name": "grpo"}',
            "--output-dir",
            str(out),
            "--checkpoint-every",
            "2",
            "--resume",
            "--publish-plane",
            "collective",
            "--collective-master-address",
            "127.0.0.1",
            "--publish-total-timeout-s",
            "120",
        )
        p = subprocess.run(
            base + args, cwd=REPO, env=e, capture_output=True, text=True, timeout=240
        )
        assert p.returncode == 0, p.stderr[-4000:]
        assert greedy(srv.url)[1] == 4
        st = redis_state_sync(redis_server.url, "ra")
        assert st["policy_version"] == 4 and st["learner_step"] == 3 and st["xlen"] == 0
        assert [x["step"] for x in trained_log(out)] == [1, 2, 3]
    finally:
        rc = srv.stop()
    assert rc == 0, srv.tail()


# ---------------------------------------------------------------------------- (b)


def test_stale_items_are_dropped_counted_acked_never_trained(
    redis_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """max_lag=0: step 1 trains a0,b0 (v0) and publishes v1; at step 2 the v0 items s1, s2
    are 1 version behind -> dropped (counted, acked), f1, f2 (v1) form the batch."""
    from prometheus_client import REGISTRY

    order = [("a0", 0), ("b0", 0), ("s1", 0), ("f1", 1), ("s2", 0), ("f2", 1)]
    push_sync(
        redis_server.url,
        "rb",
        [make_item(f"{n}:0", b"abc", b"12", policy_version=v) for n, v in order],
    )
    before = REGISTRY.get_sample_value("ludic_learner_stale_dropped_total") or 0.0
    out = tmp_path / "out"
    with ServedApp(TensorEngine.of_model(tiny_model_dir), tiny_model_dir) as fake:
        learner = asyncio.run(
            run_learner_inprocess(
                redis_url=redis_server.url,
                run_id="rb",
                model_dir=str(tiny_model_dir),
                output_dir=str(out),
                inference_urls=[fake.url],
                batch_size=2,
                num_steps=2,
                max_lag=0,
                lr=1e-3,
                algorithm={"name": "sft"},
                # v1 served before batch 2 forms (in the background it may still be in flight)
                trainer={"async_publish": False},
            )
        )
        assert fake.engine.updates == [1, 2]
    assert learner.source.stale_dropped == 2
    assert REGISTRY.get_sample_value("ludic_learner_stale_dropped_total") - before == 2
    trained = [x["items"] for x in trained_log(out)]
    assert trained == [["a0:0", "b0:0"], ["f1:0", "f2:0"]]
    st = redis_state_sync(redis_server.url, "rb")
    assert st == {"xlen": 0, "pending": 0, "policy_version": 2, "learner_step": 2}


def test_items_the_model_cannot_train_are_dead_lettered_not_fatal(
    redis_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A token id outside the vocabulary, an action longer than max_seq_len and ragged
    reference logprobs: each would fail every step it is in (and every restart replaying
    it); the learner dead-letters them at read time and trains the items around them."""
    oov = make_item("oov:0", b"abc", b"12")
    oov.input_ids[1] = 10_000  # the tiny model has 259 ids
    long = make_item("long:0", b"a", b"1" * 40)  # 41 action tokens > max_seq_len 32
    ragged = make_item("ragged:0", b"abc", b"12")
    ragged.attachments.ref_logprobs = [0.0] * 3
    good = [make_item(f"g{i}:0", b"abc", b"12") for i in range(4)]
    push_sync(redis_server.url, "rp", [good[0], oov, good[1], long, good[2], ragged, good[3]])
    out = tmp_path / "out"
    learner = asyncio.run(
        run_learner_inprocess(
            redis_url=redis_server.url,
            run_id="rp",
            model_dir=str(tiny_model_dir),
            output_dir=str(out),
            batch_size=2,
            num_steps=2,
            lr=1e-3,
            algorithm={"name": "sft"},
            max_seq_len=32,
        )
    )
    assert learner.trainer.step == 2
    assert [x["items"] for x in trained_log(out)] == [["g0:0", "g1:0"], ["g2:0", "g3:0"]]

    async def dead() -> list[tuple[str, str]]:
        import redis.asyncio as aioredis

        r = aioredis.Redis.from_url(redis_server.url)
        try:
            return [
                (f[b"reason"].decode(), f[b"detail"].decode())
                for _, f in await r.xrange("ludic:{rp}:deadletter")
            ]
        finally:
            await r.aclose()

    got = asyncio.run(dead())
    assert [reason for reason, _ in got] == ["unusable_item"] * 3
    assert "vocabulary" in got[0][1] and "max_seq_len" in got[1][1] and "ref_logprobs" in got[2][1]
    assert redis_state_sync(redis_server.url, "rp")["pending"] == 0


# ---------------------------------------------------------------------------- (c)


def test_kill9_then_resume_trains_every_item_exactly_once(
    redis_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Reference: 12 items, 6 steps of 2, checkpoints every 3 steps, uninterrupted.
    Crash run: same items; the learner trains steps 1-4 (checkpoint at 3, step 4's items
    pending, not acked), waits for more items and is killed with SIGKILL. --resume loads
    step 3, re-reads its pending entries (step 4's), retrains them, then steps 5-6. Every
    item is in the history exactly once, in the same batches, and the final weights equal
    the reference's."""
    items = random_items(12, seed=3)
    common = [
        "--batch-size",
        "2",
        "--num-steps",
        "6",
        "--checkpoint-every",
        "3",
        "--lr",
        "1e-2",
        "--algorithm",
        '{"name": "grpo"}',
    ]
    cli = [sys.executable, "-m", "services.cli"]

    push_sync(redis_server.url, "ref", items)
    ref_out = tmp_path / "ref"
    p = subprocess.run(
        cli
        + learner_cmd(
            redis_server.url, "ref", tiny_model_dir, "--output-dir", str(ref_out), *common
        ),
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stderr[-3000:]

    push_sync(redis_server.url, "crash", items[:8])
    out = tmp_path / "crash"
    cmd = cli + learner_cmd(
        redis_server.url, "crash", tiny_model_dir, "--output-dir", str(out), *common
    )
    with open(tmp_path / "crash.log", "wb") as logf:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=logf, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while redis_state_sync(redis_server.url, "crash")["learner_step"] < 4:
                assert proc.poll() is None, (tmp_path / "crash.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "learner did not reach step 4"
                time.sleep(0.2)
            st = redis_state_sync(redis_server.url, "crash")
            # steps 1-3 committed by the checkpoint at 3 (acked, deleted); step 4 pending
            assert st["pending"] == 2 and st["xlen"] == 2
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert [x["step"] for x in trained_log(out)] == [1, 2, 3, 4]

    push_sync(redis_server.url, "crash", items[8:])
    p = subprocess.run(
        cmd + ["--resume"], cwd=REPO, env=env(), capture_output=True, text=True, timeout=180
    )
    assert p.returncode == 0, p.stderr[-3000:]

    log, ref_log = trained_log(out), trained_log(ref_out)
    counts = Counter(i for x in log for i in x["items"])
    assert counts == Counter(it.item_id for it in items)  # each exactly once
    assert [x["items"] for x in log] == [x["items"] for x in ref_log]
    st = redis_state_sync(redis_server.url, "crash")
    assert st["xlen"] == 0 and st["pending"] == 0 and st["learner_step"] == 6
    got, ref = final_model(out, 6), final_model(ref_out, 6)
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], msg=k)
    manifest = json.loads((out / "step_000000006" / "manifest.json").read_text())
    assert manifest["extra"]["batch_source"]["items_trained"] == 12


# ---------------------------------------------------------------------------- (d)


def test_unreachable_replica_fails_publish_within_timeout(tiny_model_dir: Path) -> None:
    """A closed port (connection refused) and a blackholed replica (accepts, never
    answers): publish raises PublishError naming the replica, inside the total timeout,
    while a healthy replica in the same publish still acks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    good_engine = TensorEngine.of_model(tiny_model_dir)
    hole_engine = TensorEngine.of_model(tiny_model_dir, hang=True)
    with (
        ServedApp(good_engine, tiny_model_dir) as good,
        ServedApp(hole_engine, tiny_model_dir) as hole,
    ):
        pub = HttpPolicyPublisher(
            ReplicaSet([good.url, closed, hole.url]),
            retry=RetryPolicy(
                max_attempts=2, attempt_timeout_s=1.0, total_timeout_s=4.0, backoff_s=0.1
            ),
        )
        sd = {NORM: torch.ones_like(good_engine.served[NORM])}
        t0 = time.monotonic()
        with pytest.raises(PublishError, match="2 replica") as ei:
            pub.publish(sd, 1)
        dt = time.monotonic() - t0
        assert dt < 4.0 + 1.5, dt
        assert set(ei.value.failures) == {closed, hole.url}
        assert "ConnectError" in ei.value.failures[closed]
        assert "Timeout" in ei.value.failures[hole.url]
        assert ei.value.acked == [good.url] and good_engine.updates == [1]
        assert pub.acked == {good.url: 1}


def test_publisher_reuses_one_connection_across_publishes(tiny_model_dir: Path) -> None:
    # each new HTTP client costs ~15 ms of CPU (its TLS context) on the training core: a
    # publisher keeps one, so successive versions travel over one kept-alive connection
    engine = TensorEngine.of_model(tiny_model_dir)
    with ServedApp(engine, tiny_model_dir) as rep:
        pub = HttpPolicyPublisher(ReplicaSet([rep.url]), wire_dtype="none")
        shape = engine.served[NORM].shape
        try:
            for v in (1, 2, 3):
                pub.publish({NORM: torch.full(shape, float(v))}, v)
        finally:
            pub.close()
        assert engine.updates == [1, 2, 3]
        assert torch.equal(engine.served[NORM], torch.full(shape, 3.0))
        assert len(rep.peers) == 1, rep.peers


def test_learner_keeps_training_on_failed_publish_then_exits_after_limit(
    redis_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Failure policy: a failed publish is counted, training continues, Redis keeps the old
    version; max_publish_failures consecutive failures end the run with LearnerFatal."""
    from prometheus_client import REGISTRY

    from services.learner.main import LearnerFatal

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    push_sync(redis_server.url, "rd", random_items(8))
    label = {"replica": closed}
    before = REGISTRY.get_sample_value("ludic_learner_publish_failures_total", label) or 0.0
    t0 = time.monotonic()
    with pytest.raises(LearnerFatal, match="2 consecutive publishes failed"):
        asyncio.run(
            run_learner_inprocess(
                redis_url=redis_server.url,
                run_id="rd",
                model_dir=str(tiny_model_dir),
                output_dir=str(tmp_path / "out"),
                checkpoint_every=10,
                inference_urls=[closed],
                batch_size=2,
                num_steps=4,
                max_publish_failures=2,
                publish_attempts=2,
                publish_timeout_s=1.0,
                publish_total_timeout_s=3.0,
                lr=1e-3,
                algorithm={"name": "sft"},
            )
        )
    assert time.monotonic() - t0 < 60
    assert REGISTRY.get_sample_value("ludic_learner_publish_failures_total", label) - before == 2
    st = redis_state_sync(redis_server.url, "rd")
    # publishes run in the background: step 1's failure is known when step 2's publish
    # starts, step 2's (the second in a row) when step 3's starts; trained on after failure 1
    assert st["policy_version"] == 0 and st["learner_step"] == 3
    # the fatal exit saved a checkpoint and acked what it committed (3 steps of 2 of 8 items)
    assert (tmp_path / "out" / "step_000000003").is_dir()
    assert st["xlen"] == 2 and st["pending"] == 0


def test_a_run_whose_trained_policy_was_never_served_fails(
    redis_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Fewer failed publishes than max_publish_failures still fail the run when inference
    never served a trained weight (not exit 0 with "2/2 steps"): the learner saves its final
    policy and checkpoint, then fails naming the last publish error."""
    from services.learner.main import LearnerFatal

    push_sync(redis_server.url, "ns", random_items(4))
    out = tmp_path / "out"
    engine = TensorEngine.of_model(tiny_model_dir, fail_first=100)  # every update: 503
    with ServedApp(engine, tiny_model_dir) as refusing:
        with pytest.raises(LearnerFatal, match=r"final policy \(step 2\) was never served.*503"):
            asyncio.run(
                run_learner_inprocess(
                    redis_url=redis_server.url,
                    run_id="ns",
                    model_dir=str(tiny_model_dir),
                    output_dir=str(out),
                    checkpoint_every=10,
                    inference_urls=[refusing.url],
                    batch_size=2,
                    num_steps=2,
                    max_publish_failures=5,
                    publish_attempts=1,
                    lr=1e-3,
                    algorithm={"name": "sft"},
                )
            )
        assert engine.updates == [] and engine.version == 0
    final = json.loads((out / "learner_final.json").read_text())
    assert final["reason"] == "final_policy_not_served" and final["step"] == 2
    assert final["final_policy_served"] is False and final["policy_version"] == 0
    assert final["publish_failures"] == 3  # steps 1 and 2, then the final publish
    assert (out / "final" / "config.json").exists() and (out / "step_000000002").is_dir()


def test_replica_restarted_on_old_weights_gets_republished_while_the_learner_waits(
    redis_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """An inference replica that restarts serves its base weights at version 0. Actors then
    wait on max_lag, no fresh item comes, and the learner (which publishes after steps) would
    wait forever. While it waits it checks the replicas every replica_check_s and
    republishes: v1 (step 1), v2 (the republish, no step), v3 (step 2)."""
    from prometheus_client import REGISTRY

    push_sync(redis_server.url, "rr", random_items(2))
    before = REGISTRY.get_sample_value("ludic_learner_republishes_total") or 0.0
    engine = TensorEngine.of_model(tiny_model_dir)
    with ServedApp(engine, tiny_model_dir) as fake:

        def restart_then_feed() -> None:
            deadline = time.monotonic() + 120
            while engine.updates != [1] and time.monotonic() < deadline:
                time.sleep(0.05)
            engine.version = 0  # the replica restarted on its base weights
            deadline = time.monotonic() + 30
            while len(engine.updates) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            # the actors resume once the replica is current; their items carry its version
            push_sync(
                redis_server.url,
                "rr",
                [
                    make_item(f"n{i}:0", b"abc", b"12", policy_version=engine.version)
                    for i in range(2)
                ],
            )

        th = threading.Thread(target=restart_then_feed, daemon=True)
        th.start()
        asyncio.run(
            run_learner_inprocess(
                redis_url=redis_server.url,
                run_id="rr",
                model_dir=str(tiny_model_dir),
                inference_urls=[fake.url],
                batch_size=2,
                num_steps=2,
                max_lag=1,
                replica_check_s=0.5,
                lr=1e-3,
                algorithm={"name": "sft"},
            )
        )
        th.join(5)
        assert engine.updates == [1, 2, 3], engine.updates
        assert engine.version == 3
    assert REGISTRY.get_sample_value("ludic_learner_republishes_total") - before == 1
    st = redis_state_sync(redis_server.url, "rr")
    assert st["policy_version"] == 3 and st["learner_step"] == 2


# ---------------------------------------------------------------------------- replicas, LoRA


def test_replica_set_expands_multi_address_hosts() -> None:
    table = {"inference-headless": ["10.0.0.7", "10.0.0.8"], "single": ["10.0.0.9"]}
    rs = ReplicaSet(
        ["http://inference-headless:8000/", "http://single:8000", "http://127.0.0.1:9000"],
        resolver=lambda host, port: table[host],
    )
    assert rs.resolve() == [
        "http://10.0.0.7:8000",
        "http://10.0.0.8:8000",
        "http://single:8000",
        "http://127.0.0.1:9000",
    ]
    table["inference-headless"] = ["10.0.0.8"]  # re-resolved on every call
    assert rs.resolve()[0] == "http://inference-headless:8000"
    with pytest.raises(ValueError, match="not an http"):
        ReplicaSet(["inference:8000"])


def test_lora_learner_publishes_merged_full_weights(
    redis_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    push_sync(redis_server.url, "rl", random_items(4))
    with ServedApp(TensorEngine.of_model(tiny_model_dir), tiny_model_dir) as fake:
        asyncio.run(
            run_learner_inprocess(
                redis_url=redis_server.url,
                run_id="rl",
                model_dir=str(tiny_model_dir),
                inference_urls=[fake.url],
                batch_size=2,
                num_steps=2,
                lr=1e-2,
                algorithm={"name": "sft"},
                lora_rank=4,
            )
        )
        sent = fake.engine.last
    # the app validated every name against the served checkpoint: no LoRA tensor got in
    assert fake.engine.updates == [1, 2]
    assert not [k for k in sent if "lora" in k or "base_layer" in k]
    assert set(base) <= set(sent)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert sent[q].shape == base[q].shape and not torch.equal(sent[q], base[q])  # merged delta
    mlp = "model.layers.0.mlp.up_proj.weight"  # not a LoRA target: unchanged
    torch.testing.assert_close(sent[mlp], base[mlp])
