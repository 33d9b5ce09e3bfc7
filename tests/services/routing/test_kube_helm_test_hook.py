"""The chart's ``helm test`` hook pod, run for real: its script against a real scheduler on loopback.

The pod's command and environment are taken from the chart as Helm renders it
(helm-python-sdk), only ZEROKL_SCHEDULER is pointed at an in-process scheduler
over a real decode replica. It must pass there, and its comparison must fail
when two answers differ in a single bit of one logprob.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import pathlib
import struct
import sys
from typing import Any

from conftest import replica_server, scheduler_server
from zerokl.kernels.model import Model

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _hook_pod() -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("render_k8s", ROOT / "tools" / "render_k8s.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    [pod] = [o for _, o in tool.objects(tool.render()) if o["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    return pod


def _env(container: dict[str, Any], scheduler: str) -> dict[str, str]:
    env = {**os.environ, **{e["name"]: e["value"] for e in container["env"] if "value" in e}}
    env["ZEROKL_SCHEDULER"] = scheduler
    env["HOME"] = os.environ.get("HOME", "/tmp")
    # `python` in the script is this interpreter (the image's is the only one there).
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


async def _run(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def test_the_helm_test_pod_passes_against_a_real_scheduler_and_its_check_is_bitwise(model: Model) -> None:
    container = _hook_pod()["spec"]["containers"][0]
    argv = [*container["command"], *container.get("args", [])]
    assert argv[:2] == ["sh", "-c"]
    script = argv[2]
    checker = script.split("<<'PY'\n", 1)[1].rsplit("\nPY", 1)[0]

    async def main() -> None:
        async with replica_server(model) as (decode, _), scheduler_server([decode.address]) as (sched, scheduler):
            env = _env(container, sched.address)
            code, out = await _run(argv, env)
            assert code == 0, out
            assert f"OK: {env['MAX_TOKENS']} tokens and logprobs bitwise equal twice" in out
            assert sum(v.routed for v in scheduler.replicas()) == 2   # both Generates went through the scheduler

            # The same comparison on answers that differ in the last bit of one fp32 logprob must fail.
            sample = {"token_ids": [5, 9], "logprobs": [-1.25, -0.7071067690849304], "text": "ab",
                      "finish_reason": "length", "weights_version": "v1", "numerics_fingerprint": "f"}
            first = {**sample, "samples": [dict(sample, index=0)]}
            bits = struct.unpack("<I", struct.pack("<f", sample["logprobs"][1]))[0] ^ 1
            nudged = struct.unpack("<f", struct.pack("<I", bits))[0]
            second = json.loads(json.dumps(first))
            second["logprobs"][1] = second["samples"][0]["logprobs"][1] = nudged
            check_env = {**env, "MAX_TOKENS": "2"}
            code, out = await _run([sys.executable, "-c", checker, json.dumps(first), json.dumps(first)], check_env)
            assert code == 0, out
            code, out = await _run([sys.executable, "-c", checker, json.dumps(first), json.dumps(second)], check_env)
            assert code == 1 and "FAIL: the same Generate gave different logprobs, samples" in out, out

    asyncio.run(main())
