"""The numerics fingerprint: a hash of golden-vector outputs on the active backend.

Two processes whose fingerprints agree compute the same bits for every op and for
the reference model's forward. Services advertise it; the scheduler never pairs
replicas whose fingerprints differ; every weight version records the fingerprint it
was trained under.

The top of the numerics library: the model graph is part of the definition, so this
module imports zerokl.kernels.model (which is built on the ops below) and the package's
front door imports this module; `zerokl.kernels.fingerprint()` works on any first call.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import torch

from zerokl.kernels import ops
from zerokl.kernels.backend import device_name, get_backend, use_backend
from zerokl.kernels.dtypes import dtype_name
from zerokl.kernels.model.fp8 import quantize_fp8
from zerokl.kernels.model.model import Model, ModelConfig
from zerokl.kernels.portable import standard_normal, uniform
from zerokl.kernels.sampling import SamplingParams, sample
from zerokl.kernels.version import __version__

__all__ = ["golden_outputs", "golden_digests", "fingerprint", "fingerprint_of", "fingerprint_key"]

def _inputs(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    """Seeded inputs, the same on every machine (portable.standard_normal)."""
    return standard_normal(shape, torch.Generator().manual_seed(seed)) * scale


def golden_outputs(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Outputs of every op on fixed seeded inputs (made on CPU, moved to `device`).

    dtype float8_e4m3fn is the FP8 fleet's key: its activations are bf16, so it holds the bf16
    outputs plus the FP8 ops (quantization and the block-scaled GEMM) on bf16 inputs.
    """
    dev = torch.device(device)
    if dtype == torch.float8_e4m3fn:
        return {**golden_outputs(device, torch.bfloat16), **_fp8_outputs(dev)}

    def x(seed, *shape, scale=1.0, dt=dtype):
        return _inputs(seed, *shape, scale=scale).to(device=dev, dtype=dt)

    idx = torch.tensor([[0, 1, 2, 3, 4, 5, -1, -1, -1], [0, 2, 4, 6, 7, 8, 9, 10, 11]], device=dev)
    out = {
        "linear": ops.linear(x(1, 5, 67), x(2, 33, 67, scale=0.1), x(3, 33, dt=torch.float32)),
        "split_linear": ops.split_linear(x(32, 5, 96), x(33, 33, 96, scale=0.1), x(34, 33, dt=torch.float32)),
        "grouped_linear": ops.grouped_linear(x(4, 7, 40), x(5, 3, 24, 40, scale=0.1), [0, 2, 2, 7]),
        "rms_norm": ops.rms_norm(x(6, 3, 96, scale=3), x(7, 96)),
        "layer_norm": ops.layer_norm(x(8, 3, 80), x(9, 80), x(10, 80)),
        "log_softmax": ops.log_softmax(x(11, 3, 333, scale=4)),
        "softmax": ops.softmax(x(12, 3, 333, scale=4)),
        "silu": ops.silu(x(13, 4, 37, scale=6)),
        "sigmoid": ops.sigmoid(x(14, 4, 37, scale=6)),
        "rope": ops.rope(x(15, 4, 3, 16), torch.tensor([0, 7, 900, 65000], device=dev), ops.rope_inv_freq(16, 10000.0), True),
        "mla_attention": ops.mla_attention(x(16, 2, 4, 32), x(17, 2, 4, 8), x(18, 12, 32), x(19, 12, 8), idx, 0.125),
        "indexer_scores": ops.indexer_scores(x(20, 2, 4, 16), x(21, 12, 16), x(22, 2, 4, dt=torch.float32), idx),
        "moe_route": torch.cat([t.float() for t in ops.moe_route(x(23, 6, 16, dt=torch.float32), x(24, 16, dt=torch.float32), 4, 4, 2, 2.5)], 1),
        "moe_experts": ops.moe_experts(x(25, 5, 24), uniform((5, 2), torch.Generator().manual_seed(26)).to(dev),
                                       torch.tensor([[0, 1], [0, 2], [3, 0], [1, 2], [0, 3]], device=dev),
                                       x(27, 4, 20, 24, scale=0.2), x(28, 4, 20, 24, scale=0.2), x(29, 4, 24, 20, scale=0.2)),
    }
    params = SamplingParams(*(t.to(dev) for t in dataclasses.astuple(
        SamplingParams.make(4, temperature=0.9, top_k=20, top_p=0.9, seed=1234, position=torch.arange(4)))))
    draw = sample(x(30, 4, 97, scale=3, dt=torch.float32), params)
    out["sampling"] = torch.cat([draw.tokens.float(), draw.logprobs])
    out["model_tiny_logits"] = _tiny_model_logits(dev, dtype)
    return out


