from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PullRequest(_message.Message):
    __slots__ = ("source", "target_dir", "revision", "adapter", "max_bytes")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TARGET_DIR_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    source: str
    target_dir: str
    revision: str
    adapter: bool
    max_bytes: int
    def __init__(self, source: _Optional[str] = ..., target_dir: _Optional[str] = ..., revision: _Optional[str] = ..., adapter: _Optional[bool] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class PullProgress(_message.Message):
    __slots__ = ("bytes_done", "bytes_total", "stage", "done", "format", "quantization", "size_bytes")
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes_done: int
    bytes_total: int
    stage: str
    done: bool
    format: str
    quantization: str
    size_bytes: int
    def __init__(self, bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., stage: _Optional[str] = ..., done: _Optional[bool] = ..., format: _Optional[str] = ..., quantization: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class StartGroupRequest(_message.Message):
    __slots__ = ("name", "model_dir", "num_shard", "dtype", "device", "cpu_threads")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARD_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CPU_THREADS_FIELD_NUMBER: _ClassVar[int]
    name: str
    model_dir: str
    num_shard: int
    dtype: str
    device: str
    cpu_threads: int
    def __init__(self, name: _Optional[str] = ..., model_dir: _Optional[str] = ..., num_shard: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., cpu_threads: _Optional[int] = ...) -> None: ...

class StartGroupResponse(_message.Message):
    __slots__ = ("master_uds_path",)
    MASTER_UDS_PATH_FIELD_NUMBER: _ClassVar[int]
    master_uds_path: str
    def __init__(self, master_uds_path: _Optional[str] = ...) -> None: ...

class StopGroupRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class StopGroupResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GroupsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GroupsResponse(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...
