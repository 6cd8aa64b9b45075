"""Tic-tac-toe: one agent against a fixed opponent, or two agents against each other.

Cells are numbered 1..9 left to right, top to bottom; an action is a cell number
(surrounding text is ignored if it holds exactly one digit 1-9). Rewards at the end of
a game: win +1, draw 0, loss -1. An illegal move (occupied cell, not a cell) ends the
game for the single-agent env with reward ``illegal_reward``; in the two-agent env the
mover gets ``illegal_reward`` and the other agent 0.

The single-agent env states a reference completion (``ReferenceEnv``): a legal move drawn
uniformly from the free cells, so a supervised warm start on it teaches legal play and no
strategy; its ``score_completion`` is 1.0 for any legal move of the prompt's board. With
``opening=k`` a game starts after 0..k random move pairs (chosen by the seed), so the
warm start sees positions from the whole game, not only the empty board.
"""

from __future__ import annotations

import random
import re

from libludic.envs.env import LudicEnv
from libludic.envs.single_agent_env import SingleAgentEnv
from libludic.types import Info, StepOutcome

LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
SYSTEM_PROMPT = "You play tic-tac-toe. Cells are numbered 1-9, left to right, top to bottom. Reply with one cell number."


def winner(board: list[str]) -> str | None:
    for a, b, c in LINES:
        if board[a] != " " and board[a] == board[b] == board[c]:
            return board[a]
    return None


def render(board: list[str]) -> str:
    cells = [board[i] if board[i] != " " else str(i + 1) for i in range(9)]
    return "\n".join(" ".join(cells[r * 3 : r * 3 + 3]) for r in range(3))


def board_of(obs: str) -> list[str] | None:
    """The board an observation renders (``render``'s three rows), or None."""
    rows = re.findall(r"^([XO1-9]) ([XO1-9]) ([XO1-9])$", obs, flags=re.M)
    if len(rows) != 3:
        return None
    cells = [c for row in rows for c in row]
    return [c if c in "XO" else " " for c in cells]


def parse_move(action: str) -> int | None:
    digits = re.findall(r"[1-9]", action)
    return int(digits[0]) - 1 if len(digits) == 1 else None


def opponent_move(board: list[str], me: str, rng: random.Random, skill: float) -> int:
    """Win if possible, else block, else random; with probability 1-skill just random."""
    free = [i for i in range(9) if board[i] == " "]
    if rng.random() < skill:
        other = "X" if me == "O" else "O"
        for mark in (me, other):
            for i in free:
                board[i] = mark
                w = winner(board)
                board[i] = " "
                if w == mark:
                    return i
    return rng.choice(free)


