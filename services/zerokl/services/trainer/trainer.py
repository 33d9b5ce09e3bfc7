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
from typing import Sequence

import torch

from zerokl.kernels.dtypes import COMPUTE_DTYPES, names_fp8, to_dtype
from zerokl.kernels.logprob import fused_logprobs
from zerokl.kernels.sampling import SamplingParams, sampling_logprobs
from zerokl.kernels.model import Model
from zerokl.kernels.model.fp8 import is_fp8, refresh_fp8, serving_fp8_model, trainable_fp8
from zerokl.kernels.model.fp8 import serving_state_dict as fp8_serving_state_dict
from zerokl.kernels.model.indexer_loss import indexer_losses
from zerokl.kernels.model.lora import apply_lora, lora_parameters, merged_state_dict
from zerokl.kernels.model.model import AttentionBatch
from zerokl.kernels.model.recompute import checkpoint_blocks
from zerokl.kernels.ops import one_cpu_thread
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.host_memory import pinned_copy, pinned_zeros
from zerokl.services.trainer.losses import (PolicyObjective, PPOStats, dpo_loss, group_advantages, policy_loss_terms,
                                            ppo_clip_terms, sft_loss, token_loss_terms)
from zerokl.services.trainer.optim import NonFiniteStep, adamw, grad_norm, optimizer_step
from zerokl.services.trainer.types import AdamParams
from zerokl.services.trainer.step_graphs import StepGraphs
from zerokl.vocab import Completion, Rollout

__all__ = ["ScoredSequence", "Trainer"]

#: Rows of an objective's entropy pass at once ([rows, vocab] logits).
_ENTROPY_ROWS = 4096


#: The smallest shape buckets of a batch under TrainConfig.cuda_graphs: packed tokens, scored
#: rows, completion width (a count n is padded to a multiple of max(minimum, 2 ** (bits(n) - 4)):
#: at most 1/8 more, about eight shapes per doubling, so the shapes of RL batches recur).
TOKEN_BUCKET, ROW_BUCKET, WIDTH_BUCKET = 64, 256, 16


# Elements of a parameter stepped at once by the offloaded optimizer (whole rows; memory, not bits): with
# fp32 masters a slice's device state is ~5 bytes x 4 per element (master, fp32 gradient, two moments, a
# temporary), ~1.3 GiB here.
OFFLOAD_SLICE_ELEMENTS = 1 << 26
MOMENTS = ("exp_avg", "exp_avg_sq")     # AdamW's state tensors (torch's names; optim.PortableAdamW keeps them)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a first dimension to slice (a 0-dim tensor as one row of one element), sharing its storage."""
    return t if t.dim() else t.view(1)


