"""`ludic sft` on the tiny model: a few steps lower the loss; model saved; held-out split."""

from __future__ import annotations

import json
import re

from libludic.envs.arithmetic import generate_problem
from libludic.training.sft import EVAL_SEEDS, main, write_train_jsonl


def test_sft_cli_lowers_loss_and_saves(tiny_model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "sft"
    rc = main([
        "--model", str(tiny_model_dir), "--out", str(out), "--steps", "12", "--batch-size", "16",
        "--lr", "1e-2", "--digits", "2", "--seed", "1", "--log-every", "4", "--eval-n", "8",
    ])
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
