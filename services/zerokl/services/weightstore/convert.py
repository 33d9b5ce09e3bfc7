"""The only conversions between weight-store dataclasses and ``zerokl.v1`` messages.

One function per type and direction; nothing else in the weight store
touches generated proto classes except the servicer and client, which call
these at the edge.
"""
from __future__ import annotations

import datetime as dt
import json
from typing import Any

from google.protobuf import timestamp_pb2

from zerokl.services.runtime.errors import InvalidArgument
from zerokl.services.weightstore.shared import SharedCudaBuffer, SharedExport, SharedTensor
from zerokl.services.weightstore.store import (
    GcResult,
    ShardInfo,
    ShardStatus,
    UploadStatus,
    VersionEntry,
    VersionSpec,
    WeightsManifest,
)
from zerokl.v1 import weights_pb2

__all__ = [
    "manifest_to_proto",
    "manifest_from_proto",
    "upload_status_to_proto",
    "upload_status_from_proto",
    "shard_status_to_proto",
    "shard_status_from_proto",
    "version_entry_to_proto",
    "version_entry_from_proto",
    "gc_result_to_proto",
    "gc_result_from_proto",
    "commit_request_to_proto",
    "commit_request_from_proto",
    "shared_export_to_proto",
    "shared_export_from_proto",
]


def _ts(when: dt.datetime) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromDatetime(when)
    return ts


def _when(ts: timestamp_pb2.Timestamp) -> dt.datetime:
    return ts.ToDatetime(tzinfo=dt.timezone.utc)


def _config_json(config: Any) -> str:
    return json.dumps(dict(config), sort_keys=True)


