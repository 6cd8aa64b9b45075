"""SFT tasks from any env that states its reference completion (libludic/sft/tasks.py):
the arithmetic demo's task with its options, a dataset's rows, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from libludic.envs.dataset_qa_env import DatasetQAEnv, gsm8k_extract_answer, numeric_verifier
from libludic.envs.reference import ReferenceEnv
from libludic.sft.cli import main
from libludic.sft.tasks import (
    ANSWER_SLACK_TOKENS,
    TRAIN_SEED_BASE,
    make_task,
    task_spec,
)
from services.common.settings import load_settings
from services.launcher.settings import UpSettings


def records(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_arithmetic_task_takes_its_envs_options(tmp_path) -> None:
    task = make_task({"kind": "arithmetic", "kwargs": {"digits": 1, "ops": ["*"]}})
    assert task.write(tmp_path / "d.jsonl", 50) == 50
    for r in records(tmp_path / "d.jsonl"):
        a, b = r["prompt"][:-1].split("*")  # "a*b=" with one-digit operands
        assert len(a) == len(b) == 1 and int(r["completion"]) == int(a) * int(b)
    assert task.check.max_new_tokens == 2 * 1 + 3
    with pytest.raises(ValueError, match="sets split itself"):
        make_task({"kind": "arithmetic", "kwargs": {"split": "eval"}})


def qa_file(path: Path, rows: list[tuple[str, str]]) -> str:
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    return str(path)


def test_any_dataset_env_gives_pairs_checks_and_held_out_problems(tmp_path) -> None:
    train_rows = [(f"capital of {c}?", cap) for c, cap in [("fr", "Paris"), ("it", "Rome")]]
    held_rows = [("capital of es?", "Madrid"), train_rows[1]]  # one question in both files
    task = make_task(
        {
            "kind": "env",
            "kwargs": {
                "env": {"kind": "dataset_qa", "kwargs": {"path": qa_file(tmp_path / "t.jsonl", train_rows)}},
                "held_out_env": {"kind": "dataset_qa", "kwargs": {"path": qa_file(tmp_path / "h.jsonl", held_rows)}},
                "max_held_out": 2,
            },
        }
    )  # fmt: skip
    # seed s shows row s % 2; TRAIN_SEED_BASE is even, so seeds base+0..3 are rows 0,1,0,1,
    # and row 1's question is held out: only row 0's two copies are written
    assert TRAIN_SEED_BASE % 2 == 0
    assert task.write(tmp_path / "d.jsonl", 4) == 2
    assert (
        records(tmp_path / "d.jsonl") == [{"prompt": "capital of fr?", "completion": "Paris"}] * 2
    )
    assert task.held_out(2).problems == [("capital of es?", "Madrid"), ("capital of it?", "Rome")]
    # scored by the env's verifier (exact match after normalising case and a final period)
    assert task.check.score("paris.", "Paris") == 1.0 and task.check.score("Lyon", "Paris") == 0.0
    # the budget: the longest check reference ("Paris", 5 bytes) plus the slack
    assert task.check.max_new_tokens == 5 + ANSWER_SLACK_TOKENS
    with pytest.raises(ValueError, match=r"n=3 must be in \[1, 2\]"):
        task.held_out(3)


def test_a_gsm8k_row_trains_on_its_solution_and_scores_its_number() -> None:
    env = DatasetQAEnv(
        [{"question": "2 apples and 3 more?", "answer": "2 + 3 = 5 apples #### 5"}],
        verifier=numeric_verifier,
        answer_extractor=gsm8k_extract_answer,
    )
    assert isinstance(env, ReferenceEnv)
    env.env_reset(seed=0)
    solution = env.reference_completion()
    assert solution == "2 + 3 = 5 apples #### 5"  # the whole solution is what SFT imitates
    assert env.score_completion("so 5", solution) == 1.0  # the env's reward: the last number
    assert env.score_completion("so 6", solution) == 0.0
    assert env.env_step("5").reward == env.score_completion("5", solution)


def test_tasks_without_a_reference_or_with_a_bad_spec_are_refused() -> None:
    with pytest.raises(ValueError, match="states no reference completion"):
        make_task({"kind": "env", "kwargs": {"env": {"kind": "tic_tac_toe_2p"}}})
    with pytest.raises(
        ValueError, match=r"kind 'chess': use one of \['arithmetic', 'env', 'tool'\]"
    ):
        task_spec("chess")
    with pytest.raises(ValueError, match=r"sft task 'arithmetic' with kwargs \{'digit': 3\}"):
        make_task({"kind": "arithmetic", "kwargs": {"digit": 3}})
    with pytest.raises(ValueError, match="give a kind or"):
        task_spec({"name": "arithmetic"})


def test_up_sft_task_takes_a_kind_or_a_mapping_from_yaml_or_env(tmp_path) -> None:
    cfg = tmp_path / "run.yaml"
    spec = {"kind": "arithmetic", "kwargs": {"digits": 3}}
    cfg.write_text(yaml.safe_dump({"up": {"sft_task": spec}}))
    s = load_settings(UpSettings, ["--config", str(cfg)], service="up", environ={})
    assert s.sft_task == spec and task_spec(s.sft_task) == ("arithmetic", {"digits": 3})
    env = {"LUDIC_SFT_TASK": json.dumps({"kind": "arithmetic", "kwargs": {"digits": 1}})}
    s = load_settings(UpSettings, ["--config", str(cfg)], service="up", environ=env)
    assert task_spec(s.sft_task) == ("arithmetic", {"digits": 1})
    with pytest.raises(ValueError, match="up.sft_task: sft task kind 'chess'"):
        load_settings(UpSettings, ["--sft-task", "chess"], service="up", environ={})


def test_ludic_sft_trains_on_a_dataset_env_given_as_task_args(
    tiny_model_dir, tmp_path, capsys
) -> None:
    rows = [(f"{a}+{a}=", str(2 * a)) for a in range(10, 30)]
    path = qa_file(tmp_path / "qa.jsonl", rows)
    out = tmp_path / "o"
    base = ["--model", str(tiny_model_dir), "--out", str(out), "--steps", "2", "--batch-size", "4"]
    env = f"env={{kind: dataset_qa, kwargs: {{path: {path}}}}}"
    assert main([*base, "--task", "env", "--task-arg", env, "--task-arg", "max_held_out=3",
                 "--eval-n", "3", "--log-every", "1"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "greedy pass rate on 3 held-out problems" in text
    # 2 steps x 4 = 8 pairs asked: seeds TRAIN_SEED_BASE + 0..7 are rows 0..7 (the base is a
    # multiple of 20 rows); rows 0..2 are the held-out seeds 0..2 (one file for both), so 5
    assert TRAIN_SEED_BASE % len(rows) == 0
    written = records(out / "sft_train.jsonl")
    assert [r["prompt"] for r in written] == [q for q, _ in rows[3:8]]
    assert (out / "model.safetensors").exists()
    with pytest.raises(SystemExit):
        main([*base, "--task", "env", "--task-arg", "nonsense"])
    assert "write KEY=VALUE" in capsys.readouterr().err


def test_a_tool_task_demonstrates_the_call_the_answer_and_the_reply(tmp_path) -> None:
    # arithmetic states its tool call (the calculator on the expression); each problem gives
    # two records: prompt -> call, and prompt + call + the tool's real answer -> the answer
    import json

    from libludic.agents.tool_agent import parse_tool_calls
    from libludic.types import ChatResponse

    task = make_task(
        {
            "kind": "tool",
            "kwargs": {"env": {"kind": "arithmetic", "kwargs": {"ops": ["*"], "split": "train"}}},
        }
    )
    path = tmp_path / "tool.jsonl"
    assert task.write(path, 4) == 4
    first, second = [json.loads(x)["messages"] for x in path.read_text().splitlines()[:2]]
    assert [m["role"] for m in second] == ["user", "assistant", "tool", "assistant"]
    assert first == second[:2]
    q = second[0]["content"]  # "a*b="
    a, b = (int(x) for x in q.rstrip("=").split("*"))
    ((name, args),) = parse_tool_calls(ChatResponse(text=second[1]["content"]))
    assert (name, args) == ("calculator", {"expression": f"{a}*{b}"})
    assert second[2]["content"] == f"calculator: {a * b}" and second[3]["content"] == str(a * b)
    prompt, call = task.check.problems[0]
    assert task.check.score(call, call) == 1.0 and task.check.score(str(a * b), call) == 0.0
    with pytest.raises(ValueError, match="states no tool call"):
        make_task({"kind": "tool", "kwargs": {"env": {"kind": "tic_tac_toe"}}})
