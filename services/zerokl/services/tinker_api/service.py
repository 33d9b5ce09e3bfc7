"""The Tinker endpoint's logic: sessions, training runs on the trainer, sampling on the sampler replicas.

:class:`TinkerService` takes typed requests (types.py) and answers with request ids whose results
the SDK retrieves (futures.py). Nothing here computes a number: a forward or forward_backward is
the trainer's ``ForwardBackward`` on a token batch, an optimizer step its ``OptimStep`` with the
call's AdamParams, a sample a ``Generate`` on a sampler replica pinned to the sampled version and
its numerics fingerprint. So a sampled token's logprob is the trainer's logprob of it, bit for bit.

**Order.** A training client numbers its calls (``seq_id`` 1, 2, ...); the calls of one model run
one at a time in that order, whatever order they arrive in (the SDK sends the chunks of one
forward_backward at once, and a custom loss's backward after later calls were submitted). A call
sent again with a number already received (a retry) gets the first one's request id.

**One trainer, several models.** The trainer holds one model at a time. A call of another model
waits until the holder is at a step boundary (no gradients accumulated), then the holder's state is
saved as a weight-store version (weights, adapters, AdamW moments, step) and the caller's loaded
(or a fresh one made: the base model's weights with new LoRA adapters of its rank). Before every
call the trainer's state is checked against what the model left: a trainer someone else used
meanwhile (a Jobs API job) fails the call instead of training on other weights.

**Sampling.** A sampling session is bound to one version: a base model's, or what a training
client saved for sampling (``save_weights_for_sampler``; ``save_weights_and_get_sampling_client``
saves an unnamed one). The trainer shares a saved version in memory and records it in the store in
the background; samplers.SamplerPool switches a sampler replica to it (in place from that memory on
the trainer's host, else from the store) and every request is pinned to the version and its
fingerprint, as every scheduler request is. The fleet's default version never changes.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import grpc
import grpc.aio
from prometheus_client import Counter, Gauge

from zerokl.services.inference.types import InferenceRequest
from zerokl.services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, ServiceError, Unavailable
from zerokl.services.runtime.metrics import REGISTRY
from zerokl.services.tinker_api.convert import checkpoint_from_path
from zerokl.services.tinker_api.futures import FutureStore
from zerokl.services.tinker_api.samplers import SamplerPool
from zerokl.services.tinker_api.types import (
    BaseModel,
    Checkpoint,
    ForwardBackwardCall,
    ForwardBackwardOutcome,
    FutureFailure,
    LoadCall,
    ModelSpec,
    OptimStepCall,
    SampleCall,
    SampledSequence,
    SampleOutcome,
    SaveCall,
    version_prefix,
)
from zerokl.services.trainer.client import TrainerClient
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.types import TokenLossBatch, TrainerState
from zerokl.services.weightstore.client import WeightStoreClient
from zerokl.services.weightstore.shared import SharedExport

__all__ = ["TinkerService", "SessionFinished", "failure_of"]

log = logging.getLogger(__name__)

# Metrics (zerokl_ prefix, in the runtime's registry).
CALLS = Counter("zerokl_tinker_calls", "Tinker calls submitted, by kind.", ["kind"], registry=REGISTRY)
FAILED = Counter("zerokl_tinker_failed_calls", "Tinker calls whose result is an error, by kind and category.",
                 ["kind", "category"], registry=REGISTRY)
PENDING = Gauge("zerokl_tinker_pending_calls", "Tinker calls submitted and not finished.", registry=REGISTRY)
SWAPS = Counter("zerokl_tinker_trainer_swaps", "Times the trainer was handed from one Tinker model to another.",
                registry=REGISTRY)
TRAINED_TOKENS = Counter("zerokl_tinker_trained_tokens", "Positions of forward_backward datums trained on.",
                         registry=REGISTRY)
SAMPLED_TOKENS = Counter("zerokl_tinker_sampled_tokens", "Tokens sampled through the Tinker endpoint.",
                         registry=REGISTRY)
MISMATCHED = Counter("zerokl_tinker_mismatched_tokens",
                     "RL-loss positions whose trainer logprob differed from the sampling logprob (0 when aligned).",
                     registry=REGISTRY)

_SHARED_KEPT = 2        # sampler versions whose shared-memory descriptor is kept (the trainer keeps as many)
_USER_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
               grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED}
# Tinker metric keys ("name:reduction", reduced across chunks by the SDK) of the trainer's token-loss metrics.
_METRIC_KEYS = {"loss": "loss:sum", "tokens": "zerokl/tokens:sum", "mismatched_tokens": "zerokl/mismatched_tokens:sum",
                "kl": "zerokl/kl:sum", "ratio_min": "zerokl/ratio_min:min", "ratio_max": "zerokl/ratio_max:max",
                "clipped_tokens": "zerokl/clipped_tokens:sum"}


class SessionFinished(ServiceError):
    """The session was finished (the SDK stops its heartbeat on HTTP 410)."""

    code = grpc.StatusCode.NOT_FOUND


def failure_of(err: BaseException, where: str = "") -> FutureFailure:
    """The FutureFailure an error becomes: the caller's fault for bad requests and states it can fix."""
    if isinstance(err, ServiceError):
        return FutureFailure(err.message, "user" if err.code in _USER_CODES else "server")
    if isinstance(err, grpc.aio.AioRpcError):
        text = f"{where}{err.code().name}: {err.details()}"
        return FutureFailure(text, "user" if err.code() in _USER_CODES else "server")
    return FutureFailure(f"{where}{type(err).__name__}: {err}", "server")


