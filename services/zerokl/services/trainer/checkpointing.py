"""Trainer checkpoints as weight-store versions, and the stores they go to.

A version the trainer publishes is one directory of files (the weight store's
shards), committed atomically with its manifest written last:

- ``config.json`` + ``model.safetensors`` (sharded with an index when large):
  the serving weights, LoRA merged, in the glm_moe_dsa layout. This is all a
  serving replica reads (``Model.from_pretrained`` ignores the other files).
- ``trainer-state.safetensors`` (``trainer-state-0000K-of-0000N.safetensors``
  when larger than :data:`RECORD_SHARD_BYTES`) + ``trainer-state.json`` (absent when
  published ``weights_only``): everything else needed to continue the job
  bit for bit: the training model's own state dict (base weights and LoRA
  adapters), AdamW's moments and step counts, the fp32 master weights (when
  the trainer keeps them: a bf16 model's serving weights are only their
  rounding), the frozen KL/DPO reference, the step counters, the TrainConfig
  and the version lineage.

Why the state rides in the same version instead of a separate "state" entry:
the weights and the state they resume with are committed by one manifest, so
a resume point is never half-published; and every version in the store stays
a loadable model, so a replica watching the store never sees a non-model
version. The cost is that a replica fetching the whole version also fetches
the optimizer state; it needs only ``config.json`` and ``model*``.

The manifest's metadata carries ``zerokl.run`` (the job) and
``zerokl.trainer_state`` (``full`` or ``none``; the keys are
:mod:`~zerokl.services.trainer.store_marks`'); a restarted trainer resumes
from the newest ``full`` version of its run (:func:`find_resume_point`). All
files are written deterministically (sorted keys, no timestamps), so
publishing the same state twice gives the same sha256 per shard, which is how
a repeated SaveWeights is recognized as already done. Both halves are split into
files of at most :data:`RECORD_SHARD_BYTES` (the same layout every step), so one
version travels to the store on several streams at once, and a file the version
before holds too can go as a delta against it (the trainer's records:
:class:`~zerokl.services.weightstore.client.UploadBase`).

Stores: :class:`LocalWeights` uses a :class:`VersionStore` directly (the
embedded default, no weight-store process needed); :class:`RemoteWeights`
goes through a weight-store service over gRPC. Both raise
:class:`ServiceError` s, so the trainer reports a store's NOT_FOUND as
NOT_FOUND whichever store it uses.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import mmap
import os
import pathlib
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence, TypeVar

import grpc
import grpc.aio
import torch
from safetensors.torch import load_file, save, save_file

from zerokl.kernels.model import Model, ModelConfig
from zerokl.kernels.model.fp8 import quantize_fp8
from zerokl.kernels.model.checkpoint import CheckpointError, pretrained_files, save_state_pretrained
from zerokl.kernels.model.lora import merged_state_dict
from zerokl.services.runtime.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.store_marks import META_RUN, META_STATE
from zerokl.services.trainer.trainer import Trainer
from zerokl.services.weightstore.client import UploadBase, WeightStoreClient, is_serving_file
from zerokl.services.weightstore.source import ShardSource, shard_sources
from zerokl.services.runtime.server import create_channel, peer_credentials
from zerokl.services.weightstore.backends import LocalDirBackend
from zerokl.services.weightstore.store import FETCHED_MANIFEST, VersionSpec, VersionStore, WeightsManifest, file_sha256
from zerokl.services.weightstore.versions import segment_index

__all__ = [
    "open_repo",
    "STATE_TENSORS",
    "STATE_JSON",
    "RECORD_SHARD_BYTES",
    "STATE_FORMAT",
    "MAX_LINEAGE",
    "LineageEntry",
    "TrainerCheckpoint",
    "CheckpointSnapshot",
    "snapshot_checkpoint",
    "snapshot_to_host",
    "write_snapshot",
    "HostBuffer",
    "serving_sources",
    "write_checkpoint",
    "read_checkpoint",
    "has_trainer_state",
    "load_serving_model",
    "config_to_json",
    "config_from_json",
    "WeightsRepo",
    "LocalWeights",
    "RemoteWeights",
    "find_resume_point",
    "publish_checkpoint",
    "SHARDED_JSON",
    "save_sharded",
    "load_sharded",
]

STATE_TENSORS = "trainer-state.safetensors"
STATE_JSON = "trainer-state.json"
_STATE_PART = re.compile(r"trainer-state-(\d{5})-of-(\d{5})\.safetensors")
# Bytes per file of a written checkpoint (serving weights and trainer state alike): `small`'s 583 MB of bf16
# weights are ~10 files, uploaded on that many streams at once (the weight store writes each in its own thread).
RECORD_SHARD_BYTES = 64 * 1024**2
STATE_FORMAT = "zerokl.trainer-state/1"
# Versions remembered for staleness checks: a rollout older than this many
# publishes is refused whatever max_staleness says.
MAX_LINEAGE = 64


@dataclass(frozen=True)
class LineageEntry:
    """The trainer's weights were ``version`` when it had taken ``step`` optimizer steps."""

    version: str
    step: int


