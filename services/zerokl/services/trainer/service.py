"""The trainer service: :class:`TrainerService` (the logic) and the ``zerokl.v1.Trainer`` servicer.

:class:`TrainerService` owns one :class:`Trainer`, the store its checkpoints go
to, and the lineage of weight versions it has been (for staleness checks). It
takes and returns plain dataclasses and raises :class:`ServiceError` s, so it
runs the same behind gRPC and in-process; :class:`TrainerServicer` is a thin
edge that converts at the boundary (convert.py).

Concurrency: every operation runs as its own task under one lock, in arrival
order, and its tensor work runs on one dedicated thread (the event loop stays
free for health checks and Info). The task is shielded from the RPC: a client
that cancels or times out does not interrupt a half-done update, so the
trainer's state always matches what was computed (GetState tells such a
client where things stand).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import gc
import itertools
import json
import logging
import math
import os
import pathlib
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence, TypeVar

import grpc.aio
import torch
from prometheus_client import Counter, Gauge

from zerokl.kernels import __version__ as numerics_version
from zerokl.kernels.trace import Trace, trace_sequence
from zerokl.kernels.model.fp8 import numerics_dtype
from zerokl.kernels.model import ModelConfig
from zerokl.kernels.model.checkpoint import config_to_hf
from zerokl.services.runtime.errors import (
    AlreadyExists,
    FailedPrecondition,
    FieldViolation,
    Internal,
    InvalidArgument,
    NotFound,
    PreconditionViolation,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from zerokl.services.runtime.info import ServiceIdentity, identity_to_proto
from zerokl.services.runtime.optrace import identity_meta, require_operator
from zerokl.services.runtime.metrics import REGISTRY, set_serving_info
from zerokl.services.runtime.server import ServiceServer
from zerokl.services.trainer import convert
from zerokl.services.trainer.checkpointing import (
    MAX_LINEAGE,
    LineageEntry,
    WeightsRepo,
    CheckpointSnapshot,
    publish_checkpoint,
    read_checkpoint,
    snapshot_checkpoint,
    snapshot_to_host,
    write_checkpoint,
    write_snapshot,
)
from zerokl.services.trainer.losses import TOKEN_LOSSES, group_advantages
from zerokl.services.trainer.recorder import RecordFailed, RecordLost, RecordProcessDied, RecordWorker
from zerokl.services.trainer.config import MAX_LR, TrainConfig, check_train_config
from zerokl.services.trainer.optim import NonFiniteStep
from zerokl.services.trainer.store_marks import META_RUN, META_STATE, pin_owner
from zerokl.services.trainer.trainer import ScoredSequence, Trainer
from zerokl.services.trainer.types import (
    AdamParams,
    DPOBatch,
    ForwardBackwardResult,
    OptimResult,
    PPOBatch,
    PPOMetrics,
    Recorded,
    SFTBatch,
    TokenLossBatch,
    TrainBatch,
    TrainerState,
    dpo_pair_violations,
)
from zerokl.services.weightstore import convert as weights_convert
from zerokl.services.weightstore.shared import ChecksumMismatch, SharedExport
from zerokl.services.weightstore.store import VersionSpec, WeightsManifest
from zerokl.services.weightstore.sync import SharedBuffer, copy_checked, export_shared
from zerokl.services.weightstore.versions import WeightsVersion, run_segment, segment_index
from zerokl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from zerokl.vocab import Completion, InvalidOption, Rollout, SamplingOptions

__all__ = [
    "MEMORY_HISTORY_ENV",
    "TRAINER_SERVICE",
    "TrainerLimits",
    "TrainerService",
    "TrainerServicer",
    "add_trainer_service",
]

log = logging.getLogger(__name__)

TRAINER_SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name
_MAX_REPORTED = 16          # violations listed in one status; the rest are counted

# Trainer metrics (zerokl_ prefix, in the runtime's registry next to the serving ones).
STEP = Gauge("zerokl_trainer_step", "Optimizer steps taken.", registry=REGISTRY)
TOKENS = Counter("zerokl_trainer_tokens", "Completion tokens trained on (ForwardBackward).", registry=REGISTRY)
TOKENS_PER_S = Gauge("zerokl_trainer_tokens_per_second", "Throughput of the last ForwardBackward.",
                     registry=REGISTRY)
KL = Gauge("zerokl_trainer_train_inference_kl",
           "Exact mean KL between behaviour and trainer logprobs of the last PPO batch (0 when aligned).",
           registry=REGISTRY)
MISMATCHED = Counter("zerokl_trainer_mismatched_tokens",
                     "Rollout tokens whose trainer logprob differed from the behaviour logprob.", registry=REGISTRY)
CLIP_FRACTION = Gauge("zerokl_trainer_clip_fraction", "PPO clip fraction of the last PPO batch.",
                      registry=REGISTRY)
STALE_ROLLOUTS = Counter("zerokl_trainer_stale_rollouts",
                         "Rollouts from older weights admitted by an explicit max_staleness.", registry=REGISTRY)

_T = TypeVar("_T")


_STORE_CHECK_S = 5.0        # a share asks the store whether it holds the version's name already, this long at most
_SHARED_KEPT = 2            # versions kept in shared memory: the one being switched to and the one before
# Record processes that may die on one record (killed, out of memory) before it fails: each death starts another.
_RECORD_ATTEMPTS = 3


def _provisional(name: str, spec: VersionSpec) -> WeightsManifest:
    """The manifest a shared version will have in the store, before its shards are committed."""
    return WeightsManifest(version=name, spec=spec, shards=(), created_at=datetime.datetime.now(datetime.timezone.utc))


@dataclass
class _Record:
    """The weight store's record of a version saved with share: its snapshot, written, uploaded."""

    step: int
    spec: VersionSpec
    snapshot: CheckpointSnapshot | None          # a checkpoint's, until written (or superseded)
    # The shared version's memory while the record reads it: a weights-only version's bytes until the record process
    # holds them, a checkpoint's serving weights (its snapshot's views of the export) until copied to the host.
    export: SharedBuffer | None = None
    model_config: ModelConfig | None = None     # with ``export``: its config.json, and its serving dtype
    dtype: torch.dtype | None = None
    checksum: str = ""                          # of the serving bytes the fleet was sent (the export's)
    task: "asyncio.Future[WeightsManifest | None] | None" = None
    directory: pathlib.Path | None = None       # the checkpoint written, until uploaded
    manifest: WeightsManifest | None = None     # set once the store committed it
    started: float = dataclasses.field(default_factory=time.monotonic)   # when it was shared
    record_s: float = 0.0                       # share -> the store's commit, once committed
    begun: bool = False                         # its files are being written or uploaded: never superseded then
    waiters: int = 0                            # RecordWeights calls waiting for it: someone reads it
    superseded_by: str = ""                     # never recorded: the newer version whose share dropped it
    released: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)   # set once it holds no export

    @property
    def weights_only(self) -> bool:
        return self.spec.metadata.get(META_STATE) != "full"

    @property
    def failure(self) -> BaseException | None:
        """Why its record ended without the store committing it, for good; None while it runs, once committed or
        superseded, and after an outage whose files wait on disk for RecordWeights to upload them again."""
        if self.task is None or not self.task.done() or self.task.cancelled() or self.manifest is not None:
            return None
        error = self.task.exception()
        return None if isinstance(error, Unavailable) and self.directory is not None else error

    @property
    def supersedable(self) -> bool:
        """Whether a newer share may drop it: weights only (a resume point is always recorded), its record not
        started, and no RecordWeights waiting for it."""
        return (self.weights_only and self.manifest is None and not self.begun and not self.waiters
                and not self.superseded_by)


def _viewers(buffer: torch.Tensor, most: int = 5) -> str:
    """The Python tensors that view ``buffer``'s memory beside it, and what refers to each (for the log of an
    export closed while something else holds it)."""
    lo, hi = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    found: list[str] = []
    with warnings.catch_warnings(), contextlib.suppress(Exception):     # a log line: never the close's failure
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        for obj in objects:
            if isinstance(obj, torch.Tensor) and obj is not buffer and obj.is_cuda and lo <= obj.data_ptr() < hi:
                owners = [type(r).__name__ for r in gc.get_referrers(obj) if r is not objects][:4]
                found.append(f"{tuple(obj.shape)} {obj.dtype} <- {', '.join(owners) or 'nothing Python reaches'}")
                if len(found) == most:
                    break
    return "; viewed by " + ("; ".join(found) if found else "no Python tensor (a C++ holder)")


async def _released(record: _Record) -> None:
    """Until ``record`` holds no export, or its task ended (a record cancelled with the service)."""
    waiter = asyncio.ensure_future(record.released.wait())
    pending = {waiter} | ({record.task} if record.task is not None else set())
    await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()