@dataclass
class _Session:
    session_id: str
    user_metadata: dict[str, Any]
    last_heartbeat: float = field(default_factory=time.monotonic)
    finished: str | None = None             # the finish reason once finished
    runs: list[str] = field(default_factory=list)


@dataclass
class _SamplingSession:
    sampling_session_id: str
    base: BaseModel
    version: str
    fingerprint: str
    model_path: str | None
    clients: int = 0                        # join_sampling_session's counter (the original client is 0)


@dataclass
class _Op:
    kind: str                               # "ForwardBackward", "OptimStep", ...: metrics and logs
    future: asyncio.Future[Any]
    work: Callable[[], Awaitable[Any]]
    context: contextvars.Context           # the submitting request's (its trace continues into the work)


@dataclass
class _Run:
    """A Tinker training model: its calls in order, and where its trainer state lives."""

    model_id: str
    session_id: str
    base: BaseModel
    lora_rank: int
    seed: int
    user_metadata: dict[str, str]
    restore: tuple[Checkpoint, bool] | None = None   # created from a checkpoint (with its optimizer): loaded first
    next_seq: int = 1
    pending: dict[int, _Op] = field(default_factory=dict)
    request_ids: dict[int, str] = field(default_factory=dict)   # seq_id -> request id (retries get the same)
    last_seq: int = 0
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    worker: asyncio.Task[None] | None = None
    state: TrainerState | None = None       # the trainer's state when this run last held it
    resume_version: str | None = None       # its state while another run holds the trainer
    swaps: int = 0
    samplers: int = 0                       # unnamed sampler checkpoints saved
    closed: bool = False

    @property
    def accumulated(self) -> int:
        return self.state.accumulated_batches if self.state is not None else 0


