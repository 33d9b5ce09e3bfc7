"""Typed requests and outputs of the inference engine (no protobuf here: services convert).

No torch at import: a replica's server, whose engine runs in a child process, builds these and reads them
back without it (the tensors of a KV handoff are the only ones here, made where they are used).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from zerokl.vocab import FinishReason, SamplingOptions

if TYPE_CHECKING:
    import torch

__all__ = ["GenerateRequest", "SampleOutput", "KVHandoff", "EngineConfig", "OwnedWeights"]


class OwnedWeights(dict):
    """A state dict whose tensors are the engine's to keep (memory nobody else holds, e.g. the copy a
    replica made of the trainer's export): an engine whose weights were released (sleep level 2) takes
    them as its weights instead of copying them, so a wake holds one copy of the weights, not two."""

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


@dataclass(slots=True)
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
    # reuse full prompt blocks across requests
    enable_prefix_caching: bool = field(default=True, metadata={"flag": "prefix-caching"})
    max_model_len: int | None = None         # context length (None: the model's max_position_embeddings)
    cuda_graphs: bool = True                 # CUDA: capture decode steps as graphs per batch bucket (no effect on CPU)
    # Overlapped decode (vLLM's async scheduling): stage step N+1 while step N runs, N's tokens
    # handed to N+1 on the device. None (auto): on where the runner's decode path runs (CUDA); True
    # (on) also turns that path on on CPU (the same ops, eagerly). The same bits either way.
    overlap_decode: bool | None = None
    # Compile every kernel shape and capture every decode graph when the engine is built, so
    # serving compiles nothing later (runner.warm_up). Opt-in: it costs start-up time (on an H200,
    # `small` at max_num_seqs 256: ~50 s), and an engine built per call (rl.ports.LocalEnginePort)
    # would pay it every time.
    warm_up: bool = False
