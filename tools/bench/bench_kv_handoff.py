"""The prefill -> decode KV handoff on loopback: what it adds to time-to-first-token, and who carries the bytes.

    python tools/bench/bench_kv_handoff.py [--preset tiny] [--lengths 128,256,511] [--repeats 15] [--out FILE]
                                           [--device cuda --dtype bfloat16]

Starts real services (``zerokl serve decode``, ``prefill``, ``scheduler``, one torch thread each) on
127.0.0.1 and sends Generates of one token (``max_tokens=1``, greedy) through the scheduler, side by
side in one run:

- ``local``: the scheduler knows only the decode replica, which prefills the prompt itself;
- ``handoff``: the scheduler also knows the prefill replica, so the prompt's KV (the whole prompt) and
  the first token are computed there and handed to the decode replica.

Each prompt is sent once untimed, then ``--repeats`` times timed: the repeats find the prompt in the
prefix cache (the decode replica's in ``local``, the prefill replica's in ``handoff``), so neither arm
recomputes it and the difference of their median TTFTs is what the handoff itself adds: gathering
the cached rows, the transport, the checks and the import on the decode side, and one more hop.
(Prompt compute would otherwise swamp it on a shared CPU.) Reported per prompt length: the
KV bytes of one request (from the model config: layers x tokens x (latent + rope + index_k) dims x
dtype size), median TTFT of each arm, the added TTFT (total and per prompt token), the KV bytes over
the added time (an effective MB/s, a lower bound on the transport's), and the bytes the scheduler
process received per request over TCP (the kernel's ``bytes_received`` of each of its sockets, from
``ss -tinp``: requests, answers and health polls; ``/proc/PID/io`` would not do, gRPC reads sockets
with recvmsg, which rchar does not count). With the KV relayed through the scheduler that is at
least the KV; with a direct prefill -> decode plane it is the prompt and the tokens only.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import shutil
import statistics
import subprocess
import sys
import time


from zerokl.kernels.model import ModelConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from provenance import commit  # noqa: E402


LOGS: pathlib.Path | None = None     # --logs: each service's stderr goes to LOGS/<service>.log


def _serve(service: str, *flags: str) -> tuple[subprocess.Popen, str]:
    err = open(LOGS / f"{service}.log", "a") if LOGS else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "zerokl", "serve", service, "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if " listening on " in line:
            return proc, line.split(" listening on ")[1].split()[0]
    raise RuntimeError(f"{service} exited before listening ({proc.wait()})")


def tcp_received(pid: int) -> int:
    """Bytes received so far on the open TCP sockets of process ``pid`` (``ss -tinp``)."""
    if shutil.which("ss") is None:           # no iproute2 on this machine: the byte count is not reported
        return 0
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    total, mine = 0, False
    for line in out:
        if not line.startswith((" ", "\t")):          # a socket line; its tcp_info follows on the next
            mine = f"pid={pid}," in line
        elif mine:
            total += sum(int(f.split(":")[1]) for f in line.split() if f.startswith("bytes_received:"))
    return total


def kv_bytes(config: ModelConfig, tokens: int, dtype_size: int = 4) -> int:
    per_token = config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim + config.index_head_dim)
    return per_token * tokens * dtype_size


async def _ttfts(address: str, prompts: list[tuple[int, ...]], scheduler_pid: int) -> tuple[list[float], int]:
    """TTFT of each prompt, and the TCP bytes the scheduler received meanwhile."""
    from zerokl.vocab import SamplingOptions
    from zerokl.services.inference.client import InferenceClient
    from zerokl.services.inference.types import InferenceRequest
    out = []
    async with InferenceClient(address) as client:
        # Untimed: channel setup, and the prompt's KV into the prefix cache the timed repeats read.
        warm = InferenceRequest(prompt_ids=prompts[0], options=SamplingOptions(temperature=0.0, max_tokens=1))
        await client.generate_all(warm, timeout=600)
        before = tcp_received(scheduler_pid)
        for ids in prompts:
            r = InferenceRequest(prompt_ids=ids, options=SamplingOptions(temperature=0.0, max_tokens=1,
                                                                         ignore_eos=True))
            t0 = time.perf_counter()
            async for _ in client.generate(r, timeout=600):
                out.append(time.perf_counter() - t0)
                break
        received = tcp_received(scheduler_pid) - before   # the client's socket is still open
    return out, received


def main() -> None:
    import asyncio
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--lengths", default="128,256,511", help="prompt lengths (comma-separated)")
    p.add_argument("--repeats", type=int, default=15, help="timed requests per length and arm")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    p.add_argument("--device", default="cpu", help="the replicas' torch device: on cuda the KV goes device -> "
                   "pinned host -> wire -> pinned host -> device")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the replicas' dtype")
    p.add_argument("--logs", default=None, help="write each service's stderr to DIR/<service>.log")
    args = p.parse_args()
    global LOGS
    if args.logs:
        LOGS = pathlib.Path(args.logs)
        LOGS.mkdir(parents=True, exist_ok=True)
    config = ModelConfig.preset(args.preset)
    lengths = [int(x) for x in args.lengths.split(",")]
    model = ["--preset", args.preset, "--seed", "0", "--threads", "1", "--max-num-batched-tokens", "512",
             "--num-blocks", "256", "--device", args.device, "--dtype", args.dtype]
    dtype_size = 2 if args.dtype == "bfloat16" else 4
    procs = []
    try:
        dec, daddr = _serve("decode", *model)
        pre, paddr = _serve("prefill", *model)
        procs += [dec, pre]
        arms = {}
        for arm, flags in (("local", ["--decode", daddr]), ("handoff", ["--decode", daddr, "--prefill", paddr])):
            sched, saddr = _serve("scheduler", *flags, "--poll-interval", "0.5")
            procs.append(sched)
            time.sleep(1.0)  # one poll: the scheduler knows every replica healthy
            rng = random.Random(0)   # the same prompts in both arms
            arms[arm] = {}
            for n in lengths:
                prompts = [tuple(rng.randrange(3, config.vocab_size) for _ in range(n))] * args.repeats
                ttfts, received = asyncio.run(_ttfts(saddr, prompts, sched.pid))
                print(f"{arm} {n} tokens: median TTFT {statistics.median(ttfts) * 1e3:.1f} ms", flush=True)
                read = received / args.repeats
                arms[arm][n] = {"ttft_s": statistics.median(ttfts), "ttft_min_s": min(ttfts),
                                "scheduler_read_bytes_per_request": read}
            sched.terminate()
            sched.wait()
        rows = []
        for n in lengths:
            local, hand = arms["local"][n], arms["handoff"][n]
            kv = kv_bytes(config, n, dtype_size)       # the KV of the whole prompt
            added = hand["ttft_s"] - local["ttft_s"]
            added_min = hand["ttft_min_s"] - local["ttft_min_s"]
            rows.append({"prompt_tokens": n, "kv_bytes": kv, "ttft_local_ms": local["ttft_s"] * 1e3,
                         "ttft_handoff_ms": hand["ttft_s"] * 1e3, "added_ms": added * 1e3,
                         "ttft_local_min_ms": local["ttft_min_s"] * 1e3, "ttft_handoff_min_ms": hand["ttft_min_s"] * 1e3,
                         "added_min_ms": added_min * 1e3,
                         "effective_MB_s_min": kv / added_min / 1e6 if added_min > 0 else float("inf"),
                         "added_us_per_token": added * 1e6 / n,
                         "effective_MB_s": kv / added / 1e6 if added > 0 else float("inf"),
                         "scheduler_tcp_KB_per_request_local": local["scheduler_read_bytes_per_request"] / 1e3,
                         "scheduler_tcp_KB_per_request_handoff": hand["scheduler_read_bytes_per_request"] / 1e3})
        result = {"commit": commit(), "preset": args.preset, "device": args.device, "dtype": args.dtype,
                  "repeats": args.repeats, "rows": rows}
        print(f"commit {result['commit']}, preset {args.preset}, {args.device} {args.dtype}, {args.repeats} requests per cell, medians "
              f"(fastest in brackets)")
        print(f"{'tokens':>6} {'KV KB':>8} {'local ms':>16} {'handoff ms':>16} {'added ms':>16} {'us/token':>9} "
              f"{'MB/s':>8} {'scheduler TCP KB/req (local, handoff)':>38}")
        for r in rows:
            print(f"{r['prompt_tokens']:>6} {r['kv_bytes'] / 1e3:>8.1f} "
                  f"{r['ttft_local_ms']:>8.1f} [{r['ttft_local_min_ms']:>5.1f}] "
                  f"{r['ttft_handoff_ms']:>8.1f} [{r['ttft_handoff_min_ms']:>5.1f}] "
                  f"{r['added_ms']:>8.1f} [{r['added_min_ms']:>5.1f}] {r['added_us_per_token']:>9.1f} "
                  f"{r['effective_MB_s']:>8.1f} {r['scheduler_tcp_KB_per_request_local']:>18.1f} "
                  f"{r['scheduler_tcp_KB_per_request_handoff']:>19.1f}")
        if args.out:
            pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()


if __name__ == "__main__":
    main()
