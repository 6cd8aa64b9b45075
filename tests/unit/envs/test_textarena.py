"""The textarena env kind on the real TextArena package: TicTacToe-v0 games played to the end
by scripted moves through the rollout engine (win, draw, an invalid move), the observations
each player gets, the game's own random generator, the task check and the errors of a bad
config."""

from __future__ import annotations

import random

import pytest

from libludic.envs.textarena import TextArenaEnv
from libludic.plugins import PluginError
from libludic.registry import build_registries
from libludic.requests import EnvSpec, ProtocolSpec, RolloutRequest
from libludic.rollout.engine import RolloutEngine
from libludic.tasks import TaskSpec, check_task
from tests.fakes import ScriptedClient

SELF_PLAY = ProtocolSpec("multi_agent", {"roles": ["0", "1"]})


async def play(moves: list[str], **env_kwargs):
    """One game whose players reply ``moves`` in turn order; the rollouts by role and the
    client (its requests in call order)."""
    client = ScriptedClient(moves)
    eng = RolloutEngine(*build_registries(client))
    req = RolloutRequest(env=EnvSpec("textarena", env_kwargs), protocol=SELF_PLAY, env_seed=0)
    rollouts = await eng.generate_rollouts([req], max_steps=12)
    assert len(client.requests) == len(moves)  # every scripted move was asked for
    return {r.meta["agent_id"]: r for r in rollouts}, client


async def test_a_win_gives_the_winner_one_and_the_loser_minus_one():
    # cells 0-8; player 0 (O) moves first: O 4, X 0, O 2, X 1, O 6 -> the diagonal 2-4-6
    by_role, _ = await play(["[4]", "[0]", "[2]", "[1]", "6"])  # a bare "6" becomes "[6]"
    assert (by_role["0"].total_reward, by_role["1"].total_reward) == (1.0, -1.0)
    assert [s.action for s in by_role["0"].steps] == ["[4]", "[2]", "6"]
    assert [s.action for s in by_role["1"].steps] == ["[0]", "[1]"]
    last0, last1 = by_role["0"].steps[-1], by_role["1"].steps[-1]
    assert last0.terminated and last1.terminated
    # the mover's step keeps TextArena's per-player info (multi_agent adds only the reward
    # and the end to the other player's last step)
    assert last0.info["reason"] == "Player 0 has won!" and last0.info["invalid_move"] is False
    assert last0.next_obs.endswith("[GAME] Player 0 has won!")


async def test_a_draw_gives_both_zero():
    # O 4, X 0, O 2, X 6, O 3, X 5, O 1, X 7, O 8: a full board, no line
    by_role, _ = await play(["[4]", "[0]", "[2]", "[6]", "[3]", "[5]", "[1]", "[7]", "[8]"])
    assert (by_role["0"].total_reward, by_role["1"].total_reward) == (0.0, 0.0)
    assert (len(by_role["0"].steps), len(by_role["1"].steps)) == (5, 4)
    assert by_role["0"].steps[-1].info["reason"] == "The game is a draw!"


async def test_an_invalid_move_is_retried_once_then_loses():
    # X plays the occupied cell 4: TextArena tells X and asks again; X's second invalid move
    # ("I pass" -> "[I pass]", not a cell) ends the game: X -1, O +1
    by_role, client = await play(["[4]", "[4]", "I pass"])
    assert (by_role["0"].total_reward, by_role["1"].total_reward) == (1.0, -1.0)
    assert [s.action for s in by_role["1"].steps] == ["[4]", "I pass"]
    first, second = by_role["1"].steps
    assert not first.terminated and "cell 4 is already occupied" in first.next_obs
    assert second.terminated and second.info["invalid_move"] is True
    assert second.info["reason"] == "The submitted move does not follow the correct format."
    # X was asked again with TextArena's reason at the end of its dialog
    retry = client.requests[2].messages
    assert (
        "Player 1 attempted an invalid move. Reason: cell 4 is already occupied"
        in (retry[-1]["content"])
    )