# ----------------------------------------------------------------------------- TrainConfig <-> JSON

def config_to_json(config: TrainConfig) -> dict[str, Any]:
    """TrainConfig as a JSON object (betas as a list)."""
    d = dataclasses.asdict(config)
    d["betas"] = list(config.betas)
    return d


def config_from_json(d: Mapping[str, Any]) -> TrainConfig:
    """TrainConfig from :func:`config_to_json`'s form; unknown keys are an error (a newer format)."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    extra = sorted(set(d) - known)
    if extra:
        raise DataLoss(f"trainer state has unknown TrainConfig fields {extra}")
    kw = dict(d)
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    return TrainConfig(**kw)


# ----------------------------------------------------------------------------- files

@dataclass
class CheckpointSnapshot:
    """A trainer's checkpoint at one step, held apart from the trainer (a later step does not change it
    unless taken with ``copy=False``): what :func:`write_snapshot` writes. Tensors may be on the
    trainer's device; they reach the host only when written."""

    serving: Mapping[str, torch.Tensor]         # the serving weights, under the model's names
    model_config: ModelConfig
    dtype: torch.dtype                          # the serving weights' dtype, as config.json states it
    state: dict[str, torch.Tensor] | None = None    # trainer-state tensors; None: weights only
    doc: dict[str, Any] | None = None           # trainer-state.json
    ready: Any = None                           # CUDA: an event after the copies were made (the writer waits)

    @property
    def weights_only(self) -> bool:
        return self.state is None

    @property
    def nbytes(self) -> int:
        tensors = [*self.serving.values(), *(self.state or {}).values()]
        return sum(t.numel() * t.element_size() for t in tensors)


