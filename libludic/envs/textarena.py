"""TextArenaEnv: any TextArena game as a multi-agent env, one agent per player.

TextArena (the optional extra ``textarena``) holds text games for one or more players
(``TicTacToe-v0``, ``Nim-v0``, ``KuhnPoker-v0``, ...) that reset and step offline; this env
is the ``textarena`` kind. Roles are the players' ids as strings (``"0"``, ``"1"``, ...),
``active_agents`` the player whose turn it is.

Observations: TextArena addresses messages to each player (its prompt, the board, the other
players' moves, a rejected move's reason); each agent gets the messages addressed to it
since its last observation, one ``[GAME] ...`` or ``[Player k] ...`` line each, the way
TextArena's LLMObservationWrapper writes them. The game id's observation wrappers, which
re-render a player's whole history every turn for a stateless agent, are bypassed: a ludic
agent keeps its own dialog. Its action wrappers apply (``TicTacToe-v0`` turns a bare ``4``
into ``[4]``; ``TicTacToe-v0-raw`` has none).

Rewards: 0 while the game runs; at its end each player gets its entry of TextArena's final
rewards (two-player games: win +1, loss -1, draw 0). An invalid move is TextArena's to
judge: in its two-player games the mover sees the reason and moves again, and a second
invalid move in a row loses (mover -1, opponent +1).

TextArena seeds Python's global ``random`` at reset; the env gives the game a generator
state of its own around each reset and step, so other envs of the process keep theirs.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import textarena
from textarena.envs.registration import ENV_REGISTRY

from libludic.envs.env import LudicEnv
from libludic.types import Info, StepOutcome

GAME_ID = -1  # TextArena's sender id of the game's own messages (textarena.GAME_ID)


def game_ids() -> list[str]:
    """The registered game ids without their ``-raw``/``-train`` variants."""
    return sorted(k for k in ENV_REGISTRY if not k.endswith(("-raw", "-train")))


def check_game(game: str) -> None:
    if not isinstance(game, str):
        raise ValueError(f"textarena game={game!r} must be one game id, e.g. 'TicTacToe-v0'")
    if game in ENV_REGISTRY:
        return
    near = difflib.get_close_matches(game, list(ENV_REGISTRY), n=3)
    hint = f" (did you mean {', '.join(map(repr, near))}?)" if near else ""
    ids = game_ids()
    raise ValueError(
        f"textarena game={game!r} is not a TextArena game id{hint}; the {len(ids)} games "
        f"(each also as <id>-raw and most as <id>-train): {', '.join(ids)}"
    )


def game_parameters(game: str) -> list[str]:
    """The keyword arguments of ``game``'s env class (for an error message)."""
    entry = ENV_REGISTRY[game].entry_point
    try:
        if isinstance(entry, str):
            module, name = entry.split(":")
            entry = getattr(importlib.import_module(module), name)
        return [p for p in inspect.signature(entry).parameters if p != "self"]
    except (ImportError, AttributeError, ValueError, TypeError):
        return []


def render(messages: list[tuple[int, str, Any]], roles: Mapping[int, str]) -> str:
    """TextArena messages ``(sender, text, type)`` as ``[sender] text`` lines."""
    return "\n".join(
        f"[{'GAME' if sender == GAME_ID else roles.get(sender, f'Player {sender}')}] {text}"
        for sender, text, _type in messages
    )


class TextArenaEnv(LudicEnv[str, str, str]):
    """One TextArena game, ``num_players`` agents "0".."n-1" (see the module docstring)."""

    def __init__(
        self,
        game: str = "TicTacToe-v0",
        num_players: int = 2,
        game_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        check_game(game)
        if isinstance(num_players, bool) or not isinstance(num_players, int) or num_players < 1:
            raise ValueError(f"textarena num_players={num_players!r} must be an integer >= 1")
        if game_kwargs is not None and not isinstance(game_kwargs, Mapping):
            raise ValueError(f"textarena game_kwargs={game_kwargs!r} must be a mapping")
        try:
            self.env = textarena.make(game, **dict(game_kwargs or {}))
        except TypeError as e:
            raise ValueError(
                f"textarena game {game!r} rejected game_kwargs={dict(game_kwargs or {})}: {e}; "
                f"its keyword arguments: {game_parameters(game)}"
            ) from e
        self.game = game
        self.num_players = num_players
        self.done = True  # until reset
        self._rng_state = random.Random(0).getstate()

    @property
    def agent_ids(self) -> list[str]:
        return [str(p) for p in range(self.num_players)]

    @property
    def active_agents(self) -> list[str]:
        return [] if self.done else [str(self.env.state.current_player_id)]

    @contextmanager
    def _game_random(self) -> Iterator[None]:
        """Python's global ``random`` holds the game's state inside, the caller's after."""
        outer = random.getstate()
        random.setstate(self._rng_state)
        try:
            yield
        finally:
            self._rng_state = random.getstate()
            random.setstate(outer)

    def _drain(self, player: int) -> str:
        """The messages addressed to ``player`` since its last observation."""
        state = self.env.state
        messages = list(state.observations.get(player, []))
        state.observations[player] = []
        return render(messages, state.role_mapping)

    def reset(self, seed: int | None = None) -> dict[str, tuple[str, Info]]:
        self._rng_state = random.Random(seed).getstate()
        with self._game_random():
            try:
                self.env.reset(num_players=self.num_players, seed=seed)
            except AssertionError as e:  # its states assert their player count
                raise ValueError(
                    f"textarena game {self.game!r} cannot be played with "
                    f"num_players={self.num_players}: {e}"
                ) from e
        self.done = False
        return {str(p): (self._drain(p), {"player_id": p}) for p in range(self.num_players)}

    def step(self, actions: dict[str, str]) -> dict[str, StepOutcome]:
        if self.done:
            raise RuntimeError(f"TextArenaEnv({self.game}).step with no game running; reset()")
        mover = str(self.env.state.current_player_id)
        if mover not in actions:
            raise KeyError(f"it is player {mover}'s turn; got actions for {sorted(actions)}")
        with self._game_random():
            done, _info = self.env.step(actions[mover])
        if not done:
            out: dict[str, StepOutcome] = {}
            for p in range(self.num_players):
                obs = self._drain(p)
                if obs or str(p) == mover:
                    out[str(p)] = StepOutcome(obs, 0.0, info={})
            return out
        self.done = True
        with self._game_random():
            rewards, game_info = self.env.close()  # TextArena: (rewards, per-player info)
        outcomes = {}
        for p in range(self.num_players):
            player_info = dict((game_info or {}).get(p, {}))
            reason = player_info.get("reason")
            obs = "\n".join(s for s in (self._drain(p), f"[GAME] {reason}" if reason else "") if s)
            info = {k: v for k, v in player_info.items() if isinstance(v, str | int | float)}
            outcomes[str(p)] = StepOutcome(
                obs, float((rewards or {}).get(p, 0.0)), terminated=True, info=info
            )
        return outcomes
