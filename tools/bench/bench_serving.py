"""Serving as users call it, side by side in one run: the engine in process, one decode replica called
directly over gRPC, and the scheduler of `zerokl up`, on the same weights, requests and engine settings.

    python tools/bench/bench_serving.py                                   # small, bf16, 64 and 256 streams
    python tools/bench/bench_serving.py --preset tiny --dtype float32 --streams 8 --new-tokens 16   # CPU smoke
    python tools/bench/bench_serving.py --no-startup --preset tiny --dtype float32 --threads 1 --streams 64,256 \\
        --prompt-len 16 --new-tokens 32 --alone 16         # host CPU per 1k tokens of each process, on a CPU
    python tools/bench/bench_serving.py --preset small --dtype bfloat16 --out $OUT/serving.json   # the H200 run

Every served replica runs its engine in an engine process (`zerokl serve --engine-process`, the default);
``--replica-flag=--no-engine-process`` measures the engine on a thread of the gRPC server instead.

Workload (issue 32): N requests of --prompt-len random tokens, --new-tokens generated with ignore_eos,
temperature 1, seeds 0..N-1; the requests at N=64 are the first 64 of those at N=256. Steps:

1. start-up: `zerokl up --preset P --dtype D --no-trainer` on a fresh workdir (cold: publish, fetch,
   an empty Triton cache), stopped, then again on the same workdir (warm: the store holds the
   version, kernels are compiled); each timed from the command to every service SERVING in up.json.
2. the engine in this process, loaded from the version the fleet fetched (the same bytes), stepped
   with every request added at once (``Engine.step`` until done);
3. one replica (the fleet's decode-0) and the scheduler, each sent the N requests as N concurrent
   grpc.aio Generate streams over one channel with the generated stubs;
4. every result of every arm (tokens and logprobs, exact ==) against the same request run alone in
   the in-process engine (``--alone`` caps how many are run alone; the others are still compared
   across the arms).

Each arm runs an untimed wave of other prompts first (graphs, compiles). Prefix caching is off in
every arm, so no arm finds an earlier arm's prompts cached. tok/s = generated tokens / the wave's
wall time (first request sent to last token received); TTFT from the wave's start to a request's
first token. Ratios are against the in-process engine.

Host CPU per 1,000 generated tokens, per process (``cpu_s_per_1k``: utime + stime from /proc over
the timed wave): the replica's gRPC front (``front``), its engine process (``engine_process``), the
scheduler and, for the engine arm, this process. CPU seconds hold still on a loaded box where wall
time does not, so they are the figures to compare before / after a change of the serving path on a
CPU (``--no-startup --preset tiny --dtype float32 --threads 1``); ``engine_process`` minus the
engine arm's own figure is what the engine process spends on the front (commands, packing, the pipe).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import grpc
import grpc.aio
import torch

from zerokl.kernels import device_name
from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.engine.engine import Engine
from zerokl.services.engine.types import EngineConfig, GenerateRequest
from zerokl.tokenizer import load_tokenizer
from zerokl.v1 import inference_pb2, inference_pb2_grpc
from zerokl.vocab import SamplingOptions

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from provenance import commit  # noqa: E402

Result = tuple[tuple[int, ...], tuple[float, ...]]   # one request's tokens and logprobs


@dataclass
class Wave:
    """One timed wave of one arm."""

    arm: str
    streams: int
    seconds: float
    tokens: int
    ttft: list[float]
    results: dict[int, Result] = field(repr=False)
    messages: int = 0          # gRPC messages the client received (0: the in-process engine)
    cpu_s: dict[str, float] = field(default_factory=dict)   # process -> CPU seconds over the wave

    def row(self) -> dict:
        ttft = sorted(self.ttft)
        row = {"arm": self.arm, "streams": self.streams, "tok_s": self.tokens / self.seconds,
               "seconds": self.seconds, "tokens": self.tokens, "ttft_p50_s": _pct(ttft, 50),
               "ttft_p99_s": _pct(ttft, 99)}
        if self.messages:
            # What each relay hop handles per request: a message, not a token (coalescing, --stream-interval).
            row["messages"] = self.messages
            row["tokens_per_message"] = self.tokens / self.messages
        if self.cpu_s:
            row["cpu_s_per_1k"] = {name: 1000 * cpu / self.tokens for name, cpu in self.cpu_s.items()}
        return row


def _pct(sorted_values: list[float], p: float) -> float:
    k = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def prompts(n: int, length: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(2, vocab) for _ in range(length)) for _ in range(n)]


def options(i: int, new_tokens: int) -> SamplingOptions:
    return SamplingOptions(temperature=1.0, seed=i, max_tokens=new_tokens, ignore_eos=True)


# ----------------------------------------------------------------------------- CPU accounting

def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process ``pid`` has used so far."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime, stime (fields 14, 15)


def child_pids(pid: int) -> list[int]:
    """The direct children of ``pid`` (Linux)."""
    found: list[int] = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def fleet_pids(services: dict[str, dict]) -> dict[str, int]:
    """The processes whose CPU a wave is charged: the scheduler, decode-0's gRPC front and its engine process."""
    front = services["decode-0"]["pid"]
    pids = {"scheduler": services["scheduler"]["pid"], "front": front}
    # Spawned children of the front: its engine process and multiprocessing's resource tracker. None
    # with --no-engine-process (the engine is a thread of the front).
    for pid in child_pids(front):
        if b"resource_tracker" not in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes():
            pids["engine_process"] = pid
    return pids


