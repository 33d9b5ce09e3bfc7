"""zerokl.kernels.model: the GLM-5-family model every compute service runs (part of the numerics library)."""
import torch

from zerokl.kernels.fingerprint import register_golden_case
from zerokl.kernels.model.model import AttentionBatch, KVCache, Model, ModelConfig


def _tiny_model_logits(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The model graph is part of the definition: logits of the seeded tiny model on a prompt
    longer than its index_topk (so the sparse path counts too). A golden case of the fingerprint,
    registered here so the numerics library below never imports the model."""
    fp8 = dtype == torch.float8_e4m3fn                   # the FP8 model: bf16 with quantized projections
    model = Model(ModelConfig.preset("tiny"), seed=0, dtype=torch.bfloat16 if fp8 else dtype)
    if fp8:
        from zerokl.kernels.model.fp8 import quantize_fp8
        quantize_fp8(model)
    prompt = torch.randint(0, 64, (1, 48), generator=torch.Generator().manual_seed(31)).to(device)   # integers: portable
    return model.to(device)(prompt)


register_golden_case("model_tiny_logits", _tiny_model_logits)

__all__ = ["Model", "ModelConfig", "AttentionBatch", "KVCache"]
