"""The start-up estimate of item lengths (libludic/seqlen.py, services/launcher/seqlen.py):
a run whose one model call cannot fit ``learner.max_seq_len`` is refused before anything
starts, an episode that may not fit is a warning, every shipped example passes.

The task below has a prompt of known length: PaddedEnv's first observation is
``"-" * (10 + seed % 4) + "Say 3."``, 19 bytes at its longest over seeds 0..7. The tiny
model's tokenizer is byte-level, its chat template ``<|im_start|>`` + role initial + content
+ ``<|im_end|>`` per message and ``<|im_start|>a`` to open the reply, so

    P = (1 + 1 + 19 + 1) + 2 = 24    the longest first prompt
    t = (1 + 1 + 0 + 1) * 2  = 6     an earlier turn: an empty reply and an empty message
    M = 10                            the task's max_tokens
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from libludic.seqlen import (
    ChatTokens,
    SeqLenEstimate,
    estimate,
    load_chat_tokens,
    task_shape,
    verdict,
)
from libludic.tasks import TaskSpec
from services.launcher import check, main
from services.launcher.seqlen import check_lengths
from tests.example_configs import config_id, run_configs

ROOT = Path(__file__).resolve().parents[2]
PAD = {
    "name": "pad",
    "env": {"kind": "tests.user_plugins:PaddedEnv", "kwargs": {"pad": 10}},
    "inference": {"sampling": {"max_tokens": 10}},
}
TOOL = {"kind": "tool", "tools": ["calculator"], "max_tool_rounds": 2, "describe_tools": False}
LATEST = {"kind": "single_agent", "kwargs": {"context": "latest"}}


@pytest.fixture(scope="module")
def tiny() -> ChatTokens:
    return load_chat_tokens(None)


def task(**over: Any) -> TaskSpec:
    return TaskSpec.from_dict({**PAD, **over}, "feeder.tasks[0]")


def est(tokens: ChatTokens, max_steps: int = 5, **over: Any) -> SeqLenEstimate:
    return estimate(task_shape(task(**over), range(8), "feeder.tasks[0]"), tokens, max_steps)


def test_the_tiny_tokenizer_counts_the_template_and_the_bytes(tiny: ChatTokens) -> None:
    msgs: list[Any] = [{"role": "system", "content": "ab"}, {"role": "user", "content": "héllo"}]
    # system 1 + 1 + 2 + 1 = 5, user 1 + 1 + 6 (é is 2 bytes) + 1 = 9, the reply's opening 2
    assert tiny.exact and tiny.count(msgs) == 16
    # the byte bound: 64 + (2 + 8) + (6 + 8)
    assert ChatTokens(None, "a byte bound").count(msgs) == 88


def test_the_shape_is_read_from_the_task_and_its_env() -> None:
    plain = task_shape(task(), range(8), "feeder.tasks[0]")
    assert len(plain.prompts) == 8 and plain.where == "feeder.tasks[0] (pad)"
    assert max(len(p[-1]["content"]) for p in plain.prompts) == 19  # 13 dashes + "Say 3."
    assert (plain.max_tokens, plain.calls_per_observation) == (10, 1)
    assert (plain.context, plain.keeps_history) == ("full", True)
    tool = task_shape(task(agent=TOOL, protocol=LATEST), range(8), "feeder.tasks[0]")
    assert (tool.calls_per_observation, tool.context, tool.keeps_history) == (3, "latest", False)


def test_the_estimate_with_the_numbers(tiny: ChatTokens) -> None:
    e = est(tiny, max_steps=5)
    assert (e.prompt_tokens, e.turn_tokens, e.max_tokens, e.calls) == (24, 6, 10, 5)
    assert e.one_call == 24 + 10 == 34
    assert e.episode == 24 + 5 * 10 + 4 * 6 == 98  # the full context keeps 5 replies


def test_one_call_that_cannot_fit_is_refused_naming_the_numbers_and_the_fix(
    tiny: ChatTokens,
) -> None:
    e = est(tiny, max_steps=1)
    assert verdict(e, 34) is None  # 24 + 10 fits exactly
    with pytest.raises(
        ValueError,
        match=r"feeder.tasks\[0\] \(pad\): one model call needs 34 tokens, the longest of 8 "
        r"first prompts \(24 tokens by the tiny model's byte-level tokenizer\) \+ max_tokens "
        r"10, more than learner.max_seq_len=33: .* raise learner.max_seq_len to at least 34 "
        r"or lower feeder.tasks\[0\].inference.sampling.max_tokens to at most 9$",
    ):
        verdict(e, 33)


def test_an_episode_that_may_not_fit_is_a_warning(tiny: ChatTokens) -> None:
    e = est(tiny, max_steps=5)
    assert verdict(e, 98) is None
    w = verdict(e, 97)
    assert w is not None and w.startswith("feeder.tasks[0] (pad): the last call of an episode")
    assert "up to 5 replies (actor.max_steps=5 calls)" in w
    assert "at least 24 + 5 x 10 + 4 x 6 (template) = 98 tokens" in w
    assert w.endswith("lower actor.max_steps or use context: latest")


def test_the_latest_context_holds_one_observations_calls(tiny: ChatTokens) -> None:
    plain = est(tiny, max_steps=5, protocol=LATEST)
    assert (plain.calls, plain.episode) == (1, 34)  # each turn's prompt is the first's length
    assert verdict(plain, 34) is None
    # a tool agent's rounds stay with their observation: 1 + 2 calls, 24 + 3 x 10 + 2 x 6
    tool = est(tiny, max_steps=5, agent=TOOL, protocol=LATEST)
    assert (tool.calls, tool.episode) == (3, 66)
    assert verdict(tool, 66) is None
    w = verdict(tool, 65)
    assert w is not None and "(1 + max_tool_rounds 2 calls on one observation)" in w
    assert "lower the agent's max_tool_rounds (2)" in w and "context: latest" not in w


def test_the_byte_bound_warns_where_only_the_tokenizer_could_refuse() -> None:
    e = est(ChatTokens(None, "a byte bound, as the test has no tokenizer"), max_steps=1)
    # 64 + 19 bytes + 8: an upper bound of most tokenizers' count, so no refusal on it
    assert (e.exact, e.prompt_tokens, e.one_call) == (False, 91, 101)
    w = verdict(e, 100)
    assert w is not None and "one model call may need up to 101 tokens" in w
    # a reply of max_tokens cannot fit whatever the prompt: one prompt token + 10 > 10
    with pytest.raises(ValueError, match="one model call needs 11 tokens, one prompt token"):
        verdict(e, 10)


def test_seeds_whose_step_raises_are_left_out(tiny: ChatTokens) -> None:
    # resets at seed 0 only: the launcher's failing-task watch reports it at run time
    shape = task_shape(
        task(env={"kind": "tests.user_plugins:FailsAfterTheCheck"}), range(8), "feeder.tasks[0]"
    )
    assert len(shape.prompts) == 1 and len(shape.failed) == 7
    assert shape.failed[0] == "env seed 1: ValueError: cannot load problem 1"
    # no seed resets: nothing to count, a warning and not a refusal
    broken = task(env={"kind": "tests.user_plugins:BrokenEnv"})
    [line] = check_lengths([broken], 1024, 5, tiny)
    assert line.warn and str(line).startswith(
        "feeder.tasks[0] (pad): no first model call was recorded from its env seeds (8 raised; "
        "env seed 0: RuntimeError: the dataset file is missing)"
    )


def write_config(tmp_path: Path, max_seq_len: int) -> Path:
    cfg = {
        "up": {"runs_dir": str(tmp_path / "runs"), "name": "len", "eval_n": 0},
        "feeder": {"tasks": [PAD]},
        "actor": {"max_steps": 5},
        "learner": {"max_seq_len": max_seq_len},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_ludic_up_refuses_before_it_starts_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(main, "keep_secrets_in", lambda: False)  # not this test process
    path = write_config(tmp_path, max_seq_len=33)
    assert main.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "feeder.tasks[0] (pad): one model call needs 34 tokens" in err
    assert "more than learner.max_seq_len=33" in err
    assert not (tmp_path / "runs").exists()  # no model built, no service started


def test_ludic_check_prints_each_tasks_figures_or_its_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert check.main(["--config", str(write_config(tmp_path, max_seq_len=98))]) == 0
    assert (
        "ok  length feeder.tasks[0] (pad): one call up to 34 tokens (24 prompt, the longest "
        "of 8, + 10 max_tokens), episode of 5 calls at least 98; fits learner.max_seq_len"
    ) in capsys.readouterr().out
    assert check.main(["--config", str(write_config(tmp_path, max_seq_len=97))]) == 0
    assert "warn length feeder.tasks[0] (pad): the last call" in capsys.readouterr().out


@pytest.mark.parametrize("path", run_configs(), ids=config_id)
def test_every_shipped_example_passes_the_check(
    path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    assert check.main(["--config", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    tasks = yaml.safe_load(path.read_text())["feeder"]["tasks"]
    assert out.count(" length feeder.tasks[") == len(tasks), out
