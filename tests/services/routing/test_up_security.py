"""`zerokl up --auth-token ... --tls-cert/--tls-key/--tls-ca` end to end (issue 16, finding 5).

Every service of the cluster requires a token over TLS: a Generate without a
token is UNAUTHENTICATED, the client token serves it (with the usual bits),
internal RPCs (SwitchWeights, weight-store writes and Delete, SubmitJob) refuse
the client token with PERMISSION_DENIED and accept the operator token, and no
token ever appears on a child's command line. A replica that dies after the
fleet switched versions comes back at the fleet's version, not its first one.
"""
from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import grpc
import grpc.aio
import pytest
from conftest import numbers, offline
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from zerokl.kernels import __version__ as numerics_version
from zerokl.kernels import fingerprint
from zerokl.kernels.model import Model
from zerokl.services.inference import InferenceClient
from zerokl.services.inference.types import InferenceRequest
from zerokl.services.runtime import TlsConfig
from zerokl.services.jobs.types import CountdownTask, SFTJobSpec
from zerokl.services.jobs.service import JobsClient
from zerokl.services.weightstore.client import WeightStoreClient
from zerokl.vocab import SamplingOptions

CLIENT_TOKEN = "client-token-for-the-test"
IDS = tuple(range(3, 25))
OPTIONS = SamplingOptions(temperature=0.7, top_k=20, seed=3, max_tokens=8, ignore_eos=True)


