"""RL tasks: problem generators, prompt/completion formats and reward functions."""

from zerokl.tasks import countdown

__all__ = ["countdown"]
