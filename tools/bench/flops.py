"""The work a model does, counted once: parameters by role, MFU's FLOPs, the bf16 HBM bound's bytes (bench_train,
bench_rollout, bench_serve; bench_fp8_serve counts its FP8 bytes tensor by tensor).

FLOPs count multiply-adds as 2 and only what runs as a matrix product: the embedding table is a lookup (no
FLOPs), the lm_head a projection of the rows that need logits (every row in training, one row a prompt in
prefill), a routed expert's weights only for the num_experts_per_tok of n_routed_experts a token is sent to.
Attention is the absorbed MLA's: scores over the kv_lora_rank latent plus the rope part, the output over the
latent, per attended key (min(position + 1, index_topk) on sparse layers), and the DSA indexer's scores over
every earlier key on its "full" layers once a sequence passes index_topk (forward only: it has no backward).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from zerokl.kernels.model import Model, ModelConfig

__all__ = ["PEAK_BF16", "PEAK_FP8", "ParamCounts", "param_counts", "total_params", "active_params",
           "prefill_flops", "train_attention_flops_per_token", "decode_weight_bytes", "hbm_bytes_per_s"]

PEAK_BF16 = 989e12      # H100 / H200 SXM dense bf16 FLOP/s
PEAK_FP8 = 1979e12      # the same, dense FP8
# HBM bytes/s by GPU, the decode bounds' denominator: H100 SXM (80 GB HBM3) 3.35 TB/s, H200 (141 GB HBM3e) 4.8 TB/s.
_HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}


def hbm_bytes_per_s(device_name: str | None = None) -> float:
    """HBM bandwidth of the GPU named ``device_name`` (default: this process's CUDA device), for the decode
    benches' HBM bounds; the H200's where there is no CUDA device (CPU smoke runs) or the name is neither."""
    if device_name is None:
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((v for k, v in _HBM_BYTES_PER_S.items() if k in device_name), _HBM_BYTES_PER_S["H200"])


@dataclass(frozen=True)
class ParamCounts:
    """A model's parameters by what a token does with them."""

    embedding: int      # the token table: a lookup
    lm_head: int        # the output projection: once per row that needs logits
    routed: int         # every routed expert of every MoE layer (a token uses k / E of them)
    rest: int           # attention, the indexer, dense MLPs, shared experts, routers, norms: every token
    experts_per_token: float   # num_experts_per_tok / n_routed_experts

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.routed + self.rest


@functools.lru_cache(maxsize=32)
def param_counts(config: ModelConfig) -> ParamCounts:
    """The model's parameters by role, read off the model itself built on the meta device (instant)."""
    with torch.device("meta"):
        model = Model.empty(config)
    counts = {"embedding": 0, "lm_head": 0, "routed": 0, "rest": 0}
    for name, p in model.named_parameters():
        role = ("embedding" if name.startswith("embed_tokens.") else "lm_head" if name.startswith("lm_head.")
                else "routed" if name.endswith(("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")) else "rest")
        counts[role] += p.numel()
    return ParamCounts(**counts, experts_per_token=config.num_experts_per_tok / config.n_routed_experts)


def total_params(config: ModelConfig) -> int:
    return param_counts(config).total


def active_params(config: ModelConfig) -> int:
    """Parameters a training token multiplies by: all but the embedding table and the routed experts it is not
    sent to (the lm_head included: training scores every row). MFU = 6 x this x tokens/s (+ attention)."""
    pc = param_counts(config)
    return pc.rest + pc.lm_head + round(pc.routed * pc.experts_per_token)


def prefill_flops(config: ModelConfig, prompts: int, length: int) -> float:
    """Forward FLOPs of prefilling ``prompts`` prompts of ``length`` tokens (logits for each prompt's last row)."""
    c, pc = config, param_counts(config)
    body = pc.rest + pc.routed * pc.experts_per_token
    flops = 2 * body * prompts * length + 2 * pc.lm_head * prompts
    keys = sum(min(i + 1, c.index_topk) for i in range(length))
    per_key = 2 * c.num_attention_heads * (2 * c.kv_lora_rank + c.qk_rope_head_dim)      # scores + output, a layer
    flops += prompts * c.num_hidden_layers * per_key * keys
    if length > c.index_topk:
        full = sum(t == "full" for t in c.indexer_types)
        flops += prompts * full * 2 * c.index_n_heads * c.index_head_dim * length * (length + 1) // 2
    return flops


def train_attention_flops_per_token(config: ModelConfig, seq: int) -> float:
    """Training FLOPs of attention per token (forward + backward: 3x the forward's; the indexer's forward
    once), averaged over the positions of a ``seq``-token sequence."""
    c = config
    causal = (seq + 1) / 2                                                    # mean keys in a causal prefix
    attended = causal if seq <= c.index_topk else sum(min(i + 1, c.index_topk) for i in range(seq)) / seq
    flops = 3 * 2 * c.num_attention_heads * (2 * c.kv_lora_rank + c.qk_rope_head_dim) * attended * c.num_hidden_layers
    if seq > c.index_topk:
        full = sum(t == "full" for t in c.indexer_types)
        flops += 2 * c.index_n_heads * c.index_head_dim * causal * full
    return flops


def decode_weight_bytes(config: ModelConfig, batch: int, bytes_per_param: float = 2.0) -> float:
    """Weight bytes one decode step of ``batch`` rows reads: every non-expert weight but the embedding table,
    the lm_head, and the routed experts the batch touches (the expected distinct experts of batch x k uniform
    picks among E, per MoE layer)."""
    pc = param_counts(config)
    e, k = config.n_routed_experts, config.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)
    return bytes_per_param * (pc.rest + pc.lm_head + pc.routed * touched / e)
