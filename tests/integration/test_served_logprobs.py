"""Served = trained: after a weight update, vLLM's logprobs equal a transformers forward.

A real ``ludic inference`` (vLLM CPU, compiled as shipped) serves the tiny model (in fp32,
and as a bf16 checkpoint in bf16); the test perturbs every matrix (``w + 0.3 * std(w) *
noise``), pushes the result over HTTP and over the gloo collective
plane, then compares, token by token, against ``Qwen2ForCausalLM`` in fp32 on the same
pushed weights:

- ``prompt_logprobs`` of a fixed 24-token prompt vs ``log_softmax(logits)``;
- the chosen-token ``logprobs`` of a sampled completion at T=1 and T=0.6 vs
  ``log_softmax(logits / T)`` (the served logprob is that of the distribution actually
  sampled: vLLM's ``processed_logprobs``, see services/inference/README.md).

Tolerances (max |served - HF| over all positions, nats), from the figures of
``pytest tests/integration/test_served_logprobs.py -s`` (it prints every figure):

- float32 serving: measured 4.8e-7 on every check, before and after updates on both planes
  (one float32 ulp of a logprob of magnitude ~4: 2^-23 * 4). Tolerance 1e-4: 200x that
  floor, 1000x below the defects this test exists for (a stale tied head after an update:
  0.11-0.17; untempered logprobs at T=0.6: off by 0.31-0.50).
- bfloat16 serving: weights/activations rounded to 8 mantissa bits; measured 2.3e-3..5.3e-3
  (T=0.6 amplifies by 1/T). Tolerance 2e-2: ~4x that floor, still 5x below the defects
  (0.11-0.50 in bf16).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from conftest import free_port
from inference_server import InferenceServer
from safetensors.torch import load_file

from libludic.distributed.weight_sync import CollectiveWeightSender, push_http
from libludic.training.loss import LossInputs

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

TOKEN = "served-token"
# 24 tokens: bytes of arithmetic text (token id == byte for the tiny byte tokenizer)
PROMPT_IDS: list[int] = list(b"12+34=46\n7*8=56\n90-12=78")
assert len(PROMPT_IDS) == 24
TOL = {"float32": 1e-4, "bfloat16": 2e-2}  # derivation in the module docstring
MAX_TOKENS = 24


def bf16_checkpoint(src: Path, out: Path) -> Path:
    """``src`` saved in bfloat16 (the weights vLLM serves with ``--dtype bfloat16`` either
    way: it rounds an fp32 checkpoint the same), with its tokenizer."""
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation")):
            shutil.copy(f, out / f.name)
    on_disk = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in on_disk.values()} == {torch.bfloat16}
    return out


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def served(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[InferenceServer, str]]:
    dtype = request.param
    tmp = tmp_path_factory.mktemp(f"served-{dtype}")
    model_dir = tiny_model_dir
    if dtype == "bfloat16":  # the usual GPU setting: a bf16 checkpoint, served in bf16
        model_dir = bf16_checkpoint(tiny_model_dir, tmp / "bf16")
    srv = InferenceServer(
        model_dir, free_port(), TOKEN, tmp / "server.log", ["--dtype", dtype], compiled=True
    )
    srv.start()
    yield srv, dtype
    srv.stop()


@pytest.fixture(scope="module")
def base_sd(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_model_dir / "model.safetensors"))


def perturbed(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``w + 0.3 * std(w) * noise`` on every matrix; vectors (norms, biases) unchanged."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in base.items():
        if v.ndim >= 2:
            v = v + 0.3 * v.float().std() * torch.randn(v.shape, generator=g)
        out[k] = v.contiguous()
    return out


def hf_logits(model_dir: Path, weights: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """fp32 transformers logits ``[len(ids), vocab]`` with ``weights`` loaded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing  # tied to the embedding
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def completion(srv: InferenceServer, body: dict[str, object]) -> dict[str, object]:
    r = httpx.post(
        srv.url + "/v1/completions",
        json={"prompt": PROMPT_IDS, "return_token_ids": True, **body},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    out: dict[str, object] = r.json()
    return out


def max_diffs(
    srv: InferenceServer, model_dir: Path, weights: dict[str, torch.Tensor]
) -> dict[str, float]:
    """max |served - HF| for prompt_logprobs and for sampled tokens at T=1 and T=0.6."""
    out: dict[str, float] = {}
    body = completion(srv, {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})
    plp = body["choices"][0]["prompt_logprobs"]  # type: ignore[index]
    assert plp[0] is None and len(plp) == len(PROMPT_IDS)
    served = torch.tensor(
        [plp[i][str(PROMPT_IDS[i])]["logprob"] for i in range(1, len(PROMPT_IDS))],
        dtype=torch.float64,
    )
    ref = torch.log_softmax(hf_logits(model_dir, weights, PROMPT_IDS), -1)
    ref_p = ref[torch.arange(len(PROMPT_IDS) - 1), torch.tensor(PROMPT_IDS[1:])]
    out["prompt"] = (served - ref_p.double()).abs().max().item()

    for temp in (1.0, 0.6):
        body = completion(
            srv,
            {
                "max_tokens": MAX_TOKENS,
                "temperature": temp,
                "seed": 1234,
                "logprobs": 0,
                "ignore_eos": True,
            },
        )
        ch = body["choices"][0]  # type: ignore[index]
        gen: list[int] = ch["token_ids"]
        lps = ch["logprobs"]["token_logprobs"]
        assert len(gen) == len(lps) == MAX_TOKENS
        logits = hf_logits(model_dir, weights, PROMPT_IDS + gen)
        ref_t = torch.log_softmax(logits / temp, -1)
        pos = torch.arange(len(PROMPT_IDS) - 1, len(PROMPT_IDS) - 1 + len(gen))
        ref_g = ref_t[pos, torch.tensor(gen)].double()
        out[f"T={temp}"] = (torch.tensor(lps, dtype=torch.float64) - ref_g).abs().max().item()
    return out


def version(srv: InferenceServer) -> int:
    return int(httpx.get(srv.url + "/v1/policy_version").json()["policy_version"])


def test_served_logprobs_equal_hf_before_update(
    served: tuple[InferenceServer, str], tiny_model_dir: Path, base_sd: dict[str, torch.Tensor]
) -> None:
    srv, dtype = served
    assert version(srv) == 0
    d = max_diffs(srv, tiny_model_dir, base_sd)
    print(f"\n[{dtype}] before any update: max |served - HF| = {d}")
    assert max(d.values()) < TOL[dtype], d


def test_served_logprobs_equal_hf_after_http_update(
    served: tuple[InferenceServer, str], tiny_model_dir: Path, base_sd: dict[str, torch.Tensor]
) -> None:
    srv, dtype = served
    weights = perturbed(base_sd, seed=1)
    v = version(srv) + 1
    assert push_http(srv.url, weights, v, TOKEN) == v
    d = max_diffs(srv, tiny_model_dir, weights)
    print(f"\n[{dtype}] after HTTP update v{v}: max |served - HF| = {d}")
    assert max(d.values()) < TOL[dtype], d


def test_served_logprobs_equal_hf_after_collective_update(
    served: tuple[InferenceServer, str], tiny_model_dir: Path, base_sd: dict[str, torch.Tensor]
) -> None:
    srv, dtype = served
    weights = perturbed(base_sd, seed=2)
    v = version(srv) + 1
    sender = CollectiveWeightSender(
        [srv.url], "127.0.0.1", free_port(), token=TOKEN, backend="gloo", timeout_s=120
    )
    try:
        sender.init()
        assert sender.send(weights, v) == v
    finally:
        sender.close()
    d = max_diffs(srv, tiny_model_dir, weights)
    print(f"\n[{dtype}] after collective update v{v}: max |served - HF| = {d}")
    assert max(d.values()) < TOL[dtype], d


class MaxLogRatio:
    """Wraps the algorithm's loss; records max |logp - actor_logprob| over action tokens of
    the logits the Trainer hands the loss (so after the Trainer's temperature step)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.requires = LossInputs(actor_logprobs=True)
        self.seen: list[float] = []

    def compute(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> object:
        from libludic.training import loss as L

        logp = L.token_logprobs(logits.detach().double(), batch["input_ids"])
        old = batch["actor_logprobs"][:, 1:].double()
        m = L.token_mask(batch, torch.float64) > 0
        self.seen.append(float((logp - old).abs()[m].max()))
        return self.inner.compute(logits, batch)  # type: ignore[attr-defined]


@pytest.mark.parametrize("temp", [1.0, 0.6])
async def test_onpolicy_importance_ratio_is_one_at_the_sampling_temperature(
    served: tuple[InferenceServer, str],
    tiny_model_dir: Path,
    base_sd: dict[str, torch.Tensor],
    temp: float,
) -> None:
    """The path the services take, end to end: after an update, libludic's client samples
    at temperature T, the step becomes a SAWItem (transport codec round trip included), and
    the Trainer, holding the same weights, computes GRPO's clipped surrogate. Every action
    token's log ratio ``logp - actor_logprob`` must be 0 to the serving dtype's floor (the
    same tolerance as above: both sides compute log_softmax(logits / T) of the same fp32
    weights). Untempered trainer logprobs would be off by ~0.3 nats at T=0.6."""
    from transformers import AutoModelForCausalLM

    from libludic.inference.openai_client import OpenAIChatClient
    from libludic.inference.request import ChatCompletionRequest
    from libludic.inference.sampling import SamplingConfig
    from libludic.models.tiny import PAD_ID
    from libludic.training.collate import rollouts_to_saw_items
    from libludic.training.config import TrainerConfig
    from libludic.training.presets import make_grpo
    from libludic.training.trainer import Trainer
    from libludic.transport import decode_saw_item, encode_saw_item
    from libludic.types import Rollout, Step

    srv, dtype = served
    weights = perturbed(base_sd, seed=3)
    v = version(srv) + 1
    assert push_http(srv.url, weights, v, TOKEN) == v

    client = OpenAIChatClient(srv.url)
    rollouts = []
    try:
        for k in range(4):
            req = ChatCompletionRequest(
                messages=[{"role": "user", "content": f"{k + 12}+{k * 7}="}],
                sampling=SamplingConfig(temperature=temp, max_tokens=MAX_TOKENS),
                seed=100 + k,
            )
            resp, _ = await client.complete(req)
            assert resp.policy_version == v and resp.temperature == temp
            step = Step(
                index=0,
                prev_obs="",
                action=resp.text,
                next_obs=None,
                reward=float(k),
                trace=resp.trace(),
                policy_version=v,
            )
            rollouts.append(Rollout(steps=[step], meta={"group_id": "g"}))
    finally:
        await client.aclose()
    items = rollouts_to_saw_items(
        rollouts, {(r.id, 0): 1.0 - 0.5 * i for i, r in enumerate(rollouts)}
    )
    items = [decode_saw_item(encode_saw_item(it)) for it in items]
    assert all(it.attachments.temperature == temp for it in items)

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    algo = make_grpo(group_size=4)
    rec = MaxLogRatio(algo.loss)
    algo.loss = rec  # type: ignore[assignment]
    cfg = TrainerConfig(model_device="cpu", mixed_precision_dtype=None, pad_token_id=PAD_ID)
    tr = Trainer(model=model, algo=algo, batch_source=None, cfg=cfg)  # type: ignore[arg-type]
    stats = tr.accumulate_gradients(items)
    worst = max(rec.seen)
    print(
        f"\n[{dtype}] T={temp}: max |trainer logp - served logp| = {worst:.3g}, "
        f"ratio_mean={stats['loss/ratio_mean']:.8f}"
    )
    assert worst < TOL[dtype], worst
    assert stats["loss/ratio_mean"] == pytest.approx(1.0, abs=TOL[dtype])


def test_an_fp32_learners_publish_is_cast_to_the_served_dtype(
    served: tuple[InferenceServer, str], tiny_model_dir: Path, base_sd: dict[str, torch.Tensor]
) -> None:
    """The day-one bf16 setting (the bfloat16 server: a bf16 checkpoint served with
    ``--dtype bfloat16``) and fp32: a learner training fp32 master weights publishes through
    HttpPolicyPublisher, which asks the replica which dtype it serves and casts to it (half
    the bytes in bf16); the update is swapped in and served: served logprobs equal an fp32
    forward of the weights rounded to the served dtype, to that dtype's floor. (A bf16
    server refused such updates with 422 "dtype float32 not accepted" before.)"""
    from libludic.distributed.publisher import HttpPolicyPublisher, ReplicaSet
    from libludic.distributed.weight_sync import to_safetensors_bytes

    srv, dtype = served
    want = getattr(torch, dtype)
    trained = perturbed(base_sd, seed=4)  # fp32 master weights
    v = version(srv) + 1
    pub = HttpPolicyPublisher(ReplicaSet([srv.url]), TOKEN)
    pub.publish(trained, v)
    assert pub.acked == {srv.url: v} and version(srv) == v
    assert pub._auto_dtype == want  # learnt from GET /v1/policy_version
    sent, full = len(to_safetensors_bytes(trained, want)), len(to_safetensors_bytes(trained))
    assert sent < 0.55 * full if dtype == "bfloat16" else sent == full
    rounded = {k: t.to(want).float() for k, t in trained.items()}
    d = max_diffs(srv, tiny_model_dir, rounded)
    print(f"\n[{dtype}] after the fp32 learner's publish v{v}: max |served - HF| = {d}")
    assert max(d.values()) < TOL[dtype], d
    # the publish changed the served policy (perturbed weights differ by far more)
    d0 = max_diffs(srv, tiny_model_dir, base_sd)
    assert max(d0.values()) > 5 * TOL[dtype], d0
