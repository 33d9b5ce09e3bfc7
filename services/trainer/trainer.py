"""The trainer: SFT, DPO and GRPO/PPO-clip updates on the same forward that serving runs.

Logprobs are recomputed by the model's training path and the sampling distribution of
zerokl.kernels.sampling, so for weights version v they are bitwise the numbers the
inference engine sampled with. The head and the logprob run fused in row chunks
(zerokl.kernels.logprob: never [tokens, vocab] fp32 for the whole batch), only on the
rows that predict a completion token, and blocks can recompute their activations in
the backward (TrainConfig.activation_checkpointing); neither changes a forward bit; the train/inference KL is reported every step as an
exact number, and so is the count of tokens that differ (0).
A Tinker-style low-level API (forward_logprobs, forward_backward, optim_step, state
save/load) lets callers drive their own loop; sft_step/dpo_step/grpo_step compose it.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from zerokl.kernels.logprob import fused_logprobs
from zerokl.kernels.sampling import SamplingParams, sampling_logprobs
from zerokl.kernels.model import Model
from zerokl.kernels.model.fp8 import is_fp8, refresh_fp8, serving_fp8_model, trainable_fp8
from zerokl.kernels.model.fp8 import serving_state_dict as fp8_serving_state_dict
from zerokl.kernels.model.indexer_loss import indexer_losses
from zerokl.kernels.model.lora import apply_lora, lora_parameters, merged_state_dict
from zerokl.kernels.model.model import AttentionBatch
from zerokl.kernels.model.recompute import checkpoint_blocks
from zerokl.services.trainer.losses import dpo_loss, group_advantages, ppo_clip_loss, sft_loss
from zerokl.services.trainer.optim import NonFiniteStep, optimizer_step
from zerokl.vocab import Completion, Rollout

__all__ = ["DTYPES", "TrainConfig", "Trainer"]

#: TrainConfig.dtype's choices -> the model dtype (fp8: e4m3 projections, bf16 elsewhere).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class TrainConfig:
    """The trainer's hyperparameters. Every field is a `zerokl serve trainer` flag (generated:
    services/runtime/dataclass_flags.py, its help from the field's comment) and a field of
    ``zerokl.v1.TrainConfig`` (services/trainer/convert.py), so the Jobs API's ``train_config``;
    tests/services/trainer/test_trainer_service.py fails for a field not wired through each."""

    lr: float = 1e-3                    # peak learning rate (AdamW)
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


@dataclass
class TokenBatch:
    """Completions laid out for the training forward (:meth:`Trainer.batch_of`)."""

    input_ids: torch.Tensor             # [B, S] padded
    targets: torch.Tensor               # [B, T] completion tokens, padded
    mask: torch.Tensor                  # [B, T]
    rows: torch.Tensor                  # [Ntok] flat index into the B*S positions: the one predicting each completion token
    params: SamplingParams              # per completion token


class Trainer:
    """Owns a model, its optimizer and its step counter."""

    def __init__(self, model: Model, config: TrainConfig = TrainConfig()):
        self.model, self.config = model, config
        # A served FP8 model (an FP8 checkpoint) with no dtype asked for trains on its FP8 forward too.
        self.fp8 = config.dtype == "fp8" or (config.dtype is None and is_fp8(model))
        self._cast(model, config, self.fp8)
        self.reference = copy.deepcopy(model).eval() if config.kl_coef > 0 else None
        if self.reference is not None:
            for p in self.reference.parameters():
                p.requires_grad_(False)
        if config.lora_rank > 0:
            apply_lora(model, config.lora_rank, config.lora_alpha, seed=config.seed)
            params = lora_parameters(model)
        else:
            params = [p for p in model.parameters() if p.requires_grad]
        self.params = params
        self.master_weights = (config.master_weights if config.master_weights is not None
                               else self.fp8 or any(p.dtype != torch.float32 for p in params))
        # With master weights the optimizer owns fp32 copies of the trained parameters (same order
        # as self.params); the model's Parameters stay the objects everything else references.
        self.masters = [p.detach().float().clone() for p in params] if self.master_weights else None
        # foreach=False: one fixed loop over parameters (deterministic on every backend).
        self.optimizer = torch.optim.AdamW(self._optimized, lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay, foreach=False)
        self.step = 0
        self.tokens_seen = 0

    @staticmethod
    def _cast(model: Model, config: TrainConfig, fp8: bool) -> None:
        """Bring `model` to config.dtype in place (see TrainConfig.dtype); refuse what cannot hold."""
        if config.dtype is None and not fp8:
            return
        if config.dtype is not None and config.dtype not in DTYPES:
            raise ValueError(f"TrainConfig.dtype {config.dtype!r}: expected one of {', '.join(DTYPES)} or None")
        if not fp8:
            if is_fp8(model):
                raise ValueError(f"TrainConfig.dtype {config.dtype!r} on an FP8 model: load its checkpoint in "
                                 f"{config.dtype} (Model.from_pretrained(dir, dtype)) to dequantize it")
            model.to(DTYPES[config.dtype])
            return
        if config.lora_rank > 0:
            raise ValueError("TrainConfig.dtype 'fp8' trains full weights: LoRA adapters would need their merged "
                             "weights quantized per version (lora_rank 0)")
        if config.master_weights is False:
            raise ValueError("TrainConfig.dtype 'fp8' keeps fp32 master weights: the e4m3 values are quantized "
                             "from them (master_weights None or True)")
        trainable_fp8(model)

    @property
    def _optimized(self) -> list[torch.Tensor]:
        """The tensors AdamW steps: the fp32 masters, or the trained parameters themselves."""
        return self.masters if self.masters is not None else self.params

    @property
    def device(self) -> torch.device:
        """The model's device: every tensor the trainer builds lives there."""
        return self.model.embed_tokens.weight.device

    # ------------------------------------------------------------------ logprobs

    def batch_of(self, seqs: Sequence[Completion]) -> TokenBatch:
        """``seqs`` padded into one batch on the model's device, with each completion token's
        predicting row and sampling parameters (what :meth:`token_logprobs` reads)."""
        pad = self.model.config.pad_token_id or 0
        full = [list(s.prompt_ids) + list(s.completion_ids) for s in seqs]
        width = max(len(f) for f in full) - 1             # the last token is only a target
        t = max(len(s.completion_ids) for s in seqs)
        input_ids = torch.full((len(seqs), max(width, 1)), pad, dtype=torch.int64)
        targets = torch.full((len(seqs), t), pad, dtype=torch.int64)
        mask = torch.zeros(len(seqs), t)
        rows, temp, top_k, top_p = [], [], [], []
        for b, (s, f) in enumerate(zip(seqs, full)):
            input_ids[b, : len(f) - 1] = torch.tensor(f[:-1])
            n, p = len(s.completion_ids), len(s.prompt_ids)
            targets[b, :n] = torch.tensor(s.completion_ids)
            mask[b, :n] = 1
            rows += [b * input_ids.shape[1] + p - 1 + i for i in range(n)]
            temp += [s.temperature] * n
            top_k += [s.top_k] * n
            top_p += [s.top_p] * n
        n_tok, dev = len(rows), self.device
        params = SamplingParams(torch.tensor(temp, dtype=torch.float32, device=dev),
                                torch.tensor(top_k, dtype=torch.int64, device=dev),
                                torch.tensor(top_p, dtype=torch.float32, device=dev),
                                torch.zeros(n_tok, dtype=torch.int64, device=dev),
                                torch.zeros(n_tok, dtype=torch.int64, device=dev))
        # Built on the CPU element by element (cheap), moved to the model's device in one copy each.
        return TokenBatch(input_ids.to(dev), targets.to(dev), mask.to(dev),
                      torch.tensor(rows, dtype=torch.int64, device=dev), params)

    def token_logprobs(self, model: Model, batch: TokenBatch, params: SamplingParams | None = None,
                  hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token logprobs [B, T] of the completions under their sampling distributions
        (or `params`), from `hidden` [Ntok, D] (_token_hidden) when already computed.

        The final norm, lm_head and sampling_logprobs run fused in row chunks
        (zerokl.kernels.logprob): the same bits as logits for every row, then the logprob."""
        if hidden is None:
            hidden = self._token_hidden(model, batch)
        head = lambda x: model.lm_head(model.norm(x))                 # noqa: E731  (per-row, as forward_tokens)
        weights = [*model.norm.parameters(), *model.lm_head.parameters()]
        targets = batch.targets[batch.mask > 0]
        if any(type(w).__name__ == "DTensor" for w in weights):
            # FSDP2-sharded head (the distributed trainer): the fused op's backward would hand whole
            # gradients to sharded weights, so the head runs unfused here (the same forward bits).
            lp = sampling_logprobs(head(hidden), targets, params or batch.params)
        else:
            lp = fused_logprobs(hidden, head, weights, targets, params or batch.params,
                                self.config.logprob_chunk_rows or None)
        return torch.zeros(batch.mask.shape, dtype=lp.dtype, device=lp.device).masked_scatter(batch.mask > 0, lp)

    def _token_hidden(self, model: Model, batch: TokenBatch) -> torch.Tensor:
        """The residual stream [Ntok, D] (before the final norm) at the positions that predict
        each completion token; blocks checkpointed when the config says so and a gradient is recorded."""
        b, s = batch.input_ids.shape
        layout = AttentionBatch.for_sequences(b, s, batch.input_ids.device)
        with checkpoint_blocks(model, self.config.activation_checkpointing):
            hidden = model.hidden_states(batch.input_ids.reshape(-1), layout)
        return hidden[batch.rows]

    @torch.no_grad()
    def forward_logprobs(self, seqs: Sequence[Completion]) -> list[torch.Tensor]:
        """Logprobs of each completion's tokens (fp32, on the CPU), exactly as inference computes them for these weights."""
        batch = self.batch_of(seqs)
        lp = self.token_logprobs(self.model, batch)
        return [lp[b, : len(s.completion_ids)].to("cpu", copy=True) for b, s in enumerate(seqs)]

    # ------------------------------------------------------------------ low-level steps

    def forward_backward(self, method: str, batch_items: Sequence, *, loss_scale: float = 1.0, **kw) -> dict:
        """Accumulate gradients of one objective ('sft' | 'dpo' | 'ppo'); returns its metrics.

        loss_scale multiplies the loss before the backward (not the reported metrics): the
        distributed trainer weights each data rank's share of a batch with it."""
        start = time.perf_counter()
        self.model.train()
        coef = self.config.indexer_loss_coef
        with indexer_losses(self.model) if coef > 0 else contextlib.nullcontext([]) as indexer_kl:
            if method == "sft":
                batch = self.batch_of(batch_items)
                loss = sft_loss(self.token_logprobs(self.model, batch), batch.mask)
                metrics = {"loss": float(loss.detach())}
                tokens = int(batch.mask.sum())
            elif method == "dpo":
                metrics, loss, tokens = self._dpo(batch_items)
            elif method == "ppo":
                metrics, loss, tokens = self._ppo(batch_items, kw["advantages"].to(self.device))
            else:
                raise ValueError(f"unknown method {method!r}: expected sft, dpo or ppo")
        if indexer_kl:                              # the indexer's own loss (zerokl.kernels.model.indexer_loss)
            loss = loss + coef * torch.stack(indexer_kl).mean()
        (loss * loss_scale if loss_scale != 1.0 else loss).backward()
        self.tokens_seen += tokens
        metrics["tokens"] = tokens
        metrics["tokens_per_s"] = tokens / max(time.perf_counter() - start, 1e-9)
        return metrics

    def _dpo(self, pairs: Sequence[tuple[Completion, Completion]]):
        seqs = [p[0] for p in pairs] + [p[1] for p in pairs]
        batch = self.batch_of(seqs)
        policy = (self.token_logprobs(self.model, batch) * batch.mask).sum(1)
        with torch.no_grad():
            ref_model = self.reference or self.freeze_reference()
            ref = (self.token_logprobs(ref_model, batch) * batch.mask).sum(1)
        n = len(pairs)
        loss, acc = dpo_loss(policy[:n], policy[n:], ref[:n], ref[n:], self.config.dpo_beta)
        return {"loss": float(loss.detach()), "preference_accuracy": float(acc)}, loss, int(batch.mask.sum())

    def freeze_reference(self) -> Model:
        """Make a frozen copy of the current weights the reference (DPO's, and PPO's KL penalty's)."""
        self.reference = copy.deepcopy(self.model).eval()
        for p in self.reference.parameters():
            p.requires_grad_(False)
        return self.reference

    def _ppo(self, rollouts: Sequence[Rollout], advantages: torch.Tensor):
        batch = self.batch_of([r.sequence for r in rollouts])
        behaviour = torch.zeros(batch.mask.shape)
        for b, r in enumerate(rollouts):
            behaviour[b, : len(r.logprobs)] = torch.tensor(r.logprobs, dtype=torch.float32)
        behaviour = behaviour.to(self.device)
        hidden = self._token_hidden(self.model, batch)
        logprobs = self.token_logprobs(self.model, batch, hidden=hidden)
        ref = policy_full = None
        if self.reference is not None:
            # The KL penalty compares full (temperature-only) distributions: under top-k/top-p
            # the reference may give a sampled token probability 0 and the penalty infinity.
            full = dataclasses.replace(batch.params, top_k=torch.zeros_like(batch.params.top_k),
                                       top_p=torch.ones_like(batch.params.top_p))
            policy_full = self.token_logprobs(self.model, batch, full, hidden)
            with torch.no_grad():
                ref = self.token_logprobs(self.reference, batch, full)
        loss, stats = ppo_clip_loss(logprobs, behaviour, advantages, batch.mask, self.config.clip_eps,
                                    ref, self.config.kl_coef, policy_full)
        return dataclasses.asdict(stats) | {"kl": stats.kl_behaviour}, loss, stats.tokens

    def lr_at(self, step: int) -> float:
        c = self.config
        if c.warmup_steps and step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        if c.total_steps > 0:
            progress = min(1.0, (step - c.warmup_steps) / max(1, c.total_steps - c.warmup_steps))
            return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        return c.lr

    def optim_step(self, lr: float | None = None) -> dict:
        """Clip, step AdamW at `lr` (default: the scheduled learning rate), zero the gradients.

        A step that fails, or leaves any trained parameter or optimizer state
        non-finite, is undone: parameters, optimizer state and the step counter
        are as before it, the gradients are dropped, and :class:`NonFiniteStep`
        (or the error) is raised. Undoing costs one copy of the trained
        parameters and their optimizer state per step.

        With master weights the gradients are cast to fp32 onto the masters (the
        clip runs on those), AdamW steps the masters, and the model's parameters
        are set in place to the masters rounded to their dtype (round to nearest).
        """
        if self.masters is not None:
            for p, m in zip(self.params, self.masters, strict=True):
                m.grad = None if p.grad is None else p.grad.detach().float()
                p.grad = None
        grads = [p.grad for p in self._optimized if p.grad is not None]
        norm = torch.sqrt(sum((g.float() ** 2).sum() for g in grads)) if grads else torch.zeros(())

        def masters_to_model() -> None:
            if self.masters is not None:
                with torch.no_grad():
                    for p, m in zip(self.params, self.masters, strict=True):
                        p.copy_(m.to(p.dtype))

        def non_finite() -> str | None:
            bad = self._non_finite()
            return f"{len(bad)} tensor(s) non-finite, e.g. {', '.join(bad[:3])}" if bad else None

        def release() -> None:
            for p in self.params:
                p.grad = None

        metrics = optimizer_step(self, grads, float(norm), lr, non_finite=non_finite, after_update=masters_to_model,
                                 release=release)
        if self.fp8:
            # Only a step that stands is quantized: an undone one leaves the e4m3 values as before.
            self._refresh_fp8()
        return metrics

    def _refresh_fp8(self) -> None:
        """Re-quantize the FP8 model's e4m3 values and scales from the fp32 masters (one rounding)."""
        refresh_fp8(self.model, dict(zip(self.params, self.masters, strict=True)))

    def snapshot(self) -> tuple[list[torch.Tensor], list[torch.Tensor], dict, list[float]]:
        """Copies of the trained tensors, fp32 masters, optimizer state and learning rates
        (what :meth:`restore` puts back when an optimizer step is undone)."""
        params = [p.detach().clone() for p in self.params]
        masters = [m.detach().clone() for m in self.masters] if self.masters is not None else []
        state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in s.items()}
                 for p, s in self.optimizer.state.items()}
        return params, masters, state, [g["lr"] for g in self.optimizer.param_groups]

    @torch.no_grad()
    def restore(self, snapshot: tuple[list[torch.Tensor], list[torch.Tensor], dict, list[float]]) -> None:
        params, masters, state, lrs = snapshot
        for p, saved in zip(self.params, params, strict=True):
            p.copy_(saved)
        for m, saved in zip(self.masters or [], masters, strict=True):
            m.copy_(saved)
        self.optimizer.state.clear()
        self.optimizer.state.update(state)
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr

    def _non_finite(self) -> list[str]:
        """Names of trained parameters (or their optimizer state) holding a NaN or infinity.

        One device-to-host read for all of them (a read per tensor costs a sync each on a GPU:
        four per parameter); names are looked up only when something is non-finite."""
        checked: list[tuple[int, str, torch.Tensor]] = []        # (parameter index, state key or "", tensor)
        for i, (p, o) in enumerate(zip(self.params, self._optimized, strict=True)):
            checked += [(i, "", p), (i, "", o)]
            # AdamW's "step" is a count (kept on the CPU beside GPU moments), not a value a bad
            # gradient can make non-finite: the moments are what the check is for.
            checked += [(i, k, v) for k, v in self.optimizer.state.get(o, {}).items()
                        if k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point()]
        if not checked:
            return []
        finite = torch.stack([torch.isfinite(t).all() for _, _, t in checked])
        if bool(finite.all()):
            return []
        names = {id(p): n for n, p in self.model.named_parameters()}
        bad = []
        for (i, key, _), ok in zip(checked, finite.tolist(), strict=True):
            name = names.get(id(self.params[i]), f"params[{i}]")
            if not ok:
                bad.append(f"{name} ({key})" if key else name)
        return list(dict.fromkeys(bad))                 # a parameter and its master: one name

    # ------------------------------------------------------------------ high-level steps

    def sft_step(self, examples: Sequence[Completion]) -> dict:
        return self.forward_backward("sft", examples) | self.optim_step()

    def dpo_step(self, pairs: Sequence[tuple[Completion, Completion]]) -> dict:
        return self.forward_backward("dpo", pairs) | self.optim_step()

    def grpo_step(self, rollouts: Sequence[Rollout], group_size: int) -> dict:
        """One on-policy GRPO update: group-normalized rewards, PPO-clip vs behaviour logprobs."""
        adv = group_advantages(torch.tensor([r.reward for r in rollouts]), group_size)
        metrics = self.forward_backward("ppo", rollouts, advantages=adv)
        metrics["reward"] = float(sum(r.reward for r in rollouts) / len(rollouts))
        return metrics | self.optim_step()

    # ------------------------------------------------------------------ weights and state

    def serving_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights as inference serves them (LoRA merged: bitwise the adapted forward's weights; FP8:
        the e4m3 values and scales under the checkpoint's names, zerokl.kernels.model.fp8)."""
        if self.fp8:
            return fp8_serving_state_dict(self.model)
        return merged_state_dict(self.model)

    def serving_model(self) -> Model:
        """A separate Model with the serving weights (for an in-process engine; FP8: a served FP8 model)."""
        if self.fp8:
            return serving_fp8_model(self.model)
        m = Model.empty(self.model.config, self.model.dtype).to(self.device)
        m.load_state_dict(self.serving_state_dict())
        return m.eval()

    def state_dict(self) -> dict:
        """Everything needed to resume: model (incl. adapters), optimizer, fp32 master weights
        (a list in self.params order; absent without them), step counters."""
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "step": self.step, "tokens_seen": self.tokens_seen}
        if self.masters is not None:
            state["masters"] = [m.detach().clone() for m in self.masters]
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Inverse of state_dict. Master weights missing from `state` (a checkpoint written
        without them) are taken from the loaded parameters."""
        self.model.load_state_dict(state["model"])
        if self.masters is not None:
            saved = state.get("masters") or [p.detach() for p in self.params]
            for m, t in zip(self.masters, saved, strict=True):
                if t.shape != m.shape:
                    raise ValueError(f"master weight of shape {tuple(t.shape)} for a parameter of shape {tuple(m.shape)}")
                m.copy_(t)
            if self.fp8:
                # The backward's bf16 weights are the masters' rounding (as after every step); the e4m3
                # values stay those of the state (the bytes that version's replicas serve).
                for p, m in zip(self.params, self.masters, strict=True):
                    p.copy_(m.to(p.dtype))
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
