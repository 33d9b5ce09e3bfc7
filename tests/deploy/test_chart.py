"""helm/zerokl renders with a real Helm engine, validates against Kubernetes schemas, rejects bad values.

The engine is Helm v4's Go SDK bound in-process by helm-python-sdk (its
wheel ships ``libhelm_c``); the schemas are kubernetes-validate's (shipped
in its wheel, offline). Both come with ``pip install -e ".[test]"``; a
missing one fails these tests at import, it never skips them.
"""
from __future__ import annotations

import importlib.util
import pathlib
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
import zerokl.kernels

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "zerokl"
VALUES_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
# Kubernetes minor the rendered objects are validated against (the chart's kubeVersion floor is 1.27:
# native gRPC probes are GA there); strict: unknown fields are errors.
KUBE_VERSION = "1.30"
# Kinds whose schema is a CRD's, not Kubernetes': checked by hand below.
CRD_KINDS = {"ServiceMonitor"}
ROLES = ("scheduler", "prefill", "decode", "trainer", "weight-store")


def _load_tool() -> Any:
    spec = importlib.util.spec_from_file_location("render_k8s", ROOT / "tools" / "render_k8s.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render_k8s = _load_tool()


def _render(values: dict[str, Any] | None = None) -> list[tuple[str, dict[str, Any]]]:
    return list(render_k8s.objects(render_k8s.render(values)))


def _by(objs: list[tuple[str, dict[str, Any]]], kind: str, name: str) -> dict[str, Any]:
    [obj] = [o for _, o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]["containers"][0]


def test_the_engine_is_a_real_helm() -> None:
    assert helm.helm_sdk_version().startswith("v4."), helm.helm_sdk_version()
    report = helm.lint(str(CHART), strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report.get("errors", [])
    assert not problems, problems


@pytest.mark.parametrize("values_file", [None, *VALUES_FILES], ids=lambda f: f.name if f else "defaults")
def test_every_rendered_object_validates_against_the_kubernetes_schemas(values_file: pathlib.Path | None) -> None:
    values = yaml.safe_load(values_file.read_text()) if values_file else None
    objs = _render(values)
    kinds = {o["kind"] for _, o in objs}
    assert {"ConfigMap", "Deployment", "Service", "Role", "RoleBinding", "ServiceAccount"} <= kinds, kinds
    for path, obj in objs:
        if obj["kind"] in CRD_KINDS:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1" and obj["spec"]["endpoints"], path
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:  # name the object, not only the field
            raise AssertionError(f"{path}: {obj['kind']} {obj['metadata']['name']}: {err}") from None
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == "zerokl", path
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm", path


def test_the_defaults_deploy_every_service_with_native_grpc_probes_on_its_port() -> None:
    objs = _render()
    config = _by(objs, "ConfigMap", "zerokl")
    assert config["data"]["ZEROKL_NUMERICS_VERSION"] == zerokl.kernels.__version__
    workloads = {"scheduler": ("Deployment", 50050), "prefill": ("Deployment", 50051),
                 "decode": ("Deployment", 50052), "trainer": ("StatefulSet", 50053),
                 "weight-store": ("Deployment", 50055)}
    for role, (kind, port) in workloads.items():
        obj = _by(objs, kind, f"zerokl-{role}")
        pod = obj["spec"]["template"]
        c = _container(obj)
        assert c["command"][:3] == ["zerokl", "serve", role] or c["command"][0] == "sh", (role, c["command"])
        assert {"name": "grpc", "containerPort": port, "protocol": "TCP"} in c["ports"], role
        assert c["readinessProbe"]["grpc"] == {"port": port}, role
        for probe in ("startupProbe", "livenessProbe"):
            # The scheduler's health is the fleet's (NOT_SERVING without a decode replica): restarting
            # it would not help, so only its readiness follows grpc.health.v1.
            want = {"tcpSocket": {"port": port}} if role == "scheduler" else {"grpc": {"port": port}}
            assert {k: c[probe][k] for k in want} == want and len(set(c[probe]) & {"grpc", "tcpSocket"}) == 1, \
                (role, probe)
        assert f"--port={port}" in c["args"] and "--host=0.0.0.0" in c["args"], role
        assert pod["metadata"]["labels"]["zerokl.dev/numerics-version"] == zerokl.kernels.__version__
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9400"
        # Only the scheduler reads the Kubernetes API.
        assert pod["spec"].get("automountServiceAccountToken", True) is (role == "scheduler"), role
    sched = _container(_by(objs, "Deployment", "zerokl-scheduler"))
    assert "--kube-decode-service=zerokl-decode" in sched["args"]
    assert "--kube-prefill-service=zerokl-prefill" in sched["args"]
    assert "--trainer=zerokl-trainer:50053" in sched["args"]   # the Jobs API
    assert "--weight-store=$(ZEROKL_WEIGHT_STORE)" in sched["args"]  # jobs: store outages, rejected versions
    for role in ("prefill", "decode"):                         # SwitchWeights fetches from the store
        assert "--weight-store=$(ZEROKL_WEIGHT_STORE)" in _container(_by(objs, "Deployment", f"zerokl-{role}"))["args"]
    assert config["data"]["ZEROKL_WEIGHT_STORE"] == "zerokl-weight-store:50055"
    for role in ("prefill", "decode"):
        svc = _by(objs, "Service", f"zerokl-{role}")
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["ports"][0]["name"] == "grpc"
    trainer = _container(_by(objs, "StatefulSet", "zerokl-trainer"))
    assert "--init=preset:tiny:seed0" in trainer["args"]   # the replicas' weights: rollouts are on-policy


def test_the_tinker_endpoint_drives_the_trainer_and_sampler_replicas_of_its_own() -> None:
    objs = _render({"tinker": {"samplers": {"replicas": 2}}})
    tinker = _by(objs, "Deployment", "zerokl-tinker")
    assert tinker["spec"]["replicas"] == 1 and tinker["spec"]["strategy"] == {"type": "Recreate"}
    c = _container(tinker)
    assert c["command"] == ["zerokl", "serve", "tinker"]
    assert "--trainer=zerokl-trainer:50053" in c["args"]
    assert ("--sampler=zerokl-tinker-sampler-0.zerokl-tinker-sampler:50052,"
            "zerokl-tinker-sampler-1.zerokl-tinker-sampler:50052") in c["args"]
    # A preset fleet: the replicas' version, published into the store by the endpoint when absent.
    assert {"--base-model=preset:tiny:seed0", "--dtype=float32", "--model-name=zerokl/tiny",
            "--model-name=tiny", "--http-port=8000", "--port=50056"} <= set(c["args"])
    assert c["readinessProbe"]["grpc"] == {"port": 50056}
    assert {p["name"]: p["port"] for p in _by(objs, "Service", "zerokl-tinker")["spec"]["ports"]} == {
        "http": 8000, "grpc": 50056, "metrics": 9400}
    samplers = _by(objs, "StatefulSet", "zerokl-tinker-sampler")
    assert samplers["spec"]["serviceName"] == "zerokl-tinker-sampler" and samplers["spec"]["replicas"] == 2
    assert _container(samplers)["command"] == ["zerokl", "serve", "decode"]
    assert _by(objs, "Service", "zerokl-tinker-sampler")["spec"]["clusterIP"] == "None"
    # The scheduler's fleet is the decode Service's pods: the samplers are not among them.
    assert _by(objs, "Service", "zerokl-decode")["spec"]["selector"]["app.kubernetes.io/component"] == "decode"
    stored = _container(_by(_render({"model": {"source": "weightStore", "weightsVersion": "step-9"}}),
                            "Deployment", "zerokl-tinker"))
    assert "--base-model=step-9" in stored["args"] and not any(a.startswith("--model-name") for a in stored["args"])
    off = _render({"tinker": {"enabled": False}})
    assert not [o for _, o in off if "tinker" in o["metadata"]["name"]]
    trainer_policy = _by(off, "NetworkPolicy", "zerokl-trainer")
    assert _ingress_components(trainer_policy) == {"scheduler", "operator"}


def test_the_scheduler_gets_read_only_endpointslice_access_and_nothing_more() -> None:
    objs = _render()
    role = _by(objs, "Role", "zerokl-scheduler")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = _by(objs, "RoleBinding", "zerokl-scheduler")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "zerokl", "namespace": "zerokl"}]
    sched = _by(objs, "Deployment", "zerokl-scheduler")["spec"]["template"]["spec"]
    assert sched["serviceAccountName"] == "zerokl"
    assert [o["kind"] for _, o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding")] == []


def _peer_name(peer: dict[str, Any]) -> str:
    labels = peer.get("podSelector", {}).get("matchLabels", {})
    if "zerokl.dev/operator" in labels:
        return "operator"
    return labels.get("app.kubernetes.io/component", "*")


def _ingress_components(policy: dict[str, Any]) -> set[str]:
    grpc_rule = policy["spec"]["ingress"][0]
    return {_peer_name(peer) for peer in grpc_rule["from"] if "podSelector" in peer}


def test_network_policies_follow_the_services_traffic() -> None:
    objs = _render()
    policies = {o["metadata"]["name"].removeprefix("zerokl-"): o for _, o in objs if o["kind"] == "NetworkPolicy"}
    assert set(policies) == {*ROLES, "minio", "tinker", "tinker-sampler"}
    # Only the scheduler reaches the trainer and decode, and prefill besides the decode replicas that read
    # its KV (the KV plane goes prefill -> decode directly); the weight store takes the trainer's
    # publishes, the replicas' fetches (start-up and SwitchWeights) and the scheduler's job calls (is it up;
    # delete a version that failed its canary).
    # Operators' pods (zerokl doctor) may read every pod's Info.
    # The Tinker endpoint drives the trainer and its own sampler replicas (decode replicas outside the fleet).
    assert _ingress_components(policies["trainer"]) == {"scheduler", "tinker", "operator"}
    assert _ingress_components(policies["prefill"]) == {"scheduler", "decode", "operator"}
    assert _ingress_components(policies["decode"]) == {"scheduler", "operator"}
    assert _ingress_components(policies["tinker-sampler"]) == {"tinker", "operator"}
    assert _ingress_components(policies["weight-store"]) == {"trainer", "prefill", "decode", "scheduler", "tinker",
                                                             "tinker-sampler", "operator"}
    assert _ingress_components(policies["minio"]) == {"weight-store"}
    # Clients (any pod of the namespace by default) and the helm test pod reach the scheduler; clients the
    # Tinker endpoint's REST port (operators its gRPC health).
    assert _ingress_components(policies["scheduler"]) == {"*", "test", "operator"}
    tinker_ingress = policies["tinker"]["spec"]["ingress"]
    assert tinker_ingress[0]["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert {_peer_name(p) for p in tinker_ingress[0]["from"]} == {"*", "operator"}
    assert tinker_ingress[1]["ports"] == [{"port": 50056, "protocol": "TCP"}]

    def egress_to(role: str) -> set[str]:
        return {_peer_name(peer) for rule in policies[role]["spec"]["egress"] for peer in rule.get("to", [])
                if "podSelector" in peer}

    assert egress_to("scheduler") == {"prefill", "decode", "trainer", "weight-store"}
    assert egress_to("tinker") == {"trainer", "weight-store", "tinker-sampler"}
    assert egress_to("prefill") == egress_to("trainer") == egress_to("tinker-sampler") == {"weight-store"}
    assert egress_to("decode") == {"prefill", "weight-store"}
    assert egress_to("weight-store") == {"minio"}
    # The scheduler may reach the API server (discovery); nobody else gets a port-only rule.
    sched_egress = policies["scheduler"]["spec"]["egress"]
    assert {"ports": [{"port": 443, "protocol": "TCP"}, {"port": 6443, "protocol": "TCP"}]} in sched_egress
    for role in ("prefill", "decode", "trainer", "weight-store"):
        assert all("to" in rule for rule in policies[role]["spec"]["egress"]), role

    # Jaeger: every pod may send it spans.
    traced = {o["metadata"]["name"].removeprefix("zerokl-"): o for _, o in _render(
        {"tracing": {"jaeger": {"enabled": True}}}) if o["kind"] == "NetworkPolicy"}
    for role in ROLES:
        to = [peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
              for rule in traced[role]["spec"]["egress"] for peer in rule.get("to", []) if "podSelector" in peer]
        assert "jaeger" in to, role
    otlp = _render({"tracing": {"otlpEndpoint": "http://collector.observability:4317"}})
    env = {e["name"]: e.get("value") for e in _container(_by(otlp, "Deployment", "zerokl-decode"))["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector.observability:4317"
    assert env["OTEL_EXPORTER_OTLP_INSECURE"] == "true"


def test_minio_credentials_come_from_a_secret_never_from_values() -> None:
    objs = _render()
    secret = _by(objs, "Secret", "zerokl-minio")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert set(secret["data"]) == {"rootUser", "rootPassword"}
    again = _by(_render(), "Secret", "zerokl-minio")
    assert again["data"]["rootPassword"] != secret["data"]["rootPassword"]   # generated, not a constant
    store = _container(_by(objs, "Deployment", "zerokl-weight-store"))
    env = {e["name"]: e for e in store["env"]}
    assert env["ZEROKL_S3_SECRET_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "zerokl-minio", "key": "rootPassword"}
    assert "--s3-endpoint=zerokl-minio:9000" in store["args"] and "--s3-bucket=zerokl-weights" in store["args"]
    own = _render({"minio": {"existingSecret": "my-minio"}})
    assert not [o for _, o in own if o["kind"] == "Secret" and o["metadata"]["name"] == "zerokl-minio"]
    minio = _container(_by(own, "StatefulSet", "zerokl-minio"))
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in minio["env"]} == {"my-minio"}


def test_tensor_parallel_sets_gpus_and_the_torch_distributed_environment() -> None:
    objs = _render({"decode": {"tensorParallel": 2}, "prefill": {"gpus": 1}})
    decode = _container(_by(objs, "Deployment", "zerokl-decode"))
    env = {e["name"]: e.get("value") for e in decode["env"]}
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["MASTER_ADDR"], env["ZEROKL_TENSOR_PARALLEL"]) == (
        "2", "2", "localhost", "2")
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert {"name": "dshm", "mountPath": "/dev/shm"} in decode["volumeMounts"]
    prefill = _container(_by(objs, "Deployment", "zerokl-prefill"))
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in _container(_by(_render(), "Deployment", "zerokl-decode"))["resources"]["limits"]
    assert "--tp=2" in decode["args"] and not any(a.startswith("--tp") for a in prefill["args"])
    notes = render_k8s.render({"decode": {"tensorParallel": 2}})["zerokl/templates/NOTES.txt"]
    assert "decode runs with --tp=2" in notes
    trainer_notes = render_k8s.render({"trainer": {"tensorParallel": 2}})["zerokl/templates/NOTES.txt"]
    assert "trainer runs with --dp=1 --tp=2 --ep=1: 2 ranks" in trainer_notes
    assert "trainer runs with" not in render_k8s.render()["zerokl/templates/NOTES.txt"]


def test_the_trainer_gets_its_parallel_flags_and_one_gpu_per_rank() -> None:
    objs = _render({"trainer": {"dataParallel": 4, "tensorParallel": 2, "expertParallel": 2}})
    trainer = _container(_by(objs, "StatefulSet", "zerokl-trainer"))
    assert {"--dp=4", "--tp=2", "--ep=2"} <= set(trainer["args"])
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {"name": "dshm", "mountPath": "/dev/shm"} in trainer["volumeMounts"]
    plain = _container(_by(_render(), "StatefulSet", "zerokl-trainer"))
    assert not any(a.startswith(("--dp", "--tp", "--ep")) for a in plain["args"])
    assert "nvidia.com/gpu" not in plain["resources"]["limits"]


_TOKEN_ENV = {"ZEROKL_AUTH_TOKEN": "client-token", "ZEROKL_PEER_TOKEN": "peer-token",
              "ZEROKL_OPERATOR_TOKEN": "operator-token"}


def _token_refs(container: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.get("env", []) if e["name"] in _TOKEN_ENV}


def test_auth_is_on_by_default_with_generated_tokens_for_each_role() -> None:
    objs = _render()
    secret = _by(objs, "Secret", "zerokl-auth")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert set(secret["data"]) == {"client-token", "peer-token", "operator-token"}
    assert len(set(secret["data"].values())) == 3                                   # three different tokens
    assert _by(_render(), "Secret", "zerokl-auth")["data"] != secret["data"]        # random, not constants
    ours = [o for _, o in objs if o["kind"] in ("Deployment", "StatefulSet")
            and o["metadata"]["labels"]["app.kubernetes.io/component"] != "minio"]
    assert len(ours) >= 5
    for obj in ours:    # every service knows all three tokens (it must tell the roles apart)
        assert _token_refs(_container(obj)) == {env: {"name": "zerokl-auth", "key": key}
                                                 for env, key in _TOKEN_ENV.items()}, obj["metadata"]["name"]
    [hook] = [o for _, o in objs if o["kind"] == "Pod"]
    assert _token_refs(hook["spec"]["containers"][0]) == {"ZEROKL_AUTH_TOKEN": {"name": "zerokl-auth",
                                                                                "key": "client-token"}}
    own = _render({"auth": {"existingSecret": "my-tokens"}})
    assert not [o for _, o in own if o["kind"] == "Secret" and o["metadata"]["name"] == "zerokl-auth"]
    decode = _container(_by(own, "Deployment", "zerokl-decode"))
    assert {r["name"] for r in _token_refs(decode).values()} == {"my-tokens"}
    off = _render({"auth": {"enabled": False}})
    assert not [o for _, o in off if o["kind"] == "Secret" and o["metadata"]["name"] == "zerokl-auth"]
    assert not _token_refs(_container(_by(off, "Deployment", "zerokl-decode")))


BAD_VALUES = [
    ({"decode": {"replicas": 0}}, "/decode/replicas"),
    ({"prefill": {"tensorParallel": 3}}, "/prefill/tensorParallel"),
    ({"prefill": {"gpus": -1}}, "/prefill/gpus"),
    ({"minio": {"rootPassword": "hunter2"}}, "/minio/rootPassword"),
    ({"externalS3": {"secretKey": "hunter2"}}, "secretKey"),
    ({"weightStore": {"storage": "s3"}}, "/externalS3"),
    ({"weightStore": {"storage": "nfs"}}, "/weightStore/storage"),
    ({"weightStore": {"storage": "pvc", "replicas": 2}}, "/weightStore/replicas"),
    ({"model": {"source": "huggingface"}}, "/model/source"),
    ({"model": {"dtype": "float16"}}, "/model/dtype"),
    ({"numerics": {"version": "latest"}}, "/numerics/version"),
    ({"ports": {"decode": 70000}}, "/ports/decode"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"scheduler": {"extraArgs": ["rm -rf"]}}, "/scheduler/extraArgs"),
    ({"decode": {"resources": {"limits": {"memory": "lots"}}}}, "/decode/resources"),
    ({"tracing": {"otlpEndpoint": "collector:4317"}}, "/tracing/otlpEndpoint"),
    ({"helmTest": {"promptIds": "5, six"}}, "/helmTest/promptIds"),
    ({"decode": {"replica": 2}}, "replica"),
    ({"typo": True}, "typo"),
    ({"auth": {"token": "hunter2"}}, "token"),
]


@pytest.mark.parametrize(("values", "where"), BAD_VALUES, ids=[w for _, w in BAD_VALUES])
def test_values_schema_rejects_bad_values(values: dict[str, Any], where: str) -> None:
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmValuesError, match=where.replace("/", ".")):
            chart.validate_schema(values)
        with pytest.raises(helm.HelmValuesError):   # helm install/template refuse them too
            chart.render(values, name="zerokl", namespace="zerokl")


def test_the_ci_values_files_and_the_defaults_pass_the_schema() -> None:
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema({})
        for f in VALUES_FILES:
            chart.validate_schema(yaml.safe_load(f.read_text()) or {})
    assert len(VALUES_FILES) >= 4


def test_k8s_manifests_are_current() -> None:
    want = render_k8s.plain_files()
    k8s = ROOT / "k8s"
    have = {str(f.relative_to(k8s)): f.read_text() for f in k8s.rglob("*")
            if f.is_file() and f.name not in ("minio-credentials.env", "auth-tokens.env")}
    stale = sorted(name for name in set(want) | set(have) if want.get(name) != have.get(name))
    assert not stale, f"k8s/ is not what the chart renders ({stale}); run: python tools/render_k8s.py"
    kustomization = yaml.safe_load(have["kustomization.yaml"])
    assert sorted(kustomization["resources"]) == sorted(n for n in have if n.startswith("manifests/"))
    plain = [o for name in kustomization["resources"] for o in yaml.safe_load_all(have[name]) if o]
    assert not [o for o in plain if o["kind"] == "Secret" or o["kind"] == "Pod"]  # no random creds, no test hook
    for obj in plain:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def _parsers() -> dict[str, Any]:
    from zerokl.services.inference.server import build_parser as inference_parser
    from zerokl.services.routing.server import build_parser as scheduler_parser
    from zerokl.services.trainer.server import build_parser as trainer_parser
    from zerokl.services.weightstore.server import build_parser as weightstore_parser

    from zerokl.services.tinker_api.server import build_parser as tinker_parser

    return {"prefill": inference_parser("prefill"), "decode": inference_parser("decode"),
            "scheduler": scheduler_parser(), "trainer": trainer_parser(), "weight-store": weightstore_parser(),
            "tinker": tinker_parser()}


# The service a component's pods run (the Tinker endpoint's sampler replicas are decode replicas).
_SERVES = {"tinker-sampler": "decode"}


@pytest.mark.parametrize("values_file", [None, *VALUES_FILES], ids=lambda f: f.name if f else "defaults")
def test_every_container_command_line_is_accepted_by_its_service(values_file: pathlib.Path | None) -> None:
    """The args the chart writes parse with each service's real argparse ($(VAR)s taken from the ConfigMap)."""
    import re

    values = yaml.safe_load(values_file.read_text()) if values_file else None
    objs = _render(values)
    config = next(o for _, o in objs if o["kind"] == "ConfigMap")["data"]
    parsers = _parsers()
    seen = set()
    for _, obj in objs:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        component = obj["metadata"]["labels"]["app.kubernetes.io/component"]
        component = _SERVES.get(component, component)
        if component not in parsers:
            continue  # MinIO, Jaeger: not ours
        c = _container(obj)
        env = {**config, **{e["name"]: e["value"] for e in c.get("env", []) if "value" in e}}
        args = [re.sub(r"\$\((\w+)\)", lambda m, env=env: env[m.group(1)], a) for a in c["args"]]
        if c["command"][0] == "sh":   # weights fetched by the init container: the wrapper adds these two
            assert 'zerokl serve ' + component in c["command"][2]
            args = ["--model", "/weights/model", "--weights-version", "v1", *args]
        else:
            assert c["command"] == ["zerokl", "serve", component]
        parsers[component].parse_args(args)   # SystemExit (a test error) on an unknown or bad flag
        seen.add(component)
    assert {"scheduler", "decode", "weight-store", "tinker"} <= seen
