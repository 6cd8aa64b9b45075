"""Eval sets in config: ``up.eval_sets`` (and the eval service's ``sets``, falling back to
it) parsed and built at start-up, the single-set keys making one set ``heldout`` when it is
empty, errors naming the key and the fix; each set's requests; every example config's sets
run one problem."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from libludic.eval.sets import EvalSet
from libludic.plugins import PluginError
from services.common.heldout import evaluate_sets_client
from services.common.settings import load_settings
from services.eval.settings import EvalSettings
from services.launcher.settings import UpSettings
from tests.example_configs import config_id, run_configs
from tests.fakes import ScriptedClient

ROOT = Path(__file__).resolve().parents[2]
ARITH = {"kind": "arithmetic", "kwargs": {"split": "eval"}}
TTT = {
    "name": "ttt",
    "env": {"kind": "tic_tac_toe", "kwargs": {"opponent_skill": 0.5}},
    "protocol": {"kind": "single_agent", "kwargs": {"parser": {"kind": "xml", "tag": "move"}}},
    "n": 20,
    "max_tokens": 16,
    "max_steps": 5,
    "k": 4,
    "temperature": 0.8,
}
SELFPLAY = {
    "name": "selfplay",
    "env": {"kind": "tic_tac_toe_2p"},
    "protocol": {"kind": "multi_agent", "kwargs": {"roles": ["X", "O"]}},
    "n": 2,
    "max_steps": 10,
}


def test_eval_sets_are_parsed_with_their_defaults() -> None:
    s = UpSettings(eval_sets=[TTT, SELFPLAY])
    ttt, selfplay = s.parsed_eval_sets
    assert (ttt.name, ttt.n, ttt.max_steps, ttt.k, ttt.temperature) == ("ttt", 20, 5, 4, 0.8)
    assert ttt.pass_threshold == 1.0 and ttt.roles is None
    # defaults of what a set leaves out: max_tokens 8, greedy only, threshold 1
    assert (selfplay.max_tokens, selfplay.k, selfplay.temperature) == (8, 0, 1.0)
    assert selfplay.roles == ["X", "O"]


def test_no_eval_sets_make_one_heldout_set_of_the_single_set_keys() -> None:
    proto = {"kind": "single_agent", "kwargs": {"parser": "boxed"}}
    (s,) = UpSettings(
        eval_env=ARITH, eval_n=7, eval_max_tokens=12, eval_protocol=proto
    ).parsed_eval_sets
    assert (s.name, s.env, s.protocol, s.n, s.max_tokens) == ("heldout", ARITH, proto, 7, 12)
    assert (s.max_steps, s.k) == (1, 0)  # what the evaluation always was
    assert UpSettings(eval_n=0, eval_sets=[TTT]).parsed_eval_sets == []  # 0: no evaluation


@pytest.mark.parametrize(
    "change, error",
    [
        (
            {"max_step": 5},
            r"up.eval_sets\[0\] has unknown keys \['max_step'\].*did you mean 'max_steps'",
        ),
        ({"n": 0}, r"up.eval_sets\[0\] \(ttt\).n=0 must be an integer >= 1"),
        ({"k": -1}, r"up.eval_sets\[0\] \(ttt\).k=-1 must be an integer >= 0"),
        ({"max_steps": 2.5}, r"\(ttt\).max_steps=2.5 must be an integer >= 1"),
        ({"temperature": 0.0}, r"\(ttt\).temperature=0.0 must be > 0 for the k=4 samples"),
        ({"pass_threshold": float("nan")}, r"\(ttt\).pass_threshold=nan must be a finite number"),
        ({"name": "a/b"}, r"\(a/b\).name='a/b': use letters, digits"),
        ({"name": "pass_rate"}, r"name='pass_rate' is a figure's name"),
        ({"env": {"kwargs": {}}}, r"\(ttt\).env=.* must be a mapping with 'kind'"),
    ],
)
def test_a_bad_set_stops_the_start_up_naming_its_key(change: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        UpSettings(eval_sets=[{**TTT, **change}])


def test_set_names_are_unique_and_sets_are_built_at_start_up() -> None:
    with pytest.raises(ValueError, match=r"\[1\] \(ttt\).name='ttt' names another set too"):
        UpSettings(eval_sets=[TTT, TTT])
    with pytest.raises(ValueError, match=r"up.eval_sets\[0\] needs 'env'"):
        UpSettings(eval_sets=[{"name": "x"}])
    with pytest.raises(ValueError, match=r"up.eval_sets=.*must be a list"):
        UpSettings(eval_sets="ttt")  # type: ignore[arg-type]
    # built like a feeder task: a misspelt env kind or parser fails here, naming the set
    with pytest.raises(PluginError, match=r"up.eval_sets\[0\] \(ttt\).env.*tic_tac_tow"):
        UpSettings(eval_sets=[{**TTT, "env": {"kind": "tic_tac_tow"}}])
    bad_parser = {"kind": "single_agent", "kwargs": {"parser": "nope"}}
    with pytest.raises(ValueError, match=r"up.eval_sets\[0\] \(ttt\).protocol=.*'nope'"):
        UpSettings(eval_sets=[{**TTT, "protocol": bad_parser}])


def test_eval_sets_come_from_yaml_and_the_eval_service_falls_back_to_them(
    tmp_path: Path,
) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"up": {"eval_sets": [TTT, SELFPLAY]}}))
    up = load_settings(UpSettings, ["--config", str(cfg)], service="up", environ={})
    ev = load_settings(EvalSettings, ["--config", str(cfg)], service="eval", environ={})
    assert ev.parsed_sets == up.parsed_eval_sets
    assert [s.name for s in ev.parsed_sets] == ["ttt", "selfplay"]
    # eval's own section beats up:, and without sets the single-set keys make "heldout"
    cfg.write_text(
        yaml.safe_dump({"up": {"eval_sets": [TTT]}, "eval": {"sets": [], "env": ARITH, "n": 3}})
    )
    ev = load_settings(EvalSettings, ["--config", str(cfg)], service="eval", environ={})
    assert [(s.name, s.n, s.env) for s in ev.parsed_sets] == [("heldout", 3, ARITH)]
    # the environment as JSON, checked like the file
    env = {"LUDIC_SETS": '[{"name": "x", "env": {"kind": "arithmetic"}, "k": -2}]'}
    with pytest.raises(ValueError, match=r"eval.sets\[0\] \(x\).k=-2"):
        load_settings(EvalSettings, ["--config", str(cfg)], service="eval", environ=env)


def test_a_sets_requests_are_greedy_then_k_distinct_samples_per_problem() -> None:
    s = EvalSet(**{**TTT, "n": 3})
    greedy, samples = s.greedy_requests(), s.sample_requests()
    assert [r.env_seed for r in greedy] == [0, 1, 2]
    assert all(r.inference.sampling.temperature == 0.0 for r in greedy)
    assert [(r.env_seed, r.sampling_seed, r.num_episodes) for r in samples] == [
        (0, 0, 4),
        (1, 4, 4),
        (2, 8, 4),
    ]  # episode j of problem i: sampling seed 4i + j, all 12 distinct, same env seed
    assert all(r.same_env_seed and r.inference.sampling.temperature == 0.8 for r in samples)
    assert [r.meta["problem"] for r in samples] == [0, 1, 2]
    assert all(r.inference.sampling.max_tokens == 16 for r in greedy + samples)
    assert EvalSet(**{**TTT, "k": 0}).sample_requests() == []


@pytest.mark.parametrize("path", run_configs(), ids=config_id)
async def test_every_example_configs_eval_sets_run_one_problem(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    up = UpSettings(**yaml.safe_load(path.read_text())["up"])
    sets = [dataclasses.replace(s, n=1, k=min(s.k, 2)) for s in up.parsed_eval_sets]
    if not sets:  # a config that evaluates nothing says so
        assert up.eval_n == 0
        return
    client = ScriptedClient(["<move>5</move> \\boxed{3} ```python\nprint(1)\n```"])
    res = await evaluate_sets_client(client, sets)
    for s in sets:
        assert res[f"eval/{s.name}/num_episodes"] >= 1.0, s.name
        assert (f"eval/{s.name}/pass_at_k" in res) == (s.k > 0)
    assert res["eval/pass_rate"] == res[f"eval/{sets[0].name}/pass_rate"]


def test_the_tic_tac_toe_example_evaluates_both_games_whole() -> None:
    cfg = yaml.safe_load((ROOT / "examples/tic_tac_toe/selfplay.yaml").read_text())
    vs, selfplay = UpSettings(**cfg["up"]).parsed_eval_sets
    assert (vs.env["kind"], vs.max_steps, vs.n, vs.k, vs.temperature) == (
        "tic_tac_toe",
        5,
        200,
        4,
        1.0,
    )
    trained = {t["env"]["kind"]: t for t in cfg["feeder"]["tasks"]}
    assert vs.protocol == trained["tic_tac_toe"]["protocol"]  # scored as trained
    assert selfplay.env["kind"] == "tic_tac_toe_2p" and selfplay.roles == ["X", "O"]
    assert selfplay.protocol == trained["tic_tac_toe_2p"]["protocol"]
    assert selfplay.max_steps >= 9  # a whole game


def test_the_tic_tac_toe_task_that_learns_is_evaluated_as_it_is_trained() -> None:
    """examples/tic_tac_toe/grpo.yaml: the held-out games are played with the trained task's
    protocol, env and budget, on seeds no training game uses; self-play reports both roles."""
    cfg = yaml.safe_load((ROOT / "examples/tic_tac_toe/grpo.yaml").read_text())
    up = UpSettings(**cfg["up"])
    vs, selfplay = up.parsed_eval_sets
    (task,) = cfg["feeder"]["tasks"]
    assert vs.protocol == task["protocol"] and vs.env == task["env"]
    assert vs.max_tokens == task["inference"]["sampling"]["max_tokens"]
    assert vs.max_steps == cfg["actor"]["max_steps"] == 5
    assert cfg["feeder"]["seed_base"] >= vs.n  # training seeds past the held-out 0..n-1
    assert selfplay.roles == ["X", "O"] and selfplay.max_steps >= 9
    assert up.sft_steps > 0 and up.sft_task["kwargs"]["env"]["kind"] == "tic_tac_toe"
