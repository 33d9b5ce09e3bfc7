from zerokl.v1 import common_pb2 as _common_pb2
from zerokl.v1 import weights_pb2 as _weights_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Completion(_message.Message):
    __slots__ = ("prompt_ids", "completion_ids", "temperature", "top_k", "top_p")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    temperature: float
    top_k: int
    top_p: float
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., completion_ids: _Optional[_Iterable[int]] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ...) -> None: ...

class Rollout(_message.Message):
    __slots__ = ("completion", "logprobs", "reward", "weights_version")
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    completion: Completion
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    reward: float
    weights_version: str
    def __init__(self, completion: _Optional[_Union[Completion, _Mapping]] = ..., logprobs: _Optional[_Iterable[float]] = ..., reward: _Optional[float] = ..., weights_version: _Optional[str] = ...) -> None: ...

class ForwardLogprobsRequest(_message.Message):
    __slots__ = ("completions", "trace")
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    trace: _common_pb2.TraceOptions
    def __init__(self, completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., trace: _Optional[_Union[_common_pb2.TraceOptions, _Mapping]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class ForwardLogprobsResponse(_message.Message):
    __slots__ = ("logprobs", "trace")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    trace: _common_pb2.Trace
    def __init__(self, logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., trace: _Optional[_Union[_common_pb2.Trace, _Mapping]] = ...) -> None: ...

class SFTBatch(_message.Message):
    __slots__ = ("completions",)
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    def __init__(self, completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ...) -> None: ...

class PreferencePair(_message.Message):
    __slots__ = ("chosen", "rejected")
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    chosen: Completion
    rejected: Completion
    def __init__(self, chosen: _Optional[_Union[Completion, _Mapping]] = ..., rejected: _Optional[_Union[Completion, _Mapping]] = ...) -> None: ...

class DPOBatch(_message.Message):
    __slots__ = ("pairs", "reset_reference")
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    RESET_REFERENCE_FIELD_NUMBER: _ClassVar[int]
    pairs: _containers.RepeatedCompositeFieldContainer[PreferencePair]
    reset_reference: bool
    def __init__(self, pairs: _Optional[_Iterable[_Union[PreferencePair, _Mapping]]] = ..., reset_reference: _Optional[bool] = ...) -> None: ...

class PPOBatch(_message.Message):
    __slots__ = ("rollouts", "group_size", "advantages", "max_staleness")
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    rollouts: _containers.RepeatedCompositeFieldContainer[Rollout]
    group_size: int
    advantages: _containers.RepeatedScalarFieldContainer[float]
    max_staleness: int
    def __init__(self, rollouts: _Optional[_Iterable[_Union[Rollout, _Mapping]]] = ..., group_size: _Optional[int] = ..., advantages: _Optional[_Iterable[float]] = ..., max_staleness: _Optional[int] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("input_ids", "target_ids", "weights", "logprobs", "advantages")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    target_ids: _containers.RepeatedScalarFieldContainer[int]
    weights: _containers.RepeatedScalarFieldContainer[float]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    advantages: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, input_ids: _Optional[_Iterable[int]] = ..., target_ids: _Optional[_Iterable[int]] = ..., weights: _Optional[_Iterable[float]] = ..., logprobs: _Optional[_Iterable[float]] = ..., advantages: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenLossBatch(_message.Message):
    __slots__ = ("loss", "sequences", "config", "forward_only", "temperature", "top_k", "top_p")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    FORWARD_ONLY_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    loss: str
    sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    config: _containers.ScalarMap[str, float]
    forward_only: bool
    temperature: float
    top_k: int
    top_p: float
    def __init__(self, loss: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., config: _Optional[_Mapping[str, float]] = ..., forward_only: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ...) -> None: ...

class ForwardBackwardRequest(_message.Message):
    __slots__ = ("sft", "dpo", "ppo", "token")
    SFT_FIELD_NUMBER: _ClassVar[int]
    DPO_FIELD_NUMBER: _ClassVar[int]
    PPO_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    sft: SFTBatch
    dpo: DPOBatch
    ppo: PPOBatch
    token: TokenLossBatch
    def __init__(self, sft: _Optional[_Union[SFTBatch, _Mapping]] = ..., dpo: _Optional[_Union[DPOBatch, _Mapping]] = ..., ppo: _Optional[_Union[PPOBatch, _Mapping]] = ..., token: _Optional[_Union[TokenLossBatch, _Mapping]] = ...) -> None: ...

class PPOMetrics(_message.Message):
    __slots__ = ("kl", "mismatched_tokens", "clip_fraction", "ratio_min", "ratio_max", "kl_reference", "reward_mean", "stale_rollouts", "max_staleness")
    KL_FIELD_NUMBER: _ClassVar[int]
    MISMATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CLIP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    RATIO_MIN_FIELD_NUMBER: _ClassVar[int]
    RATIO_MAX_FIELD_NUMBER: _ClassVar[int]
    KL_REFERENCE_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    STALE_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    kl: float
    mismatched_tokens: int
    clip_fraction: float
    ratio_min: float
    ratio_max: float
    kl_reference: float
    reward_mean: float
    stale_rollouts: int
    max_staleness: int
    def __init__(self, kl: _Optional[float] = ..., mismatched_tokens: _Optional[int] = ..., clip_fraction: _Optional[float] = ..., ratio_min: _Optional[float] = ..., ratio_max: _Optional[float] = ..., kl_reference: _Optional[float] = ..., reward_mean: _Optional[float] = ..., stale_rollouts: _Optional[int] = ..., max_staleness: _Optional[int] = ...) -> None: ...

class ForwardBackwardResponse(_message.Message):
    __slots__ = ("method", "loss", "tokens", "tokens_per_s", "ppo", "metrics", "step", "accumulated_batches", "token_logprobs")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METHOD_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PPO_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    method: str
    loss: float
    tokens: int
    tokens_per_s: float
    ppo: PPOMetrics
    metrics: _containers.ScalarMap[str, float]
    step: int
    accumulated_batches: int
    token_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, method: _Optional[str] = ..., loss: _Optional[float] = ..., tokens: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., ppo: _Optional[_Union[PPOMetrics, _Mapping]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., step: _Optional[int] = ..., accumulated_batches: _Optional[int] = ..., token_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class OptimStepRequest(_message.Message):
    __slots__ = ("lr", "adam")
    LR_FIELD_NUMBER: _ClassVar[int]
    ADAM_FIELD_NUMBER: _ClassVar[int]
    lr: float
    adam: AdamParams
    def __init__(self, lr: _Optional[float] = ..., adam: _Optional[_Union[AdamParams, _Mapping]] = ...) -> None: ...

class AdamParams(_message.Message):
    __slots__ = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., grad_clip_norm: _Optional[float] = ...) -> None: ...

class OptimStepResponse(_message.Message):
    __slots__ = ("grad_norm", "lr", "step")
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    grad_norm: float
    lr: float
    step: int
    def __init__(self, grad_norm: _Optional[float] = ..., lr: _Optional[float] = ..., step: _Optional[int] = ...) -> None: ...

class SaveWeightsRequest(_message.Message):
    __slots__ = ("version", "metadata", "weights_only", "share", "supersede")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ONLY_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDE_FIELD_NUMBER: _ClassVar[int]
    version: str
    metadata: _containers.ScalarMap[str, str]
    weights_only: bool
    share: bool
    supersede: bool
    def __init__(self, version: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., weights_only: _Optional[bool] = ..., share: _Optional[bool] = ..., supersede: _Optional[bool] = ...) -> None: ...

class SaveWeightsResponse(_message.Message):
    __slots__ = ("manifest", "created", "shared", "record_s", "superseded_by")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    RECORD_S_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_BY_FIELD_NUMBER: _ClassVar[int]
    manifest: _weights_pb2.WeightsManifest
    created: bool
    shared: _weights_pb2.SharedWeights
    record_s: float
    superseded_by: str
    def __init__(self, manifest: _Optional[_Union[_weights_pb2.WeightsManifest, _Mapping]] = ..., created: _Optional[bool] = ..., shared: _Optional[_Union[_weights_pb2.SharedWeights, _Mapping]] = ..., record_s: _Optional[float] = ..., superseded_by: _Optional[str] = ...) -> None: ...

class RecordWeightsRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: str
    def __init__(self, version: _Optional[str] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("version", "restore_state", "config")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RESTORE_STATE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    version: str
    restore_state: bool
    config: TrainConfig
    def __init__(self, version: _Optional[str] = ..., restore_state: _Optional[bool] = ..., config: _Optional[_Union[TrainConfig, _Mapping]] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainConfig(_message.Message):
    __slots__ = ("lr", "weight_decay", "beta1", "beta2", "grad_clip", "warmup_steps", "total_steps", "lora_rank", "lora_alpha", "clip_eps", "kl_coef", "dpo_beta", "seed", "indexer_loss_coef", "activation_checkpointing", "logprob_chunk_rows", "master_weights", "dtype", "cuda_graphs", "offload_optimizer", "micro_batch_tokens")
    LR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    CLIP_EPS_FIELD_NUMBER: _ClassVar[int]
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    DPO_BETA_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    INDEXER_LOSS_COEF_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_CHECKPOINTING_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_CHUNK_ROWS_FIELD_NUMBER: _ClassVar[int]
    MASTER_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    grad_clip: float
    warmup_steps: int
    total_steps: int
    lora_rank: int
    lora_alpha: float
    clip_eps: float
    kl_coef: float
    dpo_beta: float
    seed: int
    indexer_loss_coef: float
    activation_checkpointing: bool
    logprob_chunk_rows: int
    master_weights: bool
    dtype: str
    cuda_graphs: bool
    offload_optimizer: bool
    micro_batch_tokens: int
    def __init__(self, lr: _Optional[float] = ..., weight_decay: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., grad_clip: _Optional[float] = ..., warmup_steps: _Optional[int] = ..., total_steps: _Optional[int] = ..., lora_rank: _Optional[int] = ..., lora_alpha: _Optional[float] = ..., clip_eps: _Optional[float] = ..., kl_coef: _Optional[float] = ..., dpo_beta: _Optional[float] = ..., seed: _Optional[int] = ..., indexer_loss_coef: _Optional[float] = ..., activation_checkpointing: _Optional[bool] = ..., logprob_chunk_rows: _Optional[int] = ..., master_weights: _Optional[bool] = ..., dtype: _Optional[str] = ..., cuda_graphs: _Optional[bool] = ..., offload_optimizer: _Optional[bool] = ..., micro_batch_tokens: _Optional[int] = ...) -> None: ...

class TrainerState(_message.Message):
    __slots__ = ("run", "step", "weights_version", "weights_step", "tokens_seen", "accumulated_batches", "config", "model_config_json", "numerics_version", "numerics_fingerprint")
    RUN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SEEN_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    run: str
    step: int
    weights_version: str
    weights_step: int
    tokens_seen: int
    accumulated_batches: int
    config: TrainConfig
    model_config_json: str
    numerics_version: str
    numerics_fingerprint: str
    def __init__(self, run: _Optional[str] = ..., step: _Optional[int] = ..., weights_version: _Optional[str] = ..., weights_step: _Optional[int] = ..., tokens_seen: _Optional[int] = ..., accumulated_batches: _Optional[int] = ..., config: _Optional[_Union[TrainConfig, _Mapping]] = ..., model_config_json: _Optional[str] = ..., numerics_version: _Optional[str] = ..., numerics_fingerprint: _Optional[str] = ...) -> None: ...
