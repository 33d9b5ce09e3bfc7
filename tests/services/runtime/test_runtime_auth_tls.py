"""Role-based bearer-token auth (client, peer, operator), TLS and mutual TLS over real loopback gRPC."""
from __future__ import annotations

import asyncio
import datetime
import ipaddress
import pathlib

import grpc
import grpc.aio
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from echo_service import EchoClient, start_echo_server
from grpc_health.v1 import health_pb2, health_pb2_grpc

from zerokl.services.runtime import (AuthConfig, ServerOptions, ServiceServer, TlsConfig, create_channel,
                                    load_auth_config, load_auth_token)


AUTH = AuthConfig(client_token="c-s3cret", peer_token="p-s3cret", operator_token="o-s3cret")


def test_bearer_token_guards_everything_but_health() -> None:
    async def main() -> None:
        server = await start_echo_server(ServiceServer("scheduler", ServerOptions(auth=AUTH)))
        async with create_channel(server.address) as anon, \
                create_channel(server.address, token="wrong") as wrong, \
                create_channel(server.address, token="c-s3cret") as client, \
                create_channel(server.address, token="p-s3cret") as peer, \
                create_channel(server.address, token="o-s3cret") as operator:
            for ch, code, reason in ((anon, grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization"),
                                     (wrong, grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token"),
                                     # The echo methods are not client methods: internal, closed to clients.
                                     (client, grpc.StatusCode.PERMISSION_DENIED, "needs a peer or operator")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await EchoClient(ch).unary("Echo")(b"hi", timeout=5)
                assert err.value.code() is code
                assert reason in err.value.details()
                # Streaming methods are guarded too.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    [m async for m in EchoClient(ch).stream("Count")(b"3", timeout=5)]
                assert err.value.code() is code
            health = await health_pb2_grpc.HealthStub(anon).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            for good in (peer, operator):
                assert await EchoClient(good).unary("Echo")(b"hi", timeout=5) == b"hi"
                assert [m async for m in EchoClient(good).stream("Count")(b"3", timeout=5)] == [b"0", b"1", b"2"]
        await server.drain(0)
    asyncio.run(main())


def test_auth_config_refuses_shared_or_missing_peer_tokens(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="must differ"):
        AuthConfig(client_token="same", peer_token="same")
    with pytest.raises(ValueError, match="needs a peer token"):
        AuthConfig(client_token="c")
    assert not AuthConfig().enabled and AuthConfig(peer_token="p").enabled
    (tmp_path / "peer").write_text("p-file\n")
    cfg = load_auth_config(environ={"ZEROKL_AUTH_TOKEN": "c", "ZEROKL_PEER_TOKEN_FILE": str(tmp_path / "peer"),
                                    "ZEROKL_OPERATOR_TOKEN": "o"})
    assert cfg == AuthConfig("c", "p-file", "o")


def test_token_from_file_or_env(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert load_auth_token(f, environ={}) == "from-file"
    assert load_auth_token(environ={"ZEROKL_AUTH_TOKEN_FILE": str(f)}) == "from-file"
    assert load_auth_token(environ={"ZEROKL_AUTH_TOKEN": " env "}) == "env"
    assert load_auth_token(environ={}) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError):
        load_auth_token(tmp_path / "empty", environ={})


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, issuer_key: ec.EllipticCurvePrivateKey, issuer: str, key: ec.EllipticCurvePrivateKey,
          *, ca: bool, san_ip: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san_ip:
        b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
    return b.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    d = tmp_path_factory.mktemp("pki")
    ca_key, srv_key, cli_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    files = {
        "ca": _cert("zerokl-test-ca", ca_key, "zerokl-test-ca", ca_key, ca=True),
        "server": _cert("weight-store", ca_key, "zerokl-test-ca", srv_key, ca=False, san_ip=True),
        "client": _cert("trainer", ca_key, "zerokl-test-ca", cli_key, ca=False),
    }
    out = {}
    for name, cert in files.items():
        (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[name] = str(d / f"{name}.pem")
    for name, key in (("server", srv_key), ("client", cli_key)):
        (d / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
        out[f"{name}_key"] = str(d / f"{name}.key")
    return out


def test_tls_and_mutual_tls(pki: dict[str, str]) -> None:
    async def main() -> None:
        tls = await start_echo_server(ServiceServer("weight-store", ServerOptions(
            tls=TlsConfig(pki["server"], pki["server_key"]))))
        mtls = await start_echo_server(ServiceServer("weight-store", ServerOptions(
            tls=TlsConfig(pki["server"], pki["server_key"], client_ca_file=pki["ca"]))))
        trust = TlsConfig.channel_credentials(pki["ca"])
        with_cert = TlsConfig.channel_credentials(pki["ca"], pki["client"], pki["client_key"])
        async with create_channel(tls.address, credentials=trust) as ch:
            assert await EchoClient(ch).unary("Echo")(b"tls", timeout=5) == b"tls"
        async with create_channel(tls.address) as plaintext:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await EchoClient(plaintext).unary("Echo")(b"x", timeout=2)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        async with create_channel(mtls.address, credentials=trust) as no_cert:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await EchoClient(no_cert).unary("Echo")(b"x", timeout=2)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        async with create_channel(mtls.address, credentials=with_cert) as ch:
            assert await EchoClient(ch).unary("Echo")(b"mtls", timeout=5) == b"mtls"
        await tls.drain(0)
        await mtls.drain(0)
    asyncio.run(main())
