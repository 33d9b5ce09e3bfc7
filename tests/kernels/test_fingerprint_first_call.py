"""zerokl.kernels.fingerprint() works on the first call of any caller, in a fresh interpreter.

The fingerprint's golden cases include the tiny model's forward; the library's top (its
front door and zerokl.kernels.fingerprint) imports the model, so no caller has to import
zerokl.kernels.model first (one had to: "golden cases ['model_tiny_logits'] are registered
by zerokl.kernels.model: import it first").
"""
import os
import subprocess
import sys

import torch

# The CPU default backend, also on a CUDA machine: the answer is compared with this process's.
ENV = {**os.environ, "ZEROKL_BACKEND": "torch"}


def _fresh(program: str) -> str:
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=ENV, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_the_front_door_fingerprints_on_its_first_call():
    got = _fresh("import zerokl.kernels as k; print(k.fingerprint())")
    from zerokl.kernels import fingerprint
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert got == fingerprint("torch", device)


def test_the_fingerprint_module_alone_has_the_model_case():
    got = _fresh("from zerokl.kernels.fingerprint import golden_digests; print(sorted(golden_digests()))")
    assert "'model_tiny_logits'" in got
