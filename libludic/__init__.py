"""libludic: classical policy-gradient RL for LLMs (env + parser rewards, credit + loss)."""

__version__ = "0.1.0"
