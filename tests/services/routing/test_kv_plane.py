"""The KV plane goes prefill -> decode directly (issue 19's done-when), through `zerokl up` on loopback.

Twenty Generates with 400-token prompts go through the scheduler of a real
`zerokl up` (tiny model, CPU, one decode and one prefill replica). The
scheduler's own byte counter (serialized size of every message it received
from replicas) stays under 64 KB per request, while the decode replica
reports having received, and the prefill replica having sent, exactly the KV
of every prompt (layers x prompt x (latent + rope + index_k) x 4 bytes).
"""
from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import time
import urllib.request

from conftest import CONFIG, numbers, offline
from prometheus_client.parser import text_string_to_metric_families
from test_scheduler_cli import _lines, _read_until, _reap

from zerokl.kernels.model import Model
from zerokl.services.inference import InferenceClient, InferenceRequest
from zerokl.vocab import SamplingOptions

REQUESTS, PROMPT_TOKENS = 20, 400
OPTIONS = SamplingOptions(temperature=0.8, seed=11, max_tokens=4, ignore_eos=True)
KV_BYTES = CONFIG.num_hidden_layers * PROMPT_TOKENS * (
    CONFIG.kv_lora_rank + CONFIG.qk_rope_head_dim + CONFIG.index_head_dim) * 4


def _metric(address: str, name: str, **labels: str) -> float:
    """The value of one sample on a service's /metrics (0 when absent)."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_the_scheduler_never_receives_kv_bytes_while_prefill_hands_them_to_decode(model: Model, tmp_path) -> None:
    workdir = tmp_path / "up"
    proc = subprocess.Popen([sys.executable, "-m", "zerokl", "up", "--workdir", str(workdir), "--port", "0",
                             "--preset", "tiny", "--threads", "1", "--grace", "2", "--no-trainer",
                             "--prefill-replicas", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = _lines(proc)
    try:
        _read_until(lines, "zerokl generate --server", 180)
        services = {s["name"]: s for s in json.loads((workdir / "up.json").read_text())["services"]}
        scheduler, decode, prefill = (services[n] for n in ("scheduler", "decode-0", "prefill-0"))
        # Every request must find the prefill replica healthy in the scheduler's registry.
        deadline = time.monotonic() + 30
        while _metric(scheduler["metrics"], "zerokl_scheduler_replicas", role="prefill", state="serving") < 1:
            assert time.monotonic() < deadline, "the scheduler never saw the prefill replica serving"
            time.sleep(0.2)
        rng = random.Random(19)
        prompts = [tuple(rng.randrange(3, CONFIG.vocab_size) for _ in range(PROMPT_TOKENS)) for _ in range(REQUESTS)]

        def counters() -> tuple[float, float, float]:
            return (_metric(scheduler["metrics"], "zerokl_scheduler_replica_bytes_total"),
                    _metric(decode["metrics"], "zerokl_kv_handoff_bytes_total", direction="received"),
                    _metric(prefill["metrics"], "zerokl_kv_handoff_bytes_total", direction="sent"))

        async def generate_all() -> list:
            async with InferenceClient(scheduler["address"]) as client:
                return await asyncio.gather(*(client.generate_all(InferenceRequest(p, options=OPTIONS), timeout=300)
                                              for p in prompts))

        before = counters()
        results = asyncio.run(generate_all())
        after = counters()
        routed, received, sent = (b - a for a, b in zip(before, after, strict=True))
        assert received == sent == REQUESTS * KV_BYTES, (received, sent, REQUESTS * KV_BYTES)
        assert 0 < routed / REQUESTS < 64 * 1024, f"the scheduler received {routed / REQUESTS:.0f} bytes per request"
        assert routed < KV_BYTES  # all twenty requests together: less than one prompt's KV
        # The handed-off KV gives the bits of a request run alone.
        assert numbers(results[0].samples) == numbers(offline(model, prompts[0], OPTIONS))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        _reap(proc)