def _config_from_json(text: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        config = json.loads(text)
    except ValueError as err:
        raise InvalidArgument.field("model_config_json", f"not JSON: {err}") from None
    if not isinstance(config, dict):
        raise InvalidArgument.field("model_config_json", "must be a JSON object")
    return config


def manifest_to_proto(m: WeightsManifest) -> weights_pb2.WeightsManifest:
    """WeightsManifest -> ``zerokl.v1.WeightsManifest``."""
    msg = weights_pb2.WeightsManifest(
        version=m.version, parent_version=m.spec.parent_version,
        numerics_version=m.spec.numerics_version, numerics_fingerprint=m.spec.numerics_fingerprint,
        model_config_json=_config_json(m.spec.model_config),
        shards=[weights_pb2.ShardInfo(name=s.name, size=s.size, sha256=s.sha256, base_version=s.base,
                                      stored_size=s.stored_bytes, depth=s.depth) for s in m.shards],
        created_at=_ts(m.created_at), metadata=dict(m.spec.metadata))
    if m.spec.step is not None:
        msg.step = m.spec.step
    return msg


def manifest_from_proto(msg: weights_pb2.WeightsManifest) -> WeightsManifest:
    """``zerokl.v1.WeightsManifest`` -> WeightsManifest."""
    spec = VersionSpec(msg.parent_version, msg.step if msg.HasField("step") else None, msg.numerics_version,
                       msg.numerics_fingerprint, _config_from_json(msg.model_config_json), dict(msg.metadata))
    # stored_size 0 of a whole shard: a sender that predates the field (the file's own size).
    return WeightsManifest(msg.version, spec, tuple(ShardInfo(s.name, s.size, s.sha256, s.base_version,
                                                              s.stored_size if s.base_version or s.stored_size else None,
                                                              s.depth) for s in msg.shards),
                           _when(msg.created_at))


def shard_status_to_proto(s: ShardStatus) -> weights_pb2.ShardStatus:
    """ShardStatus -> ``zerokl.v1.ShardStatus``."""
    return weights_pb2.ShardStatus(name=s.name, size=s.size, sha256=s.sha256, received=s.received,
                                   complete=s.complete, base_version=s.base, delta_size=s.delta_size,
                                   delta_sha256=s.delta_sha256)


def shard_status_from_proto(msg: weights_pb2.ShardStatus) -> ShardStatus:
    """``zerokl.v1.ShardStatus`` -> ShardStatus."""
    return ShardStatus(msg.name, msg.size, msg.sha256, msg.received, msg.complete, msg.base_version, msg.delta_size,
                       msg.delta_sha256)


def upload_status_to_proto(u: UploadStatus) -> weights_pb2.UploadStatus:
    """UploadStatus -> ``zerokl.v1.UploadStatus``."""
    return weights_pb2.UploadStatus(upload_id=u.upload_id, version=u.version,
                                    shards=[shard_status_to_proto(s) for s in u.shards],
                                    created_at=_ts(u.created_at))


def upload_status_from_proto(msg: weights_pb2.UploadStatus) -> UploadStatus:
    """``zerokl.v1.UploadStatus`` -> UploadStatus."""
    return UploadStatus(msg.upload_id, msg.version, tuple(shard_status_from_proto(s) for s in msg.shards),
                        _when(msg.created_at))


def version_entry_to_proto(e: VersionEntry) -> weights_pb2.VersionEntry:
    """VersionEntry -> ``zerokl.v1.VersionEntry``."""
    return weights_pb2.VersionEntry(manifest=manifest_to_proto(e.manifest), pinned_by=list(e.pinned_by))


def version_entry_from_proto(msg: weights_pb2.VersionEntry) -> VersionEntry:
    """``zerokl.v1.VersionEntry`` -> VersionEntry."""
    return VersionEntry(manifest_from_proto(msg.manifest), tuple(msg.pinned_by))


def gc_result_to_proto(r: GcResult) -> weights_pb2.GarbageCollectResponse:
    """GcResult -> ``zerokl.v1.GarbageCollectResponse``."""
    return weights_pb2.GarbageCollectResponse(deleted=list(r.deleted), kept_pinned=list(r.kept_pinned),
                                              expired_uploads=list(r.expired_uploads))


def gc_result_from_proto(msg: weights_pb2.GarbageCollectResponse) -> GcResult:
    """``zerokl.v1.GarbageCollectResponse`` -> GcResult."""
    return GcResult(tuple(msg.deleted), tuple(msg.kept_pinned), tuple(msg.expired_uploads))


def commit_request_to_proto(upload_id: str, shards: list[str], spec: VersionSpec) -> weights_pb2.CommitRequest:
    """A commit of ``shards`` of an upload with ``spec`` -> ``zerokl.v1.CommitRequest``."""
    msg = weights_pb2.CommitRequest(
        upload_id=upload_id, shards=shards, parent_version=spec.parent_version,
        numerics_version=spec.numerics_version, numerics_fingerprint=spec.numerics_fingerprint,
        model_config_json=_config_json(spec.model_config), metadata=dict(spec.metadata))
    if spec.step is not None:
        msg.step = spec.step
    return msg


def commit_request_from_proto(msg: weights_pb2.CommitRequest) -> tuple[str, list[str], VersionSpec]:
    """(upload id, shard names, spec); a malformed config is :class:`InvalidArgument`."""
    spec = VersionSpec(msg.parent_version, msg.step if msg.HasField("step") else None, msg.numerics_version,
                       msg.numerics_fingerprint, _config_from_json(msg.model_config_json), dict(msg.metadata))
    return msg.upload_id, list(msg.shards), spec


def shared_export_to_proto(e: SharedExport) -> weights_pb2.SharedWeights:
    """SharedExport -> ``zerokl.v1.SharedWeights`` (the trainer's SaveWeights answer, a SwitchWeights request)."""
    msg = weights_pb2.SharedWeights(
        version=e.version, host_id=e.host_id, transport=e.transport, path=e.path, total_bytes=e.total_bytes,
        checksum=e.checksum, numerics_fingerprint=e.numerics_fingerprint,
        tensors=[weights_pb2.SharedTensor(name=t.name, dtype=t.dtype, shape=list(t.shape), offset=t.offset)
                 for t in e.tensors])
    if e.cuda is not None:
        c = e.cuda
        msg.cuda.CopyFrom(weights_pb2.SharedCudaBuffer(
            device=c.device, handle=c.handle, storage_size_bytes=c.storage_size_bytes,
            storage_offset_bytes=c.storage_offset_bytes, ref_counter_handle=c.ref_counter_handle,
            ref_counter_offset=c.ref_counter_offset, event_handle=c.event_handle,
            event_sync_required=c.event_sync_required))
    return msg


def shared_export_from_proto(msg: weights_pb2.SharedWeights) -> SharedExport:
    """``zerokl.v1.SharedWeights`` -> SharedExport (checked when it is opened: ``sync.open_shared``)."""
    c = msg.cuda
    cuda = SharedCudaBuffer(c.device, c.handle, c.storage_size_bytes, c.storage_offset_bytes, c.ref_counter_handle,
                            c.ref_counter_offset, c.event_handle, c.event_sync_required) if msg.HasField("cuda") else None
    return SharedExport(msg.version, msg.host_id, msg.transport, msg.total_bytes, msg.checksum,
                        tuple(SharedTensor(t.name, t.dtype, tuple(t.shape), t.offset) for t in msg.tensors),
                        msg.numerics_fingerprint, msg.path, cuda)
