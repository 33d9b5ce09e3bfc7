"""The GLM-5-family model (glm_moe_dsa): MLA with a DSA lightning indexer and MoE, on zerokl.kernels.

Part of the numerical definition: the order of these ops is versioned with the kernels.
Reads top to bottom: attention batch and cache layouts, pure functions, leaf modules, block,
model (the config is config.py). No I/O here (checkpoint.py, below this module, reads and
writes the files; `Model.from_pretrained` hands it the model's constructor) and no parallelism:
tensor parallelism is applied from outside (parallel.py); the model only fixes the orders it
reproduces (split-tree row-parallel projections, per-instance head count). Each module names
the projections an FP8 model holds in e4m3 (FP8_PROJECTIONS, FP8_STACKED): fp8.py quantizes
them from below without naming the model's classes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from zerokl.kernels import ops, trace
from zerokl.kernels.model import checkpoint
from zerokl.kernels.model.config import ModelConfig
from zerokl.kernels.model.indexer_loss import indexer_kl_loss
from zerokl.kernels.portable import standard_normal

__all__ = ["ModelConfig", "AttentionBatch", "KVCache", "Model"]


# ----------------------------------------------------------------------------- attention batch

@dataclass
class AttentionBatch:
    """Where N new tokens sit and which keys each may attend (built by the caller, not the model).

    positions:   [N] int64, absolute position of each new token in its sequence.
    key_slots:   [N, L] int64, row n = the slots of positions 0..positions[n] of n's sequence, in
                 position order (column j is position j), -1 padded. Slots index the key store.
                 None in the training layout (below).
    write_slots: [N] int64, where each new token's latent/rope/indexer key is written.
    length:      the training layout's L: keys of its longest row (max position + 1).
    The key store is the paged KV cache when one is given, else the new tokens themselves.
    The training layout (key_slots None, no cache): sequences packed one after another, each
    from position 0, so token n's keys are tokens n - positions[n] .. n; no [N, L] table is
    built (attention walks the causal prefix implicitly, the sparse rows carry only their
    [N, index_topk] selection).
    """

    positions: torch.Tensor
    key_slots: torch.Tensor | None
    write_slots: torch.Tensor
    length: int = 0

    @property
    def key_width(self) -> int:
        """L: the width of key_slots, or the training layout's longest row."""
        return self.key_slots.shape[1] if self.key_slots is not None else self.length

    @staticmethod
    def for_sequences(batch: int, seq_len: int, device: torch.device | str = "cpu") -> "AttentionBatch":
        """The full-sequence (training) layout: `batch` sequences of `seq_len` tokens from position 0."""
        positions = torch.arange(seq_len, device=device).repeat(batch)
        return AttentionBatch(positions, None, torch.arange(batch * seq_len, device=device), seq_len)

    def explicit(self) -> "AttentionBatch":
        """The same batch with the [N, L] key table written out (the serving form; for tests)."""
        if self.key_slots is not None:
            return self
        return AttentionBatch(self.positions, _causal_slots(self.positions, self.length), self.write_slots)


