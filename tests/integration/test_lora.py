"""LoRA through FSDP2 into a real vLLM: served = trained.

``ludic learner --lora-rank 4`` runs as 2 torchrun ranks (FSDP2, gloo on CPU) on the tiny
model, trains 2 steps of 4 items and publishes over HTTP to a real ``ludic inference``
(vLLM CPU, fp32, compiled as shipped): merged full weights (``lora_publish: merged``), or
the adapter tensors alone (``lora_publish: adapter``; the server, started with
``max_lora_rank``, serves them with vLLM's LoRA support). vLLM's prompt logprobs of the
training sequences must then equal a transformers fp32 forward of the merged weights

    W' = W + (alpha / r) * B @ A       (every LoRA target: q, k, v, o projections)

computed here from the checkpoint's peft tensors (base weights + adapters), not by the
learner's merge code, so a merge the learner got wrong (or adapters never merged) fails.

Tolerance (max |served - HF| over every prompt position, nats): fp32 serving is at the
float32 floor, measured 4.8e-7 in test_served_logprobs.py; 1e-4 as there. Measured here
(``-s`` prints it): 5.1e-7 merged, 4.5e-7 adapter; the base model's logprobs sit 0.92-1.73
from the served ones (checked > 100 x TOL), so the test tells merged from unmerged weights:
with the service's ``lora_request`` left unset (the adapter loaded but not applied) it
failed at 1.73 nats. 80 s for both modes on 2 shared cores (two vLLM starts).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from inference_server import InferenceServer  # noqa: E402
from learner_items import push_sync, random_items, redis_state_sync  # noqa: E402
from test_learner import REPO, env, learner_cmd, trained_log, wait_for_no_vllm  # noqa: E402

from libludic.distributed.weight_sync import adapter_metadata, to_safetensors_bytes  # noqa: E402

try:  # tests/ is on sys.path under pytest's default import mode
    from conftest import free_port  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    from tests.conftest import free_port

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

TOKEN = "lora-test-token"
RANK, ALPHA = 4, 16.0  # TrainerConfig's default lora_alpha
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # TrainerConfig's default targets
BATCH, STEPS, LR = 4, 2, 5e-2
TOL = 1e-4  # derivation in the module docstring
PEFT_PREFIX = "base_model.model."


def merged_from_checkpoint(ck: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named weights from a peft checkpoint: ``base_layer`` weights plus
    ``(alpha / r) * lora_B @ lora_A`` for each adapted linear; adapters dropped, and the
    tied head (the checkpoint stores it twice, Hugging Face once) too."""
    out: dict[str, torch.Tensor] = {}
    for k, v in ck.items():
        if ".lora_" in k or k == PEFT_PREFIX + "lm_head.weight":
            continue
        name = k.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        if k.endswith(".base_layer.weight"):
            mod = k.removesuffix(".base_layer.weight")
            a, b = ck[f"{mod}.lora_A.default.weight"], ck[f"{mod}.lora_B.default.weight"]
            assert a.shape[0] == RANK and b.shape[1] == RANK, (a.shape, b.shape)
            v = v + (ALPHA / RANK) * (b @ a)
        out[name] = v
    return out


