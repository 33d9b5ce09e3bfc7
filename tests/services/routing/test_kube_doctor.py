"""``zerokl doctor --kube`` against a fake Kubernetes API on loopback and real in-process replicas.

The pods the fake API lists point at real prefill/decode servers of this
project, so each pod's fingerprint and weights version come from its own Info:
a bfloat16 replica really has another fingerprint, a seed-1 replica really
serves other weights. doctor runs as the operator would run it: the
``zerokl`` command in a subprocess, with a kubeconfig naming the fake API.
"""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sys

import torch
from conftest import CONFIG, WEIGHTS, replica_server
from kube_api_fake import FakeKubeAPI, config_map, pod
from zerokl.kernels import __version__ as numerics_version
from zerokl.kernels.model import Model

NS = "zerokl"
RELEASE = "r1"


def _labels(component: str, release: str = RELEASE) -> dict[str, str]:
    return {"app.kubernetes.io/name": "zerokl", "app.kubernetes.io/instance": release,
            "app.kubernetes.io/component": component, "zerokl.dev/numerics-version": numerics_version}


async def _doctor(kubeconfig: pathlib.Path, *flags: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "zerokl", "doctor", "--kube", "--kubeconfig", str(kubeconfig), "--release", RELEASE,
        "--timeout", "5", *flags, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_doctor_names_the_pods_whose_fingerprint_or_weights_differ(model: Model, model_seed1: Model,
                                                                   tmp_path: pathlib.Path) -> None:
    bf16 = Model(CONFIG, seed=0, dtype=torch.bfloat16)

    async def main() -> None:
        async with replica_server(model) as (d_a, _), replica_server(model) as (d_b, _), \
                replica_server(model, "prefill") as (p_a, prefill_a), \
                replica_server(bf16) as (d_bf16, bf16_replica), \
                replica_server(model_seed1, "prefill", weights="preset-tiny-seed1") as (p_seed1, _):
            with FakeKubeAPI() as api:
                kubeconfig = api.kubeconfig(tmp_path / "kubeconfig", namespace=NS)
                api.apply("configmaps", config_map("r1-zerokl", _labels("config"),
                                                   {"ZEROKL_NUMERICS_VERSION": numerics_version}))
                for name, component, server in [("r1-zerokl-decode-a", "decode", d_a),
                                                ("r1-zerokl-decode-b", "decode", d_b),
                                                ("r1-zerokl-prefill-a", "prefill", p_a)]:
                    api.apply("pods", pod(name, _labels(component), "127.0.0.1", server.port))
                # Not zerokl's to compare (MinIO), and another release's pod: both ignored.
                api.apply("pods", pod("r1-zerokl-minio-0", _labels("minio"), "127.0.0.1", 9))
                api.apply("pods", pod("r2-zerokl-decode-x", _labels("decode", "r2"), "127.0.0.1", 9))

                code, out, err = await _doctor(kubeconfig)
                assert code == 0, out + err
                assert "OK: 3 pods agree" in out
                for name in ("r1-zerokl-decode-a", "r1-zerokl-decode-b", "r1-zerokl-prefill-a"):
                    assert name in out
                assert "minio" not in out and "r2-" not in out
                assert prefill_a.identity.numerics_fingerprint in out and WEIGHTS in out

                # A rollout left a bf16 decode pod (another fingerprint) and a prefill pod on other weights;
                # one more pod is not scheduled yet.
                api.apply("pods", pod("r1-zerokl-decode-new", _labels("decode"), "127.0.0.1", d_bf16.port))
                api.apply("pods", pod("r1-zerokl-prefill-old", _labels("prefill"), "127.0.0.1", p_seed1.port))
                api.apply("pods", pod("r1-zerokl-decode-pending", _labels("decode"), "", 50052, phase="Pending"))
                code, out, err = await _doctor(kubeconfig, "--json")
                assert code == 1, out + err
                report = json.loads(out)
                status = {p["name"]: p["status"] for p in report["pods"]}
                assert report["ok"] is False and report["namespace"] == NS
                assert report["numerics_version"] == numerics_version
                majority = prefill_a.identity.numerics_fingerprint
                assert status == {
                    "r1-zerokl-decode-a": "ok", "r1-zerokl-decode-b": "ok", "r1-zerokl-prefill-a": "ok",
                    "r1-zerokl-decode-new": f"fingerprint {bf16_replica.identity.numerics_fingerprint} differs "
                                            f"from the majority's {majority}",
                    "r1-zerokl-prefill-old": f"weights preset-tiny-seed1 differs from the majority's {WEIGHTS}",
                    "r1-zerokl-decode-pending": "not running (Pending)",
                }

                # The human table names them too, and so does the last line.
                code, out, _ = await _doctor(kubeconfig, "--namespace", NS)
                assert code == 1
                fail = out.strip().splitlines()[-1]
                assert fail.startswith("FAIL: ")
                assert {"r1-zerokl-decode-new", "r1-zerokl-prefill-old", "r1-zerokl-decode-pending"} == {
                    part.split(":")[0] for part in fail.removeprefix("FAIL: ").split("; ")}
            # doctor reads pods and ConfigMaps, nothing else.
            assert {path.rsplit("/", 1)[-1] for _, path, _ in api.requests} == {"pods", "configmaps"}

    asyncio.run(main())


def test_doctor_without_pods_or_with_a_split_fleet_fails(model: Model, tmp_path: pathlib.Path) -> None:
    bf16 = Model(CONFIG, seed=0, dtype=torch.bfloat16)

    async def main() -> None:
        async with replica_server(model) as (d_a, _), replica_server(bf16) as (d_b, _):
            with FakeKubeAPI() as api:
                kubeconfig = api.kubeconfig(tmp_path / "kubeconfig", namespace=NS)
                code, _, err = await _doctor(kubeconfig)
                assert code == 2 and "has no zerokl pods" in err
                # One pod each side: no majority to side with, so both are named.
                api.apply("pods", pod("r1-zerokl-decode-a", _labels("decode"), "127.0.0.1", d_a.port))
                api.apply("pods", pod("r1-zerokl-decode-b", _labels("decode"), "127.0.0.1", d_b.port))
                code, out, _ = await _doctor(kubeconfig, "--json")
                assert code == 1
                statuses = [p["status"] for p in json.loads(out)["pods"]]
                assert len(statuses) == 2 and all(s.startswith("no majority fingerprint") for s in statuses)

    asyncio.run(main())
