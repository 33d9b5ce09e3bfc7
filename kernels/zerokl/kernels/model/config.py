"""The model's configuration: one frozen ModelConfig (HF config.json names) and its presets.

Below everything else of the model package: the checkpoint format (checkpoint.py) reads and
writes it without the model graph (model.py), which re-exports it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

__all__ = ["ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """One frozen description of a GLM-5-family model (names follow the HF config.json keys)."""

    vocab_size: int = 154880                 # token ids are in [0, vocab_size)
    hidden_size: int = 6144                  # residual stream width D
    intermediate_size: int = 12288           # dense-MLP hidden width (dense layers)
    moe_intermediate_size: int = 2048        # per-expert hidden width I (routed and shared experts)
    num_hidden_layers: int = 78              # decoder blocks
    num_attention_heads: int = 64            # MLA heads H
    q_lora_rank: int = 2048                  # query latent width (q_a_proj output)
    kv_lora_rank: int = 512                  # KV latent width R: what the cache stores per token
    qk_nope_head_dim: int = 192              # per-head query/key width without RoPE
    qk_rope_head_dim: int = 64               # per-head RoPE width P (one shared rope key per token)
    v_head_dim: int = 256                    # per-head value width
    n_routed_experts: int = 256              # routed experts E
    n_shared_experts: int = 1                # shared experts (fused into one MLP of width I * n_shared)
    num_experts_per_tok: int = 8             # experts per token k
    n_group: int = 1                         # expert groups for group-limited routing
    topk_group: int = 1                      # groups a token may route into
    routed_scaling_factor: float = 2.5       # route_scale applied to the normalized weights
    norm_topk_prob: bool = True              # normalize the k routing weights to sum to 1
    mlp_layer_types: tuple[str, ...] = ()    # per layer "dense" | "sparse"; () = derive from first_k_dense_replace
    first_k_dense_replace: int = 3           # leading dense layers when mlp_layer_types is not given
    indexer_types: tuple[str, ...] = ()      # per layer "full" | "shared" (reuse the previous full layer's top-k)
    index_n_heads: int = 32                  # lightning-indexer heads Hi
    index_head_dim: int = 128                # indexer head width (its first qk_rope_head_dim dims get RoPE)
    index_topk: int = 2048                   # keys each query attends; <= this many keys means dense causal
    rms_norm_eps: float = 1e-5               # block and final RMSNorm eps (latent norms use 1e-6 as GLM-5 does)
    rope_theta: float = 1_000_000.0          # RoPE base
    rope_interleave: bool = True             # MLA RoPE pairs (2i, 2i+1) (GLM-5) vs half-split
    indexer_rope_interleave: bool = True     # the same for the indexer's RoPE
    max_position_embeddings: int = 202752    # longest supported context
    bos_token_id: int | None = 0             # prepended by the tokenizer side, not by the model
    eos_token_id: int | None = 1             # ends generation
    pad_token_id: int | None = None          # padding id in batched training inputs
    tie_word_embeddings: bool = False        # GLM-5 keeps lm_head separate

    def __post_init__(self):
        n = self.num_hidden_layers
        if not self.mlp_layer_types:
            dense = min(self.first_k_dense_replace, n)
            object.__setattr__(self, "mlp_layer_types", ("dense",) * dense + ("sparse",) * (n - dense))
        if not self.indexer_types:
            object.__setattr__(self, "indexer_types", ("full",) * n)
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
        problems = []
        if len(self.mlp_layer_types) != n or set(self.mlp_layer_types) - {"dense", "sparse"}:
            problems.append(f"mlp_layer_types must be {n} entries of 'dense'|'sparse'")
        if len(self.indexer_types) != n or set(self.indexer_types) - {"full", "shared"}:
            problems.append(f"indexer_types must be {n} entries of 'full'|'shared'")
        elif self.indexer_types[0] == "shared":
            problems.append("indexer_types[0] is 'shared' but no earlier layer has an indexer")
        if self.qk_rope_head_dim % 2 or self.index_head_dim < self.qk_rope_head_dim:
            problems.append("qk_rope_head_dim must be even and <= index_head_dim")
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            problems.append("n_routed_experts must divide into n_group groups and topk_group <= n_group")
        if self.num_experts_per_tok > self.n_routed_experts:
            problems.append("num_experts_per_tok > n_routed_experts")
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_nope + qk_rope) (GLM-5 uses default RoPE: no YaRN mscale)."""
        return self.qk_head_dim ** -0.5

    @staticmethod
    def preset(name: str) -> "ModelConfig":
        """'tiny' (CPU demo, ~2M params), 'small' (~200M, GPU benchmarks), 'glm5' (GLM-5's real dimensions)."""
        try:
            return _PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}: expected one of {sorted(_PRESETS)}") from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        """sha256 of the canonical JSON (services compare it before sharing work)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def replace(self, **changes) -> "ModelConfig":
        """A copy with `changes`; per-layer type lists are re-derived when the depth changes."""
        if "num_hidden_layers" in changes:
            changes.setdefault("mlp_layer_types", ())
            changes.setdefault("indexer_types", ())
        return dataclasses.replace(self, **changes)


_PRESETS = {
    # Sequences of 64-256 tokens exceed index_topk = 32, so the sparse path is always exercised.
    "tiny": ModelConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, moe_intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=16, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, first_k_dense_replace=1, index_n_heads=4, index_head_dim=32, index_topk=32,
        rope_theta=10000.0, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
    "small": ModelConfig(
        vocab_size=32768, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=8,
        num_attention_heads=16, q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
        first_k_dense_replace=1, index_n_heads=8, index_head_dim=64, index_topk=512, max_position_embeddings=8192,
    ),
    "glm5": ModelConfig(),
}