def hf_logprobs(model_dir: Path, weights: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """fp32 transformers ``log p(ids[t] | ids[:t])`` for t >= 1, ``[len(ids) - 1]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    with torch.no_grad():
        logits = model.eval()(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def served_logprobs(url: str, ids: list[int]) -> tuple[torch.Tensor, int]:
    """vLLM's prompt logprobs of ``ids`` (positions 1..) and the version that served them."""
    r = httpx.post(
        url + "/v1/completions",
        json={"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    got = [plp[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]
    return torch.tensor(got, dtype=torch.float64), int(body["policy_version"])


def metric(url: str, name: str, plane: str) -> float:
    """A sample of the server's /metrics, e.g. ``..._sum{plane="http"}`` (0 if absent)."""
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(f'{name}{{plane="{plane}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("lora_publish", ["merged", "adapter"])
def test_two_rank_lora_learner_publishes_to_vllm_served_equals_trained(
    redis_server: Any, tiny_model_dir: Path, tmp_path: Path, lora_publish: str
) -> None:
    """2 ranks train LoRA (rank 4) for 2 steps and publish v1, v2 into vLLM: ``merged``
    full weights to /v1/weights, or (``adapter``) the LoRA tensors alone to /v1/adapter of
    a server started with ``--max-lora-rank 4``, which vLLM serves as a LoRA adapter over
    the checkpoint's weights. Then: vLLM serves v2; its prompt logprobs of 4 training
    sequences equal an fp32 forward of base + (alpha/r) B A from the step-2 checkpoint
    (TOL); the base weights are far from them; the learner's final/ weights equal that
    merge; only the LoRA targets changed; an adapter publish carried exactly the adapter's
    bytes (the checkpoint's lora tensors as safetensors)."""
    wait_for_no_vllm()
    t0 = time.monotonic()
    run = f"lora-{lora_publish}"
    items = random_items(BATCH * STEPS, seed=3)
    push_sync(redis_server.url, run, items)
    adapter = lora_publish == "adapter"
    srv = InferenceServer(
        tiny_model_dir,
        free_port(),
        TOKEN,
        tmp_path / "inference.log",
        ["--max-lora-rank", str(RANK)] if adapter else [],
        compiled=True,
    )
    srv.start()
    out = tmp_path / "out"
    plane = "adapter" if adapter else "http"
    try:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(free_port()), "-m", "services.cli",
            *learner_cmd(
                redis_server.url, run, tiny_model_dir, "--inference-urls", srv.url,
                "--batch-size", str(BATCH), "--num-steps", str(STEPS), "--lr", str(LR),
                "--lora-rank", str(RANK), "--lora-publish", lora_publish,
                "--algorithm", '{"name": "sft"}', "--output-dir", str(out),
                "--checkpoint-every", str(STEPS), "--publish-total-timeout-s", "120",
            ),
        ]  # fmt: skip
        e = env()
        e["LUDIC_AUTH_TOKEN"] = TOKEN
        p = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-4000:]
        seqs = [it.input_ids for it in items[::STEPS]]
        served = [served_logprobs(srv.url, ids) for ids in seqs]
        received = metric(srv.url, "ludic_inference_weight_bytes_received_total", plane)
        update_s = metric(srv.url, "ludic_inference_weight_update_seconds_sum", plane)
    finally:
        rc = srv.stop()
    assert rc == 0, srv.tail()
    wall_s = time.monotonic() - t0

    st = redis_state_sync(redis_server.url, run)
    assert st == {"xlen": 0, "pending": 0, "policy_version": STEPS, "learner_step": STEPS}
    assert [len(x["items"]) for x in trained_log(out)] == [BATCH] * STEPS
    assert {v for _, v in served} == {STEPS}

    base = load_file(str(tiny_model_dir / "model.safetensors"))
    ck = load_file(str(out / f"step_{STEPS:09d}" / "model.safetensors"))
    lora_b = [k for k in ck if ".lora_B." in k]
    assert len(lora_b) == len(TARGETS) * 2  # 2 layers x 4 targets
    assert all(ck[k].abs().max() > 0 for k in lora_b)  # B starts at 0: trained
    merged = merged_from_checkpoint(ck)
    assert set(merged) == set(base)
    for k, w in base.items():  # the base under the adapters is frozen
        if k.endswith(tuple(f"{t}.weight" for t in TARGETS)):
            assert not torch.equal(merged[k], w), k
        else:
            torch.testing.assert_close(merged[k], w, rtol=0, atol=0, msg=k)
    # final/ holds the learner's own merge of its weights: the same weights
    final = load_file(str(out / "final" / "model.safetensors"))
    for k in merged:
        torch.testing.assert_close(final[k], merged[k], rtol=1e-5, atol=1e-6, msg=k)

    gaps, base_gaps = [], []
    for ids, (lp, _) in zip(seqs, served):
        gaps.append((lp - hf_logprobs(tiny_model_dir, merged, ids)).abs().max().item())
        base_gaps.append((lp - hf_logprobs(tiny_model_dir, base, ids)).abs().max().item())
    # what one publish must carry: the merged weights (tied head once), or the adapter's
    # lora tensors (peft names, the checkpoint's without ".default") and its config
    if adapter:
        body = {k.replace(".default.", "."): v for k, v in ck.items() if ".lora_" in k}
        cfg = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "bias": "none"}
        meta = adapter_metadata({**cfg, "target_modules": list(TARGETS)})
    else:
        body, meta = merged, None
    per_publish = len(to_safetensors_bytes(body, metadata=meta))
    print(
        f"\nLoRA rank {RANK}, 2 ranks, {STEPS} steps, lora_publish={lora_publish}: max "
        f"|served - HF(merged)| {max(gaps):.2e} nats; against the base weights "
        f"{min(base_gaps):.2e}..{max(base_gaps):.2e}; {received / STEPS:.0f} bytes and "
        f"{update_s / STEPS:.3f} s (receive to served) per publish; {wall_s:.0f} s in all"
    )
    assert max(gaps) < TOL, gaps
    assert min(base_gaps) > 100 * TOL, base_gaps  # unmerged adapters would fail the first check
    assert received == STEPS * per_publish, (received, per_publish)