class TicTacToeEnv(SingleAgentEnv):
    """The agent plays X and moves first against a seeded heuristic opponent (O)."""

    def __init__(
        self, opponent_skill: float = 0.5, illegal_reward: float = -1.0, opening: int = 0
    ) -> None:
        if not 0.0 <= opponent_skill <= 1.0:
            raise ValueError(f"opponent_skill={opponent_skill} must be in [0, 1]")
        if isinstance(opening, bool) or not isinstance(opening, int) or not 0 <= opening <= 4:
            raise ValueError(f"opening={opening!r} must be an integer in [0, 4] (move pairs)")
        self.opponent_skill = opponent_skill
        self.illegal_reward = illegal_reward
        self.opening = opening
        self.board: list[str] = [" "] * 9
        self.rng = random.Random(0)
        self._reference: str | None = None

    @property
    def suggested_system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def env_reset(self, *, seed: int | None = None) -> tuple[str, Info]:
        self.board = [" "] * 9
        self.rng = random.Random(seed)
        if self.opening:
            self._play_opening()
        # the reference move draws from its own generator: the game's stays the opponent's
        free = [i for i in range(9) if self.board[i] == " "]
        self._reference = str(random.Random(f"ref-{seed}").choice(free) + 1)
        return self.env_current_obs(), {}

    def _play_opening(self) -> None:
        """0..opening random move pairs (X random, O by its policy) that end no game."""
        for _ in range(self.rng.randint(0, self.opening)):
            board = list(self.board)
            board[self.rng.choice([i for i in range(9) if board[i] == " "])] = "X"
            if winner(board) or " " not in board:
                return
            board[opponent_move(board, "O", self.rng, self.opponent_skill)] = "O"
            if winner(board) or " " not in board:
                return
            self.board = board

    def reference_completion(self) -> str:
        """A legal move of the current board, drawn uniformly (the warm start's target)."""
        if self._reference is None:
            raise RuntimeError("TicTacToeEnv.reference_completion called before env_reset")
        return self._reference

    def score_completion(self, completion: str, reference: str, prompt: str = "") -> float:
        """1.0 for a legal move of ``prompt``'s board (any free cell; the reference is one
        of them), else 0.0."""
        cells = board_of(prompt)
        if cells is None:  # no board in the prompt: the reference itself
            return 1.0 if parse_move(completion) == parse_move(reference) else 0.0
        move = parse_move(completion)
        return 1.0 if move is not None and cells[move] == " " else 0.0

    def env_current_obs(self) -> str:
        return f"You are X.\n{render(self.board)}\nYour move:"

    def env_step(self, action: str) -> StepOutcome:
        cell = parse_move(action)
        if cell is None or self.board[cell] != " ":
            return StepOutcome(
                "illegal move", self.illegal_reward, terminated=True, info={"illegal": True}
            )
        self.board[cell] = "X"
        if winner(self.board) == "X":
            return StepOutcome(render(self.board), 1.0, terminated=True, info={"result": "win"})
        if " " not in self.board:
            return StepOutcome(render(self.board), 0.0, terminated=True, info={"result": "draw"})
        self.board[opponent_move(self.board, "O", self.rng, self.opponent_skill)] = "O"
        if winner(self.board) == "O":
            return StepOutcome(render(self.board), -1.0, terminated=True, info={"result": "loss"})
        if " " not in self.board:
            return StepOutcome(render(self.board), 0.0, terminated=True, info={"result": "draw"})
        return StepOutcome(self.env_current_obs(), 0.0, info={})


class TwoPlayerTicTacToeEnv(LudicEnv[str, str, str]):
    """Agents "X" and "O" alternate; X moves first."""

    def __init__(self, illegal_reward: float = -1.0) -> None:
        self.illegal_reward = illegal_reward
        self.board: list[str] = [" "] * 9
        self.turn = "X"
        self.done = False

    @property
    def agent_ids(self) -> list[str]:
        return ["X", "O"]

    @property
    def active_agents(self) -> list[str]:
        return [] if self.done else [self.turn]

    @property
    def suggested_system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def _obs(self, me: str) -> str:
        return f"You are {me}.\n{render(self.board)}\n" + (
            "Your move:" if me == self.turn else "Wait."
        )

    def reset(self, seed: int | None = None) -> dict[str, tuple[str, Info]]:
        self.board, self.turn, self.done = [" "] * 9, "X", False
        return {a: (self._obs(a), {}) for a in self.agent_ids}

    def step(self, actions: dict[str, str]) -> dict[str, StepOutcome]:
        if self.done:
            raise RuntimeError("TwoPlayerTicTacToeEnv.step after the game ended; call reset()")
        me = self.turn
        other = "O" if me == "X" else "X"
        if me not in actions:
            raise KeyError(f"it is {me}'s turn; got actions for {sorted(actions)}")
        cell = parse_move(actions[me])
        if cell is None or self.board[cell] != " ":
            self.done = True
            return {
                me: StepOutcome(
                    "illegal move", self.illegal_reward, terminated=True, info={"illegal": True}
                ),
                other: StepOutcome("opponent made an illegal move", 0.0, terminated=True, info={}),
            }
        self.board[cell] = me
        if winner(self.board) == me:
            self.done = True
            return {
                me: StepOutcome(render(self.board), 1.0, terminated=True, info={"result": "win"}),
                other: StepOutcome(
                    render(self.board), -1.0, terminated=True, info={"result": "loss"}
                ),
            }
        if " " not in self.board:
            self.done = True
            return {
                a: StepOutcome(render(self.board), 0.0, terminated=True, info={"result": "draw"})
                for a in (me, other)
            }
        self.turn = other
        return {a: StepOutcome(self._obs(a), 0.0, info={}) for a in (me, other)}
