from zerokl.v1 import trainer_pb2 as _trainer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState

class CountdownTask(_message.Message):
    __slots__ = ("seed", "train_problems", "test_problems")
    SEED_FIELD_NUMBER: _ClassVar[int]
    TRAIN_PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    TEST_PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    seed: int
    train_problems: int
    test_problems: int
    def __init__(self, seed: _Optional[int] = ..., train_problems: _Optional[int] = ..., test_problems: _Optional[int] = ...) -> None: ...

class SFTJob(_message.Message):
    __slots__ = ("countdown", "examples", "steps", "batch_size", "publish_every", "seed")
    COUNTDOWN_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_EVERY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    countdown: CountdownTask
    examples: _trainer_pb2.SFTBatch
    steps: int
    batch_size: int
    publish_every: int
    seed: int
    def __init__(self, countdown: _Optional[_Union[CountdownTask, _Mapping]] = ..., examples: _Optional[_Union[_trainer_pb2.SFTBatch, _Mapping]] = ..., steps: _Optional[int] = ..., batch_size: _Optional[int] = ..., publish_every: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class DPOJob(_message.Message):
    __slots__ = ("pairs", "steps", "batch_size", "publish_every", "seed")
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_EVERY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    pairs: _trainer_pb2.DPOBatch
    steps: int
    batch_size: int
    publish_every: int
    seed: int
    def __init__(self, pairs: _Optional[_Union[_trainer_pb2.DPOBatch, _Mapping]] = ..., steps: _Optional[int] = ..., batch_size: _Optional[int] = ..., publish_every: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class RLJob(_message.Message):
    __slots__ = ("countdown", "steps", "prompts_per_step", "group_size", "max_tokens", "temperature", "top_p", "seed", "max_staleness", "eval_every", "eval_prompts", "checkpoint_every", "reward", "ignore_eos")
    COUNTDOWN_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    EVAL_EVERY_FIELD_NUMBER: _ClassVar[int]
    EVAL_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    countdown: CountdownTask
    steps: int
    prompts_per_step: int
    group_size: int
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    max_staleness: int
    eval_every: int
    eval_prompts: int
    checkpoint_every: int
    reward: str
    ignore_eos: bool
    def __init__(self, countdown: _Optional[_Union[CountdownTask, _Mapping]] = ..., steps: _Optional[int] = ..., prompts_per_step: _Optional[int] = ..., group_size: _Optional[int] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_staleness: _Optional[int] = ..., eval_every: _Optional[int] = ..., eval_prompts: _Optional[int] = ..., checkpoint_every: _Optional[int] = ..., reward: _Optional[str] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("name", "sft", "dpo", "rl", "learning_rate", "train_config")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SFT_FIELD_NUMBER: _ClassVar[int]
    DPO_FIELD_NUMBER: _ClassVar[int]
    RL_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    TRAIN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    name: str
    sft: SFTJob
    dpo: DPOJob
    rl: RLJob
    learning_rate: float
    train_config: _trainer_pb2.TrainConfig
    def __init__(self, name: _Optional[str] = ..., sft: _Optional[_Union[SFTJob, _Mapping]] = ..., dpo: _Optional[_Union[DPOJob, _Mapping]] = ..., rl: _Optional[_Union[RLJob, _Mapping]] = ..., learning_rate: _Optional[float] = ..., train_config: _Optional[_Union[_trainer_pb2.TrainConfig, _Mapping]] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "name", "kind", "state", "step", "total_steps", "weights_version", "error", "elapsed_s", "train_config")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    TRAIN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    kind: str
    state: JobState
    step: int
    total_steps: int
    weights_version: str
    error: str
    elapsed_s: float
    train_config: _trainer_pb2.TrainConfig
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., kind: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., weights_version: _Optional[str] = ..., error: _Optional[str] = ..., elapsed_s: _Optional[float] = ..., train_config: _Optional[_Union[_trainer_pb2.TrainConfig, _Mapping]] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("step", "weights_version", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    weights_version: str
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., weights_version: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("status", "step")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    status: JobStatus
    step: StepMetrics
    def __init__(self, status: _Optional[_Union[JobStatus, _Mapping]] = ..., step: _Optional[_Union[StepMetrics, _Mapping]] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ...) -> None: ...
