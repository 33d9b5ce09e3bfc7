"""The shared vocabulary: the user-facing types every layer names, imported from here only.

A request's sampling options, how a sample finished, and a sampled completion with its
behaviour logprobs and reward (what the RL loop hands the trainer) are spoken by the command line, the
protobuf converters of every service, the scheduler, the RL loop, the trainer service and the
engine. They live here, in a module that imports nothing of zerokl's, so no layer reaches into
another's implementation for them (vLLM keeps ``sampling_params.py`` apart from the batched
sampling metadata in the same way): the engine turns :class:`SamplingOptions` into its packed
per-row tensors (``zerokl.kernels.sampling.SamplingParams``, the kernel's struct) and the
services into the wire message (``zerokl.v1.SamplingParams``).

The import rule (tests/test_import_graph.py): no cycle between the packages of zerokl; this
module and ``zerokl.tokenizer`` sit below all of them.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FinishReason", "InvalidOption", "SamplingOptions", "Completion", "Rollout", "COMPUTE_DTYPES",
           "MIN_TEMPERATURE", "MAX_TEMPERATURE", "MIN_TOP_P", "MAX_STOP_STRINGS", "MAX_STOP_LENGTH"]

# The dtypes a fleet, a replica or a trainer is asked to compute in (`--dtype`, TrainConfig.dtype), as spelled
# there: zerokl.kernels.dtypes.COMPUTE_DTYPES, spelled here so that the command line, a replica's server and the
# trainer's config read them without torch (tests/kernels/test_dtypes.py checks that they agree).
COMPUTE_DTYPES = ("float32", "bfloat16", "fp8")

# "stop" (eos, stop id or stop string) | "length" | "abort" | "error" (the engine failed on this
# request alone: SampleOutput.error says how; services turn it into the request's error status)
FinishReason = str

# Sampling divides fp32 logits by the temperature: a positive temperature below the
# minimum (or one whose float32 is 0 or a denormal) would blow finite logits up to inf
# and the distribution to NaN; one above the maximum, or inf, flattens every row to the
# uniform distribution (temperature=inf with top_k=3 always drew ids 0, 1, 2) and,
# beyond float32's range, cannot even be converted. 0 means greedy.
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 1e6
# top_p is compared as a float32: a positive top_p that rounds to 0 there would keep
# no token at all. The smallest normal float32 is the floor.
MIN_TOP_P = 2.0 ** -126
MAX_STOP_STRINGS = 16           # stop strings per request
MAX_STOP_LENGTH = 1024          # characters per stop string
_INT32_MAX = 2**31 - 1          # the wire type of top_k, max_tokens and n


class InvalidOption(ValueError):
    """An option out of its range; ``field`` names it (a sampling option: ``temperature``, ``stop``, ...;
    a TrainConfig field: ``lr``, ``beta1``, ...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingOptions:
    """Per-request sampling, as vLLM/SGLang expose it."""

    temperature: float = 1.0                 # 0 = greedy (ties to the lowest id)
    top_p: float = 1.0                       # nucleus mass; 1.0 = off
    top_k: int = 0                           # 0 = off
    seed: int = 0                            # with the sample index and position, fixes every draw
    max_tokens: int = 16                     # generated tokens per sample (> 0)
    stop: tuple[str, ...] = ()               # stop strings (need a tokenizer); not included in the output
    stop_token_ids: tuple[int, ...] = ()     # extra stop ids (included in the output, like eos)
    ignore_eos: bool = False                 # keep going past eos
    n: int = 1                               # samples of this prompt; they share its KV
    prompt_logprobs: bool = False            # also return the logprob of every prompt token

    def check(self) -> None:
        """Raise InvalidOption naming the first field out of its range (what needs no model).

        Services run this where a request enters (the protobuf converters), so a
        scheduler refuses what every replica would refuse; the engine runs it again
        through :meth:`validate`. Every float must be finite and in a range whose
        float32 value cannot overflow what it feeds (see MIN_TEMPERATURE, MIN_TOP_P).
        """
        t = self.temperature
        if not (t == 0.0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
            raise InvalidOption("temperature", f"temperature must be 0 (greedy) or in "
                                               f"[{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {t!r}")
        if not (MIN_TOP_P <= self.top_p <= 1.0):
            raise InvalidOption("top_p", f"top_p must be in (0, 1] and at least {MIN_TOP_P:.3g} (the smallest "
                                         f"normal float32), got {self.top_p!r}")
        if not 0 <= self.top_k <= _INT32_MAX:
            raise InvalidOption("top_k", f"top_k must be in [0, {_INT32_MAX}] (0: off), got {self.top_k}")
        if not 0 < self.max_tokens <= _INT32_MAX:
            raise InvalidOption("max_tokens", f"max_tokens must be > 0 and at most {_INT32_MAX}, "
                                              f"got {self.max_tokens}")
        if not 1 <= self.n <= _INT32_MAX:
            raise InvalidOption("n", f"n must be >= 1, got {self.n}")
        if not 0 <= self.seed < 2**64:
            raise InvalidOption("seed", f"seed must be in [0, 2**64) (the proto's uint64), got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidOption("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for text in self.stop:
            if not text:
                raise InvalidOption("stop", "stop strings must not be empty (one would match before any text)")
            if len(text) > MAX_STOP_LENGTH:
                raise InvalidOption("stop", f"stop strings must be at most {MAX_STOP_LENGTH} characters, "
                                            f"got {len(text)}")

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidOption naming the first bad field (:meth:`check`, then the vocabulary)."""
        self.check()
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidOption("stop_token_ids", f"stop_token_ids {bad[:8]} are outside the vocabulary "
                                                  f"[0, {vocab_size})")


@dataclass(frozen=True)
class Completion:
    """A prompt and its completion, with the sampling distribution the completion was drawn from."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    temperature: float = 1.0            # 0 = greedy: logprobs are the plain log_softmax
    top_k: int = 0
    top_p: float = 1.0


@dataclass(frozen=True)
class Rollout:
    """A sampled completion as inference reported it (behaviour logprobs) with its reward."""

    sequence: Completion
    logprobs: tuple[float, ...]
    reward: float
    weights_version: str = ""
