"""Trace the seeded tiny model (the golden vectors' `model_tiny_logits` prompt) to a JSON file:
`zerokl diff A.json B.json` then names the first op whose bits differ between two machines or
two CPU code paths (e.g. ATEN_CPU_CAPABILITY=avx2 vs the native AVX-512 path).

    ZEROKL_BACKEND=torch python tools/trace_tiny.py OUT.json
"""
import argparse
import json

import torch

from zerokl.kernels.model import Model, ModelConfig
from zerokl.kernels.trace import trace_sequence

if __name__ == "__main__":
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    model = Model(ModelConfig.preset("tiny"), seed=0, dtype=getattr(torch, args.dtype))
    prompt = torch.randint(0, 64, (1, 48), generator=torch.Generator().manual_seed(31))[0].tolist()  # fingerprint.py's
    with open(args.out, "w") as f:
        json.dump(trace_sequence(model, prompt, meta={"dtype": args.dtype}).to_json(), f)
