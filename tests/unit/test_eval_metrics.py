"""The evaluation figures (libludic/eval/metrics.py): hand-built rollouts with the values
worked out in comments, then real protocol runs (tic-tac-toe self-play, arithmetic with
sampled answers) through the eval set pass of services/common/heldout.py."""

from __future__ import annotations

import re
from typing import Any

import pytest

from libludic.eval.metrics import (
    at_k_figures,
    env_return,
    episode_figures,
    set_figures,
    truncation,
)
from libludic.eval.sets import EvalSet
from libludic.types import Rollout
from services.common.heldout import evaluate_set
from tests.fakes import ScriptedClient, make_step


def rollout(*steps: Any, **meta: Any) -> Rollout:
    return Rollout(steps=list(steps), meta=dict(meta))


def four_episodes() -> list[Rollout]:
    return [
        # a: a parse error (env 0, parser -0.5), then the answer (env 1): R = 1, passes,
        # though its total reward 0.5 would not: the parser's format reward is left out
        rollout(
            make_step(0, -0.5, info={"parse_error": True, "env_reward": 0.0}),
            make_step(1, 1.0, info={"env_reward": 1.0}),
        ),
        # b: an illegal move on the first turn: R = 0
        rollout(make_step(0, 0.0, info={"env_reward": 0.0, "illegal": True})),
        # c: three turns and out of max_steps: R = 0, truncated (max_steps)
        rollout(
            make_step(0, 0.0),
            make_step(1, 0.0),
            make_step(2, 0.0, truncated=True, info={"truncation_reason": "max_steps"}),
        ),
        # d: no env_reward in info (R = step rewards 0.5 + 0.25 = 0.75); TextArena's
        # invalid_move False is no illegal move, the custom env's bad_guess True is; the env
        # cut it short itself (truncated, no reason)
        rollout(
            make_step(0, 0.5, info={"invalid_move": False, "bad_guess": True}),
            make_step(1, 0.25, truncated=True),
        ),
    ]


def test_episode_figures_by_hand() -> None:
    eps = four_episodes()
    assert [env_return(r) for r in eps] == [1.0, 0.0, 0.0, 0.75]
    assert [r.total_reward for r in eps] == [0.5, 0.0, 0.0, 0.75]
    assert [truncation(r) for r in eps] == [None, None, "max_steps", "env"]
    fig = episode_figures(eps)
    assert fig == {
        "pass_rate": 0.25,  # a only (R >= 1.0)
        # total rewards, the parser's -0.5 included: (0.5 + 0 + 0 + 0.75) / 4
        "reward_mean": pytest.approx(0.3125),
        "episode_len_mean": 2.0,  # (2 + 1 + 3 + 2) / 4 model calls
        "parse_error_rate": 0.125,  # 1 of 8 model calls
        "illegal_rate": 0.5,  # b and d
        "truncated_rate": 0.5,  # c and d
        "truncated_rate_max_steps": 0.25,  # c
        "truncated_rate_context_length": 0.0,
        "truncated_rate_parse_error": 0.0,
        "truncated_rate_env": 0.25,  # d
        "num_episodes": 4.0,
    }
    # threshold 0.75: a and d pass
    assert episode_figures(eps, pass_threshold=0.75)["pass_rate"] == 0.5


def test_no_episodes_reports_zeros() -> None:
    fig = episode_figures([])
    assert fig["num_episodes"] == 0.0 and fig["pass_rate"] == 0.0 and fig["illegal_rate"] == 0.0


def test_pass_at_k_and_mean_at_k_by_hand() -> None:
    # k = 3 samples of problems 0, 1, 2 passing (T F F), (F F F), (T T T):
    # pass@3 = (1 + 0 + 1) / 3 = 2/3; mean@3 = (1/3 + 0 + 1) / 3 = 4/9
    passes = {0: (1, 0, 0), 1: (0, 0, 0), 2: (1, 1, 1)}
    samples = [
        rollout(make_step(0, float(r)), problem=p, sample=j)
        for p, rs in passes.items()
        for j, r in enumerate(rs)
    ]
    assert at_k_figures(samples) == {
        "pass_at_k": pytest.approx(2 / 3),
        "mean_at_k": pytest.approx(4 / 9),
        "num_problems": 3.0,
    }


def test_a_sample_names_its_problem_or_the_error_says_how() -> None:
    # no meta["problem"]: the env seed is the problem (both of seed 7 pass -> pass@k 1/2)
    by_seed = [
        rollout(make_step(0, 1.0), env_seed=7),
        rollout(make_step(0, 1.0), env_seed=7),
        rollout(make_step(0, 0.0), env_seed=8),
    ]
    assert at_k_figures(by_seed)["pass_at_k"] == 0.5
    with pytest.raises(ValueError, match=r"names no problem: set meta\['problem'\]"):
        at_k_figures([rollout(make_step(0, 1.0))])


