"""DatasetQAEnv: file formats, verifiers, seed -> row, errors."""

from __future__ import annotations

import csv
import json
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from libludic.envs.dataset_qa_env import (
    DatasetQAEnv,
    exact_match_verifier,
    gsm8k_extract_answer,
    last_number,
    load_rows,
    normalise_answer,
    numeric_verifier,
)

REPO = Path(__file__).resolve().parents[3]
GSM8K_SAMPLE = REPO / "examples" / "gsm8k" / "gsm8k_sample.jsonl"

ROWS = [
    {"question": "Capital of France?", "answer": "Paris"},
    {"question": "2+2?", "answer": "4"},
    {"question": "Colour of the sky?", "answer": "blue"},
]


def write(tmp_path: Path, fmt: str) -> Path:
    p = tmp_path / f"rows.{fmt}"
    if fmt == "json":
        p.write_text(json.dumps(ROWS))
    elif fmt == "jsonl":
        p.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")  # trailing blank ok
    else:
        with p.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["question", "answer"])
            w.writeheader()
            w.writerows(ROWS)
    return p


@pytest.mark.parametrize("fmt", ["json", "jsonl", "csv"])
def test_loads_each_file_format(tmp_path, fmt):
    env = DatasetQAEnv.from_file(write(tmp_path, fmt))
    assert len(env) == 3
    obs, info = env.reset(seed=1)["agent"]
    assert obs == "2+2?" and info["row_index"] == 1
    out = env.step({"agent": " 4 "})["agent"]
    assert out.reward == 1.0 and out.terminated and out.info["correct"] is True


def test_in_memory_rows_custom_keys_and_template():
    rows = [{"q": "Name a primary colour", "a": "Red"}]
    env = DatasetQAEnv(rows, question_key="q", answer_key="a", prompt_template="Q: {question}\nA:")
    obs, _ = env.reset(seed=0)["agent"]
    assert obs == "Q: Name a primary colour\nA:"
    assert env.step({"agent": "red."})["agent"].reward == 1.0
    env.reset(seed=0)
    wrong = env.step({"agent": "green"})["agent"]
    assert wrong.reward == 0.0 and wrong.obs == "wrong, the answer was Red"


def test_seed_selects_row_deterministically():
    env = DatasetQAEnv(ROWS)
    # row = seed % 3: seeds 2, 5 and 3002 all name row 2
    for seed in (2, 5, 3002):
        obs, info = env.reset(seed=seed)["agent"]
        assert (obs, info["row_index"]) == ("Colour of the sky?", 2)
    a = DatasetQAEnv(ROWS).reset(seed=7)
    b = DatasetQAEnv(ROWS).reset(seed=7)
    assert a == b


def test_normalised_exact_match():
    assert normalise_answer("  The   Answer. ") == "the answer"
    assert exact_match_verifier("PARIS", "Paris")
    assert exact_match_verifier('"paris"', "Paris")
    assert not exact_match_verifier("Paris, France", "Paris")


def test_numeric_verifier_compares_last_numbers():
    assert last_number("I think 3 apples, so the total is 1,200.") == Decimal("1200")
    assert last_number("no digits") is None
    assert numeric_verifier("so the answer is $42.", "42")
    assert numeric_verifier("42.0", "#### 42")
    assert numeric_verifier("it is -3", "-3")
    assert not numeric_verifier("first 42 then 41", "42")
    assert not numeric_verifier("forty-two", "42")
    with pytest.raises(ValueError, match="holds no number"):
        numeric_verifier("1", "Paris")


def test_gsm8k_extractor():
    assert gsm8k_extract_answer("5 + 7 = <<5+7=12>>12 apples\n#### 12") == "12"
    assert gsm8k_extract_answer("big\n#### 1,200") == "1200"
    with pytest.raises(ValueError, match="no '####'"):
        gsm8k_extract_answer("just 12")


def test_gsm8k_sample_file():
    rows = load_rows(GSM8K_SAMPLE)
    assert 15 <= len(rows) <= 30
    for r in rows:
        assert set(r) == {"question", "answer"}
        assert last_number(gsm8k_extract_answer(r["answer"])) is not None
    env = DatasetQAEnv.gsm8k(GSM8K_SAMPLE)
    for seed in range(len(rows)):
        env.reset(seed=seed)
        ref = gsm8k_extract_answer(rows[seed]["answer"])
        # a model that reasons and then writes the number in the GSM8K style passes
        assert env.step({"agent": f"Let me think... #### {ref}"})["agent"].reward == 1.0
        env.reset(seed=seed)
        assert env.step({"agent": f"#### {int(ref) + 1}"})["agent"].reward == 0.0


def test_clear_error_on_missing_keys(tmp_path):
    with pytest.raises(ValueError, match=r"row 1 has no key\(s\) \['answer'\]; its keys are"):
        DatasetQAEnv([{"question": "a", "answer": "b"}, {"question": "c", "solution": "d"}])
    with pytest.raises(ValueError, match=r"no key\(s\) \['prompt'\]"):
        DatasetQAEnv(ROWS, question_key="prompt")


def test_clear_error_on_empty_dataset(tmp_path):
    with pytest.raises(ValueError, match="empty dataset"):
        DatasetQAEnv([])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no rows"):
        DatasetQAEnv.from_file(empty)


def test_bad_files_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "b"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        load_rows(bad)
    obj = tmp_path / "obj.json"
    obj.write_text('{"question": "a"}')
    with pytest.raises(ValueError, match="must hold a JSON list"):
        load_rows(obj)
    with pytest.raises(ValueError, match="use .json, .jsonl or .csv"):
        load_rows(tmp_path / "rows.parquet")


def test_step_before_reset_is_an_error():
    with pytest.raises(RuntimeError, match="before env_reset"):
        DatasetQAEnv(ROWS).env_step("x")


def test_from_hf_without_datasets_says_how_to_install(monkeypatch):
    # Never downloads: with `datasets` absent (blocked here) from_hf must say what to install.
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        DatasetQAEnv.from_hf("openai/gsm8k", "test", config_name="main")


def test_accepts_a_dataset_like_object_with_column_names():
    class FakeDataset(list):  # a datasets.Dataset's column_names, for this check alone
        column_names = ["question", "answer"]

    env = DatasetQAEnv(FakeDataset(ROWS))
    env.reset(seed=0)
    assert env.step({"agent": "paris"})["agent"].reward == 1.0
    with pytest.raises(ValueError, match=r"no column\(s\) \['prompt'\]"):
        DatasetQAEnv(FakeDataset(ROWS), question_key="prompt")
