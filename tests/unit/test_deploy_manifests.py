"""deploy/ checked offline: Kubernetes manifests against the Kubernetes schemas
(kubernetes-validate --strict), the KEDA ScaledObject against deploy/k8s/keda-scaledobject.schema.json,
and the compose file, the Dockerfile and the systemd unit against what exists: the image, the real
CLI parser's subcommands and flags, the ports each process listens on, and files in the repo."""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from stratus.cli import build_parser
from stratus.serving import Health

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SCHEMA = K8S / "keda-scaledobject.schema.json"
# A version kubernetes-validate bundles; old enough for any supported cluster.
K8S_VERSION = "1.29.0"
# Custom resources: no schema in kubernetes-validate; checked below on their own.
CRD_KINDS = {"ScaledObject", "ServiceMonitor"}
STRATUS_IMAGE = "stratus"
Doc = dict[str, Any]


# -- helpers ------------------------------------------------------------------------------


def load_all(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def k8s_documents() -> list[tuple[Path, Doc]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs.extend((path, doc) for doc in load_all(path))
    return docs


def doc_id(item: tuple[Path, Doc]) -> str:
    path, doc = item
    return f"{path.name}:{doc['kind']}/{doc['metadata']['name']}"


DOCS = k8s_documents()
BUILTIN = [item for item in DOCS if item[1]["kind"] not in CRD_KINDS]


def of_kind(kind: str) -> list[Doc]:
    return [doc for _, doc in DOCS if doc["kind"] == kind]


def parse(argv: list[str]) -> argparse.Namespace:
    """``stratus ARGV`` through the real parser; a wrong subcommand or flag fails the test, and
    so does an abbreviated flag (argparse would take ``--metric`` for ``--metrics``)."""
    parser = build_parser()
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"`stratus {shlex.join(argv)}` does not parse: {stderr.getvalue().strip()}")
    command = parser
    for token in argv:
        subcommands = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
        if token.startswith("-") or not subcommands:
            break
        command = subcommands[0].choices[token]
    flags = {flag for action in command._actions for flag in action.option_strings}
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and flag not in flags:
            pytest.fail(f"`stratus {shlex.join(argv)}` does not parse: {flag} is not a flag of its own")
    return args


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    assert host and port.isdigit(), f"{address!r} is not HOST:PORT"
    return host, int(port)


def listening(args: argparse.Namespace) -> dict[str, tuple[str, int]]:
    """Where a parsed ``stratus`` server listens: gRPC (--listen or an agent's --serve), metrics."""
    found = {}
    grpc_address = getattr(args, "listen", None) or getattr(args, "serve", None)
    if grpc_address:
        found["grpc"] = split_address(grpc_address)
    if args.metrics:
        found["metrics"] = split_address(args.metrics)
    return found


def router_addresses(args: argparse.Namespace) -> list[str]:
    return [a.strip() for a in args.router.split(",") if a.strip()]


# -- Kubernetes: built-in kinds ---------------------------------------------------------------


def test_manifests_cover_what_the_deployment_needs() -> None:
    kinds = [doc["kind"] for _, doc in DOCS]
    for kind in (
        "Deployment",
        "DaemonSet",
        "Service",
        "ConfigMap",
        "Secret",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ScaledObject",
        "ServiceMonitor",
    ):
        assert kind in kinds, f"no {kind} in deploy/k8s"
    deployments = {d["metadata"]["name"]: d for d in of_kind("Deployment")}
    assert {"stratus-cloud", "stratus-router", "stratus-edge-agent"} <= set(deployments)
    assert deployments["stratus-router"]["spec"]["replicas"] == 2


@pytest.mark.parametrize("item", BUILTIN, ids=doc_id)
def test_builtin_kind_is_valid_kubernetes(item: tuple[Path, Doc]) -> None:
    _, doc = item
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(str(p) for p in exc.path)
        pytest.fail(f"{doc_id(item)} at {where or '(root)'}: {exc.message}")


def test_strict_validation_catches_a_misspelt_field() -> None:
    """The check above can fail: an unknown field is an error under --strict."""
    deployment = copy.deepcopy(of_kind("Deployment")[0])
    deployment["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_kustomization_lists_existing_manifests() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = kustomization["resources"]
    for name in listed:
        assert (K8S / name).is_file(), f"kustomization.yaml lists missing {name}"
    # Everything else is the documented alternative to the edge agent Deployment.
    unlisted = {p.name for p in K8S.glob("*.yaml")} - set(listed) - {"kustomization.yaml"}
    assert unlisted == {"edge-agent-daemonset.yaml"}


# -- Kubernetes: the Stratus containers ----------------------------------------------------------


def settings() -> dict[str, str]:
    (config,) = [c for c in of_kind("ConfigMap") if c["metadata"]["name"] == "stratus-settings"]
    return dict(config["data"])


def workloads() -> Iterator[tuple[Doc, Doc]]:
    """Every (workload, container) that runs the Stratus image."""
    for doc in of_kind("Deployment") + of_kind("DaemonSet"):
        for container in doc["spec"]["template"]["spec"]["containers"]:
            if container["image"].split(":")[0].rsplit("/", 1)[-1] == STRATUS_IMAGE:
                yield doc, container


def container_env(container: Doc) -> dict[str, str]:
    """What $(VAR) in args can expand to: envFrom ConfigMaps, then env (a placeholder for
    values from the downward API or a Secret)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert source["configMapRef"]["name"] == "stratus-settings"
        env.update(settings())
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", f"<{var['name'].lower()}>")
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    def one(match: re.Match[str]) -> str:
        assert match[1] in env, f"$({match[1]}) is not set in the container's env"
        return env[match[1]]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg) for arg in args]


STRATUS_CONTAINERS = list(workloads())


def container_id(item: tuple[Doc, Doc]) -> str:
    return f"{item[0]['kind']}/{item[0]['metadata']['name']}/{item[1]['name']}"


@pytest.mark.parametrize("item", STRATUS_CONTAINERS, ids=container_id)
def test_stratus_container_args_ports_and_probes(item: tuple[Doc, Doc]) -> None:
    workload, container = item
    assert "command" not in container, "the image's ENTRYPOINT is stratus: set args only"
    args = parse(expand(container["args"], container_env(container)))
    addresses = listening(args)
    assert set(addresses) == {"grpc", "metrics"}, "every Stratus container serves gRPC and /metrics"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for name, (host, port) in addresses.items():
        assert host == "0.0.0.0", f"--{name} binds {host}: unreachable from outside the pod"
        assert ports.get(name) == port, f"container port {name!r} is not {port}"
    grpc_port = addresses["grpc"][1]
    for probe in (
        "livenessProbe",
        "readinessProbe",
        *(["startupProbe"] if "startupProbe" in container else []),
    ):
        assert container[probe]["grpc"]["port"] == grpc_port, f"{probe} does not ask the gRPC port"
        # readiness follows the server's readiness (""); liveness and startup ask only whether
        # the process serves ("liveness"), so a router with no agent yet is not restarted
        wanted = "" if probe == "readinessProbe" else Health.LIVENESS
        assert container[probe]["grpc"].get("service", "") == wanted, f"{probe}: health service {wanted!r}"
    resources = container["resources"]
    for bound in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(resources[bound]), f"no cpu and memory {bound}"
    pod = workload["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    if args.command in ("router", "agent"):
        token = {v["name"]: v for v in container["env"]}["STRATUS_TOKEN"]
        assert token["valueFrom"]["secretKeyRef"]["name"] == "stratus-token"
    if args.command == "agent":
        routers = {s["metadata"]["name"]: s for s in of_kind("Service")}
        for address in router_addresses(args):
            host, port = split_address(address.removeprefix("dns:"))
            service = routers[host.split(".")[0]]
            assert port in [p["port"] for p in service["spec"]["ports"]]
            if address.startswith("dns:"):  # every router pod: only a headless Service lists them
                assert service["spec"].get("clusterIP") == "None", f"{host} is not headless"


def test_secrets_and_volumes_refer_to_objects_that_exist() -> None:
    secrets = {s["metadata"]["name"] for s in of_kind("Secret")}
    assert {"stratus-token", "stratus-tls"} <= secrets
    for doc, container in STRATUS_CONTAINERS:
        pod = doc["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] in secrets


def test_services_select_pods_with_their_target_ports() -> None:
    pods = [d["spec"]["template"] for d in of_kind("Deployment") + of_kind("DaemonSet")]
    for service in of_kind("Service"):
        selector = service["spec"]["selector"]
        chosen = [p for p in pods if selector.items() <= p["metadata"]["labels"].items()]
        assert chosen, f"Service {service['metadata']['name']} selects no pod"
        for pod in chosen:
            names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in names, f"{service['metadata']['name']}: {port['targetPort']}"


def test_router_pdb_and_hpa_target_the_router() -> None:
    (pdb,) = of_kind("PodDisruptionBudget")
    (hpa,) = of_kind("HorizontalPodAutoscaler")
    router = next(d for d in of_kind("Deployment") if d["metadata"]["name"] == "stratus-router")
    assert (
        pdb["spec"]["selector"]["matchLabels"].items()
        <= router["spec"]["template"]["metadata"]["labels"].items()
    )
    assert pdb["spec"]["minAvailable"] < router["spec"]["replicas"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "stratus-router",
    }
    assert hpa["spec"]["minReplicas"] == router["spec"]["replicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"


# -- Kubernetes: KEDA ScaledObject ---------------------------------------------------------------


@pytest.fixture(scope="module")
def keda_schema() -> Doc:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def keda_errors(schema: Doc, doc: Doc) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_scaledobject_matches_the_schema(keda_schema: Doc) -> None:
    (scaled,) = of_kind("ScaledObject")
    assert keda_errors(keda_schema, scaled) == []
    spec = scaled["spec"]
    assert spec["minReplicaCount"] <= spec["maxReplicaCount"]
    target = spec["scaleTargetRef"]["name"]
    cloud = next(d for d in of_kind("Deployment") if d["metadata"]["name"] == target)
    assert "cloud" in [c["args"][0] for c in cloud["spec"]["template"]["spec"]["containers"]]
    # Every trigger reads Stratus metrics of the cloud gateway's scrape job, which is its
    # Service's name (the ServiceMonitor's default job label).
    services = {s["metadata"]["name"] for s in of_kind("Service")}
    for trigger in spec["triggers"]:
        query = trigger["metadata"]["query"]
        assert re.search(r"\bstratus_[a-z_]+", query), query
        jobs = re.findall(r'job="([^"]+)"', query)
        assert jobs and set(jobs) <= services, query
        float(trigger["metadata"]["threshold"])


@pytest.fixture()
def scaled() -> Doc:
    return copy.deepcopy(of_kind("ScaledObject")[0])


def test_schema_rejects_an_unquoted_threshold(keda_schema: Doc, scaled: Doc) -> None:
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 5
    assert any("threshold" in e and "string" in e for e in keda_errors(keda_schema, scaled))


def test_schema_rejects_a_scaledobject_without_triggers(keda_schema: Doc, scaled: Doc) -> None:
    del scaled["spec"]["triggers"]
    assert any("'triggers' is a required property" in e for e in keda_errors(keda_schema, scaled))
    scaled["spec"]["triggers"] = []
    assert keda_errors(keda_schema, scaled)


def test_schema_rejects_a_target_without_a_name_and_a_trigger_without_metadata(
    keda_schema: Doc, scaled: Doc
) -> None:
    del scaled["spec"]["scaleTargetRef"]["name"]
    assert any("'name' is a required property" in e for e in keda_errors(keda_schema, scaled))
    scaled = copy.deepcopy(of_kind("ScaledObject")[0])
    del scaled["spec"]["triggers"][0]["metadata"]
    assert any("'metadata' is a required property" in e for e in keda_errors(keda_schema, scaled))
    scaled = copy.deepcopy(of_kind("ScaledObject")[0])
    scaled["spec"]["pollingInterval"] = "15"
    assert keda_errors(keda_schema, scaled)


# -- Kubernetes: ServiceMonitor --------------------------------------------------------------


def test_servicemonitor_scrapes_the_metrics_ports() -> None:
    (monitor,) = of_kind("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["name"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector
    endpoints = monitor["spec"]["endpoints"]
    assert endpoints and all(e.get("port") for e in endpoints)
    scraped = {
        s["metadata"]["name"]
        for s in of_kind("Service")
        if selector.items() <= s["metadata"]["labels"].items()
        and {p["name"] for p in s["spec"]["ports"]} & {e["port"] for e in endpoints}
    }
    assert {"stratus-cloud", "stratus-router", "stratus-agent"} <= scraped
    for endpoint in endpoints:
        assert endpoint.get("path", "/metrics") == "/metrics"


# -- compose ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> Doc:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def stratus_services(compose: Doc) -> dict[str, argparse.Namespace]:
    return {
        name: parse([str(a) for a in service["command"]])
        for name, service in compose["services"].items()
        if service.get("image", "").split(":")[0] == STRATUS_IMAGE
    }


def test_compose_stratus_services_build_the_deploy_image(compose: Doc) -> None:
    services = stratus_services(compose)
    assert services
    for name in services:
        service = compose["services"][name]
        build = service["build"]
        context = (DEPLOY / build["context"]).resolve()
        assert context == ROOT, f"{name}: build context {context}"
        assert (context / build["dockerfile"]) == DEPLOY / "Dockerfile"
        assert "entrypoint" not in service, f"{name}: the image's ENTRYPOINT is stratus"


def test_compose_runs_the_whole_site(compose: Doc) -> None:
    services = stratus_services(compose)
    roles = sorted((args.command, getattr(args, "tier", None) or "") for args in services.values())
    assert roles == [
        ("agent", "device"),
        ("agent", "device"),
        ("agent", "edge"),
        ("cloud", ""),
        ("router", ""),
        ("router", ""),
    ]
    routers = sorted(f"{n}:{listening(a)['grpc'][1]}" for n, a in services.items() if a.command == "router")
    for name, args in services.items():
        if args.command == "agent":
            assert sorted(router_addresses(args)) == routers, f"{name} is not linked to every router"
    assert {"prometheus", "grafana"} <= set(compose["services"])


def test_compose_addresses_and_ports_are_ones_that_listen(compose: Doc) -> None:
    services = stratus_services(compose)
    listens = {name: listening(args) for name, args in services.items()}
    for name, args in services.items():
        service = compose["services"][name]
        for kind, (host, _) in listens[name].items():
            assert host == "0.0.0.0", f"{name}: --{kind} binds {host}, unreachable from other containers"
        assert "metrics" in listens[name], f"{name} serves no /metrics"
        own = {port for _, port in listens[name].values()}
        for entry in service.get("ports", []):
            container_port = int(str(entry).rsplit(":", 1)[-1].split("/")[0])
            assert container_port in own, f"{name} publishes {entry} but listens on {sorted(own)}"
        for entry in service.get("expose", []):
            assert int(str(entry).split("/")[0]) in own, f"{name} exposes {entry}"
        targets = list(router_addresses(args)) if args.command == "agent" else []
        if args.command == "router" and args.cloud:
            targets.append(args.cloud)
        for address in targets:
            host, port = split_address(address)
            assert host in listens, f"{name}: {address} is not a Stratus service"
            assert listens[host]["grpc"][1] == port, f"{name}: {host} does not listen on {port}"


def test_compose_mounts_files_that_exist(compose: Doc) -> None:
    declared = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in declared, f"{name} mounts undeclared volume {source}"
            assert target.startswith("/")


def mount_target(compose: Doc, service: str, source: str) -> str:
    for volume in compose["services"][service]["volumes"]:
        src, target = volume.split(":")[:2]
        if src == source:
            return target
    pytest.fail(f"{service} does not mount {source}")


def test_prometheus_scrapes_every_stratus_process(compose: Doc) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert config["global"]["scrape_interval"] == "5s"
    assert config["rule_files"] == ["/etc/prometheus/rules.yml"]
    assert mount_target(compose, "prometheus", "./prometheus/rules.yml") == "/etc/prometheus/rules.yml"
    assert (
        mount_target(compose, "prometheus", "./prometheus/prometheus.yml") == "/etc/prometheus/prometheus.yml"
    )
    listens = {name: listening(args) for name, args in stratus_services(compose).items()}
    scraped = set()
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            for target in static["targets"]:
                host, port = split_address(target)
                if host == "localhost":
                    continue
                assert host in listens, f"job {job['job_name']}: {target} is not a Stratus service"
                assert listens[host]["metrics"][1] == port, f"{host} serves /metrics elsewhere"
                scraped.add(host)
    assert scraped == set(listens)


def test_grafana_provisions_the_dashboard_and_datasource(compose: Doc) -> None:
    provisioning = DEPLOY / "grafana" / "provisioning"
    dashboards = yaml.safe_load((provisioning / "dashboards" / "stratus.yaml").read_text())
    (provider,) = dashboards["providers"]
    target = mount_target(compose, "grafana", "./grafana/stratus.json")
    assert str(Path(target).parent) == provider["options"]["path"]
    for folder in ("datasources", "dashboards"):
        assert mount_target(compose, "grafana", f"./grafana/provisioning/{folder}") == (
            f"/etc/grafana/provisioning/{folder}"
        )
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "stratus.yaml").read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    host, port = split_address(datasource["url"].removeprefix("http://"))
    assert host == "prometheus" and f"{port}:{port}" in compose["services"]["prometheus"]["ports"]


def test_a_wrong_flag_is_caught() -> None:
    """The compose, Kubernetes and systemd checks parse with the real CLI: a flag it does not
    have fails them."""
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        parse(["router", "--listen-address", "0.0.0.0:8001"])
    with pytest.raises(pytest.fail.Exception, match=r"(?s)does not parse.*--tier: invalid choice: 'cloud'"):
        parse(["agent", "--tier", "cloud"])
    with pytest.raises(pytest.fail.Exception, match="--metric is not a flag"):
        parse(["cloud", "--metric", "0.0.0.0:9464"])


# -- Dockerfile ------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
        for line in lines
        if line and not line.startswith("#")
    ]


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    start = max(i for i, (op, _) in enumerate(instructions) if op == "FROM")
    return instructions[start:]


def test_dockerfile_runs_stratus_as_a_non_root_user() -> None:
    stage = final_stage()
    users = [arg for op, arg in stage if op == "USER"]
    assert users, "no USER: the container would run as root"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}
    entrypoints = [arg for op, arg in stage if op == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["stratus"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["stratus"] == "stratus.cli:main"


def test_dockerfile_copies_models_and_sources_that_exist() -> None:
    stage = final_stage()
    copies = [arg.split() for op, arg in stage if op == "COPY" and not arg.startswith("--from")]
    assert ["models", "/app/models"] in copies, "models are not baked in at /app/models"
    for op, arg in dockerfile_instructions():
        if op != "COPY" or arg.startswith("--"):
            continue
        *sources, _ = arg.split()
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such path in the repo"
            ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
            assert f"!{source.rstrip('/')}" in ignore or f"!{source.rstrip('/')}/" in ignore, (
                f"{source} is not let through Dockerfile.dockerignore"
            )


# -- systemd ---------------------------------------------------------------------------------


def unit_settings() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for raw in (DEPLOY / "systemd" / "stratus-agent.service").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        found.setdefault(key.strip(), []).append(value.strip())
    return found


def test_systemd_unit_restarts_and_runs_a_real_agent_command() -> None:
    unit = unit_settings()
    assert unit["Restart"] == ["on-failure"]
    assert unit["User"][-1] not in {"root", "0"}
    assert unit["EnvironmentFile"], "the token comes from an EnvironmentFile"
    assert unit["NoNewPrivileges"] == ["yes"]
    (exec_start,) = unit["ExecStart"]
    argv = shlex.split(exec_start.lstrip("-@:+!"))
    assert Path(argv[0]).name == "stratus"
    args = parse(argv[1:])
    assert args.command == "agent" and args.tier == "device"
    assert args.token is None, "the token belongs in the EnvironmentFile, not on the command line"
    for address in router_addresses(args):
        split_address(address)