def test_per_role_figures_and_a_role_that_never_acted() -> None:
    # game 0: X wins (X +1, O -1); game 1: X moves illegally (X -1), O had acted before (0)
    greedy = [
        rollout(make_step(0, 0.0), make_step(1, 1.0), agent_id="X"),
        rollout(make_step(0, -1.0), agent_id="O"),
        rollout(make_step(0, 0.0), make_step(1, -1.0, info={"illegal": True}), agent_id="X"),
        rollout(make_step(0, 0.0), agent_id="O"),
    ]
    fig = set_figures(greedy, roles=["X", "O", "Z"])
    assert fig["pass_rate"] == 0.25  # 1 of the 4 (game, role) rollouts
    assert fig["pass_rate/X"] == 0.5 and fig["pass_rate/O"] == 0.0
    assert fig["reward_mean/X"] == 0.0  # (1 - 1) / 2
    assert fig["reward_mean/O"] == -0.5  # (-1 + 0) / 2
    assert fig["illegal_rate/X"] == 0.5 and fig["illegal_rate/O"] == 0.0
    assert fig["episode_len_mean/X"] == 2.0 and fig["episode_len_mean/O"] == 1.0
    # Z never acted: its episode count, and no figure averaged over nothing
    assert fig["num_episodes/Z"] == 0.0 and "pass_rate/Z" not in fig
    # roles taken from the rollouts when not given; one role: no per-role figures
    assert set_figures(greedy)["pass_rate/X"] == 0.5
    assert not any("/" in k for k in set_figures(greedy[:1]))


async def test_self_play_figures_per_role_from_a_real_game() -> None:
    """tic_tac_toe_2p under multi_agent: X plays 1, 2, 3 (top row) while O plays 4, 5.
    X: 3 moves, wins (+1); O: 2 moves, loses (-1). With max_steps 4 (one turn per move) the
    game is cut after O's second move: both truncated at max_steps, nobody passes; with
    the Evaluator's old default of 1 turn, O never acts at all."""
    s = EvalSet(
        "selfplay",
        {"kind": "tic_tac_toe_2p"},
        {"kind": "multi_agent", "kwargs": {"roles": ["X", "O"]}},
        n=1,
        max_steps=10,
    )
    moves = ["1", "4", "2", "5", "3"]
    full = await evaluate_set(ScriptedClient(list(moves)), s)
    assert full["pass_rate/X"] == 1.0 and full["pass_rate/O"] == 0.0
    assert full["reward_mean/X"] == 1.0 and full["reward_mean/O"] == -1.0
    assert full["episode_len_mean/X"] == 3.0 and full["episode_len_mean/O"] == 2.0
    assert full["pass_rate"] == 0.5 and full["reward_mean"] == 0.0  # over the 2 rollouts
    assert full["illegal_rate"] == 0.0 and full["truncated_rate"] == 0.0

    cut = await evaluate_set(ScriptedClient(list(moves)), EvalSet(**{**vars(s), "max_steps": 4}))
    assert cut["truncated_rate_max_steps"] == 1.0 and cut["pass_rate"] == 0.0
    one = await evaluate_set(ScriptedClient(list(moves)), EvalSet(**{**vars(s), "max_steps": 1}))
    assert one["num_episodes/X"] == 1.0 and one["num_episodes/O"] == 0.0


async def test_sampled_episodes_give_pass_at_k_and_mean_at_k() -> None:
    """arithmetic, 3 problems, k = 4: greedy (temperature 0) answers wrong; a sample is
    right when its sampling seed is a multiple of 3. Seeds of problem i are 4i .. 4i+3:
    problem 0 {0, 3}, problem 1 {6}, problem 2 {9} are right -> pass@4 = 1,
    mean@4 = (2/4 + 1/4 + 1/4) / 3 = 1/3."""

    def reply(req: Any) -> str:
        a, b = map(int, re.findall(r"\d+", req.messages[-1]["content"])[:2])
        right = req.sampling.temperature > 0 and req.seed % 3 == 0
        return str(a + b if right else a + b + 1)

    env = {"kind": "arithmetic", "kwargs": {"split": "eval", "prompt": "{a} + {b}"}}
    s = EvalSet("add", env, n=3, max_tokens=8, k=4, temperature=0.7)
    client = ScriptedClient([reply])
    fig = await evaluate_set(client, s)
    assert fig["pass_rate"] == 0.0 and fig["num_episodes"] == 3.0
    assert fig["pass_at_k"] == 1.0
    assert fig["mean_at_k"] == pytest.approx(1 / 3)
    assert fig["num_problems"] == 3.0
    sampled = [r for r in client.requests if r.sampling.temperature > 0]
    assert sorted(r.seed for r in sampled) == list(range(12))  # distinct sampling seeds
    assert {r.sampling.temperature for r in sampled} == {0.7}
