import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from zerokl.v1 import blob_pb2 as _blob_pb2
from zerokl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardInfo(_message.Message):
    __slots__ = ("name", "size", "sha256", "base_version", "stored_size", "depth")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    STORED_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    sha256: str
    base_version: str
    stored_size: int
    depth: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ..., base_version: _Optional[str] = ..., stored_size: _Optional[int] = ..., depth: _Optional[int] = ...) -> None: ...

class WeightsManifest(_message.Message):
    __slots__ = ("version", "parent_version", "step", "numerics_version", "numerics_fingerprint", "model_config_json", "shards", "created_at", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    version: str
    parent_version: str
    step: int
    numerics_version: str
    numerics_fingerprint: str
    model_config_json: str
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    created_at: _timestamp_pb2.Timestamp
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, version: _Optional[str] = ..., parent_version: _Optional[str] = ..., step: _Optional[int] = ..., numerics_version: _Optional[str] = ..., numerics_fingerprint: _Optional[str] = ..., model_config_json: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class BeginUploadRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: str
    def __init__(self, version: _Optional[str] = ...) -> None: ...

class ShardStatus(_message.Message):
    __slots__ = ("name", "size", "sha256", "received", "complete", "base_version", "delta_size", "delta_sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DELTA_SIZE_FIELD_NUMBER: _ClassVar[int]
    DELTA_SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    sha256: str
    received: int
    complete: bool
    base_version: str
    delta_size: int
    delta_sha256: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ..., received: _Optional[int] = ..., complete: _Optional[bool] = ..., base_version: _Optional[str] = ..., delta_size: _Optional[int] = ..., delta_sha256: _Optional[str] = ...) -> None: ...

class UploadStatus(_message.Message):
    __slots__ = ("upload_id", "version", "shards", "created_at")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    version: str
    shards: _containers.RepeatedCompositeFieldContainer[ShardStatus]
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, upload_id: _Optional[str] = ..., version: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[ShardStatus, _Mapping]]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GetUploadRequest(_message.Message):
    __slots__ = ("upload_id",)
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    def __init__(self, upload_id: _Optional[str] = ...) -> None: ...

class ShardHeader(_message.Message):
    __slots__ = ("upload_id", "name", "size", "sha256", "base_version", "delta_size", "delta_sha256")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DELTA_SIZE_FIELD_NUMBER: _ClassVar[int]
    DELTA_SHA256_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    name: str
    size: int
    sha256: str
    base_version: str
    delta_size: int
    delta_sha256: str
    def __init__(self, upload_id: _Optional[str] = ..., name: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ..., base_version: _Optional[str] = ..., delta_size: _Optional[int] = ..., delta_sha256: _Optional[str] = ...) -> None: ...

class PutShardRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ShardHeader
    chunk: _blob_pb2.BytesChunk
    def __init__(self, header: _Optional[_Union[ShardHeader, _Mapping]] = ..., chunk: _Optional[_Union[_blob_pb2.BytesChunk, _Mapping]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("upload_id", "shards", "parent_version", "step", "numerics_version", "numerics_fingerprint", "model_config_json", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    shards: _containers.RepeatedScalarFieldContainer[str]
    parent_version: str
    step: int
    numerics_version: str
    numerics_fingerprint: str
    model_config_json: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, upload_id: _Optional[str] = ..., shards: _Optional[_Iterable[str]] = ..., parent_version: _Optional[str] = ..., step: _Optional[int] = ..., numerics_version: _Optional[str] = ..., numerics_fingerprint: _Optional[str] = ..., model_config_json: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class AbortUploadRequest(_message.Message):
    __slots__ = ("upload_id",)
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    def __init__(self, upload_id: _Optional[str] = ...) -> None: ...

class AbortUploadResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: str
    def __init__(self, version: _Optional[str] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("version", "shard", "offset")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    version: str
    shard: str
    offset: int
    def __init__(self, version: _Optional[str] = ..., shard: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VersionEntry(_message.Message):
    __slots__ = ("manifest", "pinned_by")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PINNED_BY_FIELD_NUMBER: _ClassVar[int]
    manifest: WeightsManifest
    pinned_by: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, manifest: _Optional[_Union[WeightsManifest, _Mapping]] = ..., pinned_by: _Optional[_Iterable[str]] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[VersionEntry]
    def __init__(self, versions: _Optional[_Iterable[_Union[VersionEntry, _Mapping]]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("include_existing",)
    INCLUDE_EXISTING_FIELD_NUMBER: _ClassVar[int]
    include_existing: bool
    def __init__(self, include_existing: _Optional[bool] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: str
    def __init__(self, version: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("version", "owner")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    version: str
    owner: str
    def __init__(self, version: _Optional[str] = ..., owner: _Optional[str] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("version", "owner")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    version: str
    owner: str
    def __init__(self, version: _Optional[str] = ..., owner: _Optional[str] = ...) -> None: ...

class GarbageCollectRequest(_message.Message):
    __slots__ = ("keep_last",)
    KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    keep_last: int
    def __init__(self, keep_last: _Optional[int] = ...) -> None: ...

class GarbageCollectResponse(_message.Message):
    __slots__ = ("deleted", "kept_pinned", "expired_uploads")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    KEPT_PINNED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_UPLOADS_FIELD_NUMBER: _ClassVar[int]
    deleted: _containers.RepeatedScalarFieldContainer[str]
    kept_pinned: _containers.RepeatedScalarFieldContainer[str]
    expired_uploads: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, deleted: _Optional[_Iterable[str]] = ..., kept_pinned: _Optional[_Iterable[str]] = ..., expired_uploads: _Optional[_Iterable[str]] = ...) -> None: ...

class SharedWeights(_message.Message):
    __slots__ = ("version", "host_id", "transport", "path", "cuda", "total_bytes", "checksum", "tensors", "numerics_fingerprint")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    version: str
    host_id: str
    transport: str
    path: str
    cuda: SharedCudaBuffer
    total_bytes: int
    checksum: str
    tensors: _containers.RepeatedCompositeFieldContainer[SharedTensor]
    numerics_fingerprint: str
    def __init__(self, version: _Optional[str] = ..., host_id: _Optional[str] = ..., transport: _Optional[str] = ..., path: _Optional[str] = ..., cuda: _Optional[_Union[SharedCudaBuffer, _Mapping]] = ..., total_bytes: _Optional[int] = ..., checksum: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[SharedTensor, _Mapping]]] = ..., numerics_fingerprint: _Optional[str] = ...) -> None: ...

class SharedTensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ...) -> None: ...

class SharedCudaBuffer(_message.Message):
    __slots__ = ("device", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...