#: Set to 1, a CUDA trainer keeps every device allocation's stack (torch.cuda.memory._record_memory_history), and a
#: ForwardBackward that runs out of device memory logs where each of the largest live blocks was allocated.
MEMORY_HISTORY_ENV = "ZEROKL_CUDA_MEMORY_HISTORY"


@dataclass(frozen=True)
class TrainerLimits:
    """Request limits on top of the model's own (vocabulary, context length)."""

    max_batch_tokens: int = 262_144     # prompt + completion ids over one request's sequences


# ----------------------------------------------------------------------------- validation

def _completion_violations(c: Completion, where: str, vocab: int, max_len: int) -> list[FieldViolation]:
    out = []
    for name, ids in (("prompt_ids", c.prompt_ids), ("completion_ids", c.completion_ids)):
        if not ids:
            # The first completion token needs a context position; an empty
            # completion has nothing to train on.
            out.append(FieldViolation(f"{where}.{name}", "must hold at least one token id"))
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            out.append(FieldViolation(f"{where}.{name}",
                                      f"ids {bad[:4]} are outside the vocabulary [0, {vocab})"))
    if len(c.prompt_ids) + len(c.completion_ids) > max_len:
        out.append(FieldViolation(where, f"{len(c.prompt_ids) + len(c.completion_ids)} tokens exceed the "
                                         f"model's context length {max_len}"))
    try:    # the ranges inference samples under (float32-safe), so the trainer recomputes what it can serve
        SamplingOptions(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p).check()
    except InvalidOption as err:
        out.append(FieldViolation(f"{where}.{err.field}", str(err)))
    return out


def _raise_if(violations: Sequence[FieldViolation]) -> None:
    if not violations:
        return
    shown = violations[:_MAX_REPORTED]
    more = f" (and {len(violations) - len(shown)} more)" if len(violations) > len(shown) else ""
    raise InvalidArgument("; ".join(f"{v.field}: {v.description}" for v in shown) + more,
                          field_violations=shown)


def _adam_violations(adam: AdamParams, lr: float | None) -> list[FieldViolation]:
    out = []
    if lr:
        out.append(FieldViolation("lr", "give lr (0) or adam, not both"))
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        value = getattr(adam, name)
        if not (math.isfinite(value) and value >= 0):
            out.append(FieldViolation(f"adam.{name}", f"{value} must be finite and >= 0"))
        elif name == "learning_rate" and value > MAX_LR:
            out.append(FieldViolation("adam.learning_rate", f"{value} must be at most {MAX_LR:g} (the learning "
                                                            "rate ceiling)"))
        elif name.startswith("beta") and value >= 1:
            out.append(FieldViolation(f"adam.{name}", f"{value} must be in [0, 1)"))
        elif name == "eps" and value == 0:
            out.append(FieldViolation("adam.eps", "must be > 0"))
    return out


def _is_version_name(name: str) -> bool:
    try:
        WeightsVersion.validate(name)
    except InvalidArgument:
        return False
    return True


def _tokens(seqs: Sequence[Completion]) -> int:
    return sum(len(c.prompt_ids) + len(c.completion_ids) for c in seqs)


# ----------------------------------------------------------------------------- the service logic