async def test_each_player_gets_the_new_messages_addressed_to_it():
    _, client = await play(["[4]", "[0]", "[2]", "[1]", "[6]"])
    first_o, first_x, second_o = (r.messages for r in client.requests[:3])
    # O's first prompt: its own TextArena prompt and the empty board
    assert [m["role"] for m in first_o] == ["user"]
    assert first_o[0]["content"].startswith("[GAME] You are Player 0 in Tic Tac Toe.")
    assert "Available Moves: '[0]', '[1]'" in first_o[0]["content"]
    # X's first turn: its prompt, then O's move as TextArena tells it (no history repeated)
    assert [m["role"] for m in first_x] == ["user", "user"]
    assert first_x[0]["content"].startswith("[GAME] You are Player 1 in Tic Tac Toe.")
    assert first_x[1]["content"].startswith(
        "[Player 0] [4]\n[GAME] Player 0 placed their symbol (O) in cell 4."
    )
    assert "You are Player" not in first_x[1]["content"]
    # O's second turn: its reply, then what followed (its move's board, then X's move)
    assert [m["role"] for m in second_o] == ["user", "assistant", "user", "user"]
    assert (
        "[Player 1] [0]\n[GAME] Player 1 placed their symbol (X) in cell 0."
        in (second_o[3]["content"])
    )


def test_the_game_keeps_its_random_generator_to_itself():
    random.seed(5)
    expected = [random.random() for _ in range(3)]
    random.seed(5)
    env = TextArenaEnv()
    env.reset(seed=1)  # TextArena's state calls random.seed(1)
    env.step({"0": "[4]"})
    assert [random.random() for _ in range(3)] == expected


def test_a_games_chance_depends_on_its_seed_only():
    # Kuhn poker reshuffles its 3-card deck with the global random at every round; another
    # env seeding the global random between moves must not change the deals

    def game(meddle: bool) -> list[str]:
        env = TextArenaEnv("KuhnPoker-v0")  # 3 rounds; check, check: a showdown each
        seen = [obs for obs, _ in env.reset(seed=4).values()]
        while env.active_agents:
            if meddle:
                random.seed(99)
            seen += [o.obs for o in env.step({env.active_agents[0]: "[check]"}).values()]
        return seen

    alone = game(meddle=False)
    assert sum("Starting round 3 out of 3" in obs for obs in alone) == 2  # one per player
    assert game(meddle=True) == alone


def test_roles_and_turns():
    env = TextArenaEnv()
    assert env.agent_ids == ["0", "1"] and env.active_agents == []
    first = env.reset(seed=0)
    assert set(first) == {"0", "1"} and first["1"][1] == {"player_id": 1}
    assert env.active_agents == ["0"]
    with pytest.raises(KeyError, match="it is player 0's turn; got actions for \\['1'\\]"):
        env.step({"1": "[4]"})
    env.step({"0": "[4]"})
    assert env.active_agents == ["1"]


def task(**env_kwargs) -> TaskSpec:
    return TaskSpec.from_dict(
        {
            "name": "ttt",
            "env": {"kind": "textarena", "kwargs": env_kwargs},
            "protocol": {"kind": "multi_agent", "kwargs": {"roles": ["0", "1"]}},
            "inference": {"sampling": {"temperature": 1.0, "max_tokens": 16}},
        },
        "feeder.tasks[0]",
    )


def test_check_task_builds_a_textarena_task():
    assert check_task(task(game="TicTacToe-v0"), "feeder.tasks[0]") < 5.0


@pytest.mark.parametrize(
    "env_kwargs, match",
    [
        (
            {"game": "TicTacToe-v9"},
            r"game='TicTacToe-v9' is not a TextArena game id \(did you mean 'TicTacToe-v0'.*"
            r"the \d+ games .*: .*Nim-v0, .*TicTacToe-v0, ",
        ),
        (
            {"game_kwargs": {"board_size": 4}},
            r"'TicTacToe-v0' rejected game_kwargs=\{'board_size': 4\}: .*board_size.*; its "
            r"keyword arguments: \[\]",
        ),
        (
            {"num_players": 3},
            r"'TicTacToe-v0' cannot be played with num_players=3: .*has to be 2, received 3",
        ),
        ({"num_players": 0}, r"num_players=0 must be an integer >= 1"),
    ],
)
def test_a_bad_config_names_the_value_and_the_choices(env_kwargs, match):
    with pytest.raises(PluginError, match=r"feeder\.tasks\[0\] \(ttt\)\.env \(textarena\)"):
        check_task(task(**env_kwargs), "feeder.tasks[0]")
    with pytest.raises(ValueError, match=match):
        TextArenaEnv(**env_kwargs).reset(seed=0)