def _fp8_outputs(dev: torch.device) -> dict[str, torch.Tensor]:
    """What the FP8 key adds to (and replaces in) the bf16 outputs: the FP8 ops on bf16 inputs and the FP8
    model's logits."""
    act = _inputs(35, 7, 300, scale=2.0).to(device=dev, dtype=torch.bfloat16)
    q, s = ops.fp8_quantize(act)
    w, ws = ops.fp8_quantize_weight(_inputs(36, 130, 300, scale=0.05).to(dev))
    return {"fp8_quantize": torch.cat([q.float(), s], 1),
            "fp8_linear": ops.fp8_linear(act, w, ws, _inputs(37, 130).to(dev)),
            "model_tiny_logits": _tiny_model_logits(dev, torch.float8_e4m3fn)}   # replaces the bf16 model's


def _tiny_model_logits(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The model graph is part of the definition: logits of the seeded tiny model on a prompt
    longer than its index_topk (so the sparse path counts too)."""
    fp8 = dtype == torch.float8_e4m3fn                   # the FP8 model: bf16 with quantized projections
    model = Model(ModelConfig.preset("tiny"), seed=0, dtype=torch.bfloat16 if fp8 else dtype)
    if fp8:
        quantize_fp8(model)
    prompt = torch.randint(0, 64, (1, 48), generator=torch.Generator().manual_seed(31)).to(device)   # integers: portable
    return model.to(device)(prompt)


def _digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() + str((t.dtype, tuple(t.shape))).encode()).hexdigest()[:16]


def golden_digests(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, str]:
    """Per-op digests of `golden_outputs` on the active backend (so a failing golden test names the op that
    changed). Computed once per process for each (backend, device, dtype): they are this process's bits."""
    return dict(_golden_digests(get_backend(), str(torch.device(device)), dtype))


@functools.lru_cache(maxsize=None)
def _golden_digests(backend: str, device: str, dtype: torch.dtype) -> tuple[tuple[str, str], ...]:
    # The FP8 key's shared part is the bf16 key's digests (golden_outputs' FP8 branch), taken from the cache:
    # under TRITON_INTERPRET each key's tiny-model forward is tens of seconds.
    with use_backend(backend), torch.no_grad():
        if dtype == torch.float8_e4m3fn:
            digests = dict(_golden_digests(backend, device, torch.bfloat16))
            digests.update((name, _digest(t)) for name, t in _fp8_outputs(torch.device(device)).items())
        else:
            digests = {name: _digest(t) for name, t in golden_outputs(device, dtype).items()}
    return tuple(sorted(digests.items()))


def fingerprint_key(backend: str | None = None, device: str | None = None, dtype: torch.dtype = torch.float32) -> str:
    """The (backend, device type, dtype) a fingerprint covers, e.g. torch/cpu/float32 or
    triton/cuda-sm90/bfloat16; the device part names what determines the bits (device_name)."""
    backend = backend or get_backend()
    return f"{backend}/{device or device_name(backend=backend)}/{dtype_name(dtype)}"


def fingerprint_of(digests: dict[str, str]) -> str:
    """The fingerprint of per-op golden digests under this numerics version."""
    blob = __version__ + "".join(f"{k}={v};" for k, v in sorted(digests.items()))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def fingerprint(backend: str | None = None, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> str:
    """16 hex digits identifying the bits this process computes (numerics version included)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return fingerprint_of(dict(_golden_digests(backend or get_backend(), str(device), dtype)))
