"""`ludic sft` on the tiny model: a few steps lower the loss; model saved; held-out split."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

import libludic.training.sft as sft
from libludic.envs.arithmetic import generate_problem
from libludic.training.sft import EVAL_SEEDS, run_sft, write_train_jsonl
from libludic.training.sft_cli import main


def test_sft_cli_lowers_loss_and_saves(tiny_model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "sft"
    rc = main(
        [
            "--model",
            str(tiny_model_dir),
            "--out",
            str(out),
            "--steps",
            "12",
            "--batch-size",
            "16",
            "--lr",
            "1e-2",
            "--digits",
            "2",
            "--seed",
            "1",
            "--log-every",
            "4",
            "--eval-n",
            "8",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    losses = [float(x) for x in re.findall(r"step \d+/12 loss ([0-9.]+)", text)]
    assert len(losses) == 3
    # starts near log(259) = 5.56 (uniform); the digit/EOS distribution is learnt in a few steps
    assert losses[-1] < losses[0] - 1.0
    m = re.search(r"greedy pass rate on 8 held-out problems \(seeds 0\.\.7\): ([0-9.]+)", text)
    assert m and 0.0 <= float(m.group(1)) <= 1.0
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / f).exists(), f


def test_training_data_excludes_eval_problems(tmp_path) -> None:
    exclude = {generate_problem(s, 2).question for s in EVAL_SEEDS}
    n = write_train_jsonl(tmp_path / "d.jsonl", 3000, 2, exclude)
    qs = [json.loads(line)["messages"][0]["content"] for line in (tmp_path / "d.jsonl").open()]
    assert len(qs) == n and 0 < n < 3000  # 3000 draws from 8100 problems hit some of the 200
    assert not exclude & set(qs)
    rec = json.loads((tmp_path / "d.jsonl").open().readline())
    assert rec["messages"][1]["role"] == "assistant"


def _weights(d) -> dict:
    return load_file(str(d / "model.safetensors"))


def test_seed_changes_the_result_and_the_same_seed_reproduces_it(tiny_model_dir, tmp_path) -> None:
    kw = dict(steps=4, batch_size=8, lr=1e-2, eval_n=0, quiet=True)
    a = run_sft(tiny_model_dir, tmp_path / "a", seed=0, **kw)
    b = run_sft(tiny_model_dir, tmp_path / "b", seed=0, **kw)
    c = run_sft(tiny_model_dir, tmp_path / "c", seed=1, **kw)
    assert a["losses"] == b["losses"]
    wa, wb, wc = _weights(tmp_path / "a"), _weights(tmp_path / "b"), _weights(tmp_path / "c")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # seed 1 shuffles the 32 samples into other batches: other losses, other weights
    assert a["losses"] != c["losses"]
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


def test_target_pass_rate_stops_at_the_first_check_that_reaches_it(
    tiny_model_dir, tmp_path, monkeypatch
) -> None:
    seen = []
    rates = iter([0.1, 0.52, 0.55, 0.58, 0.61, 0.9])

    def fake(model, tok, seeds, digits, batch_size=100, split="eval"):
        seen.append((list(seeds), split))
        return next(rates)

    monkeypatch.setattr(sft, "greedy_pass_rate", fake)
    res = sft.run_sft(
        tiny_model_dir,
        tmp_path / "o",
        steps=50,
        batch_size=4,
        eval_n=0,
        quiet=True,
        target_pass_rate=0.6,
        check_every=4,
    )
    # checks every 4 steps (4: 0.1, 8: 0.52); 0.52 is within FINE_MARGIN 0.1 of 0.6, so then
    # every step (9: 0.55, 10: 0.58, 11: 0.61 >= 0.6): 11 steps ran
    assert [c["step"] for c in res["checks"]] == [4, 8, 9, 10, 11]
    assert res["steps_run"] == 11 and len(res["losses"]) == 11
    # the checks look at train-split problems only, never at the held-out seeds
    assert all(split == "train" and seeds == list(sft.CHECK_SEEDS) for seeds, split in seen)
    assert (tmp_path / "o" / "model.safetensors").exists()


def test_target_pass_rate_not_reached_is_an_error(tiny_model_dir, tmp_path) -> None:
    # the untrained tiny model answers no problem in 2 steps: 0.0 < 1.0
    with pytest.raises(ValueError, match="target_pass_rate=1.0 within steps=2"):
        run_sft(
            tiny_model_dir,
            tmp_path / "o",
            steps=2,
            batch_size=4,
            eval_n=0,
            quiet=True,
            target_pass_rate=1.0,
            check_every=1,
        )