def snapshot_checkpoint(trainer: Trainer, *, run: str, lineage: Sequence[LineageEntry], weights_only: bool = False,
                        serving: Mapping[str, torch.Tensor] | None = None, copy: bool = True) -> CheckpointSnapshot:
    """The checkpoint of ``trainer`` as it is now (at a step boundary).

    ``serving``: its serving weights, already a copy (a shared export's tensors); default
    ``trainer.serving_state_dict()``. ``copy``: every tensor a later step changes in place (fp32
    masters, AdamW moments and counts, LoRA weights; FP8 serving values) is cloned where it is, so
    the snapshot can be written while the trainer goes on; without it the trainer must not step
    until the snapshot is written. The clones are device copies (fast); the host copy and the files
    are :func:`write_snapshot`'s, off the training's critical path.
    """
    def own(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone() if copy else t.detach()

    if serving is None:
        serving = trainer.serving_state_dict()
        if copy and trainer.fp8:    # the FP8 serving state holds the model's own e4m3 tensors
            serving = {k: own(v) for k, v in serving.items()}
    snap = CheckpointSnapshot(serving, trainer.model.config,
                              torch.float8_e4m3fn if trainer.fp8 else trainer.model.dtype)
    if not weights_only:
        # Full fine-tuning: the serving weights ARE the training model, so they are
        # not stored twice. LoRA: the base weights and adapters (not the merged sum).
        lora = trainer.config.lora_rank > 0
        tensors = {f"model/{k}": own(v) for k, v in trainer.model.state_dict().items()} if lora else {}
        opt = trainer.optimizer.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for index, state in opt["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optimizer/{index}/{key}"] = own(value)
                else:
                    scalars.setdefault(str(index), {})[key] = value
        if trainer.masters is not None:
            # fp32 masters in trainer.params order: the serving (bf16) weights are their rounding,
            # so a run resumed without them would not continue bit for bit.
            tensors.update({f"master/{i}": own(m) for i, m in enumerate(trainer.masters)})
        if trainer.reference is not None:
            # Merged (a copy already): a plain model with these weights computes the parametrized reference's bits.
            tensors.update({f"reference/{k}": v for k, v in merged_state_dict(trainer.reference).items()})
        snap.state = tensors
        # Through JSON now: the document is the trainer's as it is at this step, whatever it does next.
        snap.doc = json.loads(json.dumps({
            "format": STATE_FORMAT,
            "run": run,
            "step": trainer.step,
            "tokens_seen": trainer.tokens_seen,
            "config": config_to_json(trainer.config),
            "optimizer": {"param_groups": opt["param_groups"], "scalars": scalars},
            "has_reference": trainer.reference is not None,
            "masters": len(trainer.masters) if trainer.masters is not None else 0,
            "model_in_state": lora,
            "lineage": [[e.version, e.step] for e in lineage[-MAX_LINEAGE:]],
        }))
    if copy and trainer.device.type == "cuda":
        snap.ready = torch.cuda.Event()
        snap.ready.record()
    return snap


def _on_host(tensors: Mapping[str, torch.Tensor], ready: Any) -> dict[str, torch.Tensor]:
    """``tensors`` in host memory. CUDA tensors are copied on a stream of their own (after ``ready``), so
    the copy runs beside the training's kernels instead of between them on their stream."""
    devices = {t.device for t in tensors.values() if t.is_cuda}
    if not devices:
        return dict(tensors)
    stream = torch.cuda.Stream(next(iter(devices)))
    with torch.cuda.stream(stream):
        if ready is not None:
            stream.wait_event(ready)
        out = {k: v.to("cpu") for k, v in tensors.items()}
    stream.synchronize()    # the device copies may be freed (they were read on this stream)
    return out


def snapshot_to_host(snapshot: CheckpointSnapshot) -> None:
    """Bring ``snapshot``'s CUDA tensors into this process's host memory, in place, so the device memory can go before
    the snapshot is written. Serving weights that view a shared export are the caller's to copy out of it first,
    checked against the checksum the readers were sent (:func:`~zerokl.services.weightstore.sync.copy_checked`)."""
    if any(t.is_cuda for t in snapshot.serving.values()):
        snapshot.serving = _on_host(snapshot.serving, snapshot.ready)
    if snapshot.state is not None:
        snapshot.state = _on_host(snapshot.state, snapshot.ready)
    snapshot.ready = None


def write_snapshot(snapshot: CheckpointSnapshot, directory: str | os.PathLike[str],
                   max_shard_bytes: int = RECORD_SHARD_BYTES) -> None:
    """Write the serving checkpoint (save_pretrained's files) and, unless the snapshot is weights only, the
    trainer state into ``directory``, each in files of at most ``max_shard_bytes`` (a larger tensor alone)."""
    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_state_pretrained(_on_host(snapshot.serving, snapshot.ready), snapshot.model_config, snapshot.dtype, path,
                          max_shard_bytes)
    if snapshot.state is None:
        return
    tensors, storages = {}, set()
    for key, t in _on_host(snapshot.state, snapshot.ready).items():
        t = t.contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in storages:
            t = t.clone()   # safetensors refuses tensors that share storage (a tied weight of a LoRA model)
        storages.add(t.untyped_storage().data_ptr())
        tensors[key] = t
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):     # sorted: the same split every step (a file's delta base is its namesake)
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if parts[-1] and size + nbytes > max_shard_bytes:
            parts.append({})
            size = 0
        parts[-1][key] = tensors[key]
        size += nbytes
    names = [STATE_TENSORS] if len(parts) == 1 else \
        [f"trainer-state-{i:05d}-of-{len(parts):05d}.safetensors" for i in range(1, len(parts) + 1)]
    for name, part in zip(names, parts, strict=True):
        save_file(part, str(path / name), metadata={"format": STATE_FORMAT})
    (path / STATE_JSON).write_text(json.dumps(snapshot.doc, indent=1, sort_keys=True) + "\n")