def _pki(d: pathlib.Path) -> dict[str, str]:
    """A CA and a certificate for 127.0.0.1 it signed, as PEM files."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())

    def cert(subject: str, public: ec.EllipticCurvePublicKey, ca: bool) -> bytes:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        issuer = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "zerokl-test-ca")])
        b = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer).public_key(public)
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                critical=False)
        return b.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    files = {"ca": cert("zerokl-test-ca", ca_key.public_key(), True), "cert": cert("zerokl", key.public_key(), False),
             "key": key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())}
    for name, data in files.items():
        (d / f"{name}.pem").write_bytes(data)
    return {name: str(d / f"{name}.pem") for name in files}


def _wait_state(proc: subprocess.Popen, workdir: pathlib.Path, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while not (workdir / "up.json").exists():
        assert proc.poll() is None, proc.stderr.read()  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the services did not come up"
        time.sleep(0.5)
    return {s["name"]: s for s in json.loads((workdir / "up.json").read_text())["services"]}


def _status(workdir: pathlib.Path, env: dict[str, str], wait_s: float = 0.0) -> tuple[int, dict]:
    """`zerokl status --json`, waiting up to ``wait_s`` for every service to be SERVING on one version."""
    run = subprocess.run([sys.executable, "-m", "zerokl", "status", "--workdir", str(workdir), "--json",
                          "--wait", str(wait_s)], capture_output=True, text=True, timeout=60 + wait_s, env=env)
    return run.returncode, json.loads(run.stdout)


def test_zerokl_up_with_tokens_and_tls(model: Model, model_seed1: Model, tmp_path: pathlib.Path) -> None:
    pki = _pki(tmp_path)
    workdir = tmp_path / "up"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROKL_")}
    proc = subprocess.Popen([sys.executable, "-m", "zerokl", "up", "--workdir", str(workdir), "--port", "0",
                             "--preset", "tiny", "--threads", "1", "--grace", "2", "--no-trainer",
                             "--prefill-replicas", "0",
                             "--auth-token", CLIENT_TOKEN, "--tls-cert", pki["cert"], "--tls-key", pki["key"],
                             "--tls-ca", pki["ca"]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        services = _wait_state(proc, workdir)
        scheduler, store = services["scheduler"]["address"], services["weight-store"]["address"]
        operator = (workdir / "secrets" / "operator.token").read_text().strip()
        assert oct((workdir / "secrets" / "operator.token").stat().st_mode & 0o777) == "0o600"
        for s in services.values():      # tokens travel as files, never on a command line
            cmdline = pathlib.Path(f"/proc/{s['pid']}/cmdline").read_bytes().decode()
            assert CLIENT_TOKEN not in cmdline and operator not in cmdline and "--peer-token-file" in cmdline
        tls = TlsConfig.channel_credentials(pki["ca"])
        request = InferenceRequest(prompt_ids=IDS, options=OPTIONS)
        want = numbers(offline(model, IDS, OPTIONS))
        want_v2 = numbers(offline(model_seed1, IDS, OPTIONS))
        checkpoint = tmp_path / "seed1"
        model_seed1.save_pretrained(checkpoint)

        async def main() -> None:
            async with InferenceClient(scheduler, credentials=tls) as anonymous, \
                    InferenceClient(scheduler, token=CLIENT_TOKEN) as plaintext, \
                    InferenceClient(scheduler, token=CLIENT_TOKEN, credentials=tls) as client, \
                    InferenceClient(scheduler, token=operator, credentials=tls) as as_operator, \
                    WeightStoreClient(store, token=CLIENT_TOKEN, credentials=tls) as store_client, \
                    WeightStoreClient(store, token=operator, credentials=tls) as store_operator, \
                    JobsClient(scheduler, token=CLIENT_TOKEN, credentials=tls) as jobs:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await anonymous.generate_all(request, timeout=30)
                assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await plaintext.generate_all(request, timeout=5)
                assert err.value.code() is grpc.StatusCode.UNAVAILABLE       # TLS only
                assert numbers((await client.generate_all(request, timeout=60)).samples) == want
                publish = dict(numerics_version=numerics_version, numerics_fingerprint=fingerprint())
                denied = [client.switch_weights("1", timeout=30), store_client.delete("1"),
                          store_client.publish(str(checkpoint), "2", **publish),
                          jobs.submit(SFTJobSpec(1, countdown=CountdownTask(seed=0), batch_size=2))]
                for call in denied:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call
                    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED, err.value
                assert [e.manifest.version for e in await store_client.list()] == ["1"]   # reads are a client's
                await store_operator.publish(str(checkpoint), "2", **publish)
                assert (await as_operator.switch_weights("2", timeout=60)).weights_version == "2"
                assert numbers((await client.generate_all(request, timeout=60)).samples) == want_v2
        asyncio.run(main())

        # The supervisor follows the fleet to version 2; a replica that dies comes back at it.
        deadline = time.monotonic() + 30
        while json.loads((workdir / "up.json").read_text())["weights_version"] != "2":
            assert time.monotonic() < deadline, "zerokl up did not notice the fleet's new version"
            time.sleep(0.5)
        os.kill(services["decode-0"]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 90
        while (report := _status(workdir, env, wait_s=90))[0] != 0 or report[1]["services"][1]["restarts"] != 1:
            assert time.monotonic() < deadline, report
            time.sleep(0.5)
        decode = report[1]["services"][1]
        assert (decode["name"], decode["state"], decode["weights_version"]) == ("decode-0", "SERVING", "2")
        assert report[1]["weights_versions"] == ["2"]   # status lent up.json's client token and CA

        cli = [sys.executable, "-m", "zerokl"]
        # Two independent command lines, side by side (each its own process).
        gen = subprocess.Popen([*cli, "generate", "--server", scheduler, "--token", CLIENT_TOKEN, "--tls-ca", pki["ca"],
                                "--prompt-ids", ",".join(map(str, IDS)), "--temperature", "0.7", "--top-k", "20",
                                "--seed", "3", "--max-tokens", "8", "--ignore-eos", "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        no_token = subprocess.run([*cli, "generate", "--server", scheduler, "--tls-ca", pki["ca"], "--prompt-ids",
                                   "3,4,5"], capture_output=True, text=True, timeout=60, env=env)
        gen_out, gen_err = gen.communicate(timeout=60)
        assert gen.returncode == 0, gen_err
        assert json.loads(gen_out)["token_ids"] == list(want_v2[0][1])
        assert no_token.returncode == 1 and "UNAUTHENTICATED" in no_token.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()  # type: ignore[union-attr]
