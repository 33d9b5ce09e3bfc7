"""`zerokl up` and `zerokl serve scheduler` as a user runs them: separate processes, real ports, signals."""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import numbers, offline
from zerokl.kernels import fingerprint
from zerokl.kernels.model import Model
from zerokl.services.inference import InferenceClient
from zerokl.services.inference.types import InferenceRequest, SampleResult
from zerokl.services.routing.registry import load_static_config
from zerokl.services.routing.server import build_parser, sources_from_args
from zerokl.vocab import SamplingOptions

IDS = tuple(range(3, 25))
OPTIONS = SamplingOptions(temperature=0.7, top_k=20, seed=3, max_tokens=8, ignore_eos=True)
GENERATE = ["--prompt-ids", ",".join(map(str, IDS)), "--temperature", "0.7", "--top-k", "20", "--seed", "3",
            "--max-tokens", "8", "--ignore-eos", "--json"]


def _lines(proc: subprocess.Popen) -> queue.Queue:
    """``proc``'s stdout lines, read by a thread (None at EOF) so waiting for one can time out."""
    out: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            out.put(line)
        out.put(None)
    threading.Thread(target=read, daemon=True).start()
    return out


def _read_until(lines: queue.Queue, marker: str, timeout_s: float) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not any(marker in line for line in seen):
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        if line is None:
            raise AssertionError("the process ended early:\n" + "".join(seen))
        seen.append(line)
    return seen


