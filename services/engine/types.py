"""Typed requests and outputs of the inference engine (no protobuf here: services convert)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["InvalidOption", "SamplingOptions", "GenerateRequest", "SampleOutput", "KVHandoff", "EngineConfig", "FinishReason",
           "MIN_TEMPERATURE", "MAX_TEMPERATURE", "MIN_TOP_P", "MAX_STOP_STRINGS", "MAX_STOP_LENGTH"]

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
    """A sampling option out of its range; ``field`` names it (``temperature``, ``stop``, ...)."""

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
class KVHandoff:
    """The exact KV of a prompt (or a prefix of it), as computed by a prefill replica.

    latent [layers, n, kv_lora_rank], rope [layers, n, qk_rope_head_dim],
    index_k [layers, n, index_head_dim] in the model dtype, for positions 0..n-1 of the
    prompt. Never re-quantized: the decode replica writes these bits into its cache.
    ``trusted``: it came from an authenticated peer (or this process), so its blocks may
    enter the prefix cache; untrusted KV serves its own request only.

    A prefill replica's handoff covers the WHOLE prompt and carries the first token each
    sample drew there (``first_token_ids[i]`` for sample i, with its logprob): the decode
    replica emits them without a forward and goes on from the second token. Without first
    tokens the handoff covers a strict prefix and the decode engine computes the rest.
    """

    prompt_ids: tuple[int, ...]
    latent: torch.Tensor
    rope: torch.Tensor
    index_k: torch.Tensor
    trusted: bool = False
    first_token_ids: tuple[int, ...] = ()    # [n]: sample i's token at position len(prompt)
    first_logprobs: tuple[float, ...] = ()   # [n]: their logprobs under the sampling distribution

    @property
    def num_tokens(self) -> int:
        return self.latent.shape[1]


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    options: SamplingOptions = SamplingOptions()
    handoff: KVHandoff | None = None         # prompt KV computed elsewhere (prefill replica)
    mode: str = "generate"                   # "generate" | "score" (prompt logprobs only) | "prefill" (export KV
                                             # and draw each sample's first token)


@dataclass
class SampleOutput:
    """What one engine step produced for one sample of a request (a streaming delta)."""

    request_id: str
    index: int                               # sample index in [0, n)
    token_ids: list[int]                     # new tokens this step
    logprobs: list[float]                    # their logprobs under the sampling distribution
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_logprobs: list[float] | None = None   # first delta only, when asked: [len(prompt) - 1]
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0               # prompt tokens served from the prefix cache
    text: str = ""                           # detokenized delta (engines with a tokenizer)
    handoff: KVHandoff | None = None         # mode "prefill": the KV of the prompt and each sample's first token
    error: str | None = None                 # finish_reason "error": the exception, "Type: message"


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 512                    # KV blocks in the paged cache
    block_size: int = 16                     # tokens per block
    max_num_batched_tokens: int = 256        # token budget of one step (decode tokens + prefill chunks)
    max_num_seqs: int = 64                   # running samples at most
    enable_prefix_caching: bool = True       # reuse full prompt blocks across requests
    max_model_len: int | None = None         # defaults to the model's max_position_embeddings
    cuda_graphs: bool = True                 # CUDA: capture decode steps as graphs per batch bucket (no effect on CPU)
