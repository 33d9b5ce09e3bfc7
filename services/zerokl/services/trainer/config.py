"""The trainer's hyperparameters, :class:`TrainConfig`, and the check every surface runs where one enters.

What the trainer's clients, the Jobs API and the scheduler exchange and check without running a kernel,
so this module imports no torch and no numerics library: the scheduler and `zerokl jobs` load it and start
without them (tests/services/routing/test_scheduler_cli.py, tests/services/jobs/test_jobs_cli.py). The
trainer's compute is :mod:`zerokl.services.trainer.trainer`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from zerokl.services.runtime.errors import InvalidArgument
from zerokl.vocab import COMPUTE_DTYPES, InvalidOption

__all__ = ["MAX_LR", "TrainConfig", "check_train_config"]

#: The highest learning rate any surface accepts (TrainConfig.lr, OptimStep's lr and adam.learning_rate, a job's
#: learning_rate).
#: AdamW moves every trained weight by about lr per step whatever the gradient's size, and a model's
#: weights are O(0.01..1): at lr 1 one step already replaces them rather than updating them, and far
#: above it (lr 1e9) a step leaves finite weights whose activations overflow, weights no replica can
#: serve. Useful rates are 1e-6..1e-2.
MAX_LR = 1.0
_UINT32, _UINT64 = 2**32, 2**64         # the wire types of TrainConfig's counts and seed


@dataclass(frozen=True)
class TrainConfig:
    """The trainer's hyperparameters. Every field is a `zerokl serve trainer` flag (generated:
    services/zerokl/services/runtime/dataclass_flags.py, its help from the field's comment) and a field of
    ``zerokl.v1.TrainConfig`` (services/zerokl/services/trainer/convert.py), so the Jobs API's ``train_config``;
    tests/services/trainer/test_trainer_service.py fails for a field not wired through each."""

    lr: float = 1e-3                    # peak learning rate (AdamW), in (0, MAX_LR = 1]
    weight_decay: float = 0.0           # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.95)   # AdamW betas
    grad_clip: float = 1.0              # max global grad norm (0 = off)
    warmup_steps: int = 0               # linear warmup from 0
    total_steps: int = 0                # > 0: cosine decay to 10% of lr by then; 0 = constant after warmup
    lora_rank: int = 0                  # > 0: train LoRA adapters only (zerokl.kernels.model.lora)
    lora_alpha: float = 16.0            # LoRA scale alpha (update x alpha/rank)
    clip_eps: float = 0.2               # PPO clip range
    kl_coef: float = 0.0                # > 0: k3 KL penalty to the frozen initial policy
    dpo_beta: float = 0.1               # DPO temperature beta
    seed: int = 0                       # LoRA initialization seed
    indexer_loss_coef: float = 0.0      # > 0: add the DSA indexer's KL loss toward the attention distribution
    activation_checkpointing: bool = False   # recompute each block's activations in the backward
    logprob_chunk_rows: int = 0         # rows per chunk of the fused head + logprob (0 = by vocab size)
    # fp32 master weights: AdamW steps fp32 copies of the trained parameters and the model gets
    # them rounded to its dtype after each step. None = on when a trained parameter is not fp32:
    # a bf16 weight updated in bf16 loses any update below ~2^-8 of its value (8 mantissa bits),
    # so small-lr RL (1e-5..1e-4) barely moves it. The forward runs on the model's own weights
    # either way, so logprobs stay bitwise the engine's.
    master_weights: bool | None = None
    # The forward's dtype (the fleet's: `zerokl up --dtype`). None = the model's own. "bfloat16" /
    # "float32": the model is cast to it. "fp8": the FP8 forward of an FP8 fleet (NUMERICS.md, "FP8"):
    # fp32 masters (always on), each quantized projection's e4m3 values and block scales beside its
    # bf16 weight, re-quantized from the fp32 master after every optimizer step; the forward is the
    # replicas' FP8 product (logprobs equal bit for bit, KL 0), the backward the bf16 op's
    # (straight-through); serving_state_dict is the served FP8 form (e4m3 + scales).
    dtype: Literal["bfloat16", "float32", "fp8"] | None = None
    # Replay each SFT / PPO forward + backward from a CUDA graph per batch shape (None = on CUDA;
    # services/zerokl/services/trainer/step_graphs.py: the same kernels, the same bits, no per-kernel launch cost).
    # Batches are then padded to shape buckets (packed tokens, scored tokens and completion width,
    # each to at most 1/8 more: `bucket`) so that shapes recur: the forward's bits do not change
    # (every row is computed alone), the gradients are those of the padded batch. No effect on
    # CPU or the distributed trainer (its steps hold collectives). Unset is off with offload_optimizer, and on is
    # refused there: a captured step keeps its gradients (the model's bytes again) and activations on the device
    # between steps, the memory a co-located replica wakes into.
    cuda_graphs: bool | None = None
    # Keep the optimizer state (AdamW's moments, and the fp32 masters with master weights) in pinned host
    # memory between steps, for an inference replica sharing the device (co-location, `zerokl up --colocate`):
    # the optimizer step brings one parameter's state to the device at a time, steps it there (AdamW's
    # single-tensor step: the bits of the on-device step) and sends it back; the device memory the step used
    # goes back to the driver. Not with dtype fp8 or the distributed trainer.
    offload_optimizer: bool = False
    # Packed tokens (prompt + completion) per forward + backward of an SFT / DPO / PPO batch; 0 = the whole
    # batch at once. A larger batch runs as consecutive micro-batches of whole sequences (never a sequence
    # split), each loss weighted by its share of the batch's normalizer (tokens; GSPO's sequences; DPO's
    # pairs), gradients accumulated: the batch's gradient, at the memory of one micro-batch (512 answers of
    # 1,024 tokens are 536k tokens: one forward of them ran out of an H100's 80 GB). The split depends on the
    # batch alone, so two trainers with the same value (a job's fleet and its in-process twin) step to the
    # same bits; a different value changes the gradient's summation order, so its bits (never a logprob's).
    # Not with the distributed trainer (its ranks would split their shares into different numbers of forwards).
    micro_batch_tokens: int = 0

    def check(self) -> None:
        """Raise :class:`~zerokl.vocab.InvalidOption` naming the first field out of its range.

        Every surface that takes a TrainConfig runs it where the config enters (the trainer's flags,
        LoadWeights, a job's ``train_config`` at submission), so a bad value is refused by name before
        anything trains with it. Floats must be finite; ``lr`` at most :data:`MAX_LR`; AdamW's decay
        factor ``1 - lr * weight_decay`` stays in [0, 1]; betas in [0, 1) (torch's AdamW); counts and
        the seed within their wire types."""
        def bad(name: str, why: str, value: object) -> InvalidOption:
            return InvalidOption(name, f"{why}, got {value!r}")

        floats = {"lr": self.lr, "weight_decay": self.weight_decay, "grad_clip": self.grad_clip,
                  "lora_alpha": self.lora_alpha, "clip_eps": self.clip_eps, "kl_coef": self.kl_coef,
                  "dpo_beta": self.dpo_beta, "indexer_loss_coef": self.indexer_loss_coef}
        for name, value in floats.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, "must be a finite number", value)
        if not 0.0 < self.lr <= MAX_LR:
            raise bad("lr", f"must be in (0, {MAX_LR:g}] (the learning rate ceiling: AdamW moves each weight by "
                            "about lr a step)", self.lr)
        if self.weight_decay < 0.0 or self.lr * self.weight_decay > 1.0:
            raise bad("weight_decay", "must be >= 0 with lr * weight_decay <= 1 (AdamW multiplies each weight by "
                                      "1 - lr * weight_decay)", self.weight_decay)
        if not (isinstance(self.betas, tuple) and len(self.betas) == 2):
            raise bad("betas", "must be two numbers (beta1, beta2)", self.betas)
        for name, beta in zip(("beta1", "beta2"), self.betas):
            if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
                raise bad(name, "must be in [0, 1)", beta)
        for name in ("grad_clip", "kl_coef", "indexer_loss_coef"):
            if floats[name] < 0.0:
                raise bad(name, "must be >= 0 (0: off)", floats[name])
        for name in ("lora_alpha", "clip_eps", "dpo_beta"):
            if floats[name] <= 0.0:
                raise bad(name, "must be > 0", floats[name])
        counts = {"warmup_steps": _UINT32, "total_steps": _UINT32, "lora_rank": _UINT32,
                  "logprob_chunk_rows": _UINT32, "micro_batch_tokens": _UINT32, "seed": _UINT64}
        for name, limit in counts.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
                raise bad(name, f"must be an integer in [0, {limit})", value)
        for name in ("activation_checkpointing", "master_weights", "cuda_graphs", "offload_optimizer"):
            value = getattr(self, name)
            optional = name in ("master_weights", "cuda_graphs")
            if not isinstance(value, bool) and not (value is None and optional):
                raise bad(name, "must be true or false" + (" (or unset)" if optional else ""), value)
        if self.dtype is not None and self.dtype not in COMPUTE_DTYPES:
            raise bad("dtype", f"must be one of {', '.join(COMPUTE_DTYPES)} (or unset: the model's own)", self.dtype)
        if self.dtype == "fp8" and self.lora_rank > 0:
            raise bad("lora_rank", "must be 0 with dtype fp8 (it trains full weights: LoRA adapters would need "
                                   "their merged weights quantized per version)", self.lora_rank)
        if self.dtype == "fp8" and self.offload_optimizer:
            raise bad("offload_optimizer", "must be false with dtype fp8 (the e4m3 values are quantized from the "
                                           "fp32 masters on the device)", self.offload_optimizer)
        if self.offload_optimizer and self.cuda_graphs:
            raise bad("cuda_graphs", "must be unset or false with offload_optimizer (a captured step keeps its "
                                     "gradients and activations on the device between steps: the memory a "
                                     "co-located replica wakes into)", self.cuda_graphs)
        if self.dtype == "fp8" and self.master_weights is False:
            raise bad("master_weights", "must be unset or true with dtype fp8 (the e4m3 values are quantized "
                                        "from fp32 masters)", self.master_weights)


def check_train_config(config: TrainConfig, where: str) -> None:
    """INVALID_ARGUMENT naming ``where.<field>`` for the first field of ``config`` out of its range."""
    try:
        config.check()
    except InvalidOption as err:
        raise InvalidArgument.field(f"{where}.{err.field}", str(err)) from None