class HostBuffer:
    """``nbytes`` of host memory of this process (an anonymous mapping, ``tensor`` over it, uint8) that gives its pages
    back to the kernel range by range (:meth:`release`), so a copy made out of it piece by piece holds the bytes once,
    not twice: the record process copies a shared export into one (``open_shared(into=...)``) and builds the serving
    files out of it (:func:`serving_sources`), 22.7 GiB for the GLM-5 slice. A page goes once every byte of it was
    released (released ranges are merged); bytes released read as zeros after."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, max(nbytes, 1))      # private, anonymous: a page is allocated when first written
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes) if nbytes \
            else torch.empty(0, dtype=torch.uint8)
        self._base = self.tensor.data_ptr()
        self._ends: dict[int, int] = {}     # released ranges, merged: start -> end, and end -> start
        self._starts: dict[int, int] = {}

    def release(self, t: torch.Tensor) -> None:
        """``t``'s bytes will not be read again: give back every page that no unreleased byte shares. A tensor
        outside this buffer (a clone) is ignored."""
        start = t.data_ptr() - self._base
        end = start + t.numel() * t.element_size()
        if start < 0 or end > self.nbytes or end <= start:
            return
        if end in self._ends:                   # joins the range after it
            end = self._ends.pop(end)
            del self._starts[end]
        if start in self._starts:               # and the one before it
            start = self._starts.pop(start)
            del self._ends[start]
        self._ends[start], self._starts[end] = end, start
        lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        hi = end // mmap.PAGESIZE * mmap.PAGESIZE if end < self.nbytes else -(-end // mmap.PAGESIZE) * mmap.PAGESIZE
        if hi > lo:     # the merged range's whole pages (again: those given back before cost nothing)
            self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)     # they read as zeros from here

    def close(self) -> None:
        """Give every page back. The mapping itself goes with the last tensor over it (a view left in a traceback
        reads zeros, never freed memory)."""
        if self.nbytes:
            self._map.madvise(mmap.MADV_DONTNEED, 0, len(self._map))
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self._ends.clear()
        self._starts.clear()


def serving_sources(snapshot: CheckpointSnapshot, max_shard_bytes: int = RECORD_SHARD_BYTES,
                    release: Callable[[torch.Tensor], None] | None = None) -> list[ShardSource]:
    """The serving files :func:`write_snapshot` writes for a weights-only ``snapshot`` (the same names, the same
    bytes), built in this process's memory instead of on disk: for an upload straight from memory
    (:class:`~zerokl.services.weightstore.source.ShardSource`). Each file is safetensors' own bytes
    (``safetensors.torch.save``, what ``save_file`` writes), and ``release`` is called with the file's tensors once
    they are in it (a :class:`HostBuffer` gives those pages back), so the snapshot's bytes and the files' are held
    once in all, plus the file being built: at most max(``max_shard_bytes``, the largest tensor) more (64 MiB
    record shards; the GLM-5 slice's largest tensor, its embedding, is 1.8 GiB)."""
    files = pretrained_files(_on_host(snapshot.serving, snapshot.ready), snapshot.model_config, snapshot.dtype,
                             max_shard_bytes)
    sources = []
    for name, content in files:
        if not isinstance(content, bytes):
            tensors = content
            content = save(tensors, metadata={"format": "pt"})
            if release is not None:
                for t in tensors.values():
                    release(t)
        sources.append(ShardSource.memory(name, content))
    return sources


def _state_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The trainer-state tensor files of a checkpoint directory (one, or every part of a split); [] if none or
    parts are missing."""
    if (path / STATE_TENSORS).exists():
        return [path / STATE_TENSORS]
    parts = sorted(p for p in path.iterdir() if _STATE_PART.fullmatch(p.name)) if path.is_dir() else []
    counts = {_STATE_PART.fullmatch(p.name).group(2) for p in parts}     # type: ignore[union-attr]
    if len(counts) != 1 or len(parts) != int(next(iter(counts))):
        return []
    return parts


def write_checkpoint(trainer: Trainer, directory: str | os.PathLike[str], *, run: str,
                     lineage: Sequence[LineageEntry], weights_only: bool = False) -> None:
    """Write the serving checkpoint and (unless ``weights_only``) the trainer state into ``directory``
    (the trainer must not step meanwhile: a snapshot without copies, written at once)."""
    write_snapshot(snapshot_checkpoint(trainer, run=run, lineage=lineage, weights_only=weights_only, copy=False),
                   directory)


def has_trainer_state(directory: str | os.PathLike[str]) -> bool:
    """Whether a checkpoint directory carries a resume point."""
    path = pathlib.Path(directory)
    return (path / STATE_JSON).exists() and bool(_state_files(path))


def load_serving_model(directory: str | os.PathLike[str], device: torch.device | str = "cpu") -> Model:
    """The serving weights of a checkpoint directory on ``device`` (:class:`FailedPrecondition` if it is not one)."""
    try:
        return Model.from_pretrained(directory).to(device)
    except (CheckpointError, KeyError, ValueError, OSError) as err:
        raise FailedPrecondition(f"{pathlib.Path(directory).name} is not a loadable glm_moe_dsa checkpoint: "
                                 f"{err}") from None


@dataclass
class TrainerCheckpoint:
    """A trainer rebuilt from a checkpoint directory, and what it remembers."""

    trainer: Trainer
    run: str
    lineage: list[LineageEntry]


def read_checkpoint(directory: str | os.PathLike[str], *, restore_state: bool,
                    config: TrainConfig, run: str = "", device: torch.device | str = "cpu") -> TrainerCheckpoint:
    """A trainer from a checkpoint directory, its model (and reference) on ``device``.

    ``restore_state``: the exact trainer that wrote it (its TrainConfig, adapters,
    optimizer, reference, counters and lineage; ``config`` is ignored). Otherwise
    the serving weights become the base of a fresh trainer with ``config`` at
    step 0, and the lineage starts empty (the caller names the base).
    """
    path = pathlib.Path(directory)
    if not restore_state:
        return TrainerCheckpoint(Trainer(load_serving_model(path, device), config), run, [])
    if not has_trainer_state(path):
        raise FailedPrecondition(f"{path.name} has no trainer state (published weights_only, or not by a trainer)")
    try:
        doc = json.loads((path / STATE_JSON).read_text())
        if doc.get("format") != STATE_FORMAT:
            raise DataLoss(f"{path.name}: unknown trainer-state format {doc.get('format')!r}")
        tensors = {k: v for part in _state_files(path) for k, v in load_file(str(part)).items()}
    except (ValueError, KeyError, OSError) as err:
        raise DataLoss(f"{path.name}: unreadable trainer state: {err}") from None
    train_config = config_from_json(doc["config"])
    # The trainer's own construction on the serving weights (LoRA adapters
    # registered exactly as at the start of the job), then every trained
    # tensor overwritten from the state.
    model = load_serving_model(path, device)
    model_config, dtype = model.config, model.dtype
    trainer = Trainer(model, train_config)
    if doc.get("model_in_state"):
        model_state = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    else:
        model_state = trainer.model.state_dict()
    opt_state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer/"):
            _, index, name = key.split("/", 2)
            opt_state.setdefault(int(index), {})[name] = value
    for index, scalars in doc["optimizer"]["scalars"].items():
        opt_state.setdefault(int(index), {}).update(scalars)
    groups = doc["optimizer"]["param_groups"]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    try:
        masters = [tensors[f"master/{i}"] for i in range(int(doc.get("masters", 0)))]
    except KeyError as err:
        raise DataLoss(f"{path.name}: trainer state lacks master weight {err}") from None
    # A state written before master weights existed has none: the trainer takes them from its weights.
    if masters and trainer.masters is None:
        raise DataLoss(f"{path.name}: trainer state has {len(masters)} master weight(s) but the trainer keeps none")
    try:
        trainer.load_state_dict({"model": model_state, "optimizer": {"state": opt_state, "param_groups": groups},
                                 "masters": masters,
                                 "step": int(doc["step"]), "tokens_seen": int(doc["tokens_seen"])})
    except (RuntimeError, ValueError, KeyError) as err:
        raise DataLoss(f"{path.name}: trainer state does not fit its model: {err}") from None
    if doc.get("has_reference"):
        reference = Model.empty(model_config, dtype).to(device)
        if trainer.fp8:                 # the FP8 forward's reference: masters beside e4m3 values (its layout)
            quantize_fp8(reference, masters=True)
        reference.load_state_dict({k.removeprefix("reference/"): v for k, v in tensors.items()
                                   if k.startswith("reference/")})
        for p in reference.parameters():
            p.requires_grad_(False)
        trainer.reference = reference.eval()
    lineage = [LineageEntry(str(v), int(s)) for v, s in doc["lineage"]]
    return TrainerCheckpoint(trainer, str(doc.get("run", run)), lineage)


def _local_shards(src: pathlib.Path | Sequence[ShardSource]) -> dict[str, str]:
    """sha256 of each file of ``src`` (a directory, or files on disk or in memory), by name."""
    def sha256(source: ShardSource) -> str:
        if source.path is not None:
            return file_sha256(source.path)
        with source.view() as view:
            return hashlib.sha256(view).hexdigest()
    return {s.name: sha256(s) for s in shard_sources(src) if s.name != FETCHED_MANIFEST}


# ----------------------------------------------------------------------------- stores

class WeightsRepo(Protocol):
    """Where versions go: a local VersionStore or a weight-store service. Errors are ServiceErrors."""

    def describe(self) -> str: ...

    async def publish_dir(self, src: pathlib.Path | Sequence[ShardSource], version: str, spec: VersionSpec,
                          base: UploadBase | None = None) -> WeightsManifest: ...

    async def fetch(self, version: str, dest: pathlib.Path, serving_only: bool = False) -> WeightsManifest: ...

    async def manifest(self, version: str) -> WeightsManifest: ...

    async def manifests(self) -> list[WeightsManifest]: ...

    async def abort_open_upload(self, version: str) -> None: ...

    async def pin(self, version: str, owner: str) -> None: ...

    async def unpin(self, version: str, owner: str) -> None: ...

    async def close(self) -> None: ...


class LocalWeights:
    """A :class:`VersionStore` used in-process (its blocking I/O runs in worker threads)."""

    def __init__(self, store: VersionStore) -> None:
        self.store = store

    def describe(self) -> str:
        return self.store.backend.describe()

    async def publish_dir(self, src: pathlib.Path | Sequence[ShardSource], version: str, spec: VersionSpec,
                          base: UploadBase | None = None) -> WeightsManifest:
        return await asyncio.to_thread(self.store.publish_dir, src, version, spec,
                                       (base.manifest.version, base.directory) if base is not None else None)

    async def fetch(self, version: str, dest: pathlib.Path, serving_only: bool = False) -> WeightsManifest:
        def fetch() -> WeightsManifest:
            manifest = self.store.fetch(version, dest)      # local files: hard links where they are whole
            if serving_only:
                for shard in manifest.shards:
                    if not is_serving_file(shard.name):
                        (pathlib.Path(dest) / shard.name).unlink(missing_ok=True)
            return manifest
        return await asyncio.to_thread(fetch)

    async def manifest(self, version: str) -> WeightsManifest:
        return await asyncio.to_thread(self.store.get_manifest, version)

    async def manifests(self) -> list[WeightsManifest]:
        return await asyncio.to_thread(self.store.manifests)

    async def abort_open_upload(self, version: str) -> None:
        upload = await asyncio.to_thread(self.store.begin_upload, version)
        await asyncio.to_thread(self.store.abort_upload, upload.upload_id)

    async def pin(self, version: str, owner: str) -> None:
        await asyncio.to_thread(self.store.pin, version, owner)

    async def unpin(self, version: str, owner: str) -> None:
        await asyncio.to_thread(self.store.unpin, version, owner)

    async def close(self) -> None:
        return None


_T = TypeVar("_T")

# A weight store's status, re-raised as the same status from the trainer.
_BY_CODE: dict[grpc.StatusCode, type[ServiceError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.DATA_LOSS: DataLoss,
    # A store with no room: a refusal, not an outage (a retry meets the same full disk); what it acknowledged stays
    # in the open upload, which a publish after room is made resumes (publish_checkpoint never drops it for this).
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    # The store's own handler failed (a bug, or a request it cannot take): a retry, or the upload dropped and sent again
    # (publish_checkpoint's answer to FAILED_PRECONDITION), meets it again, so it stays INTERNAL, said by the caller.
    # Never grpc's INTERNAL "Internal error from Core" for a write that raced a stream's end: the store client raises
    # the status the store ended a PutShard stream with, and one the store ended with none as UNAVAILABLE (an outage).
    grpc.StatusCode.INTERNAL: Internal,
}

# A weight store's statuses that mean "out for now": retried by the trainer's callers.
_OUTAGE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class RemoteWeights:
    """A weight-store service over gRPC, through ``channel`` (closed by :meth:`close`). ``local_root``: the
    store's directory when this host sees it (``--weight-store-root``): fetched files it holds whole are hard links
    to its copies (checked against the manifest as streamed ones are), not second copies on the disk."""

    def __init__(self, channel: grpc.aio.Channel, target: str, local_root: pathlib.Path | None = None) -> None:
        self.channel = channel
        self.client = WeightStoreClient(channel=channel)
        self.target = target
        self.local_root = local_root

    def describe(self) -> str:
        return f"weight-store {self.target}"

    async def _call(self, fn: Callable[[], Awaitable[_T]]) -> _T:
        try:
            return await fn()
        except grpc.aio.AioRpcError as err:
            code = err.code()
            if code in _BY_CODE:
                raise _BY_CODE[code](f"weight store {self.target}: {err.details()}") from None
            if code in _OUTAGE:
                # The store (or the way to it) is out for now; the trainer's caller may retry.
                raise Unavailable(f"weight store {self.target}: {err.details()}") from None
            # Anything else (UNKNOWN for a PermissionError writing an upload, PERMISSION_DENIED, ...)
            # will fail the same way on a retry: said at once, by name, never as an outage.
            raise FailedPrecondition(f"weight store {self.target} failed the call ({code.name}): "
                                     f"{err.details()}") from None

    async def publish_dir(self, src: pathlib.Path | Sequence[ShardSource], version: str, spec: VersionSpec,
                          base: UploadBase | None = None) -> WeightsManifest:
        return await self._call(lambda: self.client.publish(
            src, version, parent_version=spec.parent_version, step=spec.step,
            numerics_version=spec.numerics_version, numerics_fingerprint=spec.numerics_fingerprint,
            model_config=spec.model_config, metadata=spec.metadata, base=base))

    async def fetch(self, version: str, dest: pathlib.Path, serving_only: bool = False) -> WeightsManifest:
        return await self._call(lambda: self.client.fetch(version, dest, serving_only=serving_only,
                                                          local_root=self.local_root))

    async def manifest(self, version: str) -> WeightsManifest:
        return await self._call(lambda: self.client.manifest(version))

    async def manifests(self) -> list[WeightsManifest]:
        return [e.manifest for e in await self._call(self.client.list)]

    async def abort_open_upload(self, version: str) -> None:
        upload = await self._call(lambda: self.client.begin_upload(version))
        await self._call(lambda: self.client.abort_upload(upload.upload_id))

    async def pin(self, version: str, owner: str) -> None:
        await self._call(lambda: self.client.pin(version, owner))

    async def unpin(self, version: str, owner: str) -> None:
        await self._call(lambda: self.client.unpin(version, owner))

    async def close(self) -> None:
        await self.channel.close()


async def find_resume_point(repo: WeightsRepo, run: str) -> WeightsManifest | None:
    """The newest version of ``run`` that carries trainer state (None: the run has not published one):
    of its newest segment (:func:`~zerokl.services.weightstore.versions.run_segment`), the one of the
    highest step, the later committed on a tie (records of a run may commit out of order after a store
    outage)."""
    points = [(index, m) for m in await repo.manifests()
              if (index := segment_index(run, m.spec.metadata.get(META_RUN, ""))) is not None
              and m.spec.metadata.get(META_STATE) == "full"]
    return max(points, key=lambda p: (p[0], p[1].spec.step or 0, p[1].created_at))[1] if points else None


async def publish_checkpoint(repo: WeightsRepo, src: pathlib.Path | Sequence[ShardSource], version: str,
                             spec: VersionSpec, base: UploadBase | None = None) -> tuple[WeightsManifest, bool]:
    """Publish ``src`` (a directory, or its files: on disk or in memory, :class:`ShardSource`) as ``version``;
    (manifest, created). ``base``: an earlier version whose files are still on this host (files of the same name
    go as deltas against them where smaller).

    A version that exists already with exactly these files (same names and
    sha256) is the same checkpoint published before (a retried SaveWeights, or
    one repeated after a restart): its manifest is returned with created False.
    So is a version recorded weights only whose every file is one of ours: the
    same weights, recorded without the trainer state (an RL job's version
    between checkpoints); its manifest says so (META_STATE "none"), and it is
    no resume point. Other contents: :class:`AlreadyExists`. An open upload of
    the version left by a crashed trainer is dropped and the publish starts over.
    """
    try:
        existing = await repo.manifest(version)
    except NotFound:
        existing = None
    if existing is not None:
        ours = await asyncio.to_thread(_local_shards, src)
        theirs = {s.name: s.sha256 for s in existing.shards}
        weights_only = existing.spec.metadata.get(META_STATE) == "none"
        if ours == theirs or weights_only and theirs.items() <= ours.items():
            return existing, False
        raise AlreadyExists(f"version {version} is already published with other contents; "
                            "name another version")
    try:
        return await repo.publish_dir(src, version, spec, base), True
    except FailedPrecondition:
        # An upload of this version was left open with other bytes (a trainer
        # that crashed while publishing, then did not redo the same step).
        await repo.abort_open_upload(version)
        return await repo.publish_dir(src, version, spec, base), True


# ----------------------------------------------------------------------------- sharded (DCP) checkpoints

SHARDED_JSON = "zerokl-sharded.json"
SHARDED_FORMAT = "zerokl.sharded-trainer/1"


def _world_mesh(trainer):
    group = trainer.group
    if getattr(group, "world_mesh", None) is None:
        from torch.distributed.device_mesh import init_device_mesh
        group.world_mesh = init_device_mesh(trainer.device.type, (trainer.layout.world,))
    return group.world_mesh


def save_sharded(trainer, directory: str | os.PathLike[str]) -> None:
    """Write a DistributedTrainer's weights, AdamW state and counters with torch.distributed.checkpoint
    (collective: every rank writes its own files).

    Layout-independent: every tensor is saved in its one-device shape, split by rows over
    the world (a DTensor Shard(0) on a 1-D mesh of all ranks), so a later load reshards it
    for any dp x tp x ep (load_sharded). Keys: ``model/<name>``, ``optimizer/<name>/<state>``
    (the model's own names; publish() gives the HF names the serving side loads).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = _world_mesh(trainer)
    flat: dict[str, Any] = {f"model/{k}": v for k, v in trainer.full_state_dict().items()}
    for name, s in trainer.full_optimizer_state().items():
        flat.update({f"optimizer/{name}/{k}": v for k, v in s.items()})
    state = {k: (distribute_tensor(v.to(trainer.device), mesh, [Shard(0)], src_data_rank=None) if v.dim() else v)
             for k, v in flat.items()}
    path = pathlib.Path(directory)
    dcp.save(state, checkpoint_id=str(path))
    if torch.distributed.get_rank() == 0:
        doc = {"format": SHARDED_FORMAT, "step": trainer.step, "tokens_seen": trainer.tokens_seen,
               "config": config_to_json(trainer.config), "layout": dataclasses.asdict(trainer.layout)}
        (path / SHARDED_JSON).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    torch.distributed.barrier(group=trainer.group.control)


def load_sharded(trainer, directory: str | os.PathLike[str]) -> dict:
    """Load a save_sharded checkpoint (written at any layout) into a DistributedTrainer of this
    layout: weights, AdamW state and counters; gradients dropped. Returns the sidecar document."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor
    path = pathlib.Path(directory)
    try:
        doc = json.loads((path / SHARDED_JSON).read_text())
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except (OSError, ValueError) as err:
        raise DataLoss(f"{path.name}: not a sharded trainer checkpoint: {err}") from None
    if doc.get("format") != SHARDED_FORMAT:
        raise DataLoss(f"{path.name}: unknown sharded format {doc.get('format')!r}")
    mesh = _world_mesh(trainer)
    state: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        empty = torch.empty(tuple(md.size), dtype=md.properties.dtype, device=trainer.device)
        state[key] = distribute_tensor(empty, mesh, [Shard(0)], src_data_rank=None) if empty.dim() else empty
    dcp.load(state, checkpoint_id=str(path))
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu() for k, v in state.items()}
    model = {k.removeprefix("model/"): v for k, v in full.items() if k.startswith("model/")}
    optimizer: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in full.items():
        if k.startswith("optimizer/"):
            name, what = k.removeprefix("optimizer/").rsplit("/", 1)
            optimizer.setdefault(name, {})[what] = v
    trainer.load_full(model, optimizer, step=int(doc["step"]), tokens_seen=int(doc["tokens_seen"]))
    return doc


# ----------------------------------------------------------------------------- the store a trainer's flags select

async def open_repo(args: argparse.Namespace) -> WeightsRepo:
    """The store the flags select; a remote one must answer within --weight-store-wait."""
    if args.weight_store:
        channel = create_channel(args.weight_store, token=_token(args), credentials=peer_credentials(args))
        try:
            await asyncio.wait_for(channel.channel_ready(), args.weight_store_wait)
        except asyncio.TimeoutError:
            await channel.close()
            raise SystemExit(f"--weight-store {args.weight_store}: no answer within "
                             f"{args.weight_store_wait}s") from None
        root = getattr(args, "weight_store_root", None)
        return RemoteWeights(channel, args.weight_store, pathlib.Path(root) if root else None)
    from zerokl.services.weightstore.server import DEFAULT_ROOT     # (the store's server, not imported by it)
    return LocalWeights(VersionStore(LocalDirBackend(args.weights_dir or DEFAULT_ROOT)))


def _token(args: argparse.Namespace) -> str | None:
    # The hop to the weight store carries the peer token: publishing weights is an internal RPC.
    from zerokl.services.runtime.auth import PEER_TOKEN_ENV, PEER_TOKEN_FILE_ENV, load_auth_token
    return load_auth_token(args.peer_token_file, env=PEER_TOKEN_ENV, file_env=PEER_TOKEN_FILE_ENV)