def _generate(server: str | None, env: dict[str, str] | None = None) -> dict:
    """`zerokl generate --json` against ``server`` (None: the one `zerokl up`'s state names)."""
    where = ["--server", server] if server else []
    run = subprocess.run([sys.executable, "-m", "zerokl", "generate", *where, *GENERATE],
                         capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def _served(address: str) -> list[tuple]:
    """The numbers of the same request served at ``address``, asked by a client in this process: where the
    check is the service's answer, not the command line's (which `_generate` checks)."""
    async def main() -> list[tuple]:
        async with InferenceClient(address) as client:
            result = await client.generate_all(InferenceRequest(prompt_ids=IDS, options=OPTIONS), timeout=60)
        return numbers(result.samples)
    return asyncio.run(main())


def _status(workdir: pathlib.Path, wait_s: float = 0.0) -> tuple[int, dict]:
    run = subprocess.run([sys.executable, "-m", "zerokl", "status", "--workdir", str(workdir), "--json",
                          "--wait", str(wait_s)], capture_output=True, text=True, timeout=60 + wait_s)
    return run.returncode, json.loads(run.stdout)


def _wait_back(workdir: pathlib.Path, name: str, timeout_s: float = 90) -> dict:
    """`zerokl status --wait` until every service is healthy again; the row of ``name`` then."""
    code, report = _status(workdir, timeout_s)
    assert code == 0, report
    return next(r for r in report["services"] if r["name"] == name)


def _at_once(*calls: Callable[[], object]) -> list:
    """Run independent command-line calls side by side (each a process of its own); their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def _as_samples(result: dict) -> list[SampleResult]:
    return [SampleResult(s["index"], s["token_ids"], s["logprobs"], s["text"], s["finish_reason"],
                         s.get("prompt_logprobs")) for s in result["samples"]]


def test_zerokl_up_serves_through_the_scheduler_restarts_a_dead_service_and_stops_everything_on_sigterm(
        model: Model, tmp_path) -> None:
    workdir = tmp_path / "up"
    # The first restart waits 8 s: time enough to see `zerokl status` name the dead replica on a slow host.
    proc = subprocess.Popen([sys.executable, "-m", "zerokl", "up", "--workdir", str(workdir), "--port", "0",
                             "--preset", "tiny", "--threads", "1", "--grace", "2", "--decode-replicas", "2",
                             "--restart-backoff", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = _lines(proc)
    try:
        out = "".join(_read_until(lines, "zerokl generate --server", 180))
        assert "publishing the tiny preset (seed 0) as version 1" in out
        state = json.loads((workdir / "up.json").read_text())
        services = {s["name"]: s for s in state["services"]}
        trainer = ["trainer"] if "trainer" in services else []
        assert trainer or "not starting the trainer" in out
        assert list(services) == ["weight-store", "decode-0", "decode-1", *trainer, "scheduler"]
        for name, s in services.items():
            assert s["status"] == "SERVING" and f"{name} " in out and s["address"] in out
            assert (workdir / "logs" / f"{name}.log").exists()
            if name != "weight-store":
                assert (s["weights_version"], s["numerics_fingerprint"]) == ("1", fingerprint()), name

        via_scheduler = _generate(services["scheduler"]["address"])
        # Version 1 is the tiny preset, seed 0, published, fetched and loaded: the same bits as built here.
        want = numbers(offline(model, IDS, OPTIONS))
        assert numbers(_as_samples(via_scheduler)) == _served(services["decode-0"]["address"]) == want
        assert (via_scheduler["weights_version"], via_scheduler["numerics_fingerprint"]) == ("1", fingerprint())

        status, table, found = _at_once(
            lambda: subprocess.run([sys.executable, "-m", "zerokl", "status", "--workdir", str(workdir), "--json"],
                                   capture_output=True, text=True, timeout=60),
            lambda: subprocess.run([sys.executable, "-m", "zerokl", "status", "--workdir", str(workdir)],
                                   capture_output=True, text=True, timeout=60),
            # `zerokl generate` with no --server finds the `--port 0` scheduler in up.json.
            lambda: _generate(None, {**os.environ, "ZEROKL_UP_DIR": str(workdir)}))
        assert status.returncode == 0, status.stdout + status.stderr
        report = json.loads(status.stdout)
        assert report["ok"] and report["fingerprints"] == [fingerprint()] and report["weights_versions"] == ["1"]
        assert [r["health"] for r in report["services"]] == ["SERVING"] * len(services)
        assert table.returncode == 0 and f"OK: {len(services)}/{len(services)} serving" in table.stdout
        assert numbers(_as_samples(found)) == want

        # One of two decode replicas dies: Generate keeps working through the other, `zerokl status` names
        # the dead one until the supervisor has it back, and then everything is healthy again.
        os.kill(services["decode-0"]["pid"], signal.SIGKILL)
        assert _served(services["scheduler"]["address"]) == want
        code, report = _status(workdir)
        assert code == 1 and report["down"] == ["decode-0"], report
        row = next(r for r in report["services"] if r["name"] == "decode-0")
        # Named down by the supervisor's state; its probe is UNREACHABLE unless the replacement already answers
        # (a loaded host: the restart's backoff can pass before this status runs).
        assert row["state"] in ("DOWN", "RESTARTING") and row["last_exit"] == -signal.SIGKILL, row
        assert row["health"] == "UNREACHABLE" or row["state"] == "RESTARTING", row
        assert _served(services["scheduler"]["address"]) == want
        row = _wait_back(workdir, "decode-0")
        assert (row["state"], row["restarts"], row["last_exit"]) == ("SERVING", 1, -signal.SIGKILL)
        assert row["weights_version"] == "1"
        assert _served(services["decode-0"]["address"]) == want
        services = {s["name"]: s for s in json.loads((workdir / "up.json").read_text())["services"]}  # new pid

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()  # type: ignore[union-attr]
        status_after = subprocess.run([sys.executable, "-m", "zerokl", "status", "--workdir", str(workdir)],
                                      capture_output=True, text=True, timeout=60)
        assert status_after.returncode == 1
        rest = []
        while (line := lines.get(timeout=10)) is not None:
            rest.append(line)
        assert "zerokl up: stopped\n" in rest, rest
        for s in services.values():
            with pytest.raises(ProcessLookupError):
                os.kill(s["pid"], 0)
        assert not (workdir / "up.json").exists()
    finally:
        _reap(proc)

    # Again on the same workdir, the decode replica tensor-parallel (--replica-flag=--tp=2): nothing to
    # publish, version 1 is served with the same bits; a replica that dies takes its follower with it and is
    # restarted (follower and all), serving the same bits again.
    proc = subprocess.Popen([sys.executable, "-m", "zerokl", "up", "--workdir", str(workdir), "--port", "0",
                             "--preset", "tiny", "--threads", "1", "--no-trainer", "--prefill-replicas", "0",
                             "--grace", "2", "--replica-flag=--tp=2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = _lines(proc)
    try:
        out = "".join(_read_until(lines, "zerokl generate --server", 180))
        assert "publishing" not in out and "not starting the trainer (--no-trainer)" in out
        services = {s["name"]: s for s in json.loads((workdir / "up.json").read_text())["services"]}
        assert list(services) == ["weight-store", "decode-0", "scheduler"]
        assert services["scheduler"]["weights_version"] == "1"
        assert _served(services["scheduler"]["address"]) == want
        pid = services["decode-0"]["pid"]
        [follower] = map(int, pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
        os.kill(pid, signal.SIGKILL)
        row = _wait_back(workdir, "decode-0")
        assert proc.poll() is None and (row["state"], row["restarts"]) == ("SERVING", 1)
        assert _served(services["scheduler"]["address"]) == want
        again = {s["name"]: s for s in json.loads((workdir / "up.json").read_text())["services"]}
        new_pid = again["decode-0"]["pid"]
        [new_follower] = map(int, pathlib.Path(f"/proc/{new_pid}/task/{new_pid}/children").read_text().split())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        for p in [*(s["pid"] for s in services.values()), follower, new_pid, new_follower]:
            for _ in range(40):        # the follower notices its parent is gone within a second
                try:
                    os.kill(p, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.25)
            else:
                raise AssertionError(f"pid {p} still running")
    finally:
        _reap(proc)


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    proc.stdout.close()  # type: ignore[union-attr]
    proc.stderr.close()  # type: ignore[union-attr]


def test_scheduler_flags_and_replica_file(tmp_path) -> None:
    parser = build_parser()
    args = parser.parse_args(["--decode", "127.0.0.1:1,127.0.0.1:2", "--decode", "127.0.0.1:3",
                              "--prefill", "127.0.0.1:4", "--pin-weights-version", "v1"])
    [flags] = sources_from_args(args)
    assert [(e.role, e.address) for e in flags.endpoints] == [
        ("decode", "127.0.0.1:1"), ("decode", "127.0.0.1:2"), ("decode", "127.0.0.1:3"), ("prefill", "127.0.0.1:4")]

    good = tmp_path / "fleet.yaml"
    good.write_text("decode: [127.0.0.1:5, '127.0.0.1:6']\nprefill: 127.0.0.1:7\n")
    assert [(e.role, e.address) for e in load_static_config(good).endpoints] == [
        ("decode", "127.0.0.1:5"), ("decode", "127.0.0.1:6"), ("prefill", "127.0.0.1:7")]
    for text, words in (("decoder: [127.0.0.1:5]\n", "unknown keys"), ("decode: [localhost]\n", "not host:port"),
                        ("decode: [127.0.0.1:5, 127.0.0.1:5]\n", "listed twice")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(SystemExit, match=words):
            sources_from_args(parser.parse_args(["--replicas", str(bad)]))
    with pytest.raises(SystemExit, match="at least one decode replica"):
        sources_from_args(parser.parse_args([]))
    run = subprocess.run([sys.executable, "-m", "zerokl", "serve", "scheduler", "--decode", "nowhere"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "not host:port" in run.stderr


def test_zerokl_serve_scheduler_runs_without_torch() -> None:
    """The scheduler routes, serves the Jobs API and drives the trainer over gRPC, and runs no kernel: from its
    start through serving to its stop it imports neither torch nor the numerics library (~3 s of CPU saved on
    each start; a job's logprobs would be the first tensors it made)."""
    program = ("import sys; from zerokl.cli import main; "
               "rc = main(['serve', 'scheduler', '--decode', '127.0.0.1:1', '--trainer', '127.0.0.1:1', "
               "'--weight-store', '127.0.0.1:1', '--port', '0', '--grace', '0']); "
               "print(rc, 'torch' in sys.modules, 'zerokl.kernels' in sys.modules)")
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        listening = proc.stdout.readline()
        assert "scheduler listening on" in listening
        # An answer comes from its event loop, so after the signal handlers (installed right after the line).
        with grpc.insecure_channel(listening.split()[3]) as channel:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=60)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    rc, torch_loaded, kernels_loaded = out.split()
    assert rc == "0", err
    assert (torch_loaded, kernels_loaded) == ("False", "False"), err
