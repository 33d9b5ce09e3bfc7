"""RL tasks: problem generators, prompt/completion formats and reward functions."""

from zerokl.tasks import countdown, countdown_trace

__all__ = ["countdown", "countdown_trace"]