class TrainerService:
    """One trainer behind an RPC-shaped async API (see the module docstring for concurrency).

    ``lineage`` lists the weight versions the trainer's weights have been, with
    the step at which they were; its last entry names the current base
    (:attr:`TrainerState.weights_version`). ``identity`` is what Info reports.
    """

    def __init__(self, trainer: Trainer, repo: WeightsRepo, *, run: str, lineage: Sequence[LineageEntry],
                 identity: ServiceIdentity, limits: TrainerLimits = TrainerLimits(), segment: str = "",
                 recorder: RecordWorker | None = None) -> None:
        if not lineage:
            raise ValueError("lineage must name the version the trainer starts from")
        if segment and segment_index(run, segment) is None:
            raise ValueError(f"{segment!r} is not a segment of run {run!r}")
        self.repo = repo
        self.run = run                      # the job's name (--run): pins and resume look at all its segments
        self.segment = segment or run       # what versions are published under now (versions.run_segment)
        self.limits = limits
        self._trainer = trainer
        self._lineage = list(lineage)[-MAX_LINEAGE:]
        self._identity = identity
        self._pinned: str | None = None     # the resume point this trainer pins in the store
        self._exports: dict[str, SharedBuffer] = {}   # versions in shared memory, oldest first
        self._records: dict[str, _Record] = {}        # versions saved with share: their store records
        # Writes and uploads the records of shared versions in a process of its own, on the store ``repo`` is
        # (built from the same flags: trainer/server.py); None: this service cannot share versions.
        self._recorder = recorder
        self._accumulated = 0
        self._lock = asyncio.Lock()
        # One thread for every tensor operation: the model is used by one
        # thread at a time, always the same, in arrival order.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zerokl-trainer")
        self._server: ServiceServer | None = None
        STEP.set(trainer.step)

    # ------------------------------------------------------------------ plumbing

    @property
    def identity(self) -> ServiceIdentity:
        return self._identity

    @property
    def trainer(self) -> Trainer:
        """The current trainer (replaced by LoadWeights; use between calls only)."""
        return self._trainer

    def attach(self, server: ServiceServer) -> None:
        """Report NOT_SERVING on ``server`` while weights are swapped."""
        self._server = server

    async def close(self) -> None:
        """Wait for queued work, stop the compute thread and close the store."""
        for record in list(self._records.values()):
            if record.task is not None and not record.task.done():
                with contextlib.suppress(Exception):
                    await record.task   # a version the fleet serves is recorded before the store closes
        async with self._lock:
            self._executor.shutdown(wait=True)
        for export in self._exports.values():
            export.close()
        self._exports.clear()
        if self._recorder is not None:
            await self._recorder.close()
        await self.repo.close()

    async def _exclusive(self, work: Callable[[], Awaitable[_T]]) -> _T:
        async def locked() -> _T:
            async with self._lock:
                return await work()
        task = asyncio.ensure_future(locked())
        # Retrieved here so a task whose caller went away never logs "exception never retrieved".
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(task)

    async def _compute(self, fn: Callable[..., _T], *args: Any, **kw: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kw))

    def _check_completions(self, seqs: Sequence[tuple[str, Completion]]) -> list[FieldViolation]:
        config = self._trainer.model.config
        out = []
        for where, c in seqs:
            out += _completion_violations(c, where, config.vocab_size, config.max_position_embeddings)
        total = _tokens([c for _, c in seqs])
        if total > self.limits.max_batch_tokens:
            out.append(FieldViolation("batch", f"{total} tokens exceed this trainer's limit of "
                                               f"{self.limits.max_batch_tokens} per request"))
        return out

    # ------------------------------------------------------------------ RPCs

    async def forward_logprobs(self, completions: Sequence[Completion]) -> list[torch.Tensor]:
        """Per-token fp32 logprobs of each completion under its sampling distribution."""
        if not completions:
            raise InvalidArgument.field("completions", "empty batch")

        async def work() -> list[torch.Tensor]:
            # Checked under the lock: a queued LoadWeights may change the vocabulary.
            _raise_if(self._check_completions([(f"completions[{i}]", c) for i, c in enumerate(completions)]))
            return await self._compute(self._trainer.forward_logprobs, list(completions))
        return await self._exclusive(work)

    async def traced_logprobs(self, completion: Completion, capture: Sequence[str] = ()) -> tuple[torch.Tensor, Trace]:
        """forward_logprobs of one completion and the per-op trace of prompt + completion (zerokl diff),
        from the same weights (one exclusive call)."""
        async def work() -> tuple[torch.Tensor, Trace]:
            _raise_if(self._check_completions([("completions[0]", completion)]))
            lp = await self._compute(self._trainer.forward_logprobs, [completion])
            trace = await self._compute(trace_sequence, self._trainer.model,
                                        (*completion.prompt_ids, *completion.completion_ids), completion.temperature,
                                        completion.top_k, completion.top_p, tuple(capture),
                                        identity_meta(self.identity))
            return lp[0], trace
        return await self._exclusive(work)

    async def forward_backward(self, batch: TrainBatch | None) -> ForwardBackwardResult:
        """Accumulate the gradients of one objective; the method is the batch's type."""
        if not isinstance(batch, (SFTBatch, DPOBatch, PPOBatch, TokenLossBatch)):
            raise InvalidArgument.field("batch", "set one of sft, dpo, ppo, token (unknown or missing method)")

        async def work() -> ForwardBackwardResult:
            # Checked under the lock: a queued LoadWeights may change the vocabulary.
            self._check_batch(batch)
            staleness = self._staleness(batch) if isinstance(batch, PPOBatch) else []
            if isinstance(batch, TokenLossBatch) and not hasattr(self._trainer, "forward_backward_tokens"):
                raise FailedPrecondition("token batches (Tinker's per-token losses) are not supported by a "
                                         "--dp/--tp/--ep trainer yet: serve the trainer in one process")
            forward_only = isinstance(batch, TokenLossBatch) and batch.forward_only
            waited = None if forward_only else await self._release_exports_for_training()
            before = torch.cuda.memory_allocated(self._trainer.device) if self._trainer.device.type == "cuda" else 0
            try:
                if isinstance(batch, TokenLossBatch):
                    result = await self._compute(self._forward_backward_tokens, batch)
                else:
                    result = await self._compute(self._forward_backward, batch, staleness)
            except ServiceError:
                raise       # a refusal, before anything was computed
            except Exception as err:
                if forward_only:    # no backward ran: the pending gradients are as they were
                    raise Internal(f"ForwardBackward failed ({type(err).__name__}: {err})") from None
                # A backward that failed part-way may have added to some gradients: every pending gradient
                # goes (the batches accumulated before it included), so nothing half-applied blocks or
                # leaks into a later step.
                dropped = self._accumulated
                log.exception("trainer: ForwardBackward failed (%d batch(es) were pending)", dropped)
                if isinstance(err, torch.cuda.OutOfMemoryError):
                    try:
                        report = self._device_memory_report()
                    except Exception as failed:  # noqa: BLE001 - the report must not replace the step's own error
                        report = f"(the report failed: {type(failed).__name__}: {failed})"
                    log.error("trainer: device memory at the failure (%.2f GiB allocated before this ForwardBackward)"
                              "\n%s", before / 2**30, report)
                if not await self._compute(self._drop_gradients):
                    raise Internal(f"ForwardBackward failed ({type(err).__name__}: {err})") from None
                raise Internal(f"ForwardBackward failed ({type(err).__name__}: {err}); no gradient is pending "
                               f"now ({dropped} batch(es) accumulated before it were dropped too)") from None
            self._accumulated += 0 if forward_only else 1
            result = dataclasses.replace(result, accumulated_batches=self._accumulated)
            if waited is not None:
                result = dataclasses.replace(result, metrics={**result.metrics, "export_wait_s": waited})
            TOKENS.inc(result.tokens)
            TOKENS_PER_S.set(result.tokens_per_s)
            if result.ppo is not None:
                KL.set(result.ppo.kl)
                MISMATCHED.inc(result.ppo.mismatched_tokens)
                CLIP_FRACTION.set(result.ppo.clip_fraction)
                STALE_ROLLOUTS.inc(result.ppo.stale_rollouts)
            return result
        return await self._exclusive(work)

    def _log_device_memory(self, when: str) -> None:
        """Co-located (a replica wakes on the device into what this trainer leaves free): one line of what the trainer
        holds on it ``when``, and the full :meth:`_device_memory_report` once its allocator holds more than 1 GiB
        beyond the parameters and the exports. The GLM-5 slice's first wake on an H100 ran out of memory with 68.8
        GiB held by the trainer, of which its weights and the step's export were 45.4 (docs/perf.md)."""
        device, gib = self._trainer.device, 2**30
        free, total = torch.cuda.mem_get_info(device)
        params = sum(t.numel() * t.element_size() for t in self._trainer.model.parameters() if t.is_cuda)
        exports = sum(s.buffer.numel() for s in self._exports.values() if s.buffer.is_cuda)
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        log.info("trainer: device memory %s: allocated %.2f GiB, reserved %.2f GiB (parameters %.2f, exports %.2f); "
                 "the device has %.2f of %.2f GiB free", when, allocated / gib, reserved / gib, params / gib,
                 exports / gib, free / gib, total / gib)
        if reserved - params - exports > gib:
            log.info("trainer: device memory %s, beyond the parameters and the exports:\n%s", when,
                     self._device_memory_report())

    def _device_memory_report(self) -> str:
        """What holds this trainer's device memory, for a ForwardBackward that ran out of it: the model's parameters
        and gradients, the exports and records kept, and every other device storage a Python object reaches (the
        largest first). Memory no Python object reaches (autograd's saved tensors, a shared block in torch's IPC
        limbo) shows only in the allocator's total; with MEMORY_HISTORY_ENV set, live blocks by allocating frame."""
        device = self._trainer.device
        gib = 2**30

        def storages(tensors) -> dict[int, int]:  # noqa: ANN001 - tensors -> {storage address: bytes}
            return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        params = storages(self._trainer.model.parameters())
        grads = storages(p.grad for p in self._trainer.model.parameters() if p.grad is not None)
        others: dict[int, tuple[int, str]] = {}
        with warnings.catch_warnings():     # isinstance on every object touches deprecated module attributes too
            warnings.simplefilter("ignore")
            found = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
        for obj in found:
            if obj.device.type == device.type:
                key, n = obj.untyped_storage().data_ptr(), obj.untyped_storage().nbytes()
                if key not in params and key not in grads and n > others.get(key, (0, ""))[0]:
                    others[key] = (n, f"{type(obj).__name__} {tuple(obj.shape)} {obj.dtype}")
        largest = sorted(others.values(), reverse=True)
        allocator = (f"allocated {torch.cuda.memory_allocated(device) / gib:.2f} GiB, reserved "
                     f"{torch.cuda.memory_reserved(device) / gib:.2f} GiB; " if device.type == "cuda" else "")
        lines = [f"{allocator}parameters {sum(params.values()) / gib:.2f} GiB, gradients {sum(grads.values()) / gib:.2f} "
                 f"GiB, other {device.type} storages a Python object reaches {sum(n for n, _ in largest) / gib:.2f} GiB "
                 f"in {len(largest)}",
                 f"exports kept: {', '.join(self._exports) or 'none'}; records: " + (", ".join(
                     f"{name} (export {'held' if r.export is not None else 'released'}, snapshot "
                     f"{'held' if r.snapshot is not None else 'none'})" for name, r in self._records.items()) or "none")]
        lines += [f"  {n / gib:8.3f} GiB  {what}" for n, what in largest[:12]]
        if os.environ.get(MEMORY_HISTORY_ENV) == "1" and device.type == "cuda":
            sites: dict[str, list[int]] = {}
            snapshot = torch.cuda.memory._snapshot()
            states: dict[str, int] = {}
            for segment in snapshot.get("segments", []):
                for block in segment.get("blocks", []):
                    states[block.get("state", "?")] = states.get(block.get("state", "?"), 0) + block.get("size", 0)
                    if block.get("state") != "active_allocated":
                        continue
                    frames = block.get("frames") or []
                    ours = [f for f in frames if "/zerokl/" in f["filename"]] or frames[:1]
                    site = " <- ".join(f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}" for f in ours[:3])
                    sites.setdefault(site or "(no frames recorded)", []).append(block["size"])
            lines.append("blocks by state: " + (", ".join(f"{k} {v / gib:.2f} GiB" for k, v in states.items()) or
                                                "none in the snapshot") + "; live ones by where they were allocated:")
            lines += [f"  {sum(v) / gib:8.3f} GiB in {len(v):4d}  {site}"
                      for site, v in sorted(sites.items(), key=lambda kv: -sum(kv[1]))[:12]]
        return "\n".join(lines)

    def _check_batch(self, batch: TrainBatch) -> None:
        if isinstance(batch, SFTBatch):
            if not batch.completions:
                raise InvalidArgument.field("sft.completions", "empty batch")
            _raise_if(self._check_completions([(f"sft.completions[{i}]", c)
                                               for i, c in enumerate(batch.completions)]))
        elif isinstance(batch, DPOBatch):
            if not batch.pairs:
                raise InvalidArgument.field("dpo.pairs", "empty batch")
            out = self._check_completions([(f"dpo.pairs[{i}].{side}", c) for i, pair in enumerate(batch.pairs)
                                           for side, c in zip(("chosen", "rejected"), pair, strict=True)])
            _raise_if(out + dpo_pair_violations(batch.pairs, "dpo.pairs"))
        elif isinstance(batch, TokenLossBatch):
            self._check_token_batch(batch)
        else:
            self._check_ppo(batch)

    def _check_token_batch(self, batch: TokenLossBatch) -> None:
        if batch.loss not in TOKEN_LOSSES:
            raise InvalidArgument.field("token.loss", f"{batch.loss!r} is not a loss: expected one of "
                                                      f"{', '.join(TOKEN_LOSSES)}")
        if not batch.sequences:
            raise InvalidArgument.field("token.sequences", "empty batch")
        config = self._trainer.model.config
        vocab, max_len = config.vocab_size, config.max_position_embeddings
        out: list[FieldViolation] = []
        rl = batch.loss != "cross_entropy"
        for i, seq in enumerate(batch.sequences):
            where, n = f"token.sequences[{i}]", len(seq.input_ids)
            if not n:
                out.append(FieldViolation(f"{where}.input_ids", "must hold at least one token id"))
            if len(seq.target_ids) != n:
                out.append(FieldViolation(f"{where}.target_ids", f"{len(seq.target_ids)} targets for {n} input ids "
                                                                 "(one per position)"))
            for name, ids in (("input_ids", seq.input_ids), ("target_ids", seq.target_ids)):
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    out.append(FieldViolation(f"{where}.{name}", f"ids {bad[:4]} are outside the vocabulary "
                                                                 f"[0, {vocab})"))
            if n > max_len:
                out.append(FieldViolation(f"{where}.input_ids", f"{n} tokens exceed the model's context length "
                                                                f"{max_len}"))
            for name in ("weights", "logprobs", "advantages"):
                values = getattr(seq, name)
                if values is None:
                    if rl and name != "weights":
                        out.append(FieldViolation(f"{where}.{name}", f"required by the {batch.loss} loss"))
                    continue
                if len(values) != n:
                    out.append(FieldViolation(f"{where}.{name}", f"{len(values)} values for {n} positions"))
                elif not all(math.isfinite(v) for v in values):
                    out.append(FieldViolation(f"{where}.{name}", "must be finite"))
        allowed = TOKEN_LOSSES[batch.loss]
        for key, value in batch.config.items():
            if key not in allowed:
                keys = ", ".join(allowed) or "none"
                out.append(FieldViolation(f"token.config.{key}", f"not a key of the {batch.loss} loss (its keys: "
                                                                 f"{keys})"))
            elif not (math.isfinite(value) and value >= 0):
                out.append(FieldViolation(f"token.config.{key}", f"{value} must be finite and >= 0"))
        merged = {**allowed, **batch.config}
        if "clip_low_threshold" in merged and merged["clip_low_threshold"] > merged["clip_high_threshold"]:
            out.append(FieldViolation("token.config", "clip_low_threshold must not exceed clip_high_threshold"))
        try:
            SamplingOptions(temperature=batch.temperature, top_k=batch.top_k, top_p=batch.top_p).check()
        except InvalidOption as err:
            out.append(FieldViolation(f"token.{err.field}", str(err)))
        total = sum(len(s.input_ids) for s in batch.sequences)
        if total > self.limits.max_batch_tokens:
            out.append(FieldViolation("batch", f"{total} tokens exceed this trainer's limit of "
                                               f"{self.limits.max_batch_tokens} per request"))
        _raise_if(out)

    def _check_ppo(self, batch: PPOBatch) -> None:
        rollouts = batch.rollouts
        if not rollouts:
            raise InvalidArgument.field("ppo.rollouts", "empty batch")
        out = self._check_completions([(f"ppo.rollouts[{i}].completion", r.sequence) for i, r in enumerate(rollouts)])
        for i, r in enumerate(rollouts):
            where = f"ppo.rollouts[{i}]"
            if len(r.logprobs) != len(r.sequence.completion_ids):
                out.append(FieldViolation(f"{where}.logprobs", f"{len(r.logprobs)} logprobs for "
                                                               f"{len(r.sequence.completion_ids)} completion ids"))
            elif not all(math.isfinite(x) for x in r.logprobs):
                out.append(FieldViolation(f"{where}.logprobs", "must be finite (a sampled token has p > 0)"))
            if not math.isfinite(r.reward):
                out.append(FieldViolation(f"{where}.reward", f"{r.reward} is not finite"))
            if not r.weights_version:
                out.append(FieldViolation(f"{where}.weights_version",
                                          "required: the weights version the rollout was sampled under"))
        n = len(rollouts)
        if batch.advantages is not None:
            if batch.group_size is not None:
                out.append(FieldViolation("ppo.group_size", "give either group_size (GRPO) or advantages, not both"))
            if len(batch.advantages) != n:
                out.append(FieldViolation("ppo.advantages", f"{len(batch.advantages)} advantages for {n} rollouts"))
            elif not all(math.isfinite(a) for a in batch.advantages):
                out.append(FieldViolation("ppo.advantages", "must be finite"))
        elif batch.group_size is None or batch.group_size <= 0:
            out.append(FieldViolation("ppo.group_size", "required (> 0) unless advantages are given"))
        elif n % batch.group_size:
            out.append(FieldViolation("ppo.group_size", f"{batch.group_size} does not divide the {n} rollouts "
                                                        "into whole groups"))
        _raise_if(out)

    def _staleness(self, batch: PPOBatch) -> list[int]:
        """Per rollout, how many optimizer steps its weights are behind the trainer's.

        FAILED_PRECONDITION for a version that is not an ancestor of the
        current weights, or one staler than the batch admits (none unless it
        sets max_staleness).
        """
        step = self._trainer.step
        at = {e.version: e.step for e in self._lineage}     # later entries win
        allowed = batch.max_staleness or 0
        out: list[int] = []
        bad: dict[str, list[int]] = {}
        for i, r in enumerate(batch.rollouts):
            lag = step - at[r.weights_version] if r.weights_version in at else None
            out.append(-1 if lag is None else lag)
            if lag is None or lag > allowed:
                bad.setdefault(r.weights_version, []).append(i)
        if not bad:
            return out
        current = self._lineage[-1]
        violations = []
        for version, rows in bad.items():
            if version not in at:
                violations.append(PreconditionViolation(
                    "UNKNOWN_WEIGHTS_VERSION", version,
                    f"rollouts {rows[:8]} were sampled under {version}, which is not among the weights this "
                    f"trainer has had since {self._lineage[0].version}"))
            else:
                lag = step - at[version]
                violations.append(PreconditionViolation(
                    "STALE_WEIGHTS_VERSION", version,
                    f"rollouts {rows[:8]} were sampled under {version}, {lag} optimizer step(s) behind the "
                    f"trainer (step {step}); max_staleness is {allowed}"))
        where = (f"{current.version}" if current.step == step
                 else f"{current.version} + {step - current.step} step(s), unpublished")
        raise FailedPrecondition(
            f"{sum(len(r) for r in bad.values())} of {len(batch.rollouts)} rollouts are off-policy: the trainer's "
            f"weights are {where}; sample under them, or set max_staleness to admit older rollouts. "
            + "; ".join(v.description for v in violations),
            precondition_violations=violations)

    def _forward_backward_tokens(self, batch: TokenLossBatch) -> ForwardBackwardResult:
        """The tensor work of a token batch (on the compute thread)."""
        trainer = self._trainer
        sampling = (batch.temperature, batch.top_k, batch.top_p)
        seqs = [ScoredSequence(s.input_ids, 0, s.target_ids, *sampling) for s in batch.sequences]

        def per_position(name: str) -> list[tuple[float, ...]] | None:
            rows = [getattr(s, name) for s in batch.sequences]
            if all(r is None for r in rows):
                return None
            # A sequence without the input gets 1 (weights) or 0 (the RL inputs) at every position.
            fill = 1.0 if name == "weights" else 0.0
            return [r if r is not None else (fill,) * len(s.input_ids) for r, s in zip(rows, batch.sequences)]

        m, logprobs = trainer.forward_backward_tokens(
            batch.loss, seqs, weights=per_position("weights"), behaviour=per_position("logprobs"),
            advantages=per_position("advantages"), config={**TOKEN_LOSSES[batch.loss], **batch.config},
            forward_only=batch.forward_only)
        return ForwardBackwardResult(
            method=batch.method, loss=float(m["loss"]), tokens=int(m["tokens"]), tokens_per_s=float(m["tokens_per_s"]),
            step=trainer.step, accumulated_batches=0, metrics={k: float(v) for k, v in m.items()},
            token_logprobs=tuple(logprobs))

    def _forward_backward(self, batch: TrainBatch, staleness: list[int]) -> ForwardBackwardResult:
        """The tensor work of one ForwardBackward (on the compute thread)."""
        trainer = self._trainer
        ppo = None
        if isinstance(batch, SFTBatch):
            m = trainer.forward_backward("sft", list(batch.completions))
        elif isinstance(batch, DPOBatch):
            if batch.reset_reference:
                trainer.freeze_reference()
            m = trainer.forward_backward("dpo", list(batch.pairs))
        else:
            rollouts: list[Rollout] = list(batch.rollouts)
            if batch.advantages is not None:
                advantages = torch.tensor(batch.advantages, dtype=torch.float32)
            else:
                # Exactly Trainer.grpo_step's advantages, so the two paths give the same bits.
                advantages = group_advantages(torch.tensor([r.reward for r in rollouts]), batch.group_size or 1)
            m = trainer.forward_backward("ppo", rollouts, advantages=advantages)
            reward = float(sum(r.reward for r in rollouts) / len(rollouts))
            stale = sum(1 for s in staleness if s > 0)
            worst = max(staleness, default=0)
            m |= {"reward": reward, "stale_rollouts": stale, "max_staleness": worst}
            ppo = PPOMetrics(kl=m["kl"], mismatched_tokens=int(m["mismatched_tokens"]),
                             clip_fraction=m["clip_fraction"], ratio_min=m["ratio_min"], ratio_max=m["ratio_max"],
                             kl_reference=m["kl_reference"], reward_mean=reward, stale_rollouts=stale,
                             max_staleness=worst)
        return ForwardBackwardResult(
            method=batch.method, loss=float(m["loss"]), tokens=int(m["tokens"]), tokens_per_s=float(m["tokens_per_s"]),
            step=trainer.step, accumulated_batches=0, ppo=ppo, metrics={k: float(v) for k, v in m.items()})

    def _drop_gradients(self) -> bool:
        """No gradient pending: the trained tensors' .grad cleared, the accumulated count 0 (compute thread).
        False (nothing done) for a distributed trainer, whose ranks hold their own gradients."""
        trainer = self._trainer
        if not isinstance(trainer, Trainer):
            return False
        for p in [*trainer.params, *(trainer.masters or [])]:
            p.grad = None
        self._accumulated = 0
        return True

    async def optim_step(self, lr: float | None = None, adam: AdamParams | None = None) -> OptimResult:
        """Apply the accumulated gradients at `lr` (None or 0: the trainer's schedule), or with this
        step's own ``adam`` hyperparameters; FAILED_PRECONDITION when there are none, or when the step
        would make a weight or optimizer state non-finite (the step is then undone and its gradients
        dropped); INVALID_ARGUMENT for a bad `lr` (negative, non-finite, or above the ceiling
        :data:`~zerokl.services.trainer.config.MAX_LR`) or ``adam``."""
        if lr is not None and not (math.isfinite(lr) and 0.0 <= lr <= MAX_LR):
            raise InvalidArgument.field("lr", f"must be finite, >= 0 and at most {MAX_LR:g} (the learning rate "
                                              f"ceiling; 0: the trainer's schedule), got {lr}")
        if adam is not None:
            _raise_if(_adam_violations(adam, lr))

        async def work() -> OptimResult:
            if self._accumulated == 0:
                raise FailedPrecondition("no gradients accumulated since the last step: call ForwardBackward first")
            try:
                if adam is not None:
                    m = await self._compute(self._trainer.optim_step, None, adam)
                else:
                    m = await self._compute(self._trainer.optim_step, lr or None)
            except NonFiniteStep as err:
                raise FailedPrecondition(f"{err}; the step was refused and undone (weights, optimizer state and "
                                         f"step {self._trainer.step} as before it, its gradients dropped)") from None
            finally:
                # The trainer drops the gradients whether the step applied or was undone.
                self._accumulated = 0
            STEP.set(m["step"])
            return OptimResult(grad_norm=float(m["grad_norm"]), lr=float(m["lr"]), step=int(m["step"]))
        return await self._exclusive(work)

    async def save_weights(self, version: str = "", metadata: Mapping[str, str] | None = None,
                           weights_only: bool = False, share: bool = False, supersede: bool = False
                           ) -> tuple[WeightsManifest, bool] | tuple[WeightsManifest, bool, SharedExport]:
        """Publish the current weights (and, unless ``weights_only``, the trainer state) as a version.

        Returns (manifest, created); created is False when the same checkpoint
        was already published under that name (a retry). With ``share``: (manifest, created,
        shared): the serving weights are put in shared memory (:mod:`zerokl.services.weightstore.sync`,
        one device copy) and the call answers at once; the checkpoint is written and uploaded to
        the store in the background (:meth:`record_weights` waits for it), so the RL step's
        critical path holds no file or store I/O. The manifest is then the one the store will hold
        (no shards yet). With ``supersede`` (and ``share``) the caller serves the version shared before this
        one: the weights-only versions shared before that one whose record has not started (and that no
        :meth:`record_weights` waits for) are never recorded (:meth:`_supersede`).
        """
        metadata = dict(metadata or {})
        reserved = sorted(k for k in metadata if k.startswith("zerokl."))
        if reserved:
            raise InvalidArgument.field("metadata", f"keys {reserved} are reserved (prefix 'zerokl.')")

        async def work() -> tuple[WeightsManifest, bool]:
            trainer = self._trainer
            if self._accumulated and not weights_only:
                raise FailedPrecondition(
                    f"{self._accumulated} ForwardBackward batch(es) are accumulated but not applied: a resume point "
                    "is a step boundary (call OptimStep first, or publish weights_only)")
            try:
                return await self._save(trainer, version, metadata, weights_only, share, supersede)
            except AlreadyExists:
                if version:
                    raise   # a name the caller chose: theirs to change
            # The run's default name for this step holds other contents (in the weight store, or the fleet was sent
            # them in place): the trainer was taken back to an earlier version (LoadWeights) after the run published
            # later steps. Its steps go on under the run's next segment, so they never take (or serve under) a name
            # the run used for other bytes.
            taken = str(WeightsVersion(self.segment, trainer.step))
            self.segment = await self._fresh_segment(next_one=True)
            log.warning("trainer: %s is taken by other contents; publishing under segment %s", taken, self.segment)
            return await self._save(trainer, version, metadata, weights_only, share, supersede)
        return await self._exclusive(work)

    async def _save(self, trainer: Trainer, version: str, metadata: Mapping[str, str], weights_only: bool,
                    share: bool, supersede: bool = False
                    ) -> tuple[WeightsManifest, bool] | tuple[WeightsManifest, bool, SharedExport]:
        """SaveWeights' work under the lock: name, spec, then publish (or share); AlreadyExists when the store
        holds the name with other contents, before anything is shared."""
        name = version or str(WeightsVersion(self.segment, trainer.step))
        WeightsVersion.validate(name, "version")
        entry = LineageEntry(name, trainer.step)
        # A repeat of the save that made the current base writes the same files (same lineage).
        repeat = self._lineage[-1] == entry
        lineage = self._lineage if repeat else [*self._lineage, entry]
        parent = lineage[-2].version if len(lineage) > 1 else ""
        if not _is_version_name(parent):
            parent = ""     # e.g. an --init directory whose name is no valid version id
        spec = VersionSpec(
            parent_version=parent, step=trainer.step, numerics_version=self._identity.numerics_version,
            numerics_fingerprint=self._identity.numerics_fingerprint,
            model_config=config_to_hf(trainer.model.config, numerics_dtype(trainer.model)),   # FP8: quantization_config
            metadata={**metadata, META_RUN: self.segment, META_STATE: "none" if weights_only else "full"})
        if share:
            shared = await self._share(trainer, name, lineage, spec, weights_only)
            if supersede:
                self._supersede(name)
            return shared
        manifest, created = await self._publish_now(trainer, name, lineage, spec, weights_only)
        self._lineage = lineage[-MAX_LINEAGE:]
        self._set_identity(self._identity.with_weights(name))
        if manifest.spec.metadata.get(META_STATE) == "full":     # not a weights-only record found there
            await self.pin_resume_point(name)
        return manifest, created

    async def _publish_now(self, trainer: Trainer, name: str, lineage: list[LineageEntry], spec: VersionSpec,
                           weights_only: bool) -> tuple[WeightsManifest, bool]:
        """Write the checkpoint and publish it as ``name`` now; (manifest, created)."""
        with tempfile.TemporaryDirectory(prefix="zerokl-trainer-save-") as tmp:
            await self._compute(write_checkpoint, trainer, tmp, run=self.segment, lineage=lineage,
                                weights_only=weights_only)
            try:
                return await publish_checkpoint(self.repo, pathlib.Path(tmp), name, spec)
            except Unavailable as err:
                # Said by name: the caller must not mistake the store's outage for this trainer's.
                raise Unavailable(f"the weight store ({self.repo.describe()}) is unreachable: {err.message}; "
                                  f"{name} is not published, the trainer keeps step {trainer.step} "
                                  "(retry SaveWeights)") from None

    # ------------------------------------------------------------------ in-place sharing (issue 37)

    async def _share(self, trainer: Trainer, name: str, lineage: list[LineageEntry], spec: VersionSpec,
                     weights_only: bool) -> tuple[WeightsManifest, bool, SharedExport]:
        """SaveWeights(share)'s work, under the lock: export, snapshot, then queue the store's record of
        ``name`` (written and uploaded outside the lock: the next step trains meanwhile)."""
        pending = self._records.get(name)
        failure = pending.failure if pending is not None else None
        if pending is not None and name in self._exports and failure is None:
            # A retry of the same save (same step, same bits): the same descriptor.
            if pending.step != trainer.step:
                raise FailedPrecondition(f"version {name} was shared at step {pending.step}; the trainer is at "
                                         f"step {trainer.step}: name another version")
            return pending.manifest or _provisional(name, spec), False, self._exports[name].export
        stored = await self._stored(name)
        own = stored is not None and self._lineage[-1] == LineageEntry(name, trainer.step) \
            and (weights_only or stored.spec.metadata.get(META_STATE) == "full")
        if stored is not None and not own:
            # Any other name the store holds: a step redone (after a restart or a rollback), whose record is the
            # same files, or a name taken by other contents. Recorded now, before anything is shared:
            # publish_checkpoint recognizes the same files (the share goes on) and refuses other ones
            # (ALREADY_EXISTS), so the fleet never serves bytes that the store holds otherwise under the same
            # name, which a restart would serve. Rare, so the store's I/O on the step's path is.
            stored, _ = await self._publish_now(trainer, name, lineage, spec, weights_only)
        # The model's own tensors, packed into the export's buffer before the next step: no second copy of the
        # model on the device beside the export (the GLM-5 slice: 23 GiB each, a replica's beside them).
        state = await self._compute(trainer.serving_state_dict, copy=False)
        shared = await self._compute(export_shared, state, name, self._identity.numerics_fingerprint)
        del state
        if failure is not None and stored is None:
            # Shared before, its record failed (the memory it read gone, the store's refusal, its process dead at each
            # try): the fleet was sent it and the store does not hold it. Recorded again from the trainer's weights
            # when they are the bytes the fleet was sent; other bytes never take its name.
            assert pending is not None
            if shared.export.checksum != pending.checksum:
                shared.close()
                raise AlreadyExists(f"{name} was shared with other contents (checksum {pending.checksum}, these "
                                    f"{shared.export.checksum}), and its record failed ({failure})")
            log.warning("trainer: the record of %s failed (%s); recording it again from the trainer's weights, the "
                        "bytes the fleet was sent (checksum %s)", name, failure, pending.checksum)
        # The record's snapshot: the exported bytes themselves (what the fleet serves is what the store
        # records: a weights-only version's record process writes its files from them), and at a checkpoint the
        # trainer state, copied where it is before the next step.
        snapshot = None if stored is not None or weights_only else await self._compute(
            snapshot_checkpoint, trainer, run=self.segment, lineage=lineage, weights_only=False,
            serving=shared.tensors())
        replaced = self._exports.pop(name, None)     # the export of a version recorded again: this one is newer
        self._exports[name] = shared
        if replaced is not None:
            self._release(replaced)
        # Co-location (offload_optimizer: a replica shares the device): only the newest export stays on it.
        kept = 1 if trainer.config.offload_optimizer else _SHARED_KEPT
        while len(self._exports) > kept:            # the oldest first: a switch back reads the store
            self._release(self._exports.pop(next(iter(self._exports))))
        if trainer.config.offload_optimizer and trainer.device.type == "cuda":
            # A replica wakes into what the trainer leaves on the device: the packing's temporaries (a weight
            # that is not contiguous is copied before it is packed) go back to the driver first.
            await self._compute(torch.cuda.empty_cache)
            await self._compute(self._log_device_memory, f"after sharing {name}")
        if own:
            # The trainer's own version, recorded already (a job starting where the last one ended): nothing to write.
            self._records.pop(name, None)
            self._records[name] = _Record(step=trainer.step, spec=stored.spec, snapshot=None, manifest=stored)
            self._set_identity(self._identity.with_weights(name))
            return stored, False, shared.export
        self._lineage = lineage[-MAX_LINEAGE:]
        self._set_identity(self._identity.with_weights(name))
        if stored is not None:
            # Recorded above: the store held these very files (created False, as a plain save says).
            self._records.pop(name, None)
            self._records[name] = _Record(step=trainer.step, spec=stored.spec, snapshot=None, manifest=stored)
            if stored.spec.metadata.get(META_STATE) == "full":     # not a weights-only record found there
                await self.pin_resume_point(name)
            return stored, False, shared.export
        record = _Record(step=trainer.step, spec=spec, snapshot=snapshot, export=shared,
                         checksum=shared.export.checksum)
        if snapshot is None:
            record.model_config = trainer.model.config
            record.dtype = numerics_dtype(trainer.model)       # float8_e4m3fn for an FP8 trainer's bytes
        earlier = [r.task for r in self._records.values() if r.task is not None and not r.task.done()]
        self._records.pop(name, None)
        self._records[name] = record    # last: the newest share (_supersede keeps it)
        record.task = asyncio.ensure_future(self._record(record, name, earlier))
        record.task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return _provisional(name, spec), True, shared.export

    def _supersede(self, newest: str) -> None:
        """``newest`` was just shared and its caller serves the version shared before it: drop the records of the
        versions shared before that one which nobody reads (:attr:`_Record.supersedable`). A replica that read one
        from the store waited for its record in its switch (it landed before the caller shared again), so what is
        dropped here every replica took in place; a resume point is never dropped. Their snapshots go at once."""
        names = list(self._records)
        if newest not in names:
            return
        at = names.index(newest)
        for name in names[:max(at - 1, 0)]:      # the one before ``newest``: what the caller serves, recorded
            record = self._records[name]
            if record.supersedable:
                record.superseded_by, record.snapshot = newest, None
                self._drop_export(record)
                log.info("trainer: %s superseded by %s (weights only, read by no one: not recorded)", name, newest)

    async def _release_exports_for_training(self) -> float | None:
        """Co-location (``offload_optimizer``: a replica shares the device): the shared versions leave the device
        before a backward needs its memory (for the GLM-5 slice one export is 23 GiB of an 80 GB device). Each
        replica copied the newest one when it switched to it, before the rollouts this batch trains on; a record
        still to copy one is waited for, and closes it once it has the bytes (:meth:`_drop_export`): a weights-only
        version's once the record process holds them (it takes the versions one at a time), a checkpoint's serving
        weights once copied to the host (at once). The backward of the slice beside an export ran out of an H100's
        memory. A later switch to a released version reads the store, as one to an older version always did.
        Returns the seconds waited (the ForwardBackward's ``export_wait_s`` metric); None when not co-located."""
        if not self._trainer.config.offload_optimizer:
            return None
        while self._exports:
            self._release(self._exports.pop(next(iter(self._exports))))
        start = time.monotonic()
        holding = [r for r in self._records.values() if r.export is not None]
        if holding:
            await asyncio.gather(*(_released(r) for r in holding))
            log.info("trainer: waited %.2f s for %d record(s) to copy their versions off the device before a "
                     "backward", time.monotonic() - start, len(holding))
        return time.monotonic() - start

    def _release(self, shared: SharedBuffer) -> None:
        """Close a version's shared memory, unless a pending record still writes from it (closed once it did).
        Co-located, every reader copied it by then (a replica in its switch, before the rollouts that follow; a
        record before it let go); elsewhere the trainer keeps the newest two. The memory goes at once
        (SharedBuffer.close)."""
        if any(r.export is shared for r in self._records.values()):
            return
        device = self._trainer.device
        if device.type != "cuda":
            shared.close()
            return
        # Said in the log, as the memory it gives back: a CUDA export stays allocated while anything in this process
        # still views it, or while the share's IPC count (1, the trainer's own: sync's module docstring) is not 0.
        references, uses, before = shared.ipc_references(), shared.storage_uses(), torch.cuda.memory_allocated(device)
        viewers = _viewers(shared.buffer) if uses > 1 else ""
        shared.close()
        freed = before - torch.cuda.memory_allocated(device)
        log.log(logging.INFO if freed >= shared.nbytes else logging.WARNING,
                "trainer: closed the export of %s (%.2f GiB): %.2f GiB freed; its IPC count before %s (1: ours), "
                "holders of its memory here %d (1: the export alone)%s", shared.export.version, shared.nbytes / 2**30,
                freed / 2**30, references, uses, viewers)

    def _drop_export(self, record: _Record) -> None:
        """``record`` no longer reads its export: closed when the trainer no longer keeps it either."""
        shared, record.export = record.export, None
        record.released.set()
        if shared is not None and shared not in self._exports.values():
            self._release(shared)

    async def _stored(self, name: str) -> WeightsManifest | None:
        """The store's manifest of ``name``; None when it holds none, or cannot say within a few seconds (an outage:
        the share goes on, and the record that follows retries and says what it finds)."""
        try:
            return await asyncio.wait_for(self.repo.manifest(name), _STORE_CHECK_S)
        except NotFound:
            return None
        except (Unavailable, asyncio.TimeoutError) as err:
            log.warning("trainer: the weight store cannot say whether it holds %s (%s); sharing it unchecked", name,
                        getattr(err, "message", None) or type(err).__name__)
            return None

    async def _record(self, record: _Record, name: str,
                      earlier: Sequence["asyncio.Future[Any]"]) -> WeightsManifest | None:
        """After the records queued before it (versions reach the store in the order they were shared, one at a
        time), write ``name``'s snapshot to files (in a worker thread, beside the training) and upload them;
        None when it was superseded before its turn came (never recorded). A record process that dies meanwhile is
        replaced and asked again with what the trainer still holds (:meth:`_write_weights`, :meth:`_upload`)."""
        if record.snapshot is not None and self._trainer.config.offload_optimizer:
            # Co-located: a checkpoint's serving weights are views of its export, copied to the host at once, before
            # the records queued before it are done, so the export's memory goes; the next backward waits for it (a
            # resume point's views would otherwise hold 23 GiB of the GLM-5 slice's 80 GB device until written).
            # Elsewhere the trainer keeps its newest exports anyway: the record copies them when its turn comes.
            try:
                await self._serving_checked(record, name)
                await asyncio.to_thread(snapshot_to_host, record.snapshot)     # the trainer state
            finally:
                self._drop_export(record)
        for task in earlier:
            with contextlib.suppress(Exception):
                await asyncio.shield(task)
        if record.superseded_by:
            return None
        record.begun = True
        if record.snapshot is None:
            directory = await self._write_weights(record, name)
        else:
            # A checkpoint: the trainer state's snapshot is this process's memory, written here (in a thread).
            directory = pathlib.Path(tempfile.mkdtemp(prefix="zerokl-trainer-record-"))
            try:
                if record.export is not None:
                    await self._serving_checked(record, name)
                await asyncio.to_thread(write_snapshot, record.snapshot, directory)
            except BaseException:
                shutil.rmtree(directory, True)
                raise
            finally:
                self._drop_export(record)           # written: its views of the export are done with
        record.directory, record.snapshot = directory, None     # the files hold it now: its memory goes
        return await self._upload(record, name)

    async def _serving_checked(self, record: _Record, name: str) -> None:
        """A checkpoint's serving weights, views of its export until now, copied into this process's host memory and
        checked against the checksum the fleet was sent, as a weights-only version's record process checks its copy:
        the store records what the fleet serves, never bytes the shared memory came to hold after the share. The
        export is let go once copied (a co-located backward waits for that, not for the checksum). :class:`RecordFailed`
        on a mismatch: nothing is written, the version is not durable (a share of it by the trainer still on it
        records it again from the trainer's weights)."""
        assert record.snapshot is not None and record.export is not None
        loop = asyncio.get_running_loop()
        record.snapshot.serving = {}    # its views of the export: the copy replaces them, and they keep no memory alive
        try:
            serving = await asyncio.to_thread(copy_checked, record.export,
                                              copied=lambda: loop.call_soon_threadsafe(self._drop_export, record))
        except ChecksumMismatch as err:
            record.snapshot = None      # never written: the trainer state's snapshot goes now
            raise RecordFailed(f"the serving weights of {name} changed in the trainer's shared memory after they were "
                               f"shared ({err}): {name} is not recorded, and is not durable") from None
        record.snapshot.serving = serving

    async def _write_weights(self, record: _Record, name: str) -> pathlib.Path:
        """A weights-only version's files, written by the record process from the shared memory (it checks the bytes
        against the checksum the fleet was sent). A record process that dies meanwhile is replaced and asked again
        with the export: the record's own until the dead process copied it, then the copy the trainer keeps
        (:data:`_SHARED_KEPT`; a co-located trainer keeps none past a backward). :class:`RecordFailed` when the
        trainer holds the bytes no more, or after :data:`_RECORD_ATTEMPTS` deaths: the version is not durable."""
        assert record.model_config is not None and record.dtype is not None
        try:
            for attempt in itertools.count(1):
                assert record.export is not None
                try:
                    # The export goes as soon as the record process holds its bytes, before they are written: a
                    # co-located trainer's backward needs that device memory (the GLM-5 slice: 23 GiB of 80 GB).
                    return await self._record_process().write(record.export.export, record.model_config, record.dtype,
                                                              copied=lambda: self._drop_export(record))
                except RecordProcessDied as died:
                    if attempt == _RECORD_ATTEMPTS:
                        raise RecordFailed(f"{died.message} on each of {attempt} tries to write {name}: {name} is "
                                           "not recorded, and is not durable") from None
                    if record.export is None:       # the process that died had copied the bytes
                        self._hold_again(record, name, died, "writing")
                    log.warning("trainer: %s writing %s; a new one writes it again", died.message, name)
            raise AssertionError("unreachable")
        finally:
            self._drop_export(record)

    def _hold_again(self, record: _Record, name: str, died: RecordProcessDied, doing: str) -> None:
        """The export of a weights-only ``record`` held again, from the copy the trainer keeps, after the record process
        that held its bytes died: :class:`RecordFailed` when the trainer holds them no more (not durable)."""
        kept = self._exports.get(name)
        if kept is None or kept.export.checksum != record.checksum:
            raise RecordFailed(f"{died.message} {doing} {name}, after the trainer let go of its bytes: "
                               f"{name} is not recorded, and is not durable") from None
        record.export = kept
        record.released.clear()     # held again: a co-located backward waits for it

    def _record_process(self) -> RecordWorker:
        if self._recorder is None:
            raise FailedPrecondition("this trainer has no record process (a service built without one cannot "
                                     "record versions it shares)")
        return self._recorder

    async def _upload(self, record: _Record, name: str) -> WeightsManifest:
        """Upload the files of ``record`` (on this host's disk, or in the record process's memory) as ``name``; a record
        process that dies meanwhile is replaced and asked again (the store resumes the open upload), after writing the
        files again from the export the trainer keeps when they were in its memory, :data:`_RECORD_ATTEMPTS` times at
        most. A store out for now (UNAVAILABLE) leaves the files for RecordWeights to upload again; any other failure
        is the record's for good (a store with no room, a store's own INTERNAL: :class:`RecordFailed` with its
        message), and its files go."""
        assert record.directory is not None
        try:
            for attempt in itertools.count(1):
                try:
                    # The record process uploads (the files of the version recorded before: deltas against them) and
                    # owns the directory from here.
                    manifest = await self._record_process().upload(record.directory, name, record.spec, record.step)
                    break
                except Unavailable as err:
                    raise Unavailable(f"the weight store ({self.repo.describe()}) is unreachable: {err.message}; "
                                      f"{name} is not recorded yet (RecordWeights retries)") from None
                except ResourceExhausted as err:
                    # Not an outage: a retry meets the same full disk, and the step goes on without the store.
                    raise RecordFailed(f"the weight store ({self.repo.describe()}) refused {name}: {err.message}; "
                                       f"{name} is not recorded, and is not durable") from None
                except RecordProcessDied as died:
                    if attempt == _RECORD_ATTEMPTS:
                        raise RecordFailed(f"{died.message} on each of {attempt} tries to upload {name}: {name} is "
                                           "not recorded, and is not durable") from None
                    if isinstance(died, RecordLost) or not record.directory.exists():
                        # Its files were in the dead process's memory (--record-deltas start, off): written again
                        # from the export the trainer keeps, then uploaded (the store resumes the open upload).
                        self._hold_again(record, name, died, "uploading")
                        record.directory = await self._write_weights(record, name)
                    log.warning("trainer: %s uploading %s; a new one uploads it again", died.message, name)
                except RecordFailed:
                    raise       # the record process's own failure, said as it is
                except Internal as err:
                    # The store's own handler failed the upload (a bug, or a request it cannot take; never a write that
                    # raced a stream's end: that is an outage), as the store said it: the same upload meets it again.
                    raise RecordFailed(f"the weight store ({self.repo.describe()}) failed {name} (INTERNAL): "
                                       f"{err.message}; {name} is not recorded, and is not durable") from None
        except Unavailable:
            raise
        except Exception as err:
            # Never uploaded again (a share of the version records it anew): its files leave this host's disk, which
            # may be the full one.
            directory, record.directory = record.directory, None
            if directory is not None:       # on disk, or in the record process's memory (it lets go of them)
                await self._record_process().drop(directory)
            log.warning("trainer: the record of %s failed (%s: %s)", name, type(err).__name__,
                        getattr(err, "message", None) or err)
            raise
        record.manifest, record.record_s = manifest, time.monotonic() - record.started
        log.info("trainer: recorded %s in %.2f s: %d bytes, %d written (%s)", name, record.record_s,
                 manifest.total_size, manifest.stored_size, "with the trainer state" if not record.weights_only
                 else "weights only")
        if not record.weights_only:
            await self.pin_resume_point(name)
        return manifest

    async def record_weights(self, version: str) -> Recorded:
        """Wait for the store's record of a version saved with share (retrying its upload after an
        outage): its manifest and the seconds from the share to the commit; at once, that it was superseded
        (never recorded). Waiting for a record keeps it from being superseded. NOT_FOUND when this trainer
        process never shared it."""
        record = self._records.get(version)
        if record is None:
            raise NotFound(f"this trainer shared no version {version!r} (it records what it shares; a restart "
                           "forgets what it had not recorded)")
        if record.manifest is None and not record.superseded_by:
            assert record.task is not None
            record.waiters += 1
            try:
                await asyncio.shield(record.task)
            except Unavailable:
                if record.directory is None:
                    raise
                # The checkpoint is on disk: upload it again (the store may be back).
                record.task = asyncio.ensure_future(self._upload(record, version))
                record.task.add_done_callback(lambda t: t.cancelled() or t.exception())
                await asyncio.shield(record.task)
            finally:
                record.waiters -= 1
        if record.superseded_by:
            return Recorded(None, superseded_by=record.superseded_by)
        assert record.manifest is not None
        return Recorded(record.manifest, record.record_s)

    async def pin_resume_point(self, version: str) -> None:
        """Pin the run's newest resume point and unpin the previous one, so retention never deletes it.

        Best effort: a failure is logged, not raised (the version is already
        published; a pin is housekeeping).
        """
        owner = pin_owner(self.run)
        try:
            await self.repo.pin(version, owner)     # idempotent
            if self._pinned not in (None, version):
                with contextlib.suppress(NotFound):     # deleted meanwhile (a version that failed its canary)
                    await self.repo.unpin(self._pinned, owner)
        except Exception as err:  # noqa: BLE001 - a pin is housekeeping; report it, keep training
            log.warning("trainer: could not move the pin of run %s to %s: %s", self.run, version, err)
            return
        self._pinned = version

    async def _fresh_segment(self, next_one: bool = False) -> str:
        """The segment a trainer reset to step 0 publishes under: the current one while nothing of the run
        holds a step past 0 under it (published, being recorded, or this trainer's lineage), else the run's
        next. Without it a second job with its own hyperparameters would name its step 1 as the first
        job's step 1 (ALREADY_EXISTS), and a restart would resume the first job's newest checkpoint.
        ``next_one``: the run's next segment whatever the current one holds (its default name for this
        step is taken)."""
        used = {segment_index(self.run, m.spec.metadata.get(META_RUN, ""))
                for m in await self.repo.manifests() if m.spec.step}
        if next_one or self._records or any(entry.step for entry in self._lineage):
            used.add(segment_index(self.run, self.segment))
        used.discard(None)
        return run_segment(self.run, max(used) + 1) if used else self.segment

    async def load_weights(self, version: str, restore_state: bool = False,
                           config: TrainConfig | None = None) -> TrainerState:
        """Switch to a published version (``latest`` names the newest); pending gradients are dropped.
        Without ``restore_state`` the fresh trainer has ``config`` (default: the current one)."""
        if not version:
            raise InvalidArgument.field("version", "required (a version id, or 'latest')")
        if config is not None:
            check_train_config(config, "config")

        async def work() -> TrainerState:
            swapping = self._server.not_serving() if self._server is not None else contextlib.nullcontext()
            async with swapping:
                with tempfile.TemporaryDirectory(prefix="zerokl-trainer-load-") as tmp:
                    manifest = await self.repo.fetch(version, pathlib.Path(tmp))
                    try:
                        ckpt = await self._compute(read_checkpoint, tmp, restore_state=restore_state,
                                                   config=config or self._trainer.config, run=self.run,
                                                   device=self._trainer.device)
                    except ValueError as err:
                        # A config that cannot hold on these weights (e.g. a dtype on an FP8 checkpoint): the
                        # trainer is as before.
                        raise InvalidArgument.field("config", f"{err} (loading {manifest.version})") from None
            trainer = ckpt.trainer
            # Versions shared before are not this trainer's weights any more: a later share of the same
            # name (a step redone from here) exports afresh, never an earlier descriptor.
            for export in self._exports.values():
                export.close()
            self._exports.clear()
            if restore_state:
                if segment_index(self.run, ckpt.run) is not None:
                    self.segment = ckpt.run      # its steps continue the segment they were saved in
            else:
                self.segment = await self._fresh_segment()
            lineage = ckpt.lineage if restore_state else []
            if not lineage or lineage[-1] != LineageEntry(manifest.version, trainer.step):
                lineage.append(LineageEntry(manifest.version, trainer.step))
            self._trainer, self._lineage, self._accumulated = trainer, lineage[-MAX_LINEAGE:], 0
            if restore_state:
                # The loaded version is now where a restart resumes (e.g. a rollback past a rejected version).
                await self.pin_resume_point(manifest.version)
            model = trainer.model
            self._set_identity(self._identity.with_weights(manifest.version, model_config=model.config.to_dict()))
            STEP.set(trainer.step)
            return self._state()
        return await self._exclusive(work)

    async def state(self) -> TrainerState:
        """Step, weights version and configuration (after any queued work)."""
        async def work() -> TrainerState:
            return self._state()
        return await self._exclusive(work)

    def _state(self) -> TrainerState:
        t, base = self._trainer, self._lineage[-1]
        return TrainerState(
            run=self.run, step=t.step, weights_version=base.version, weights_step=base.step,
            tokens_seen=t.tokens_seen, accumulated_batches=self._accumulated, config=t.config,
            model_config_json=json.dumps(config_to_hf(t.model.config, numerics_dtype(t.model)), sort_keys=True),
            numerics_version=numerics_version, numerics_fingerprint=self._identity.numerics_fingerprint)

    def _set_identity(self, identity: ServiceIdentity) -> None:
        self._identity = identity
        set_serving_info(identity)


