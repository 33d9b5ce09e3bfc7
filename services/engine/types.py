"""Typed requests and outputs of the inference engine (no protobuf here: services convert)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingOptions", "GenerateRequest", "SampleOutput", "KVHandoff", "EngineConfig", "FinishReason"]

FinishReason = str  # "stop" (eos, stop id or stop string) | "length" | "abort"


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

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first bad field."""
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")


@dataclass(frozen=True)
class KVHandoff:
    """The exact KV of a prompt prefix, as computed by a prefill replica.

    latent [layers, n, kv_lora_rank], rope [layers, n, qk_rope_head_dim],
    index_k [layers, n, index_head_dim] in the model dtype, for positions 0..n-1 of the
    prompt. Never re-quantized: the decode replica writes these bits into its cache.
    ``trusted``: it came from an authenticated peer (or this process), so its blocks may
    enter the prefix cache; untrusted KV serves its own request only.
    """

    prompt_ids: tuple[int, ...]
    latent: torch.Tensor
    rope: torch.Tensor
    index_k: torch.Tensor
    trusted: bool = False

    @property
    def num_tokens(self) -> int:
        return self.latent.shape[1]


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    options: SamplingOptions = SamplingOptions()
    handoff: KVHandoff | None = None         # prompt KV computed elsewhere (prefill replica)
    mode: str = "generate"                   # "generate" | "score" (prompt logprobs only) | "prefill" (export KV)


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
    handoff: KVHandoff | None = None         # mode "prefill": the KV of prompt[:-1]


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 512                    # KV blocks in the paged cache
    block_size: int = 16                     # tokens per block
    max_num_batched_tokens: int = 256        # token budget of one step (decode tokens + prefill chunks)
    max_num_seqs: int = 64                   # running samples at most
    enable_prefix_caching: bool = True       # reuse full prompt blocks across requests
    max_model_len: int | None = None         # defaults to the model's max_position_embeddings
