"""Guess the number, as a ludic plugin package: ``GuessEnv`` (env.py), the ``bisect`` tool
(tools.py) and the ``fewer_guesses`` reward function (rewards.py)."""
