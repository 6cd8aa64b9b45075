"""TicTacToeEnv as a supervised task: legal play (libludic/envs/tic_tac_toe.py)."""

from libludic.envs.tic_tac_toe import TicTacToeEnv, board_of, parse_move
from libludic.sft.tasks import env_task


def test_the_reference_is_a_legal_move_of_positions_from_the_whole_game():
    env = TicTacToeEnv(opening=4)
    free_counts = set()
    for seed in range(200):
        obs, _ = env.env_reset(seed=seed)
        cells = board_of(obs)
        assert cells is not None
        ref = parse_move(env.reference_completion())
        assert ref is not None and cells[ref] == " "  # legal
        free_counts.add(cells.count(" "))
    assert free_counts >= {9, 7, 5, 3, 1}  # 0..4 move pairs before the agent's turn


def test_any_legal_move_scores_one_and_the_check_judges_against_the_prompt():
    env = TicTacToeEnv()
    obs = "You are X.\nX 2 O\n4 5 6\n7 8 9\nYour move:"
    assert env.score_completion("5", "2", obs) == 1.0  # legal, not the reference
    assert env.score_completion("1", "2", obs) == 0.0  # occupied
    assert env.score_completion("5 or 6", "2", obs) == 0.0  # two cells: no move
    task = env_task({"kind": "tic_tac_toe", "kwargs": {"opening": 3}})
    assert task.check.takes_prompt
    prompt, ref = task.check.problems[0]
    assert task.check.score(ref, ref, prompt) == 1.0


def test_opening_is_checked():
    import pytest

    with pytest.raises(ValueError, match=r"opening=5 must be an integer in \[0, 4\]"):
        TicTacToeEnv(opening=5)