def _row_slices(t: torch.Tensor) -> list[tuple[int, int]]:
    """[a, b) ranges of ``t``'s first dimension, each of at most OFFLOAD_SLICE_ELEMENTS elements (one row at least)."""
    per_row = max(1, t[0].numel()) if t.shape[0] else 1
    step = max(1, OFFLOAD_SLICE_ELEMENTS // per_row)
    return [(a, min(a + step, t.shape[0])) for a in range(0, t.shape[0], step)] or [(0, 0)]


def bucket(n: int, minimum: int) -> int:
    """n rounded up to its shape bucket: a multiple of max(minimum, 2 ** (n.bit_length() - 4))."""
    step = max(minimum, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


@dataclass(frozen=True)
class ScoredSequence:
    """Tokens the training forward reads and the tokens it scores: row ``first + i`` of
    ``input_ids`` predicts ``targets[i]``, under the sampling distribution of the last three fields.

    A :class:`Completion` is its prompt and completion without the last token, scored from the
    prompt's last token on (:meth:`of`); a Tinker ``Datum`` is its ``model_input`` scored at every
    position (``first`` 0) against any ``target_tokens`` (the cookbook puts 0 on prompt positions).
    """

    input_ids: tuple[int, ...]
    first: int
    targets: tuple[int, ...]
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @staticmethod
    def of(c: Completion) -> "ScoredSequence":
        """The completion's tokens scored after its prompt (the last token is only a target)."""
        full = (*c.prompt_ids, *c.completion_ids)
        return ScoredSequence(full[:-1], len(c.prompt_ids) - 1, tuple(c.completion_ids), c.temperature, c.top_k,
                              c.top_p)


@dataclass
class TokenBatch:
    """Completions laid out for the training forward (:meth:`Trainer.batch_of`).

    The sequences are packed one after another (no padding between them: an RL batch's lengths
    vary by several times), each from position 0. N packed tokens, then (bucketed batches)
    padding tokens, each a sequence of one token. Ntok rows are scored: one per completion
    token, then (bucketed batches) padding rows that score token 0 at packed token 0 and land
    in slots past B*T, which nothing reads."""

    input_ids: torch.Tensor             # [N] the packed sequences (each without its last token), then padding
    positions: torch.Tensor             # [N] each token's position in its sequence
    targets: torch.Tensor               # [B, T] completion tokens, padded
    mask: torch.Tensor                  # [B, T]
    rows: torch.Tensor                  # [Ntok] the packed token predicting each scored token
    params: SamplingParams              # [Ntok] per scored token
    token_targets: torch.Tensor         # [Ntok] the scored token of each row
    token_slots: torch.Tensor           # [Ntok] where each row's logprob goes in the flat [B*T] output (padding: past it)
    tokens: int                         # completion tokens (the rows before any padding)
    filters: tuple[bool, bool]          # (a row uses top-k or top-p, a row uses top-p): known here, never read back
    length: int                         # the longest sequence's tokens (attention's longest key list)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the batch, in a fixed order (a CUDA graph's inputs)."""
        return [self.input_ids, self.positions, self.targets, self.mask, self.rows, *dataclasses.astuple(self.params),
                self.token_targets, self.token_slots]

    def with_tensors(self, tensors: list[torch.Tensor]) -> "TokenBatch":
        """The same batch over ``tensors`` (as :meth:`tensors` orders them)."""
        n = len(dataclasses.fields(SamplingParams))
        input_ids, positions, targets, mask, rows, *rest = tensors
        return TokenBatch(input_ids, positions, targets, mask, rows, SamplingParams(*rest[:n]), *rest[n:],
                          self.tokens, self.filters, self.length)

    def layout(self) -> AttentionBatch:
        """The model's training layout of the packed tokens (no key table, no cache)."""
        n = self.input_ids.shape[0]
        return AttentionBatch(self.positions, None, torch.arange(n, device=self.input_ids.device), self.length)


#: How the terms of micro-batches make the whole batch's (the rest are means over scored tokens, weighted
#: by each micro-batch's share of them; ``loss`` and DPO's accuracy by the loss's own shares).
_SUMMED = frozenset({"tokens", "mismatched_tokens"})
_LEAST, _MOST = frozenset({"ratio_min"}), frozenset({"ratio_max", "max_abs_log_ratio"})
_LOSS_WEIGHTED = frozenset({"loss", "preference_accuracy"})


def _combined_terms(parts: list[dict[str, torch.Tensor]], shares: list[float], token_shares: list[float],
                    counted: list[int], sequence_clip: bool = False) -> dict[str, torch.Tensor]:
    """The terms of a batch from its micro-batches' (0-dim device tensors; nothing read back): counts summed,
    extremes over the micro-batches with a scored token, means weighted by ``token_shares`` (``loss`` and
    DPO's accuracy, and with ``sequence_clip`` GSPO's per-sequence clip fraction, by ``shares``). A mass ratio
    (``correction_discarded_weight``) comes out as its micro-batches' token-weighted mean."""
    scored = [t for t, n in zip(parts, counted) if n > 0] or parts
    out = {}
    for name, first in parts[0].items():
        if name in _SUMMED:
            out[name] = torch.stack([t[name] for t in parts]).sum()
        elif name in _LEAST or name in _MOST:
            values = torch.stack([t[name] for t in scored])
            out[name] = values.amin() if name in _LEAST else values.amax()
        else:
            by_loss = name in _LOSS_WEIGHTED or (sequence_clip and name == "clip_fraction")
            weights = shares if by_loss else token_shares
            out[name] = sum(w * t[name].double() for w, t in zip(weights, parts)).to(first.dtype)
    return out


class Trainer:
    """Owns a model, its optimizer and its step counter."""

    def __init__(self, model: Model, config: TrainConfig = TrainConfig()):
        self.model, self.config = model, config
        # A served FP8 model (an FP8 checkpoint) with no dtype asked for trains on its FP8 forward too.
        self.fp8 = names_fp8(config.dtype) or (config.dtype is None and is_fp8(model))
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
        if config.offload_optimizer and self.fp8:
            raise ValueError("TrainConfig.offload_optimizer with an FP8 model: its e4m3 values are quantized from "
                             "the fp32 masters on the device (offload_optimizer false)")
        self.offload = config.offload_optimizer
        # With master weights the optimizer owns fp32 copies of the trained parameters (same order
        # as self.params); the model's Parameters stay the objects everything else references.
        # Offloaded, they live in pinned host memory (_offloaded_step brings each to the device for its step).
        self.masters = ([pinned_copy(p.detach().float()) if self.offload else p.detach().float().clone() for p in params]
                        if self.master_weights else None)
        self._finite: dict[int, torch.Tensor] = {}     # offloaded: each stepped parameter's state finite (device)
        # One fixed loop over parameters; on a CPU the same bits on every machine (optim.adamw).
        self.optimizer = adamw(self._optimized, config.lr, config.betas, config.weight_decay, self.device)
        # CUDA graphs for the SFT / PPO steps (step_graphs.py); an FP8 model's e4m3 values and scales are
        # re-made in place after each optimizer step (refresh_fp8 copies into the same buffers), so a replay
        # reads the new ones. The distributed trainer turns them off; so does an offloaded optimizer (co-location:
        # a graph's gradients and activations would stay on the device between steps, TrainConfig.cuda_graphs).
        graphs = config.cuda_graphs is not False and self.device.type == "cuda" and not self.offload
        self._graphs = StepGraphs(params) if graphs else None
        self.step = 0
        self.tokens_seen = 0

    @staticmethod
    def _cast(model: Model, config: TrainConfig, fp8: bool) -> None:
        """Bring `model` to config.dtype in place (see TrainConfig.dtype); refuse what cannot hold."""
        if config.dtype is None and not fp8:
            return
        if config.dtype is not None and config.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"TrainConfig.dtype {config.dtype!r}: expected one of {', '.join(COMPUTE_DTYPES)} or None")
        if not fp8:
            if is_fp8(model):
                raise ValueError(f"TrainConfig.dtype {config.dtype!r} on an FP8 model: load its checkpoint in "
                                 f"{config.dtype} (Model.from_pretrained(dir, dtype)) to dequantize it")
            model.to(to_dtype(config.dtype))
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

    def batch_of(self, seqs: Sequence[Completion | ScoredSequence], bucketed: bool | None = None) -> TokenBatch:
        """``seqs`` packed into one batch on the model's device, with each scored token's
        predicting row and sampling parameters (what :meth:`token_logprobs` reads): a
        Completion's completion tokens, a :class:`ScoredSequence`'s targets.

        bucketed (default: when CUDA graphs run the steps): the packed tokens, the scored rows
        and the completion width padded to their shape buckets (:func:`bucket`), so that batch
        shapes recur; every row's bits are the same either way (each is computed alone)."""
        if bucketed is None:
            bucketed = self._graphs is not None
        seqs = [s if isinstance(s, ScoredSequence) else ScoredSequence.of(s) for s in seqs]
        pad = self.model.config.pad_token_id or 0
        ids, positions, rows, token_targets, slots, temp, top_k, top_p = [], [], [], [], [], [], [], []
        t = max(len(s.targets) for s in seqs)
        if bucketed:
            t = bucket(t, WIDTH_BUCKET)
        targets = torch.full((len(seqs), t), pad, dtype=torch.int64)
        mask = torch.zeros(len(seqs), t)
        for b, s in enumerate(seqs):
            start, n = len(ids), len(s.targets)
            ids += s.input_ids
            positions += range(len(s.input_ids))
            targets[b, :n] = torch.tensor(s.targets)
            mask[b, :n] = 1
            rows += range(start + s.first, start + s.first + n)
            token_targets += s.targets
            slots += range(b * t, b * t + n)
            temp += [s.temperature] * n
            top_k += [s.top_k] * n
            top_p += [s.top_p] * n
        length = max(1, max(positions, default=0) + 1)
        tokens, dev = len(rows), self.device
        filters = (any(k > 0 for k in top_k) or any(q < 1.0 for q in top_p), any(q < 1.0 for q in top_p))
        if bucketed:
            extra = bucket(max(1, len(ids)), TOKEN_BUCKET) - len(ids)
            ids += [pad] * extra                             # padding tokens: one-token sequences
            positions += [0] * extra
        extra = bucket(tokens, ROW_BUCKET) - tokens if bucketed else 0
        rows += [0] * extra                                  # padding rows: token 0 scored at packed token 0, ...
        token_targets += [0] * extra
        slots += range(len(seqs) * t, len(seqs) * t + extra)  # ... each into its own slot past B*T
        temp += [1.0] * extra
        top_k += [0] * extra
        top_p += [1.0] * extra
        n_tok = tokens + extra
        params = SamplingParams(torch.tensor(temp, dtype=torch.float32, device=dev),
                                torch.tensor(top_k, dtype=torch.int64, device=dev),
                                torch.tensor(top_p, dtype=torch.float32, device=dev),
                                torch.zeros(n_tok, dtype=torch.int64, device=dev),
                                torch.zeros(n_tok, dtype=torch.int64, device=dev))
        # Built on the CPU element by element (cheap), moved to the model's device in one copy each.
        as_long = lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev)   # noqa: E731
        return TokenBatch(as_long(ids), as_long(positions), targets.to(dev), mask.to(dev), as_long(rows), params,
                          as_long(token_targets), as_long(slots), tokens, filters, length)

    def token_logprobs(self, model: Model, batch: TokenBatch, params: SamplingParams | None = None,
                       hidden: torch.Tensor | None = None, filters: tuple[bool, bool] | None = None) -> torch.Tensor:
        """Per-token logprobs [B, T] of the completions under their sampling distributions
        (or `params`, whose filters are `filters` when known, else read from them), from
        `hidden` [Ntok, D] (_token_hidden) when already computed.

        The final norm, lm_head and sampling_logprobs run fused in row chunks
        (zerokl.kernels.logprob): the same bits as logits for every row, then the logprob."""
        if hidden is None:
            hidden = self._token_hidden(model, batch)
        head = lambda x: model.lm_head(model.norm(x))                 # noqa: E731  (per-row, as forward_tokens)
        weights = [*model.norm.parameters(), *model.lm_head.parameters()]
        filters = batch.filters if params is None else filters
        if any(type(w).__name__ == "DTensor" for w in weights):
            # FSDP2-sharded head (the distributed trainer): the fused op's backward would hand whole
            # gradients to sharded weights, so the head runs unfused here (the same forward bits).
            lp = sampling_logprobs(head(hidden), batch.token_targets, params or batch.params, filters)
        else:
            lp = fused_logprobs(hidden, head, weights, batch.token_targets, params or batch.params,
                                self.config.logprob_chunk_rows or None, filters)
        b, t = batch.mask.shape
        # Each row's logprob into its slot (padding rows past B*T): an index copy, no count read back.
        # Sized by shapes only (a graph replays it for any batch of these shapes): B*T + Ntok.
        out = torch.zeros(b * t + lp.shape[0], dtype=lp.dtype, device=lp.device)
        return out.index_copy(0, batch.token_slots, lp)[: b * t].view(b, t)

    def _token_hidden(self, model: Model, batch: TokenBatch) -> torch.Tensor:
        """The residual stream [Ntok, D] (before the final norm) at the positions that predict
        each completion token; blocks checkpointed when the config says so and a gradient is recorded."""
        with checkpoint_blocks(model, self.config.activation_checkpointing):
            hidden = model.hidden_states(batch.input_ids, batch.layout())
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
        distributed trainer weights each data rank's share of a batch with it. For 'ppo', ``objective``
        (losses.PolicyObjective: an estimator and a correction, the experiment's) replaces PPO-clip against
        the sampler's logprobs; its metrics then add the collapse telemetry and the sampled positions' entropy.
        SFT and PPO steps read nothing back from the device until their backward is queued (their metrics are
        read after it), so with TrainConfig.cuda_graphs they replay from a CUDA graph. A batch of more than
        TrainConfig.micro_batch_tokens runs as micro-batches (:meth:`micro_batches`), eagerly (each after the
        first adds to the gradients), its metrics those of the whole batch (:func:`_combined_terms`)."""
        start = time.perf_counter()
        self.model.train()
        objective: PolicyObjective | None = kw.get("objective")
        if objective is not None and (method != "ppo" or self.reference is not None):
            raise ValueError("an objective is a 'ppo' update's, without a KL reference")
        if method not in ("sft", "dpo", "ppo"):
            raise ValueError(f"unknown method {method!r}: expected sft, dpo or ppo")
        advantages = kw["advantages"] if method == "ppo" else None
        parts = self.micro_batches(method, batch_items)
        if len(parts) == 1:
            terms, tokens = self._accumulate(method, batch_items, advantages, objective, loss_scale, graphs=True)
        else:
            # Each micro-batch's loss (a mean over its own tokens, sequences or pairs) weighted by its share of
            # the batch's: the weighted sum is the batch's mean, so is its gradient.
            counted = [sum(len(s.targets) for s in self._sequences(method, batch_items[a:b])) for a, b in parts]
            normalizers = ([sum(1 for r in batch_items[a:b] if r.sequence.completion_ids) for a, b in parts]
                           if objective is not None and objective.estimator == "gspo"
                           else [b - a for a, b in parts] if method == "dpo" else counted)
            shares = [n / max(1, sum(normalizers)) for n in normalizers]
            token_shares = [n / max(1, sum(counted)) for n in counted]
            results = [self._accumulate(method, batch_items[a:b], None if advantages is None else advantages[a:b],
                                        objective, loss_scale * share, graphs=False)
                       for (a, b), share in zip(parts, shares)]
            terms = _combined_terms([t for t, _ in results], shares, token_shares, counted,
                                    sequence_clip=objective is not None and objective.estimator == "gspo")
            tokens = sum(n for _, n in results)
        if method == "ppo" and objective is None:
            stats = PPOStats.from_terms(terms)
            metrics = dataclasses.asdict(stats) | {"kl": stats.kl_behaviour}
        else:
            values = torch.stack([v.double() for v in terms.values()]).tolist()     # one read, after the backward
            metrics = dict(zip(terms, values))
            if method == "ppo":
                metrics["mismatched_tokens"] = int(metrics["mismatched_tokens"])
        self.tokens_seen += tokens
        metrics["tokens"] = tokens
        metrics["tokens_per_s"] = tokens / max(time.perf_counter() - start, 1e-9)
        return metrics

    @staticmethod
    def _sequences(method: str, items: Sequence) -> list[ScoredSequence]:
        """The sequences ``method``'s items train on, in their batch's order (DPO: the chosen, then the rejected)."""
        seqs = ([r.sequence for r in items] if method == "ppo"
                else [p[0] for p in items] + [p[1] for p in items] if method == "dpo" else items)
        return [s if isinstance(s, ScoredSequence) else ScoredSequence.of(s) for s in seqs]

    def micro_batches(self, method: str, batch_items: Sequence) -> list[tuple[int, int]]:
        """[start, end) ranges of ``batch_items``, consecutive, each of at most TrainConfig.micro_batch_tokens
        packed tokens (an item larger than that alone); one range with micro-batching off (0). The split
        reads the items only: any trainer with the same value splits a batch the same way."""
        limit = self.config.micro_batch_tokens
        if limit <= 0:
            return [(0, len(batch_items))]

        parts, start, total = [], 0, 0
        for i, item in enumerate(batch_items):
            n = sum(len(s.input_ids) for s in self._sequences(method, [item]))
            if i > start and total + n > limit:
                parts.append((start, i))
                start, total = i, 0
            total += n
        parts.append((start, len(batch_items)))
        return parts

    def _accumulate(self, method: str, batch_items: Sequence, advantages: torch.Tensor | None,
                    objective: PolicyObjective | None, loss_scale: float, graphs: bool
                    ) -> tuple[dict[str, torch.Tensor], int]:
        """Forward + backward of one (micro-)batch, its loss times ``loss_scale``: its terms (0-dim device
        tensors, nothing read back) and its completion tokens. ``graphs``: from a CUDA graph when the
        trainer has them (a micro-batch after the first adds to the gradients: eager)."""
        batch = self.batch_of(self._sequences(method, batch_items))
        extra = [self._behaviour(batch_items, batch), advantages.to(self.device)] if method == "ppo" else []
        coef = self.config.indexer_loss_coef

        def step(inputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
            with indexer_losses(self.model) if coef > 0 else contextlib.nullcontext([]) as indexer_kl:
                if method == "sft":
                    b = batch.with_tensors(list(inputs))
                    loss = sft_loss(self.token_logprobs(self.model, b), b.mask)
                    terms = {"loss": loss.detach()}
                elif method == "ppo":
                    loss, terms = self._ppo_terms(batch.with_tensors(list(inputs[:-2])), *inputs[-2:], objective)
                else:
                    loss, terms = self._dpo(batch, len(batch_items))
            if indexer_kl:                          # the indexer's own loss (zerokl.kernels.model.indexer_loss)
                loss = loss + coef * torch.stack(indexer_kl).mean()
            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
            return terms

        inputs = batch.tensors() + extra
        if graphs and method != "dpo" and self._graphs is not None and coef == 0:
            # the shapes, and whether attention's longest key list passes the indexer's top-k (the
            # sparse path; the batch's length decides nothing else)
            sparse = batch.length > self.model.config.index_topk
            key = (method, loss_scale, batch.filters, id(self.reference), sparse, objective,
                   tuple(t.shape for t in inputs))
            terms = self._graphs.run(key, inputs, step)
        else:
            # On a CPU the whole step runs on one intra-op thread: the backward's GEMMs and sums are
            # plain torch, whose bits follow MKL's thread split (the forward's ops hold it already).
            with one_cpu_thread() if self.device.type == "cpu" else contextlib.nullcontext():
                terms = step(inputs)
        return terms, batch.tokens

    def forward_backward_tokens(self, loss: str, seqs: Sequence[ScoredSequence], *,
                                weights: Sequence[Sequence[float]] | None = None,
                                behaviour: Sequence[Sequence[float]] | None = None,
                                advantages: Sequence[Sequence[float]] | None = None,
                                config: dict[str, float] | None = None,
                                forward_only: bool = False) -> tuple[dict, list[torch.Tensor]]:
        """One of Tinker's per-token losses (losses.TOKEN_LOSSES, a sum over positions) on ``seqs``;
        accumulates its gradients unless ``forward_only``. Returns (metrics, the trainer's fp32 logprob
        of every target, one CPU tensor per sequence: the numbers inference samples with).

        ``weights`` (cross_entropy; None: 1 everywhere), ``behaviour`` (the sampling logprobs) and
        ``advantages`` hold one value per target of each sequence (None: 0 everywhere); ``config``
        the loss's keys, every one given (losses.TOKEN_LOSSES has the defaults)."""
        start = time.perf_counter()
        self.model.train()
        batch = self.batch_of(seqs, bucketed=False)
        b, t = batch.mask.shape

        def padded(rows: Sequence[Sequence[float]] | None) -> torch.Tensor:
            out = torch.zeros(b, t, dtype=torch.float32)
            for i, row in enumerate(rows or ()):
                out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
            return out.to(self.device)

        valid = batch.mask > 0
        w = batch.mask.clone() if weights is None else padded(weights)
        coef = self.config.indexer_loss_coef if not forward_only else 0.0
        # On a CPU on one intra-op thread, as forward_backward: the backward's bits never follow MKL's split.
        with one_cpu_thread() if self.device.type == "cpu" else contextlib.nullcontext():
            with torch.set_grad_enabled(not forward_only), \
                    indexer_losses(self.model) if coef > 0 else contextlib.nullcontext([]) as indexer_kl:
                lp = self.token_logprobs(self.model, batch)
                total, terms = token_loss_terms(loss, lp, valid, w, padded(behaviour), padded(advantages),
                                                config or {})
            if not forward_only:
                if indexer_kl:                      # the indexer's own loss (zerokl.kernels.model.indexer_loss)
                    total = total + coef * torch.stack(indexer_kl).mean()
                total.backward()
                self.tokens_seen += batch.tokens
        values = torch.stack([v.double() for v in terms.values()]).tolist()      # one read, after the backward
        metrics = dict(zip(terms, values))
        metrics["tokens_per_s"] = batch.tokens / max(time.perf_counter() - start, 1e-9)
        logprobs = [lp[i, : len(s.targets)].detach().to("cpu", torch.float32, copy=True) for i, s in enumerate(seqs)]
        return metrics, logprobs

    def _dpo(self, batch: TokenBatch, n: int):
        """DPO's loss and terms on ``batch``: the n chosen completions, then the n rejected ones."""
        policy = (self.token_logprobs(self.model, batch) * batch.mask).sum(1)
        with torch.no_grad():
            ref_model = self.reference or self.freeze_reference()
            ref = (self.token_logprobs(ref_model, batch) * batch.mask).sum(1)
        loss, acc = dpo_loss(policy[:n], policy[n:], ref[:n], ref[n:], self.config.dpo_beta)
        return loss, {"loss": loss.detach(), "preference_accuracy": acc}

    def freeze_reference(self) -> Model:
        """Make a frozen copy of the current weights the reference (DPO's, and PPO's KL penalty's)."""
        self.reference = copy.deepcopy(self.model).eval()
        for p in self.reference.parameters():
            p.requires_grad_(False)
        return self.reference

    def _behaviour(self, rollouts: Sequence[Rollout], batch: TokenBatch) -> torch.Tensor:
        """The behaviour (sampling) logprobs [B, T] of the rollouts, on the device."""
        behaviour = torch.zeros(batch.mask.shape)
        for b, r in enumerate(rollouts):
            behaviour[b, : len(r.logprobs)] = torch.tensor(r.logprobs, dtype=torch.float32)
        return behaviour.to(self.device)

    def _ppo_terms(self, batch: TokenBatch, behaviour: torch.Tensor, advantages: torch.Tensor,
                   objective: PolicyObjective | None = None):
        """PPO-clip's loss and its statistics as device tensors (losses.ppo_clip_terms), or ``objective``'s
        (losses.policy_loss_terms) with the mean entropy of the sampled positions' distributions."""
        hidden = self._token_hidden(self.model, batch)
        logprobs = self.token_logprobs(self.model, batch, hidden=hidden)
        if objective is not None:
            loss, terms = policy_loss_terms(logprobs, behaviour, advantages, batch.mask, objective)
            terms["entropy"] = self._mean_entropy(hidden.detach()[: batch.tokens],
                                                  batch.params.temperature[: batch.tokens])
            return loss, terms
        ref = policy_full = None
        if self.reference is not None:
            # The KL penalty compares full (temperature-only) distributions: under top-k/top-p
            # the reference may give a sampled token probability 0 and the penalty infinity.
            full = dataclasses.replace(batch.params, top_k=torch.zeros_like(batch.params.top_k),
                                       top_p=torch.ones_like(batch.params.top_p))
            policy_full = self.token_logprobs(self.model, batch, full, hidden, filters=(False, False))
            with torch.no_grad():
                ref = self.token_logprobs(self.reference, batch, full, filters=(False, False))
        return ppo_clip_terms(logprobs, behaviour, advantages, batch.mask, self.config.clip_eps, ref,
                              self.config.kl_coef, policy_full)

    @torch.no_grad()
    def _mean_entropy(self, hidden: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """Mean entropy (nats) of softmax(logits / temperature) over the rows of ``hidden`` [N, D] (the sampled
        positions' distributions: an objective's collapse telemetry), _ENTROPY_ROWS rows of logits at a time."""
        model = self.model
        total = torch.zeros((), dtype=torch.float64, device=hidden.device)
        for i in range(0, hidden.shape[0], _ENTROPY_ROWS):
            logits = model.lm_head(model.norm(hidden[i: i + _ENTROPY_ROWS])).float()
            logp = torch.log_softmax(logits / temperature[i: i + _ENTROPY_ROWS].clamp(min=1e-6).unsqueeze(1), dim=-1)
            total += -(logp.exp() * logp).sum(dim=-1).double().sum()
        return total / max(1, hidden.shape[0])

    def lr_at(self, step: int) -> float:
        c = self.config
        if c.warmup_steps and step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        if c.total_steps > 0:
            progress = min(1.0, (step - c.warmup_steps) / max(1, c.total_steps - c.warmup_steps))
            return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        return c.lr

    def optim_step(self, lr: float | None = None, adam: AdamParams | None = None) -> dict:
        """Clip, step AdamW at `lr` (default: the scheduled learning rate), zero the gradients.
        ``adam`` (instead of ``lr``) sets this step's learning rate, betas, eps, weight decay and
        clip (types.AdamParams; Tinker's per-call optimizer parameters).

        A step that fails, or leaves any trained parameter or optimizer state
        non-finite, is undone: parameters, optimizer state and the step counter
        are as before it, the gradients are dropped, and :class:`NonFiniteStep`
        (or the error) is raised. Undoing costs one copy of the trained
        parameters and their optimizer state per step.

        With master weights the gradients are cast to fp32 onto the masters (the
        clip runs on those), AdamW steps the masters, and the model's parameters
        are set in place to the masters rounded to their dtype (round to nearest).
        """
        if self.offload:
            # Offloaded, each fp32 gradient is made (from the model's) when its master comes to the device:
            # the norm of the model's gradients is theirs (a bf16 value's fp32 square is the same number).
            grads = [p.grad for p in self.params if p.grad is not None]
        else:
            if self.masters is not None:
                for p, m in zip(self.params, self.masters, strict=True):
                    m.grad = None if p.grad is None else p.grad.detach().float()
                    p.grad = None
            grads = [p.grad for p in self._optimized if p.grad is not None]

        def masters_to_model() -> None:
            if self.masters is not None and not self.offload:     # offloaded: done per parameter on the device
                with torch.no_grad():
                    for p, m in zip(self.params, self.masters, strict=True):
                        p.copy_(m.to(p.dtype))

        def non_finite() -> str | None:
            bad = self._non_finite()
            return f"{len(bad)} tensor(s) non-finite, e.g. {', '.join(bad[:3])}" if bad else None

        def release() -> None:
            for p in self.params:
                p.grad = None

        run = self._offloaded_step if self.offload else None
        self._finite = {}
        try:
            metrics = optimizer_step(self, grads, grad_norm(grads), lr, non_finite=non_finite,
                                     after_update=masters_to_model, release=release, adam=adam, run=run)
        finally:
            # This list held every gradient (22.7 GiB on the GLM-5 slice) past the step: freed now, so the cache
            # below gives their memory back too, not only what the step itself freed.
            grads.clear()
            if self.offload and self.device.type == "cuda":
                torch.cuda.empty_cache()    # the step's device memory back to the driver: a co-located replica's
        if self.fp8:
            # Only a step that stands is quantized: an undone one leaves the e4m3 values as before.
            self._refresh_fp8()
        return metrics

    @torch.no_grad()
    def _offloaded_step(self, scale: float | None) -> None:
        """AdamW with its state in host memory: each parameter in turn, in slices of whole rows of at most
        OFFLOAD_SLICE_ELEMENTS, has its state (moments, master) come to the device, its gradient made (fp32 for
        a master) and clipped by ``scale`` (None: no clip), steps there and goes back to its pinned host
        buffers; the model's parameter gets its master's rounding meanwhile and drops its gradient once
        stepped. AdamW is elementwise and torch's single-tensor step treats every tensor alone, so a slice
        stepped alone (a Parameter viewing the rows, its moments' rows, the step count before the step) has
        the bits of the whole step on the device. Peak device memory: the gradients plus one slice's state (a
        GLM-5 expert stack, 256 x 2,048 x 6,144, 6 GiB in bf16, stepped whole with its moments ran out of an
        H100's memory).

        Two passes: the first steps copies of every slice and only checks that every result is finite (a step
        that overflows raises there, having changed nothing); the second, only when all are, steps them for good
        (the same bits: the same operations on the same values). So a refused step needs no undo snapshot,
        which offloaded would be a second host copy of the whole state (68 GiB for the GLM-5 slice, on a 128 GiB
        host that holds the state and the record process's copy of a version too). ``_non_finite`` reads the
        flags of the pass that ran last."""
        index = {id(t): k for k, t in enumerate(self._optimized)}
        groups = self.optimizer.param_groups
        work = [(group, o, index[id(o)]) for group in groups for o in group["params"]
                if self.params[index[id(o)]].grad is not None]
        params = [group["params"] for group in groups]      # each group steps one slice's view at a time
        try:
            for keep in (False, True):
                for group, o, i in work:
                    self._finite[i] = self._step_offloaded(group, o, self.params[i], scale, keep)
                if not keep and self._non_finite():
                    return                  # refused (optimizer_step raises NonFiniteStep): nothing was written
        finally:
            for group, ps in zip(groups, params, strict=True):
                group["params"] = ps
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()      # the host buffers hold the step's bytes

    def _step_offloaded(self, group: dict, o: torch.Tensor, p: torch.Tensor, scale: float | None,
                        keep: bool) -> torch.Tensor:
        """One offloaded parameter ``o`` (``p`` the model's) stepped slice by slice on the device; the device flag
        that every result is finite. ``keep`` False: its slices are stepped as copies and nothing is written;
        True: the results are written back."""
        device, optimizer = self.device, self.optimizer
        state = optimizer.state.get(o)
        if not state:
            # The first step: while checking, each slice's moments are zeros made on the device; for good, the
            # moments are born in host memory (never whole on the device).
            state = {"step": torch.zeros((), dtype=torch.float32)}
            if keep:
                state |= {k: pinned_zeros(o.shape, o.dtype) for k in MOMENTS}
        hosted = {k: _rows(v) for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor)}
        weights, grads, step = _rows(o.data), _rows(p.grad), state["step"]
        flags, stepped = [], step
        for a, b in _row_slices(weights):
            # With masters, an fp32 copy (clipped in each pass: an fp32 parameter's gradient is one already);
            # without, the parameter's own gradient, clipped in place in the checking pass.
            grad = grads[a:b].to(torch.float32, copy=True) if self.masters is not None else grads[a:b]
            if scale is not None and (self.masters is not None or not keep):
                grad.mul_(scale)
            # Offloaded masters live on the host: their rows come over; else the parameter's own rows. While
            # checking, always copies (on a CPU ``to`` would hand back the host rows themselves).
            if self.masters is not None:
                w = weights[a:b].to(device, non_blocking=True, copy=not keep)
            else:
                w = weights[a:b] if keep else weights[a:b].clone()
            view = torch.nn.Parameter(w)
            view.grad = grad
            moments = ({k: v[a:b].to(device, non_blocking=True, copy=not keep) for k, v in hosted.items()}
                       if hosted else {k: torch.zeros_like(w) for k in MOMENTS})
            optimizer.state[view] = {"step": step.clone(), **moments}
            group["params"] = [view]
            optimizer.step()
            sliced = optimizer.state.pop(view)
            flags.append(torch.isfinite(w).all())
            for k, v in sliced.items():
                if k != "step" and isinstance(v, torch.Tensor):
                    if v.is_floating_point():
                        flags.append(torch.isfinite(v).all())
                    if keep:
                        hosted[k][a:b].copy_(v, non_blocking=True)
            if keep and self.masters is not None:
                _rows(p.data)[a:b].copy_(w.to(p.dtype))
                weights[a:b].copy_(w, non_blocking=True)
            stepped = sliced["step"]
        if keep:
            state["step"] = stepped
            optimizer.state[o] = state
            # Written through other tensors (a Parameter over its rows, its .data), which keep their own version
            # counters: bumped, caches of what a weight holds (zerokl.kernels.portable's) recompute.
            torch.autograd.graph.increment_version(p)
            if o is not p:
                torch.autograd.graph.increment_version(o)
            p.grad = None                 # stepped: its device memory goes to the next parameter's slices
        return torch.stack(flags).all()

    def _offload_state(self) -> None:
        """Every optimizer state tensor (and master) into pinned host memory (after a load or a restore)."""
        if not self.offload:
            return
        with torch.no_grad():
            for m in self.masters or []:
                if m.device.type != "cpu" or (torch.cuda.is_available() and not m.is_pinned()):
                    m.data = pinned_copy(m.data)
            for state in self.optimizer.state.values():
                for k, v in list(state.items()):
                    if k != "step" and isinstance(v, torch.Tensor) and (
                            v.device.type != "cpu" or (torch.cuda.is_available() and not v.is_pinned())):
                        state[k] = pinned_copy(v)

    def _refresh_fp8(self) -> None:
        """Re-quantize the FP8 model's e4m3 values and scales from the fp32 masters (one rounding)."""
        refresh_fp8(self.model, dict(zip(self.params, self.masters, strict=True)))

    def snapshot(self) -> tuple[list[torch.Tensor], list[torch.Tensor], dict, list[float]]:
        """Copies of the trained tensors, fp32 masters, optimizer state and learning rates
        (what :meth:`restore` puts back when an optimizer step is undone)."""
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        if self.offload:
            # Offloaded (a co-located replica shares the device), the step checks every result before it writes
            # any (_offloaded_step): only the learning rates come back.
            return [], [], None, lrs
        params = [p.detach().clone() for p in self.params]
        masters = [m.detach().clone() for m in self.masters] if self.masters is not None else []
        state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in s.items()}
                 for p, s in self.optimizer.state.items()}
        return params, masters, state, lrs

    @torch.no_grad()
    def restore(self, snapshot: tuple[list[torch.Tensor], list[torch.Tensor], dict | None, list[float]]) -> None:
        params, masters, state, lrs = snapshot
        if state is not None:         # None: an offloaded trainer's, whose refused step wrote nothing
            for p, saved in zip(self.params, params, strict=True):
                p.copy_(saved)
            for m, saved in zip(self.masters or [], masters, strict=True):
                m.copy_(saved)
            self.optimizer.state.clear()
            self.optimizer.state.update(state)
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._offload_state()

    def _non_finite(self) -> list[str]:
        """Names of trained parameters (or their optimizer state) holding a NaN or infinity.

        One device-to-host read for all of them (a read per tensor costs a sync each on a GPU:
        four per parameter); names are looked up only when something is non-finite."""
        checked: list[tuple[int, str, torch.Tensor]] = []        # (parameter index, state key or "", finite)
        for i, (p, o) in enumerate(zip(self.params, self._optimized, strict=True)):
            checked.append((i, "", torch.isfinite(p).all()))
            if self.offload:
                # Offloaded: its master and moments were checked on the device as they were stepped.
                if i in self._finite:
                    checked.append((i, "optimizer state", self._finite[i]))
                continue
            checked.append((i, "", torch.isfinite(o).all()))
            # AdamW's "step" is a count (kept on the CPU beside GPU moments), not a value a bad
            # gradient can make non-finite: the moments are what the check is for.
            checked += [(i, k, torch.isfinite(v).all()) for k, v in self.optimizer.state.get(o, {}).items()
                        if k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point()]
        if not checked:
            return []
        finite = torch.stack([t for _, _, t in checked])
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

    def grpo_step(self, rollouts: Sequence[Rollout], group_size: int,
                  objective: PolicyObjective | None = None) -> dict:
        """One on-policy GRPO update: group-normalized rewards, PPO-clip vs behaviour logprobs (or
        ``objective``'s estimator and correction: :meth:`forward_backward`)."""
        adv = group_advantages(torch.tensor([r.reward for r in rollouts]), group_size)
        metrics = self.forward_backward("ppo", rollouts, advantages=adv, objective=objective)
        metrics["reward"] = float(sum(r.reward for r in rollouts) / len(rollouts))
        return metrics | self.optim_step()

    # ------------------------------------------------------------------ weights and state

    def serving_state_dict(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """Weights as inference serves them (LoRA merged: bitwise the adapted forward's weights; FP8:
        the e4m3 values and scales under the checkpoint's names, zerokl.kernels.model.fp8, the model's
        own tensors). ``copy`` False: the model's own tensors wherever no merge computes one, to be read
        before the next step (an export packing them into its buffer)."""
        if self.fp8:
            return fp8_serving_state_dict(self.model)
        return merged_state_dict(self.model, copy=copy)

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
        self._offload_state()
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