class CPUMeter:
    """CPU seconds of some processes over a span: ``with meter: ...``, then ``meter.used``."""

    def __init__(self, pids: dict[str, int], own: bool = False) -> None:
        self.pids, self.own = pids, own
        self.used: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        now = {name: process_cpu_s(pid) for name, pid in self.pids.items()}
        if self.own:
            now["this_process"] = time.process_time()
        return now

    def __enter__(self) -> "CPUMeter":
        self._start = self._read()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._read()
        self.used = {name: end[name] - self._start[name] for name in end}


# ----------------------------------------------------------------------------- zerokl up

def up(workdir: pathlib.Path, flags: list[str], timeout: float) -> tuple[subprocess.Popen, dict[str, dict], float]:
    """`zerokl up` on ``workdir``: the process, its services (up.json) once all SERVING, and how long that took."""
    started = time.monotonic()
    log = open(workdir.parent / f"{workdir.name}-up.log", "a")
    proc = subprocess.Popen([sys.executable, "-m", "zerokl", "up", "--workdir", str(workdir), "--port", "0",
                             "--no-trainer", *flags], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    state = workdir / "up.json"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"zerokl up exited ({proc.returncode}); see {log.name}")
        if state.exists():
            try:
                services = {s["name"]: s for s in json.loads(state.read_text())["services"]}
            except (json.JSONDecodeError, KeyError):
                services = {}
            if services and all(s["status"] == "SERVING" for s in services.values()):
                return proc, services, time.monotonic() - started
        if time.monotonic() - started > timeout:
            proc.send_signal(signal.SIGTERM)
            raise RuntimeError(f"zerokl up was not SERVING within {timeout}s; see {log.name}")
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ----------------------------------------------------------------------------- arms

def engine_wave(engine: Engine, ids: list[tuple[int, ...]], new_tokens: int) -> Wave:
    """Every request added at once, then ``Engine.step`` until all are done."""
    tokens: dict[int, list[int]] = {i: [] for i in range(len(ids))}
    logprobs: dict[int, list[float]] = {i: [] for i in range(len(ids))}
    first: dict[int, float] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(ids):
        engine.add_request(GenerateRequest(f"e{i}", p, options(i, new_tokens)))
    while engine.has_work():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            i = int(out.request_id[1:])
            if out.token_ids and i not in first:
                first[i] = now - t0
            tokens[i] += out.token_ids
            logprobs[i] += out.logprobs
    seconds = time.perf_counter() - t0
    results = {i: (tuple(tokens[i]), tuple(logprobs[i])) for i in tokens}
    return Wave("engine", len(ids), seconds, sum(len(t) for t in tokens.values()), list(first.values()), results)


