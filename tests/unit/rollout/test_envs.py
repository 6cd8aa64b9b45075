import pytest

from libludic.envs.arithmetic import ArithmeticEnv, generate_problem, score_answer
from libludic.envs.tic_tac_toe import TicTacToeEnv, TwoPlayerTicTacToeEnv, parse_move, winner


def test_generate_problem_is_deterministic_per_seed():
    assert generate_problem(7) == generate_problem(7)
    p = generate_problem(7, digits=2)
    a, b = p.question[:-1].split("+")
    assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
    assert p.answer == str(int(a) + int(b))
    assert len({generate_problem(s).question for s in range(50)}) > 40


def test_generate_problem_ops_and_validation():
    p = generate_problem(3, digits=1, ops=("-",))
    a, b = p.question[:-1].split("-")
    assert int(a) >= int(b) and p.answer == str(int(a) - int(b))
    with pytest.raises(ValueError, match="unsupported op"):
        generate_problem(1, ops=("/",))
    with pytest.raises(ValueError, match="digits"):
        generate_problem(1, digits=0)


def test_splits_partition_the_problem_space():
    from libludic.envs.arithmetic import in_eval_split

    def operands(p):
        a, b = p.question[:-1].split("+")
        return int(a), int(b)

    train = {generate_problem(s, split="train").question for s in range(2000)}
    evals = {generate_problem(s, split="eval").question for s in range(2000)}
    assert train and evals and not (train & evals)
    assert all(in_eval_split(*operands(generate_problem(s, split="eval"))) for s in range(100))
    assert generate_problem(5, split="eval") == generate_problem(5, split="eval")
    # about 10% of all problems are eval problems
    frac = sum(in_eval_split(*operands(generate_problem(s))) for s in range(2000)) / 2000
    assert 0.07 < frac < 0.13
    # unrelated to the digits: eval problems have every units-digit pair, not a structured slice
    pairs = {
        (a % 10, b % 10)
        for a, b in (operands(generate_problem(s, split="eval")) for s in range(3000))
    }
    assert len(pairs) > 90
    with pytest.raises(ValueError, match="split"):
        generate_problem(1, split="test")


def test_score_answer_exact_and_partial():
    assert score_answer(" 46 ", "46") == 1.0
    assert score_answer("47", "46") == 0.0
    # partial: 1 of 2 digits right, scaled by 0.5 -> 0.5 * 1/2 = 0.25
    assert score_answer("47", "46", partial_credit=True) == pytest.approx(0.25)
    assert score_answer("4", "46", partial_credit=True) == 0.0  # wrong length earns nothing


def test_arithmetic_env_episode():
    env = ArithmeticEnv()
    ((obs, info),) = env.reset(seed=11).values()
    assert obs == generate_problem(11).question and info["answer"] == generate_problem(11).answer
    out = env.step({"agent": info["answer"]})["agent"]
    assert out.reward == 1.0 and out.terminated
    with pytest.raises(KeyError, match="expected an action for 'agent'"):
        env.step({"other": "1"})


def test_tic_tac_toe_single_agent_win_loss_and_illegal():
    env = TicTacToeEnv(opponent_skill=1.0)
    env.reset(seed=0)
    out = env.step({"agent": "5"})["agent"]
    assert not out.terminated and env.board[4] == "X" and env.board.count("O") == 1
    occupied = env.board.index("O") + 1
    bad = env.step({"agent": str(occupied)})["agent"]
    assert bad.terminated and bad.reward == -1.0 and bad.info["illegal"]
    assert parse_move("cell 7") == 6 and parse_move("12") is None and parse_move("none") is None


def test_tic_tac_toe_winner_detection():
    assert winner(list("XXX      ")) == "X"
    assert winner(list("O  O  O  ")) == "O"
    assert winner(list("XOXOXOOXO")) is None


def test_two_player_rewards_are_zero_sum():
    env = TwoPlayerTicTacToeEnv()
    env.reset()
    for x, o in [("1", "4"), ("2", "5")]:
        assert env.active_agents == ["X"]
        env.step({"X": x})
        env.step({"O": o})
    out = env.step({"X": "3"})
    assert out["X"].reward == 1.0 and out["O"].reward == -1.0
    assert env.active_agents == []
    with pytest.raises(RuntimeError, match="reset"):
        env.step({"O": "6"})
