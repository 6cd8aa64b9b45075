"""`ludic sft` on the tiny model: a few steps lower the loss; model saved; held-out split;
any JSONL of prompt/completion pairs trains the same way."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import libludic.sft.run as sft
from libludic.eval.greedy import GreedyCheck
from libludic.sft.cli import main
from libludic.sft.run import run_sft
from libludic.sft.tasks import CHECK_SEEDS, MAX_HELD_OUT, make_task


def test_sft_cli_lowers_loss_and_saves(tiny_model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "sft"
    rc = main(
        [
            "--model",
            str(tiny_model_dir),
            "--out",
            str(out),
            "--task",
            "arithmetic",
            "--steps",
            "12",
            "--batch-size",
            "16",
            "--lr",
            "1e-2",
            "--task-arg",
            "digits=2",
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
    m = re.search(r"greedy pass rate on 8 held-out problems: ([0-9.]+)", text)
    assert m and 0.0 <= float(m.group(1)) <= 1.0
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / f).exists(), f


def test_training_data_excludes_eval_problems(tmp_path) -> None:
    task = make_task({"kind": "arithmetic", "kwargs": {"digits": 2}})
    exclude = {q for q, _ in task.held_out(MAX_HELD_OUT).problems}
    n = task.write(tmp_path / "d.jsonl", 3000)
    recs = [json.loads(line) for line in (tmp_path / "d.jsonl").open()]
    qs = [r["prompt"] for r in recs]
    # split="train" never yields a held-out problem, so the guard drops none
    assert len(qs) == n == 3000
    assert not exclude & set(qs)
    assert all(int(r["completion"]) == sum(map(int, r["prompt"][:-1].split("+"))) for r in recs)
    # the check looks at train-split problems only, never at the held-out ones
    assert not exclude & {q for q, _ in task.check.problems}
    assert len(task.check.problems) == len(CHECK_SEEDS)


def test_a_jsonl_of_pairs_trains_like_the_chat_records_it_stands_for(
    tiny_model_dir, tmp_path
) -> None:
    pairs = [{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in range(10, 42)]
    chats = [
        {
            "messages": [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["completion"]},
            ]
        }
        for r in pairs
    ]
    for name, recs in (("pairs", pairs), ("chats", chats)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    kw = dict(steps=3, batch_size=8, lr=1e-2, quiet=True)
    a = run_sft(tiny_model_dir, tmp_path / "a", tmp_path / "pairs.jsonl", **kw)
    b = run_sft(tiny_model_dir, tmp_path / "b", tmp_path / "chats.jsonl", **kw)
    assert a["num_samples"] == 32 and a["losses"] == b["losses"]
    assert a["pass_rate"] != a["pass_rate"]  # NaN: no held-out check given


def test_the_cli_takes_a_file_and_refuses_a_target_without_a_task(
    tiny_model_dir, tmp_path, capsys
) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{a}?", "completion": "x"}) + "\n" for a in range(8))
    )
    base = [
        "--model",
        str(tiny_model_dir),
        "--out",
        str(tmp_path / "o"),
        "--steps",
        "2",
        "--batch-size",
        "4",
    ]
    assert main([*base, "--data", str(data)]) == 0
    assert (tmp_path / "o" / "model.safetensors").exists()
    with pytest.raises(SystemExit):
        main([*base, "--data", str(data), "--target-pass-rate", "0.5"])
    assert "--target-pass-rate needs --task" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base)  # neither --data nor --task


def _weights(d) -> dict:
    return load_file(str(d / "model.safetensors"))


def test_seed_changes_the_result_and_the_same_seed_reproduces_it(tiny_model_dir, tmp_path) -> None:
    data = tmp_path / "d.jsonl"
    make_task("arithmetic").write(data, 32)
    kw = dict(steps=4, batch_size=8, lr=1e-2, quiet=True)
    a = run_sft(tiny_model_dir, tmp_path / "a", data, seed=0, **kw)
    b = run_sft(tiny_model_dir, tmp_path / "b", data, seed=0, **kw)
    c = run_sft(tiny_model_dir, tmp_path / "c", data, seed=1, **kw)
    assert a["losses"] == b["losses"]
    wa, wb, wc = _weights(tmp_path / "a"), _weights(tmp_path / "b"), _weights(tmp_path / "c")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # seed 1 shuffles the 32 samples into other batches: other losses, other weights
    assert a["losses"] != c["losses"]
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


def sft_to_target(
    model_dir: Path, tmp_path: Path, check: GreedyCheck, target: float
) -> dict[str, Any]:
    """50 SFT steps of batch 4 on arithmetic data, checked every 4 steps against ``target``."""
    data = tmp_path / "d.jsonl"
    make_task("arithmetic").write(data, 64)
    return sft.run_sft(
        model_dir,
        tmp_path / "o",
        data,
        steps=50,
        batch_size=4,
        quiet=True,
        check=check,
        target_pass_rate=target,
        check_every=4,
    )


def test_target_pass_rate_stops_at_the_first_check_that_reaches_it(
    tiny_model_dir, tmp_path, monkeypatch
) -> None:
    seen = []
    rates = iter([0.1, 0.52, 0.55, 0.58, 0.61, 0.9])
    check = GreedyCheck([("1+1=", "2")], lambda answer, ref: float(answer == ref), 3)

    def fake(model, tok, chk, batch_size=100):
        seen.append(chk)
        return next(rates)

    monkeypatch.setattr(sft, "greedy_pass_rate", fake)
    res = sft_to_target(tiny_model_dir, tmp_path, check, 0.6)
    # checks every 4 steps (4: 0.1, 8: 0.52); 0.52 is within FINE_MARGIN 0.1 of 0.6, so then
    # every step (9: 0.55, 10: 0.58, 11: 0.61 >= 0.6): 11 steps ran
    assert [c["step"] for c in res["checks"]] == [4, 8, 9, 10, 11]
    assert res["steps_run"] == 11 and len(res["losses"]) == 11
    assert all(c is check for c in seen)  # only the check given, never a held-out set
    assert (tmp_path / "o" / "model.safetensors").exists()


def test_a_low_target_is_not_near_from_a_pass_rate_of_zero(tiny_model_dir, tmp_path, monkeypatch):
    """A target below FINE_MARGIN (0.1, a tool-call warm start stopped early) is near only
    within half of it: from 0.0 the checks stay every check_every steps (they were every
    step, each a greedy generation of the whole check set)."""
    rates = iter([0.0, 0.0, 0.06, 0.11])
    monkeypatch.setattr(sft, "greedy_pass_rate", lambda *a, **k: next(rates))
    res = sft_to_target(tiny_model_dir, tmp_path, make_task("arithmetic").check, 0.1)
    # 4: 0.0, 8: 0.0 (not near: 0.0 < 0.1 - 0.05), 12: 0.06 (near), 13: 0.11 >= 0.1
    assert [c["step"] for c in res["checks"]] == [4, 8, 12, 13]


def test_target_pass_rate_not_reached_is_an_error(tiny_model_dir, tmp_path) -> None:
    # the untrained tiny model answers no problem in 2 steps: 0.0 < 1.0
    task = make_task("arithmetic")
    data = tmp_path / "d.jsonl"
    task.write(data, 8)
    with pytest.raises(ValueError, match="target_pass_rate=1.0 within steps=2"):
        run_sft(
            tiny_model_dir,
            tmp_path / "o",
            data,
            steps=2,
            batch_size=4,
            quiet=True,
            check=task.check,
            target_pass_rate=1.0,
            check_every=1,
        )
    with pytest.raises(ValueError, match="target_pass_rate needs a check"):
        run_sft(tiny_model_dir, tmp_path / "o", data, steps=2, target_pass_rate=0.5)
