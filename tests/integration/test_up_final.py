"""`ludic up` keeps the policy it evaluated: ``<run>/final`` loads with transformers, is the
trained policy, and scores, greedily on the same held-out problems, the summary's
``pass_rate_after``."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from libludic.eval.evaluator import Evaluator
from libludic.inference.hf_client import HFChatClient
from libludic.registry import build_registries
from libludic.rollout.engine import RolloutEngine
from services.common.heldout import eval_requests
from services.launcher.settings import UpSettings
from tests.integration.test_up import config, finished, ludic_up

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.up]


def hf_eval(model_dir: Path, n: int) -> dict[str, float]:
    """The launcher's held-out evaluation (same requests: env seeds 0..n-1, greedy) run on
    transformers instead of the inference service."""
    s = UpSettings()
    client = HFChatClient(model_dir)
    engine = RolloutEngine(*build_registries(client))
    ev = Evaluator(
        engine=engine, requests=eval_requests(s.eval_env, n, s.eval_max_tokens), concurrency=64
    )
    return asyncio.run(ev.evaluate())


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp_path = tmp_path_factory.mktemp("up_final")
    run_id = f"final-{os.getpid()}"
    # a built `small` model after 300 SFT steps (lr 1e-3) answers roughly 5-15% of the held-out
    # problems (measured 0.13 here), so equal pass rates compare real answers
    cfg = config(
        tmp_path,
        tmp_path,
        run_id,
        num_steps=3,
        eval_n=200,
        eval_every_steps=0,
        init_size="small",
        sft_steps=300,
    )
    doc = yaml.safe_load(cfg.read_text())
    doc["up"]["model"] = ""  # build the model in the run dir (then SFT it)
    # fp32 serving (the default; bf16 answers differ: fp32 0.13 vs bf16 0.125 on one warm
    # start) compares the saved weights
    doc["inference"]["dtype"] = "float32"
    cfg.write_text(yaml.safe_dump(doc))
    finished(ludic_up(cfg, tmp_path / "up.log"), tmp_path / "up.log", timeout_s=900)
    run_dir = tmp_path / "runs" / run_id
    return {"dir": run_dir, "summary": json.loads((run_dir / "summary.json").read_text())}


def test_final_policy_is_saved_and_is_the_trained_one(run) -> None:
    run_dir = run["dir"]
    final = run_dir / "final"
    assert (final / "config.json").exists() and (final / "tokenizer.json").exists()
    assert not (run_dir / "learner" / "final").exists()  # moved, not copied
    # RL moved the weights: final/ is the trained policy, not the warm start it began from
    w0, w1 = (
        load_file(str(run_dir / "sft" / "model.safetensors")),
        load_file(str(final / "model.safetensors")),
    )
    assert w0.keys() == w1.keys() and any(not torch.equal(w0[k], w1[k]) for k in w0)
    got = hf_eval(final, run["summary"]["eval_n"])
    assert got["eval/num_episodes"] == 200 and got["eval/pass_rate"] > 0


# An in-place update refreshes vLLM's tied output head too: a served policy keeping the start's
# lm_head scores apart from final/ (e.g. 0.115 against 0.125). Served fp32 equals
# transformers fp32 to ~5e-7 nats, so greedy answers (and the pass rate) agree exactly.
def test_final_policy_scores_the_summarys_pass_rate_after(run) -> None:
    s = run["summary"]
    assert s["pass_rate_after"] > 0, (
        "the warm start answers nothing: the comparison would be vacuous"
    )
    got = hf_eval(run["dir"] / "final", s["eval_n"])
    assert got["eval/pass_rate"] == pytest.approx(s["pass_rate_after"]), (got, s["evals"][-1])
