from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class BytesChunk(_message.Message):
    __slots__ = ("offset", "data", "sha256", "total_size")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    sha256: bytes
    total_size: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., sha256: _Optional[bytes] = ..., total_size: _Optional[int] = ...) -> None: ...
