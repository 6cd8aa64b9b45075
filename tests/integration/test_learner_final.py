"""The learner's ``<output_dir>/final/`` is exactly the policy it last published, as a model
directory transformers loads (real redis-server, the in-process learner, the inference app
around a fake engine that keeps the weights it received)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))

from learner_items import make_item, push_sync  # noqa: E402

from tests.fakes import ServedApp, TensorEngine  # noqa: E402

pytestmark = pytest.mark.integration


def test_final_dir_holds_the_last_published_weights(
    redis_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from services.learner import main as learner_main
    from services.learner.settings import LearnerSettings

    push_sync(
        redis_server.url,
        "fin",
        [make_item(f"i{k}:0", b"abc", b"12", policy_version=0) for k in range(4)],
    )
    out = tmp_path / "out"
    with ServedApp(TensorEngine.of_model(tiny_model_dir), tiny_model_dir) as fake:
        s = LearnerSettings(
            device="cpu",
            metrics_port=0,
            block_ms=200,
            redis_url=redis_server.url,
            run_id="fin",
            model_dir=str(tiny_model_dir),
            output_dir=str(out),
            inference_urls=[fake.url],
            batch_size=2,
            num_steps=2,
            max_lag=4,
            lr=1e-2,
            algorithm={"name": "sft", "group_size": 1},
        )
        asyncio.run(learner_main.run(s))
        assert fake.engine.updates == [1, 2]
        sent = {k: v.clone() for k, v in fake.engine.last.items()}
    final = out / "final"
    assert not (out / "final.tmp").exists()
    saved = load_file(str(final / "model.safetensors"))
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    # every saved tensor is the one published at step 2 (tied lm_head is stored once, as HF does)
    assert set(saved) <= set(sent) and saved
    for k, v in saved.items():
        assert torch.equal(v, sent[k].to(v.dtype)), k
    assert any(not torch.equal(saved[k], start[k]) for k in saved)  # trained, not the start
    m = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    assert (
        tok("12+34=")["input_ids"]
        and m.config.vocab_size
        == AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.vocab_size
    )
