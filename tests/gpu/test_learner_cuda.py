"""``ludic learner`` on CUDA (bf16 compute, torchrun) publishing into a real ``ludic inference``
on CUDA vLLM serving bf16, over HTTP and over the NCCL weight plane; afterwards the served
logprobs are those of the trained weights (as tests/integration/test_served_logprobs.py
checks on the CPU), to bf16's floor.

NCCL allows one rank per GPU in a communicator, so the NCCL plane needs the learner and vLLM
on different GPUs: it runs with 2 or more GPUs (learner ranks on the first, vLLM on the
last); the HTTP plane shares GPU 0 with vLLM (``--gpu-memory-utilization 0.3``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

import gpus  # noqa: E402
from inference_server import InferenceServer  # noqa: E402
from learner_items import make_item, push_sync, redis_state_sync  # noqa: E402
from test_learner import PROMPT, REPO, env, greedy, learner_cmd  # noqa: E402
from test_served_logprobs import TOL, max_diffs  # noqa: E402

from services.launcher.stack import free_port  # noqa: E402

pytestmark = pytest.mark.gpu
TOKEN = "gpu-test-token"


@pytest.mark.parametrize("plane", ["http", "nccl"])
def test_learner_on_cuda_publishes_bf16_training_into_cuda_vllm(
    plane: str,
    redis_server: Any,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """2 steps of 4 items (GRPO) trained on CUDA with bf16 autocast (FSDP2's bf16 policy with
    2 ranks), published as v1, v2: inference serves v2, its greedy output moved, Redis says
    v2 and the stream is acked, and the served prompt logprobs equal an fp32 forward of the
    learner's final weights rounded to bf16 (tolerance: test_served_logprobs.TOL)."""
    gpu_count = gpus.count()
    if plane == "nccl" and gpu_count < 2:
        pytest.skip("the NCCL weight plane needs 2 GPUs: one rank per GPU in a communicator")
    ranks = min(2, gpu_count - 1) if plane == "nccl" else min(2, gpu_count)
    serve_gpu = gpu_count - 1 if plane == "nccl" else 0
    extra = ["--dtype", "bfloat16"]
    if plane == "http":
        extra += ["--gpu-memory-utilization", "0.3"]
    srv = InferenceServer(tiny_model_dir, free_port(), TOKEN, tmp_path / "inference.log", extra)
    with monkeypatch.context() as m:
        m.setenv("CUDA_VISIBLE_DEVICES", str(serve_gpu))
        srv.start(timeout_s=600)
    try:
        before, v0 = greedy(srv.url)
        assert v0 == 0
        items = [
            make_item(f"g{i}:0", PROMPT, b"1234567"[i % 4 :], weight=1.0 + 0.25 * i)
            for i in range(8)
        ]
        push_sync(redis_server.url, plane, items)
        out = tmp_path / "out"
        publish = ["--inference-urls", srv.url]
        if plane == "nccl":
            publish += [
                "--publish-plane", "collective", "--collective-backend", "nccl",
                "--collective-master-address", "127.0.0.1",
            ]  # fmt: skip
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(ranks), "-m", "services.cli",
            *learner_cmd(redis_server.url, plane, tiny_model_dir, *publish),
            "--device", "cuda", "--mixed-precision", "bf16", "--batch-size", "4",
            "--num-steps", "2", "--lr", "5e-2", "--algorithm", '{"name": "grpo"}',
            "--output-dir", str(out), "--checkpoint-every", "2",
            "--publish-total-timeout-s", "300",
        ]  # fmt: skip
        e = env()
        e["LUDIC_AUTH_TOKEN"] = TOKEN
        e["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(ranks))
        p = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr[-4000:]
        after, v = greedy(srv.url)
        assert v == 2
        assert after != before, "greedy output did not change after two published updates"
        st = redis_state_sync(redis_server.url, plane)
        assert st["policy_version"] == 2 and st["learner_step"] == 2
        assert st["xlen"] == 0 and st["pending"] == 0
        trained = load_file(str(out / "final" / "model.safetensors"))
        rounded = {k: t.to(torch.bfloat16).float() for k, t in trained.items()}
        d = max_diffs(srv, tiny_model_dir, rounded)
        print(f"\n[{plane}] max |served - HF| after 2 CUDA steps = {d}")
        assert max(d.values()) < TOL["bfloat16"], d
    finally:
        rc = srv.stop()
    assert rc == 0, srv.tail()
