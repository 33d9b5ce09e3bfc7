from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ServiceInfo(_message.Message):
    __slots__ = ("service", "replica_id", "numerics_version", "numerics_fingerprint", "backend", "device", "dtype", "weights_version", "model_config_hash", "zerokl_version", "cluster_id")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    ZEROKL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    service: str
    replica_id: str
    numerics_version: str
    numerics_fingerprint: str
    backend: str
    device: str
    dtype: str
    weights_version: str
    model_config_hash: str
    zerokl_version: str
    cluster_id: str
    def __init__(self, service: _Optional[str] = ..., replica_id: _Optional[str] = ..., numerics_version: _Optional[str] = ..., numerics_fingerprint: _Optional[str] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., weights_version: _Optional[str] = ..., model_config_hash: _Optional[str] = ..., zerokl_version: _Optional[str] = ..., cluster_id: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TraceOptions(_message.Message):
    __slots__ = ("enabled", "capture")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    capture: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, enabled: _Optional[bool] = ..., capture: _Optional[_Iterable[str]] = ...) -> None: ...

class TraceOp(_message.Message):
    __slots__ = ("layer", "op", "dtype", "shape", "digests", "values")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    layer: int
    op: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    digests: _containers.RepeatedScalarFieldContainer[int]
    values: bytes
    def __init__(self, layer: _Optional[int] = ..., op: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., digests: _Optional[_Iterable[int]] = ..., values: _Optional[bytes] = ...) -> None: ...

class Trace(_message.Message):
    __slots__ = ("token_ids", "ops", "meta")
    class MetaEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    ops: _containers.RepeatedCompositeFieldContainer[TraceOp]
    meta: _containers.ScalarMap[str, str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., ops: _Optional[_Iterable[_Union[TraceOp, _Mapping]]] = ..., meta: _Optional[_Mapping[str, str]] = ...) -> None: ...