# ----------------------------------------------------------------------------- gRPC edge

class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    """Serves ``zerokl.v1.Trainer`` from a :class:`TrainerService`."""

    def __init__(self, service: TrainerService) -> None:
        self._service = service

    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> common_pb2.ServiceInfo:
        return identity_to_proto(self._service.identity)

    async def ForwardLogprobs(self, request: trainer_pb2.ForwardLogprobsRequest,
                              context: grpc.aio.ServicerContext) -> trainer_pb2.ForwardLogprobsResponse:
        completions = [convert.completion_from_proto(c) for c in request.completions]
        capture = convert.forward_trace_from_proto(request)
        if capture is None:
            return convert.logprobs_to_proto(await self._service.forward_logprobs(completions))
        require_operator("a ForwardLogprobs with a trace")
        if len(completions) != 1:
            raise InvalidArgument.field("completions", "a traced ForwardLogprobs takes exactly one completion")
        lp, trace = await self._service.traced_logprobs(completions[0], capture)
        return convert.logprobs_to_proto([lp], trace)

    async def ForwardBackward(self, request: trainer_pb2.ForwardBackwardRequest,
                              context: grpc.aio.ServicerContext) -> trainer_pb2.ForwardBackwardResponse:
        result = await self._service.forward_backward(convert.batch_from_proto(request))
        return convert.forward_backward_result_to_proto(result)

    async def OptimStep(self, request: trainer_pb2.OptimStepRequest,
                        context: grpc.aio.ServicerContext) -> trainer_pb2.OptimStepResponse:
        adam = convert.adam_params_from_proto(request.adam) if request.HasField("adam") else None
        return convert.optim_result_to_proto(await self._service.optim_step(request.lr, adam))

    async def SaveWeights(self, request: trainer_pb2.SaveWeightsRequest,
                          context: grpc.aio.ServicerContext) -> trainer_pb2.SaveWeightsResponse:
        if request.share:
            manifest, created, shared = await self._service.save_weights(
                request.version, dict(request.metadata), request.weights_only, share=True,
                supersede=request.supersede)
            response = convert.save_result_to_proto(manifest, created)
            response.shared.CopyFrom(weights_convert.shared_export_to_proto(shared))
            return response
        manifest, created = await self._service.save_weights(request.version, dict(request.metadata),
                                                             request.weights_only)
        return convert.save_result_to_proto(manifest, created)

    async def RecordWeights(self, request: trainer_pb2.RecordWeightsRequest,
                            context: grpc.aio.ServicerContext) -> trainer_pb2.SaveWeightsResponse:
        if not request.version:
            raise InvalidArgument.field("version", "name a version SaveWeights(share) returned")
        return convert.recorded_to_proto(await self._service.record_weights(request.version))

    async def LoadWeights(self, request: trainer_pb2.LoadWeightsRequest,
                          context: grpc.aio.ServicerContext) -> trainer_pb2.TrainerState:
        config = convert.train_config_from_proto(request.config) if request.HasField("config") else None
        return convert.state_to_proto(await self._service.load_weights(request.version, request.restore_state, config))

    async def GetState(self, request: trainer_pb2.GetStateRequest,
                       context: grpc.aio.ServicerContext) -> trainer_pb2.TrainerState:
        return convert.state_to_proto(await self._service.state())


def add_trainer_service(server: ServiceServer, service: TrainerService) -> None:
    """Register ``zerokl.v1.Trainer`` on ``server`` (which reports NOT_SERVING during LoadWeights)."""
    service.attach(server)
    server.add_servicer(trainer_pb2_grpc.add_TrainerServicer_to_server, TrainerServicer(service), TRAINER_SERVICE)
