from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ServiceInfo(_message.Message):
    __slots__ = ("service", "replica_id", "numerics_version", "numerics_fingerprint", "backend", "device", "dtype", "weights_version", "model_config_hash", "zerokl_version")
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
    def __init__(self, service: _Optional[str] = ..., replica_id: _Optional[str] = ..., numerics_version: _Optional[str] = ..., numerics_fingerprint: _Optional[str] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., weights_version: _Optional[str] = ..., model_config_hash: _Optional[str] = ..., zerokl_version: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