class TinkerService:
    """Tinker's REST semantics on zerokl's trainer, sampler replicas and weight store (module docstring)."""

    def __init__(self, base: BaseModel, *, trainer: TrainerClient | None, samplers: SamplerPool,
                 store: WeightStoreClient, futures: FutureStore | None = None, swap_wait_s: float = 600.0,
                 long_poll_s: float = 30.0) -> None:
        self.base, self.trainer, self.samplers, self.store = base, trainer, samplers, store
        self.futures = futures or FutureStore()
        self.swap_wait_s, self.long_poll_s = swap_wait_s, long_poll_s
        self._sessions: dict[str, _Session] = {}
        self._sampling: dict[str, _SamplingSession] = {}
        self._runs: dict[str, _Run] = {}
        self._trainer_lock = asyncio.Lock()
        self._boundary = asyncio.Condition()     # notified whenever the trainer's holder may have changed state
        self._holder: _Run | None = None
        self._base_config: TrainConfig | None = None
        self._shared: OrderedDict[str, SharedExport] = OrderedDict()
        self._fingerprints: dict[str, str] = {base.version: base.numerics_fingerprint}
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ lifecycle

    async def close(self) -> None:
        """Stop every run's worker and every sampling task (their pending calls are cancelled)."""
        for run in self._runs.values():
            run.closed = True
            if run.worker is not None:
                run.worker.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(r.worker for r in self._runs.values() if r.worker is not None), *self._tasks,
                             return_exceptions=True)

    # ------------------------------------------------------------------ models and names

    def resolve_base(self, name: str, field_name: str = "base_model") -> BaseModel:
        """The base model ``name`` means (its name, an alias, or its tokenizer directory); NOT_FOUND naming
        what this endpoint serves otherwise."""
        if name in (self.base.name, self.base.tokenizer_dir) or name in self.base.aliases:
            return self.base
        raise NotFound(f"{field_name}: unknown base model {name!r}; this cluster serves {self.base.name!r} (also "
                       f"named {', '.join(repr(a) for a in self.base.aliases) or 'nothing else'})")

    def capabilities(self) -> dict[str, Any]:
        return {"supported_models": [{"model_name": self.base.name, "max_context_length": self.base.max_context_length,
                                      "trainable": self.trainer is not None, "sampleable": len(self.samplers) > 0}]}

    # ------------------------------------------------------------------ sessions

    def create_session(self, user_metadata: dict[str, Any]) -> str:
        session_id = f"session-{secrets.token_hex(8)}"
        self._sessions[session_id] = _Session(session_id, dict(user_metadata))
        return session_id

    def _session(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"no session {session_id!r} (create one: ServiceClient())")
        if session.finished is not None:
            raise SessionFinished(f"session {session_id} was finished ({session.finished})")
        return session

    def heartbeat(self, session_id: str) -> None:
        self._session(session_id).last_heartbeat = time.monotonic()

    def finish_session(self, session_id: str, reason: str) -> None:
        """Mark the session finished: its models take no more calls (calls already submitted finish)."""
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"no session {session_id!r}")
        if session.finished is None:
            session.finished = reason
            for model_id in session.runs:
                self._runs[model_id].closed = True

    # ------------------------------------------------------------------ training: submission

    def create_model(self, spec: ModelSpec) -> tuple[str, str]:
        """(request_id, model_id) of a new training model of ``spec.base_model``."""
        session = self._session(spec.session_id)
        base = self.resolve_base(spec.base_model)
        self._need_trainer()
        model_id = _model_id(session.session_id, spec.model_seq_id)
        if model_id in self._runs:                  # the same call sent again (the SDK retries): the same model
            run = self._runs[model_id]
        else:
            run = self._new_run(session, model_id, base, spec.lora_rank,
                                secrets.randbelow(2**31) if spec.seed is None else spec.seed, dict(spec.user_metadata))
        request_id, future = self.futures.new()
        CALLS.labels("CreateModel").inc()
        future.set_result({"model_id": run.model_id, "type": "create_model"})
        return request_id, run.model_id

    def _new_run(self, session: _Session, model_id: str, base: BaseModel, rank: int, seed: int,
                 metadata: dict[str, str], restore: tuple[Checkpoint, bool] | None = None) -> _Run:
        run = _Run(model_id, session.session_id, base, rank, seed, metadata, restore)
        run.worker = asyncio.ensure_future(self._work(run))
        self._runs[model_id] = run
        session.runs.append(model_id)
        return run

    def _need_trainer(self) -> TrainerClient:
        if self.trainer is None:
            raise FailedPrecondition("this Tinker endpoint has no trainer (zerokl up without --no-trainer; "
                                     "serve tinker --trainer ADDR): it can only sample")
        return self.trainer

    def run_info(self, model_id: str) -> dict[str, Any]:
        """GetInfoResponse of a model (fetched once by every TrainingClient)."""
        run = self._run(model_id)
        # model_data.model_name is the tokenizer directory: the SDK loads tokenizers by it
        # (TrainingClient.get_tokenizer, and the SamplingClients it makes), offline.
        return {"type": "get_info", "model_id": run.model_id, "model_name": run.base.name,
                "model_data": {"arch": "glm_moe_dsa", "model_name": run.base.tokenizer_dir,
                               "tokenizer_id": run.base.tokenizer_dir},
                "is_lora": run.lora_rank > 0, "lora_rank": run.lora_rank or None,
                "optimizer_config": {"type": "adamw"}}

    def _run(self, model_id: str) -> _Run:
        run = self._runs.get(model_id)
        if run is None:
            raise NotFound(f"no model {model_id!r} (create one: create_lora_training_client)")
        return run

    def _submit(self, run: _Run, seq_id: int | None, kind: str, work: Callable[[], Awaitable[Any]]) -> str:
        """Queue ``work`` as the model's call number ``seq_id`` (None: after every call received); its request id."""
        if run.closed:
            raise FailedPrecondition(f"model {run.model_id}'s session is finished: it takes no more calls")
        if seq_id is not None and seq_id in run.request_ids:
            return run.request_ids[seq_id]          # the same call sent again
        seq = run.last_seq + 1 if seq_id is None else seq_id
        if seq < run.next_seq:
            raise InvalidArgument.field("seq_id", f"{seq} is behind model {run.model_id}'s next call "
                                                  f"({run.next_seq}): the model's calls are numbered in order")
        request_id, future = self.futures.new()
        CALLS.labels(kind).inc()
        run.request_ids[seq] = request_id
        run.last_seq = max(run.last_seq, seq)
        run.pending[seq] = _Op(kind, future, work, contextvars.copy_context())
        run.wakeup.set()
        return request_id

    def reject(self, model_id: str, seq_id: int | None) -> None:
        """Call number ``seq_id`` of the model was refused before it was queued (a bad request): its place
        in the order is taken by nothing, so the model's later calls do not wait for it."""
        run = self._runs.get(model_id)
        if run is None or seq_id is None or seq_id in run.request_ids or seq_id < run.next_seq:
            return
        request_id, future = self.futures.new()
        future.set_result(FutureFailure("the request was refused when it was sent", "user"))
        run.request_ids[seq_id] = request_id
        run.last_seq = max(run.last_seq, seq_id)

        async def nothing() -> FutureFailure:
            return future.result()
        run.pending[seq_id] = _Op("Rejected", future, nothing, contextvars.copy_context())
        run.wakeup.set()

    async def _work(self, run: _Run) -> None:
        """Run the model's calls one at a time, in seq_id order."""
        while True:
            while run.next_seq not in run.pending:
                run.wakeup.clear()
                await run.wakeup.wait()
            op = run.pending.pop(run.next_seq)
            run.next_seq += 1
            await asyncio.get_running_loop().create_task(self._settle(op.kind, op.future, op.work),
                                                         context=op.context)

    async def _settle(self, kind: str, future: asyncio.Future[Any], work: Callable[[], Awaitable[Any]]) -> None:
        """Run ``work`` into ``future``: its result, or the FutureFailure its error becomes."""
        PENDING.inc()
        try:
            result = await work()
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as err:  # noqa: BLE001 - every failure is the call's result, the service goes on
            if not isinstance(err, (ServiceError, grpc.aio.AioRpcError)):
                log.exception("tinker: a %s call failed", kind)
            result = failure_of(err)
            FAILED.labels(kind, result.category).inc()
        finally:
            PENDING.dec()
        if not future.done():
            future.set_result(result)

    def submit_forward_backward(self, call: ForwardBackwardCall) -> str:
        run = self._run(call.model_id)
        self._check_ids(call, run.base)
        batch = TokenLossBatch(loss=call.loss, sequences=call.sequences, config=dict(call.config),
                               forward_only=call.forward_only, temperature=call.sampling.temperature,
                               top_k=call.sampling.top_k, top_p=call.sampling.top_p)

        async def work() -> ForwardBackwardOutcome:
            result = await self._on_trainer(run, lambda trainer: trainer.forward_backward_batch(batch))
            if not call.forward_only:
                TRAINED_TOKENS.inc(sum(len(s.input_ids) for s in call.sequences))
            MISMATCHED.inc(int(result.metrics.get("mismatched_tokens", 0)))
            metrics = {_METRIC_KEYS[k]: v for k, v in result.metrics.items() if k in _METRIC_KEYS}
            return ForwardBackwardOutcome(metrics, tuple(result.token_logprobs or ()))
        return self._submit(run, call.seq_id, "Forward" if call.forward_only else "ForwardBackward", work)

    def _check_ids(self, call: ForwardBackwardCall, base: BaseModel) -> None:
        """Token ids within the vocabulary, sequences within the context (the trainer checks again)."""
        vocab, context = base.vocab_size, base.max_context_length
        for i, seq in enumerate(call.sequences):
            for name, ids in (("model_input", seq.input_ids), ("loss_fn_inputs.target_tokens", seq.target_ids)):
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    raise InvalidArgument.field(f"data[{i}].{name}", f"token ids {bad[:4]} are outside {base.name}'s "
                                                                     f"vocabulary [0, {vocab})")
            if not seq.input_ids:
                raise InvalidArgument.field(f"data[{i}].model_input", "must hold at least one token id")
            if len(seq.input_ids) > context:
                raise InvalidArgument.field(f"data[{i}].model_input", f"{len(seq.input_ids)} tokens exceed "
                                                                      f"{base.name}'s context length {context}")

    def submit_optim_step(self, call: OptimStepCall) -> str:
        run = self._run(call.model_id)

        async def work() -> dict[str, Any]:
            result = await self._on_trainer(run, lambda trainer: trainer.optim_step(adam=call.adam))
            return {"metrics": {"grad_norm:mean": result.grad_norm, "learning_rate:mean": result.lr,
                                "zerokl/step:max": float(result.step)}}
        return self._submit(run, call.seq_id, "OptimStep", work)

    def submit_save(self, call: SaveCall) -> str:
        run = self._run(call.model_id)
        session = self._sessions[run.session_id]
        if call.name is None:               # save_weights_and_get_sampling_client: an unnamed sampler version
            run.samplers += 1
            name = f"ephemeral-{run.samplers:06d}"
        else:
            name = call.name
        checkpoint = Checkpoint(run.model_id, call.kind, name)
        metadata = {**call.user_metadata, "tinker.base_model": run.base.name, "tinker.model_id": run.model_id,
                    "tinker.lora_rank": str(run.lora_rank), "tinker.path": checkpoint.path}

        async def work() -> dict[str, Any]:
            if call.kind == "weights":
                manifest, _ = await self._on_trainer(run, lambda t: t.save_weights(checkpoint.version,
                                                                                   metadata=metadata))
                self._fingerprints[checkpoint.version] = manifest.spec.numerics_fingerprint
                return {"path": checkpoint.path, "type": "save_weights"}
            manifest, _, shared = await self._on_trainer(
                run, lambda t: t.share_weights(checkpoint.version, weights_only=True, metadata=metadata))
            self._remember_shared(checkpoint.version, shared, manifest.spec.numerics_fingerprint)
            response: dict[str, Any] = {"path": checkpoint.path, "type": "save_weights_for_sampler"}
            if call.name is None:
                response["sampling_session_id"] = self._new_sampling_session(
                    session, run.base, checkpoint.version, manifest.spec.numerics_fingerprint, checkpoint.path)
            return response
        return self._submit(run, call.seq_id, "SaveWeights" if call.kind == "weights" else "SaveWeightsForSampler",
                            work)

    def _remember_shared(self, version: str, shared: SharedExport, fingerprint: str) -> None:
        self._fingerprints[version] = fingerprint
        self._shared[version] = shared
        while len(self._shared) > _SHARED_KEPT:
            self._shared.popitem(last=False)

    def submit_load(self, call: LoadCall) -> tuple[str, str]:
        """(request_id, model_id): load_state into a model, or a new model from a checkpoint."""
        checkpoint = checkpoint_from_path(call.path)
        if call.model_id is not None:
            run = self._run(call.model_id)

            async def load() -> dict[str, Any]:
                await self._on_trainer(run, lambda t: self._load(t, run, checkpoint, call.optimizer))
                return {"path": call.path, "model_id": run.model_id, "type": "load_weights"}
            return self._submit(run, call.seq_id, "LoadWeights", load), run.model_id
        session = self._session(call.session_id or "")
        self._need_trainer()
        base = self.resolve_base(call.base_model) if call.base_model else self.base
        model_id = _model_id(session.session_id, call.model_seq_id or 0)
        if model_id in self._runs:                 # the same call sent again
            run = self._runs[model_id]
            return run.request_ids[0], model_id
        run = self._new_run(session, model_id, base, 0, 0, dict(call.user_metadata),
                            restore=(checkpoint, call.optimizer))
        request_id, future = self.futures.new()
        CALLS.labels("LoadWeights").inc()

        async def first_load() -> dict[str, Any]:
            manifest = await self.store.manifest(checkpoint.version)
            run.lora_rank = int(manifest.spec.metadata.get("tinker.lora_rank", "0"))
            await self._on_trainer(run, lambda trainer: trainer.get_state())     # activation loads it
            return {"path": call.path, "model_id": run.model_id, "type": "load_weights"}
        # The model's first call (seq id 0): its later calls start at 1.
        run.pending[0] = _Op("LoadWeights", future, first_load, contextvars.copy_context())
        run.request_ids[0], run.next_seq = request_id, 0
        run.wakeup.set()
        return request_id, run.model_id

    # ------------------------------------------------------------------ training: the trainer, shared by models

    async def _on_trainer(self, run: _Run, fn: Callable[[TrainerClient], Awaitable[Any]]) -> Any:
        """``fn(trainer)`` with ``run``'s state loaded in the trainer (waiting for another model's step
        boundary when it holds the trainer mid-step)."""
        trainer = self._need_trainer()
        deadline = time.monotonic() + self.swap_wait_s
        while True:
            async with self._trainer_lock:
                holder = self._holder
                if holder is None or holder is run or holder.accumulated == 0 or holder.closed:
                    await self._activate(trainer, run)
                    try:
                        return await fn(trainer)
                    finally:
                        with contextlib.suppress(grpc.aio.AioRpcError):
                            run.state = await trainer.get_state()
                        async with self._boundary:
                            self._boundary.notify_all()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FailedPrecondition(
                    f"the trainer trains one model at a time between optimizer steps: model {holder.model_id} holds "
                    f"it with {holder.accumulated} forward_backward batch(es) no optim_step has applied, for "
                    f"{self.swap_wait_s:.0f}s; call optim_step on it (or finish its session) first")
            async with self._boundary:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._boundary.wait(), min(remaining, 1.0))

    async def _activate(self, trainer: TrainerClient, run: _Run) -> None:
        """Make the trainer hold ``run``'s state (under the trainer lock)."""
        if self._holder is run:
            state = await trainer.get_state()
            if run.state is not None and _marks(state) != _marks(run.state):
                self._holder = None
                raise FailedPrecondition(
                    f"the trainer's state changed under model {run.model_id} since its last call (something else "
                    f"used the trainer, e.g. a Jobs API job): it holds {state.weights_version} at step {state.step}, "
                    f"the model left {run.state.weights_version} at step {run.state.step}. Its progress since its "
                    "last save_state is lost: create its training client again from that checkpoint")
            return
        holder = self._holder
        if holder is not None and not holder.closed:     # a finished session's model never comes back
            # Its state to the store (a step boundary: nothing accumulated), so it can come back.
            holder.swaps += 1
            version = f"{version_prefix(holder.model_id)}-swap-{holder.swaps:06d}"
            await trainer.save_weights(version, metadata={"tinker.model_id": holder.model_id})
            holder.resume_version = version
            SWAPS.inc()
            log.info("tinker: model %s leaves the trainer (state in %s)", holder.model_id, version)
        self._holder = None
        if run.resume_version is not None:
            run.state = await trainer.load_weights(run.resume_version, restore_state=True)
        elif run.restore is not None:
            checkpoint, optimizer = run.restore
            run.state = await self._load(trainer, run, checkpoint, optimizer)
        else:
            run.state = await trainer.load_weights(run.base.version, restore_state=False,
                                                   config=await self._config(trainer, run))
        self._holder = run
        log.info("tinker: model %s holds the trainer (%s, step %d)", run.model_id, run.state.weights_version,
                 run.state.step)

    async def _load(self, trainer: TrainerClient, run: _Run, checkpoint: Checkpoint, optimizer: bool) -> TrainerState:
        """Load a checkpoint into the trainer for ``run``: with its optimizer state (a resume), or its
        weights as a fresh model's base (new adapters of the run's rank, a fresh optimizer)."""
        if optimizer and checkpoint.kind != "weights":
            raise InvalidArgument.field("path", f"{checkpoint.path} holds sampler weights only: load it without the "
                                                "optimizer, or load a save_state checkpoint")
        config = None if optimizer else await self._config(trainer, run)
        run.state = await trainer.load_weights(checkpoint.version, restore_state=optimizer, config=config)
        run.restore, run.resume_version = None, None
        self._holder = run
        return run.state

    async def _config(self, trainer: TrainerClient, run: _Run) -> TrainConfig:
        """A fresh run's TrainConfig: the trainer's own as it started (dtype, master weights, ...) with the
        run's LoRA rank and seed."""
        if self._base_config is None:
            self._base_config = (await trainer.get_state()).config
        return dataclasses.replace(self._base_config, lora_rank=run.lora_rank, seed=run.seed)

    # ------------------------------------------------------------------ sampling

    def create_sampling_session(self, session_id: str, base_model: str | None, model_path: str | None) -> str:
        """A sampling session bound to a base model's version or to a saved sampler checkpoint."""
        session = self._session(session_id)
        if (base_model is None) == (model_path is None):
            raise InvalidArgument.field("model_path", "give exactly one of base_model and model_path")
        if base_model is not None:
            base = self.resolve_base(base_model)
            return self._new_sampling_session(session, base, base.version, base.numerics_fingerprint, None)
        checkpoint = checkpoint_from_path(model_path or "", "model_path")
        fingerprint = self._fingerprints.get(checkpoint.version)
        return self._new_sampling_session(session, self.base, checkpoint.version, fingerprint, model_path)

    def _new_sampling_session(self, session: _Session, base: BaseModel, version: str, fingerprint: str | None,
                              model_path: str | None) -> str:
        sampling_session_id = f"sampler-{secrets.token_hex(8)}"
        # fingerprint None: not known yet (a version saved before this process started): read from its manifest.
        self._sampling[sampling_session_id] = _SamplingSession(sampling_session_id, base, version,
                                                               fingerprint if fingerprint is not None else "\0",
                                                               model_path)
        return sampling_session_id

    def sampler_info(self, sampling_session_id: str) -> dict[str, Any]:
        s = self._sampling_session(sampling_session_id)
        # base_model: the tokenizer directory, which SamplingClient.get_tokenizer loads offline
        return {"sampler_id": s.sampling_session_id, "base_model": s.base.tokenizer_dir, "model_path": s.model_path}

    def join_sampling_session(self, sampling_session_id: str) -> int:
        s = self._sampling_session(sampling_session_id)
        s.clients += 1
        return s.clients

    def _sampling_session(self, sampling_session_id: str) -> _SamplingSession:
        s = self._sampling.get(sampling_session_id)
        if s is None:
            raise NotFound(f"no sampling session {sampling_session_id!r}")
        return s

    def submit_sample(self, call: SampleCall) -> tuple[str, list[str]]:
        """(request_id, one sequence id per sample) of a sample / compute_logprobs."""
        if call.sampling_session_id is not None:
            target = self._sampling_session(call.sampling_session_id)
        elif call.base_model is not None:
            base = self.resolve_base(call.base_model)
            target = _SamplingSession("", base, base.version, base.numerics_fingerprint, None)
        else:
            checkpoint = checkpoint_from_path(call.model_path or "", "model_path")
            target = _SamplingSession("", self.base, checkpoint.version,
                                      self._fingerprints.get(checkpoint.version, "\0"), call.model_path)
        bad = [t for t in call.prompt_ids if not 0 <= t < target.base.vocab_size]
        if bad:
            raise InvalidArgument.field("prompt", f"token ids {bad[:4]} are outside {target.base.name}'s vocabulary "
                                                  f"[0, {target.base.vocab_size})")
        bad = [t for t in call.options.stop_token_ids if not 0 <= t < target.base.vocab_size]
        if bad:
            raise InvalidArgument.field("sampling_params.stop", f"token ids {bad[:4]} are outside the vocabulary "
                                                                f"[0, {target.base.vocab_size})")
        request_id, future = self.futures.new()
        CALLS.labels("Sample").inc()
        task = asyncio.ensure_future(self._settle("Sample", future, lambda: self._sample(target, call)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return request_id, [f"{request_id}-{i}" for i in range(call.options.n)]

    async def _sample(self, target: _SamplingSession, call: SampleCall) -> SampleOutcome:
        if target.fingerprint == "\0":
            # A version this process did not save: its fingerprint is in its manifest.
            target.fingerprint = (await self.store.manifest(target.version)).spec.numerics_fingerprint
        request = InferenceRequest(prompt_ids=call.prompt_ids, options=call.options, weights_version=target.version,
                                   numerics_fingerprint=target.fingerprint)
        async with self.samplers.serving(target.version, self._shared.get(target.version)) as replica:
            result = await replica.generate_all(request)
        sequences = []
        for sample in result.samples:
            if sample.finish_reason not in ("stop", "length"):
                raise Unavailable(f"sample {sample.index} ended with {sample.finish_reason!r} (the sampler replica "
                                  "stopped it): retry")
            sequences.append(SampledSequence(tuple(sample.token_ids), tuple(sample.logprobs), sample.finish_reason))
            SAMPLED_TOKENS.inc(len(sample.token_ids))
        prompt_logprobs = result.samples[0].prompt_logprobs if call.options.prompt_logprobs and result.samples else None
        return SampleOutcome(tuple(sequences), None if prompt_logprobs is None else tuple(prompt_logprobs),
                             result.weights_version, result.numerics_fingerprint)

    # ------------------------------------------------------------------ futures

    async def retrieve(self, request_id: str) -> tuple[bool, Any]:
        """(done, result) of a call, after a long poll of up to ``long_poll_s``."""
        return await self.futures.wait(request_id, self.long_poll_s)


def _model_id(session_id: str, model_seq_id: int) -> str:
    """A model's id: the SDK derives it the same way for a model created from a checkpoint."""
    return f"{session_id}:train:{model_seq_id}"


def _marks(state: TrainerState) -> tuple[str, int, int]:
    """What identifies the trainer's state between two calls of one model."""
    return state.weights_version, state.step, state.accumulated_batches