def _causal_slots(positions: torch.Tensor, width: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Training layout: the key slots n - positions[n] + j for j <= positions[n], -1 after, of the
    token rows `rows` (default all): [len(rows), width]."""
    if rows is None:
        rows = torch.arange(positions.shape[0], device=positions.device)
    cols = torch.arange(width, device=positions.device)
    pos = positions[rows].view(-1, 1)
    start = rows.view(-1, 1) - pos
    return torch.where(cols <= pos, start + cols, torch.full_like(start + cols, -1))


@dataclass
class KVCache:
    """Paged per-layer key store: what MLA and the indexer need per token, nothing more.

    latent [layers, slots, kv_lora_rank] (normalized), rope [layers, slots, qk_rope_head_dim]
    (rotated), index_k [layers, slots, index_head_dim] (normed, rotated). slot = block * block_size
    + offset; block tables live with the caller. Stored in the model dtype, so a token read back
    from the cache has exactly the bits it had when computed.
    """

    latent: torch.Tensor
    rope: torch.Tensor
    index_k: torch.Tensor
    block_size: int

    @staticmethod
    def allocate(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> "KVCache":
        slots, n = num_blocks * block_size, config.num_hidden_layers
        return KVCache(
            torch.zeros(n, slots, config.kv_lora_rank, dtype=dtype, device=device),
            torch.zeros(n, slots, config.qk_rope_head_dim, dtype=dtype, device=device),
            torch.zeros(n, slots, config.index_head_dim, dtype=dtype, device=device),
            block_size,
        )


# ----------------------------------------------------------------------------- pure functions

def _heads_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-head projection: x [N, H, K] times weight[h].T ([H, M, K]) -> [N, H, M]."""
    n, h, k = x.shape
    flat = x.transpose(0, 1).reshape(h * n, k)
    out = ops.grouped_linear(flat, weight, [i * n for i in range(h + 1)])
    return out.view(h, n, -1).transpose(0, 1)


def _rope_part(x: torch.Tensor, rope_dim: int, positions: torch.Tensor, inv_freq: torch.Tensor,
               interleaved: bool, first: bool) -> torch.Tensor:
    """Rotate the rope_dim slice of x [N, H, D] (the first slice for the indexer, the last for MLA).
    split, not slicing: split's backward concatenates, where a slice's zero-fills all of x."""
    if first:
        pe, rest = x.split([rope_dim, x.shape[-1] - rope_dim], -1)
        return torch.cat([ops.rope(pe, positions, inv_freq, interleaved), rest], -1)
    rest, pe = x.split([x.shape[-1] - rope_dim, rope_dim], -1)
    return torch.cat([rest, ops.rope(pe, positions, inv_freq, interleaved)], -1)


def _store(cache_layer: torch.Tensor | None, new: torch.Tensor, write_slots: torch.Tensor) -> torch.Tensor:
    """The key store for this step: the cache with the new rows written in, or the new rows alone."""
    if cache_layer is None:
        return new
    cache_layer[write_slots] = new.detach().to(cache_layer.dtype)
    return cache_layer


# ----------------------------------------------------------------------------- leaf modules

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


def gemm_weight(module: nn.Module, name: str = "weight") -> torch.Tensor | ops.Fp8Weight:
    """A weight as the GEMM ops take it: the tensor, or, in an FP8 model (zerokl.kernels.model.fp8),
    its e4m3 values with the `<name>_scale_inv` block scales beside them; a trainer's FP8 model
    keeps `<name>` as the master and its quantized values in `<name>_fp8`."""
    scale = getattr(module, name + "_scale_inv", None)
    if scale is None:
        return getattr(module, name)
    values = getattr(module, name + "_fp8", None)
    if values is None:
        return ops.Fp8Weight(getattr(module, name), scale)
    return ops.Fp8Weight(values, scale, master=getattr(module, name))


class Linear(nn.Module):
    """A bias-free projection through the invariant GEMM (weight [out, in], as nn.Linear)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, gemm_weight(self))


class SplitLinear(Linear):
    """A row-parallel projection (attention o_proj): the canonical split-tree K reduction
    (ops.split_linear), so a tensor-parallel run joins the ranks' partials in this order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.split_linear(x, gemm_weight(self))


class Indexer(nn.Module):
    """DSA lightning indexer: picks the index_topk keys each query attends."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim
        self.topk, self.interleave = c.index_topk, c.indexer_rope_interleave
        self.wq_b = Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim)
        self.wk = Linear(c.hidden_size, c.index_head_dim)
        self.k_norm = LayerNorm(c.index_head_dim, 1e-6)
        self.weights_proj = Linear(c.hidden_size, c.index_n_heads)
        # relu(a * s) == s * relu(a) for s > 0: both HF scales are folded into the fp32 head weights.
        self.head_scale = (c.index_n_heads ** -0.5) * (c.index_head_dim ** -0.5)

    def keys(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """The one indexer key per token [N, index_head_dim] (LayerNorm, then RoPE on the first part)."""
        k = self.k_norm(self.wk(x)).unsqueeze(1)
        return _rope_part(k, self.rope_dim, positions, inv_freq, self.interleave, first=True).squeeze(1)

    def scores(self, x, q_latent, positions, inv_freq, key_store, key_slots) -> torch.Tensor:
        """Indexer scores [N, L] fp32 of each row's keys key_slots [N, L] (-inf at padding)."""
        n = x.shape[0]
        q = self.wq_b(q_latent).view(n, self.n_heads, self.head_dim)
        q = _rope_part(q, self.rope_dim, positions, inv_freq, self.interleave, first=True)
        trace.record("self_attn.indexer.q", q)
        w = ops.linear(x.float(), self.weights_proj.weight.float()) * self.head_scale
        trace.record("self_attn.indexer.head_weights", w)
        return ops.indexer_scores(q, key_store, w, key_slots)

    def select(self, x, q_latent, positions, inv_freq, key_store, key_slots) -> torch.Tensor:
        """Selected key slots [N, <= index_topk] in ascending position order, -1 padded."""
        scores = self.scores(x, q_latent, positions, inv_freq, key_store, key_slots)
        trace.record("self_attn.indexer.scores", scores)
        chosen = ops.topk_positions(scores, None, self.topk)          # ascending columns of key_slots
        trace.record("self_attn.indexer.chosen", chosen)
        return torch.where(chosen >= 0, key_slots.gather(1, chosen.clamp(min=0)), chosen)

    def select_sequences(self, x, q_latent, positions, inv_freq, key_store, length: int) -> torch.Tensor:
        """select() for the training layout: [N, index_topk] token slots. Rows with <= index_topk
        keys take all of them (what select gives them); only the longer rows are scored, over
        an [N_long, length] slot table (indexer_scores reads an explicit list)."""
        if trace.tracing():
            # Score every row, as the serving path does, so each token has its indexer records:
            # a row with <= index_topk keys selects all of them either way (the same bits).
            return self.select(x, q_latent, positions, inv_freq, key_store, _causal_slots(positions, length))
        selected = _causal_slots(positions, self.topk)
        long = torch.nonzero(positions >= self.topk).squeeze(1)
        if long.numel():
            table = _causal_slots(positions, length, long)
            selected[long] = self.select(x[long], q_latent[long], positions[long], inv_freq, key_store, table)
        return selected


class MLAttention(nn.Module):
    """Multi-head latent attention, absorbed form on every path, over indexer-selected keys."""

    # Linear submodules whose weights an FP8 model holds in e4m3 (zerokl.kernels.model.fp8); kv_b_proj
    # stays in the model dtype: the absorbed attention folds it into the queries and values.
    FP8_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")

    def __init__(self, c: ModelConfig, has_indexer: bool):
        super().__init__()
        self.c = c
        # Heads computed here: all of them, or this rank's share once tensor parallelism
        # (zerokl.kernels.model.parallel) has sharded q_b_proj / kv_b_proj / o_proj by heads.
        self.n_heads = h = c.num_attention_heads
        self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6)
        self.q_b_proj = Linear(c.q_lora_rank, h * c.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim))
        self.o_proj = SplitLinear(h * c.v_head_dim, c.hidden_size)
        self.indexer = Indexer(c) if has_indexer else None
        self.indexer_losses: list | None = None   # a list to append the indexer's KL loss to (indexer_loss.py)

    def forward(self, x, batch: AttentionBatch, inv_freq, cache: KVCache | None, layer: int,
                shared_selection: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        c, n = self.c, x.shape[0]
        h, dn, r, p = self.n_heads, c.qk_nope_head_dim, c.kv_lora_rank, c.qk_rope_head_dim
        # Views by split (and squeeze), not slicing: their backward joins the parts' gradients,
        # where slicing's zero-fills a whole tensor per slice and adds them.
        q_latent = self.q_a_layernorm(self.q_a_proj(x))                               # [N, q_lora]
        q_nope, q_pe = self.q_b_proj(q_latent).view(n, h, c.qk_head_dim).split([dn, p], -1)
        q_rope = ops.rope(q_pe, batch.positions, inv_freq, c.rope_interleave)         # [N, H, P]
        trace.record("self_attn.q_rope", q_rope)
        kv_in, k_pe = self.kv_a_proj_with_mqa(x).split([r, p], -1)
        latent = self.kv_a_layernorm(kv_in)                                            # [N, R]
        k_rope = ops.rope(k_pe.unsqueeze(1), batch.positions, inv_freq, c.rope_interleave).squeeze(1)
        trace.record("self_attn.k_rope", k_rope)
        latent_store = _store(cache.latent[layer] if cache else None, latent, batch.write_slots)
        rope_store = _store(cache.rope[layer] if cache else None, k_rope, batch.write_slots)

        training = batch.key_slots is None          # the training layout: keys are the new tokens
        if training and cache is not None:
            raise ValueError("the training layout (key_slots None) has no cache")
        if self.indexer is not None:
            index_store = _store(cache.index_k[layer] if cache else None,
                                 self.indexer.keys(x, batch.positions, inv_freq), batch.write_slots)
            if batch.key_width <= c.index_topk:
                selected = batch.key_slots        # every row has <= index_topk keys: all are selected
            elif training:
                selected = self.indexer.select_sequences(x, q_latent, batch.positions, inv_freq, index_store,
                                                         batch.length)
            else:
                selected = self.indexer.select(x, q_latent, batch.positions, inv_freq, index_store, batch.key_slots)
        else:
            selected = shared_selection           # None in the training layout: every causal key
        trace.record("self_attn.selected", selected)

        w_k, w_v = self.kv_b_proj.weight.view(h, dn + c.v_head_dim, r).split([dn, c.v_head_dim], 1)
        q_absorbed = _heads_linear(q_nope, w_k.transpose(1, 2).contiguous())         # [N, H, R]
        trace.record("self_attn.q_absorbed", q_absorbed)
        if training:
            o_latent = ops.mla_attention_sequences(q_absorbed, q_rope, latent, k_rope, batch.positions,
                                                   c.softmax_scale, selected)
        else:
            o_latent = ops.mla_attention(q_absorbed, q_rope, latent_store, rope_store, selected, c.softmax_scale)
        trace.record("self_attn.attention", o_latent)
        if self.indexer_losses is not None and self.indexer is not None and selected is not None and training \
                and torch.is_grad_enabled():
            self.indexer_losses.append(self._indexer_loss(x, q_latent, batch.positions, inv_freq, q_absorbed,
                                                          q_rope, latent, k_rope, selected))
        o = _heads_linear(o_latent.to(x.dtype), w_v.contiguous())                             # [N, H, v]
        trace.record("self_attn.v_heads", o)
        return self.o_proj(o.reshape(n, h * c.v_head_dim)), selected

    def _indexer_loss(self, x, q_latent, positions, inv_freq, q_absorbed, q_rope, latent, k_rope, selected):
        """The indexer's KL loss (indexer_loss.indexer_kl_loss) on the rows it chose keys for
        (more than index_topk keys); the main model's tensors enter detached."""
        long = torch.nonzero(positions >= self.c.index_topk).squeeze(1)
        x_d, sel = x.detach(), selected[long]
        keys = self.indexer.keys(x_d, positions, inv_freq)
        scores = self.indexer.scores(x_d[long], q_latent.detach()[long], positions[long], inv_freq, keys, sel)
        return indexer_kl_loss(scores, q_absorbed[long], q_rope[long], latent, k_rope, sel, self.c.softmax_scale)


class MLP(nn.Module):
    """SwiGLU MLP (dense layers and the shared experts); down_proj is row-parallel: split-tree K order."""

    FP8_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")    # quantized in an FP8 model (fp8.py)

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = Linear(dim, hidden), Linear(dim, hidden), Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.swiglu_mlp(x, gemm_weight(self.gate_proj), gemm_weight(self.up_proj), gemm_weight(self.down_proj))


class Router(nn.Module):
    """Sigmoid router; its weight and correction bias stay fp32 whatever the model dtype."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(c.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.c
        logits = ops.linear(x.float(), self.weight.float())
        trace.record("mlp.gate.logits", logits)
        return ops.moe_route(logits, self.e_score_correction_bias, c.num_experts_per_tok, c.n_group,
                             c.topk_group, c.routed_scaling_factor, c.norm_topk_prob)


class MoE(nn.Module):
    """Dropless routed SwiGLU experts plus the shared expert, added after the routed sum."""

    FP8_STACKED = ("gate_proj", "up_proj", "down_proj")        # stacked [E, out, in] expert weights quantized in an FP8 model

    def __init__(self, c: ModelConfig):
        super().__init__()
        e, i, d = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
        self.gate = Router(c)
        self.gate_proj = nn.Parameter(torch.empty(e, i, d))     # experts.E.gate_proj.weight, stacked
        self.up_proj = nn.Parameter(torch.empty(e, i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        self.shared_experts = MLP(d, i * c.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        experts = gemm_weight(self, "gate_proj"), gemm_weight(self, "up_proj"), gemm_weight(self, "down_proj")
        trace.record_experts(x, ids, *experts)
        routed = ops.moe_experts(x, weights, ids, *experts)
        trace.record("mlp.combine", routed)
        return (routed + self.shared_experts(x).float()).to(x.dtype)


# ----------------------------------------------------------------------------- block

class Block(nn.Module):
    def __init__(self, c: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MLAttention(c, has_indexer=c.indexer_types[layer] == "full")
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size) if c.mlp_layer_types[layer] == "dense" else MoE(c)

    def forward(self, x, batch, inv_freq, cache, shared_selection):
        attn, selected = self.self_attn(self.input_layernorm(x), batch, inv_freq, cache, self.layer, shared_selection)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), selected


# ----------------------------------------------------------------------------- model

class Model(nn.Module):
    """A GLM-5-family causal LM whose every path (train, prefill, decode) computes the same bits.

    `Model(ModelConfig.preset("tiny"), seed=0)` builds a seeded random model.
    """

    def __init__(self, config: ModelConfig, seed: int | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self._build(config)
        self.init_weights(seed)
        self.to(dtype)

    @classmethod
    def empty(cls, config: ModelConfig, dtype: torch.dtype = torch.float32) -> "Model":
        """A Model whose weights are left as allocated, nothing drawn: for a caller that sets every
        tensor of the state dict (a checkpoint load, a copy of another model's weights).

        The seeded draw of ``Model(config, seed)`` runs the portable RNG over every weight on
        the CPU, far slower than any load that would then overwrite it (docs/perf.md, issue 37)."""
        model = cls.__new__(cls)
        nn.Module.__init__(model)
        model._build(config)
        return model.to(dtype)

    def _build(self, config: ModelConfig) -> None:
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.register_buffer("inv_freq", ops.rope_inv_freq(config.qk_rope_head_dim, config.rope_theta), persistent=False)

    def to(self, *args, **kwargs):
        """Like nn.Module.to, but router weights and correction biases stay fp32 with their exact
        values (never rounded through the model's dtype: a bf16 model loaded from the same state
        dict holds the same bytes), inv_freq is brought back to fp32, and an FP8 model's e4m3
        weights and their scales keep their dtypes (they only move)."""
        routers = {f"{name}.{attr}" for name, m in self.named_modules() if isinstance(m, Router)
                   for attr in ("weight", "e_score_correction_bias")}
        keep = {name: t.data for name, t in [*self.named_parameters(), *self.named_buffers()]
                if t.dtype == torch.float8_e4m3fn or name.endswith("_scale_inv") or name in routers}
        super().to(*args, **kwargs)
        for name, t in keep.items():           # nn.Module.to replaces buffers: look each one up again
            owner, _, attr = name.rpartition(".")
            module = self.get_submodule(owner)
            moved = getattr(module, attr)
            kept = t.to(moved.device, torch.float32) if name in routers else t.to(moved.device)
            if isinstance(moved, nn.Parameter):
                moved.data = kept
            else:
                module.register_buffer(attr, kept)
        # inv_freq is derived, not loaded: every path builds it the same way (fp32, through .to's
        # dtype), so its bits are part of the definition as they are.
        self.inv_freq.data = self.inv_freq.data.float()
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.no_grad()
    def init_weights(self, seed: int | None,
                     normal: Callable[[tuple[int, ...]], torch.Tensor] | None = None) -> None:
        """Normal(0, 0.02) projections (down/out projections scaled by depth), unit norms, zero biases.

        The draws come from kernels/zerokl/kernels/portable.standard_normal, so a seeded model has the same
        weights on every machine (torch.randn's CPU kernel follows the ISA). ``normal`` (shape -> standard
        normal draws, one call a parameter in order) replaces them: a benchmark draws on its device with a
        seeded generator of its own (tools/bench/bench_train.py:build_model), by the same recipe."""
        if normal is None:
            g = torch.Generator().manual_seed(0 if seed is None else seed)
            normal = lambda shape: standard_normal(shape, g)  # noqa: E731
        depth_scale = (2 * self.config.num_hidden_layers) ** -0.5
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif name.endswith("norm.bias"):
                p.zero_()
            else:
                std = 0.02 * (depth_scale if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")) else 1.0)
                p.copy_(normal(tuple(p.shape)) * std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Training path: input_ids [B, S] (each row from position 0) -> logits [B, S, V]."""
        b, s = input_ids.shape
        batch = AttentionBatch.for_sequences(b, s, input_ids.device)
        return self.forward_tokens(input_ids.reshape(-1), batch).view(b, s, -1)

    def forward_tokens(self, tokens: torch.Tensor, batch: AttentionBatch, cache: KVCache | None = None,
                       logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Serving path and the core of every path: N new tokens [N] -> logits [N, V] in the model dtype.

        With a cache, each token's latent, rope key and indexer key are written at
        batch.write_slots and attention reads the cache; without one, the new tokens are the
        key store. Either way each token's logits depend only on its own sequence.
        logits_rows [M] picks the rows that need logits (the final norm and lm_head are
        per-row, so the picked rows have the same bits as in the full output).
        """
        x = self.hidden_states(tokens, batch, cache)
        if logits_rows is not None:
            x = x[logits_rows]
        return self.lm_head(self.norm(x))

    def hidden_states(self, tokens: torch.Tensor, batch: AttentionBatch, cache: KVCache | None = None) -> torch.Tensor:
        """The residual stream [N, D] after the last block, before the final norm: forward_tokens
        without the head (the trainer's fused logprob head, zerokl.kernels.logprob, reads it)."""
        x = self.embed_tokens(tokens)
        selected = None
        for block in self.layers:
            x, selected = block(x, batch, self.inv_freq, cache, selected)
        return x

    # Thin entry points; the I/O lives in zerokl.kernels.model.checkpoint, below this module (it builds
    # the model it reads through the constructor handed to it: cls.empty).
    @classmethod
    def from_pretrained(cls, directory, dtype: torch.dtype | None = None) -> "Model":
        """Load a glm_moe_dsa checkpoint (config.json + safetensors, HF parameter names)."""
        return checkpoint.load_pretrained(directory, dtype, empty=cls.empty)

    def save_pretrained(self, directory, max_shard_bytes: int = checkpoint.DEFAULT_MAX_SHARD_BYTES) -> None:
        """Write config.json + safetensors with HF parameter names (sharded with an index when large)."""
        checkpoint.save_pretrained(self, directory, max_shard_bytes)