def _alone_one(engine: Engine, prompt: tuple[int, ...], i: int, new_tokens: int) -> Result:
    """Request ``i`` alone in the engine."""
    engine.add_request(GenerateRequest(f"a{i}", prompt, options(i, new_tokens)))
    tokens: list[int] = []
    logprobs: list[float] = []
    while engine.has_work():
        for out in engine.step():
            tokens += out.token_ids
            logprobs += out.logprobs
    return tuple(tokens), tuple(logprobs)


async def grpc_wave(arm: str, address: str, ids: list[tuple[int, ...]], new_tokens: int) -> Wave:
    """N concurrent Generate streams over one channel."""
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        await ch.channel_ready()
        first: dict[int, float] = {}
        results: dict[int, Result] = {}
        messages = [0]
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            request = inference_pb2.GenerateRequest(
                prompt_token_ids=inference_pb2.TokenIds(ids=ids[i]),
                sampling=inference_pb2.SamplingParams(temperature=1.0, seed=i, max_tokens=new_tokens,
                                                      ignore_eos=True))
            tokens: list[int] = []
            logprobs: list[float] = []
            async for msg in stub.Generate(request):
                messages[0] += 1
                if msg.token_ids and i not in first:
                    first[i] = time.perf_counter() - t0
                tokens += msg.token_ids
                logprobs += msg.logprobs
            results[i] = (tuple(tokens), tuple(logprobs))

        await asyncio.gather(*(one(i) for i in range(len(ids))))
        seconds = time.perf_counter() - t0
    return Wave(arm, len(ids), seconds, sum(len(r[0]) for r in results.values()), list(first.values()), results,
                messages[0])


