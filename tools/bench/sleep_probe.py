"""Where an engine's device memory goes when it sleeps (CUDA): the allocator's live and reserved bytes before and
after `Engine.sleep`, and after a further `gc.collect()` + `empty_cache()`, for the engine and requests of
tests/services/engine/test_sleep.py at both levels.

    python tools/bench/sleep_probe.py

Measured on an H100 before sleep collected cycles (e6eb64d): level 1, reserved 52 MiB -> 48 after the sleep (20
released, live bytes 24.2 -> 4.2) -> 8 after gc.collect: the dropped decode graphs held their memory pool until the
cyclic collector freed them.
"""
import gc
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "services" / "engine"))
from test_sleep import CONFIG, _requests, _run  # noqa: E402

from zerokl.kernels.model import Model  # noqa: E402
from zerokl.services.engine.engine import Engine  # noqa: E402
from zerokl.services.engine.types import EngineConfig  # noqa: E402


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> None:
    for level in (1, 2):
        model = Model(CONFIG, seed=0, dtype=torch.bfloat16).cuda().eval()
        engine = Engine(model, EngineConfig(num_blocks=2048))
        _run(engine, _requests(4))
        torch.cuda.synchronize()
        held, live = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        released = engine.sleep(level)
        print(f"level {level}: reserved {mib(held)} (live {mib(live)}); sleep released {mib(released)}: reserved "
              f"{mib(torch.cuda.memory_reserved())} (live {mib(torch.cuda.memory_allocated())})")
        gc.collect()
        torch.cuda.empty_cache()
        print(f"  then gc.collect + empty_cache: reserved {mib(torch.cuda.memory_reserved())} "
              f"(live {mib(torch.cuda.memory_allocated())})")
        del engine, model
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