# ----------------------------------------------------------------------------- main

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--preset", default="small")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--streams", default="64,256", help="concurrent requests per wave, comma-separated")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="every arm's engine step budget")
    p.add_argument("--alone", type=int, default=64,
                   help="how many requests to run alone as the reference (default %(default)s; every arm is also "
                        "compared with the in-process engine's batch at every N)")
    p.add_argument("--replica-flag", action="append", default=[], metavar="FLAG",
                   help="an extra `zerokl serve decode` flag for the fleet's replicas, e.g. --replica-flag=--gil-switch-ms=0.1")
    p.add_argument("--startup", action=argparse.BooleanOptionalAction, default=True,
                   help="time the fleet's cold and warm start-up (two starts); --no-startup starts it once")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of every engine, the fleet's (`zerokl up --threads`) and this process's "
                        "(default: torch's choice here, `zerokl up`'s in the fleet)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--workdir", default=None, help="where the fleet lives (default: a temporary directory)")
    p.add_argument("--out", "--json", dest="json", default=None, help="write the results (JSON) here")
    args = p.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    top = max(streams)
    config = ModelConfig.preset(args.preset)
    seq_blocks = -(-(args.prompt_len + args.new_tokens) // 16)
    engine_flags = {"max_num_seqs": top, "num_blocks": top * seq_blocks + 64,
                    "max_num_batched_tokens": args.max_num_batched_tokens}
    replica_flags = [f"--replica-flag=--{k.replace('_', '-')}={v}" for k, v in engine_flags.items()]
    replica_flags += ["--replica-flag=--no-prefix-caching", *(f"--replica-flag={f}" for f in args.replica_flag)]
    fleet = ["--preset", args.preset, "--dtype", args.dtype, *replica_flags]
    if args.threads:
        fleet += ["--threads", str(args.threads)]
        torch.set_num_threads(args.threads)
    report: dict = {"date": datetime.date.today().isoformat(), "commit": commit(), "preset": args.preset,
                    "dtype": args.dtype, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                    "engine_config": engine_flags, "replica_flags": args.replica_flag, "torch": torch.__version__}

    def save() -> None:
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(report, indent=2))

    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        workdir = pathlib.Path(args.workdir) if args.workdir else pathlib.Path(tmp) / "fleet"
        workdir.mkdir(parents=True, exist_ok=True)
        env_cache = os.environ.pop("TRITON_CACHE_DIR", None)   # the fleet's own, in its workdir: cold
        proc, services, cold = up(workdir, fleet, args.startup_timeout)
        if args.startup:
            stop(proc)
            proc, services, warm = up(workdir, fleet, args.startup_timeout)
            report["startup_s"] = {"cold": cold, "warm": warm}
            print(f"zerokl up SERVING: cold {cold:.1f}s, warm {warm:.1f}s", flush=True)
        if env_cache is not None:
            os.environ["TRITON_CACHE_DIR"] = env_cache
        save()
        try:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            report["device"] = device_name()
            model = Model.from_pretrained(workdir / "models" / "1", dtype=getattr(torch, args.dtype)).to(device).eval()
            engine = Engine(model, EngineConfig(enable_prefix_caching=False, **engine_flags),
                            load_tokenizer("countdown"))
            ids = prompts(top, args.prompt_len, config.vocab_size, seed=0)
            warmup = prompts(top, args.prompt_len, config.vocab_size, seed=1)
            addresses = {"replica": services["decode-0"]["address"], "scheduler": services["scheduler"]["address"]}
            pids = fleet_pids(services)
            report["processes"] = pids
            waves: list[Wave] = []
            for n in streams:
                engine_wave(engine, warmup[:n], args.new_tokens)
                with CPUMeter(pids, own=True) as meter:
                    waves.append(engine_wave(engine, ids[:n], args.new_tokens))
                waves[-1].cpu_s = meter.used
                for arm, address in addresses.items():
                    asyncio.run(grpc_wave(arm, address, warmup[:n], args.new_tokens))
                    with CPUMeter(pids, own=True) as meter:
                        waves.append(asyncio.run(grpc_wave(arm, address, ids[:n], args.new_tokens)))
                    waves[-1].cpu_s = meter.used
                for w in waves[-3:]:
                    print(json.dumps(w.row()), flush=True)
                report["waves"] = [w.row() for w in waves]
                save()
            count = top if args.alone is None else args.alone
            t0 = time.perf_counter()
            reference = {i: _alone_one(engine, ids[i], i, args.new_tokens) for i in range(min(count, top))}
            report["alone"] = {"requests": len(reference), "seconds": time.perf_counter() - t0}
            # Exact: every arm == the request alone, and every arm == the in-process engine at that N.
            checks = {}
            for w in waves:
                base = next(b for b in waves if b.arm == "engine" and b.streams == w.streams)
                checks[f"{w.arm}@{w.streams}"] = {
                    "equal_alone": all(w.results[i] == r for i, r in reference.items() if i < w.streams),
                    "equal_engine_batch": w.results == base.results,
                    "compared_alone": sum(1 for i in reference if i < w.streams)}
            report["identical"] = checks
            report["all_identical"] = all(c["equal_alone"] and c["equal_engine_batch"] for c in checks.values())
            rows = report["waves"]
            for r in rows:
                e = next(b for b in rows if b["arm"] == "engine" and b["streams"] == r["streams"])
                r["ratio_tok_s"] = r["tok_s"] / e["tok_s"]
                r["ratio_ttft_p50"] = r["ttft_p50_s"] / e["ttft_p50_s"]
            save()
            print(table(report), flush=True)
        finally:
            stop(proc)


def table(report: dict) -> str:
    startup = report.get("startup_s")
    started = (f"zerokl up SERVING cold {startup['cold']:.1f}s, warm {startup['warm']:.1f}s; " if startup else "")
    lines = [f"{report['date']} {report.get('device', '?')} commit {report['commit']} {report['preset']} "
             f"{report['dtype']}: {started}identical (tokens, logprobs) to alone and across arms: "
             f"{report['all_identical']} ({report['alone']['requests']} alone)",
             "| arm | streams | tok/s | x engine | TTFT p50 s | x engine | TTFT p99 s | tokens/message | "
             "CPU s / 1k tokens: this process | front | engine process | scheduler |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["waves"]:
        per = f"{r['tokens_per_message']:.1f}" if "tokens_per_message" in r else "-"
        cpu = r.get("cpu_s_per_1k", {})
        cpus = " | ".join(f"{cpu[k]:.3f}" if k in cpu else "-"
                          for k in ("this_process", "front", "engine_process", "scheduler"))
        lines.append(f"| {r['arm']} | {r['streams']} | {r['tok_s']:,.0f} | {r['ratio_tok_s']:.2f} | "
                     f"{r['ttft_p50_s']:.3f} | {r['ratio_ttft_p50']:.2f} | {r['ttft_p99_s']:.3f} | {per} | {cpus} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
