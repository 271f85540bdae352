"""deploy/helm/stratus checked offline with Helm itself: helm-python-sdk binds Helm's Go SDK (v4),
so `lint` here is `helm lint` (its rules and values.schema.json) and `render` is `helm template`
(its template engine), with no helm binary and no cluster.

Each variation of the values (the defaults, LoadBalancer, NodePort, cert-manager, existing Secrets,
KEDA, the OpenAI API, everything at once, another release name) is rendered and checked as
deploy/k8s is (tests/unit/test_deploy_manifests.py, whose helpers these are): built-in kinds with
kubernetes-validate --strict, custom resources against schemas written from their projects'
documented fields, every Stratus command line against the real CLI parser, probes, mounts and
Services; and what the chart promises: routers reach every cloud pod (dns:/// and a headless
Service), share one store (the chart's NATS JetStream server, running deploy/nats/nats-server.conf
with its trust domain, which nats-server itself checks; or one of the operator's), agents outside
the cluster reach them, certificates carry the SPIFFE ids and the names dialled, and bad values
fail with a message that names them."""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import json
import platform
import re
import shlex
import shutil
import sys
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from stratus.cli import pki
from stratus.serving import auth
from tests.unit.test_deploy_manifests import (
    K8S_VERSION,
    NATS_CONFIG,
    NATS_PORT,
    STRATUS_IMAGE,
    Fleet,
    agent_name_fits,
    certs_parser,
    check_args_ports_and_probes,
    check_config_file,
    check_container_config,
    check_every_pod_behind,
    check_nats_pod,
    check_no_peer_flags,
    check_routers_dial_the_store,
    check_services_select_pods,
    config_file_text,
    container_env,
    dialled,
    documented_nats_cert_commands,
    expand,
    issued,
    nats_check,
    nats_users,
    parse,
    router_addresses,
    secret_volume_key,
    tls_paths,
)

# helm-python-sdk has wheels for these platforms only; its source needs Go and Helm's Go modules.
HELM_WHEELS = {("linux", "x86_64"), ("linux", "aarch64"), ("darwin", "arm64"), ("win32", "AMD64")}
if (sys.platform, platform.machine()) not in HELM_WHEELS:
    pytest.skip(
        f"helm-python-sdk has no wheel for this platform ({sys.platform} {platform.machine()})",
        allow_module_level=True,
    )
from tests.unit import helm_worker as helm  # noqa: E402 (after the platform check)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "stratus"
NAMESPACE = "site-a"  # not the chart's name, so a hard-coded namespace shows
Doc = dict[str, Any]
Values = dict[str, Any]

SCHEMAS = {
    "ScaledObject": (DEPLOY / "k8s" / "keda-scaledobject.schema.json", None),
    "Certificate": (DEPLOY / "k8s" / "cert-manager.schema.json", "Certificate"),
    "Issuer": (DEPLOY / "k8s" / "cert-manager.schema.json", "Issuer"),
    "PrometheusRule": (DEPLOY / "k8s" / "prometheus-operator.schema.json", "PrometheusRule"),
    "ServiceMonitor": (DEPLOY / "k8s" / "prometheus-operator.schema.json", "ServiceMonitor"),
}
OPENAI = {"enabled": True, "port": 8080, "apiKeySecret": {"name": "openai-key", "key": "api-key"}}
CERT_MANAGER = {
    "source": "certManager",
    "certManager": {"issuerRef": {"name": "fleet", "kind": "ClusterIssuer"}},
}
CERT_MANAGER_CA = {
    "source": "certManager",
    "certManager": {"caSecretName": "stratus-fleet-ca-key", "trustDomain": "factory.example"},
}
# (release name, values): each is rendered and every check below runs on it.
VARIANTS: dict[str, tuple[str, Values]] = {
    "defaults": ("stratus", {}),
    "load-balancer": (
        "stratus",
        {
            "router": {
                "service": {
                    "type": "LoadBalancer",
                    "hosts": ["routers.factory.example", "203.0.113.7"],
                    "loadBalancerSourceRanges": ["198.51.100.0/24"],
                    "perPod": {"enabled": True},
                }
            }
        },
    ),
    "node-port": (
        "stratus",
        {
            "router": {
                "autoscaling": {"enabled": False},
                "replicas": 3,
                "service": {
                    "type": "NodePort",
                    "nodePorts": {"grpc": 30801, "openai": 30880},
                    "perPod": {"enabled": True, "nodePorts": [30811, 30812, 30813]},
                },
            },
            "openai": OPENAI,
        },
    ),
    "cert-manager": ("stratus", {"tls": CERT_MANAGER}),
    "cert-manager-ca": ("stratus", {"tls": CERT_MANAGER_CA, "router": {"service": {"hosts": ["10.0.0.5"]}}}),
    "existing-secrets": (
        "stratus",
        {"tls": {"secrets": {"router": "site-router", "cloud": "site-cloud", "agent": "site-agent"}}},
    ),
    "keda": ("stratus", {"cloud": {"keda": {"enabled": True}}}),
    # the operator's own NATS server, with a credentials file from a Secret
    "external-store": (
        "stratus",
        {
            "siteState": {
                "nats": {"enabled": False},
                "url": "tls://nats.factory.example:4222",
                "credentials": {"secretName": "site-store-creds"},
            }
        },
    ),
    "openai": ("stratus", {"openai": OPENAI}),
    "everything": (
        "factory",
        {
            "clusterDomain": "cluster.example",
            "tls": CERT_MANAGER_CA,
            "openai": OPENAI,
            "tokens": {"client": {"secretName": "client-token"}, "cloud": {"secretName": "cloud-token"}},
            "models": {"volume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}},
            "router": {"service": {"type": "NodePort"}},
            "siteState": {"nats": {"persistence": {"size": "2Gi", "storageClassName": "fast"}}},
            "cloud": {"keda": {"enabled": True}},
            "edgeAgents": {"kind": "Deployment", "certificateName": "line-7"},
            "monitoring": {
                "serviceMonitor": {"enabled": True},
                "prometheusRule": {"enabled": True},
                "grafanaDashboard": {"enabled": True},
            },
        },
    ),
}


# -- rendering -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@functools.cache
def _rendered(variant: str) -> tuple[tuple[Doc, ...], str]:
    release, values = VARIANTS[variant]
    with helm.Chart.load(CHART) as loaded:
        manifests = loaded.render(copy.deepcopy(values), name=release, namespace=NAMESPACE)
    notes = "".join(text for path, text in manifests.items() if path.endswith("NOTES.txt"))
    docs = tuple(
        doc
        for path, text in sorted(manifests.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    )
    return docs, notes


class Site:
    """One rendering of the chart, with the look-ups the checks need."""

    def __init__(self, variant: str) -> None:
        self.variant = variant
        self.release, self.values = VARIANTS[variant]
        self.docs, self.notes = _rendered(variant)

    def of_kind(self, kind: str) -> list[Doc]:
        return [doc for doc in self.docs if doc["kind"] == kind]

    def named(self, kind: str, name: str) -> Doc:
        (doc,) = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        return doc

    @property
    def services(self) -> list[Doc]:
        return self.of_kind("Service")

    def workloads(self) -> list[Doc]:
        return [d for d in self.docs if d["kind"] in {"Deployment", "StatefulSet", "DaemonSet"}]

    def stratus_workloads(self) -> list[Doc]:
        """The workloads running the Stratus image (all but the store's NATS server)."""
        return [
            w
            for w in self.workloads()
            if all(
                c["image"].split(":")[0] == STRATUS_IMAGE for c in w["spec"]["template"]["spec"]["containers"]
            )
        ]

    @property
    def configs(self) -> dict[str, dict[str, str]]:
        return {c["metadata"]["name"]: dict(c["data"]) for c in self.of_kind("ConfigMap")}

    def containers(self) -> Iterator[tuple[Doc, Doc, argparse.Namespace]]:
        """Every Stratus (workload, container, parsed args): each command line through the real CLI parser."""
        configs = self.configs
        for workload in self.stratus_workloads():
            for container in workload["spec"]["template"]["spec"]["containers"]:
                args = parse(expand([str(a) for a in container["args"]], container_env(container, configs)))
                yield workload, container, args

    @property
    def own_store(self) -> bool:
        """The chart runs the site's store (siteState.nats.enabled, the default)."""
        return bool(self.values.get("siteState", {}).get("nats", {}).get("enabled", True))

    def nats(self) -> tuple[Doc, Doc]:
        """The store's StatefulSet and its one container."""
        workload = self.named("StatefulSet", f"{self.fullname}-nats")
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        return workload, container

    def role(self, command: str) -> tuple[Doc, Doc, argparse.Namespace]:
        (found,) = [item for item in self.containers() if item[2].command == command]
        return found

    @property
    def fullname(self) -> str:
        """What every object's name starts with (the chart's rule: the release, plus -stratus)."""
        return self.release if "stratus" in self.release else f"{self.release}-stratus"

    def fqdn(self, service: str) -> str:
        domain = self.values.get("clusterDomain", "cluster.local")
        return f"{service}.{NAMESPACE}.svc.{domain}"


@pytest.fixture(params=sorted(VARIANTS))
def site(request: pytest.FixtureRequest) -> Site:
    return Site(request.param)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    return Fleet(tmp_path_factory.mktemp("fleet"))


def merged(*updates: Values) -> Values:
    """Nested dicts merged left to right, as Helm merges values files."""
    out: Values = {}
    for update in updates:
        for key, value in update.items():
            out[key] = (
                merged(out[key], value)
                if isinstance(value, dict) and isinstance(out.get(key), dict)
                else value
            )
    return out


# -- Helm's own checks -------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_helm_lint_finds_no_error_or_warning(variant: str) -> None:
    """Strict lint (warnings count) with Helm's rules and values.schema.json; info (an icon is
    recommended: the project has none to point to) is allowed."""
    _, values = VARIANTS[variant]
    report = helm.lint(
        CHART, copy.deepcopy(values), strict=True, namespace=NAMESPACE, kube_version=f"v{K8S_VERSION}"
    )
    findings = [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2]
    assert not findings and not report["errors"], findings or report["errors"]


# Refused by values.schema.json: by `helm lint` and by every install or render.
SCHEMA_REFUSES: dict[str, tuple[Values, str]] = {
    "service type": (
        {"router": {"service": {"type": "Foo"}}},
        r"/router/service/type.*'ClusterIP', 'LoadBalancer', 'NodePort'",
    ),
    "misspelt key": ({"router": {"replica": 3}}, r"(?s)/router.*additional properties 'replica' not allowed"),
    "node port range": (
        {"router": {"service": {"type": "NodePort", "nodePorts": {"grpc": 8001}}}},
        r"/router/service/nodePorts/grpc.: minimum: got 8,001, want 30,000",
    ),
    "agent kind": ({"edgeAgents": {"kind": "StatefulSet"}}, r"/edgeAgents/kind.*'DaemonSet', 'Deployment'"),
    "keda threshold unquoted": (
        {"cloud": {"keda": {"demandThreshold": 600}}},
        r"/cloud/keda/demandThreshold.*string",
    ),
    "store URL with a password": (
        {"siteState": {"nats": {"enabled": False}, "url": "tls://router:secret@nats.example:4222"}},
        r"/siteState/url.*does not match",
    ),
    "store URL in plain text": (
        {"siteState": {"nats": {"enabled": False}, "url": "nats://nats.example:4222"}},
        r"/siteState/url.*does not match",
    ),
    "the removed rollout state": (
        {"router": {"rolloutState": {"persistence": {"enabled": True}}}},
        r"(?s)/router.*additional properties 'rolloutState' not allowed",
    ),
}
# Refused by the chart's checks across values (templates/_helpers.tpl, stratus.checkValues), at
# install or render; Helm's lint mode deliberately lets `fail` pass, so lint does not see them.
CHECKS_REFUSE: dict[str, tuple[Values, str]] = {
    "openai without a key": ({"openai": {"enabled": True}}, r"openai.enabled needs openai.apiKeySecret.name"),
    "cert-manager without issuer": (
        {"tls": {"source": "certManager"}},
        r"needs tls.certManager.issuerRef.name .* or tls.certManager.caSecretName",
    ),
    "node ports on ClusterIP": (
        {"router": {"service": {"nodePorts": {"grpc": 30801}}}},
        r"need router.service.type NodePort or LoadBalancer",
    ),
    "per-pod ports miscounted": (
        {"router": {"service": {"type": "NodePort", "perPod": {"enabled": True, "nodePorts": [30811]}}}},
        r"lists 1 ports for 6 router pods",
    ),
    "PDB blocks every drain": (
        {"router": {"podDisruptionBudget": {"minAvailable": 2}}},
        r"minAvailable \(2\) must be below the fewest routers \(2\)",
    ),
    "no store": (
        {"siteState": {"nats": {"enabled": False}}},
        r"the routers of a site share one store: set siteState.nats.enabled=true, or siteState.url",
    ),
    "two stores": (
        {"siteState": {"url": "tls://nats.example:4222"}},
        r"give siteState.nats.enabled .* or siteState.url .*, not both",
    ),
    "credentials for the chart's store": (
        {"siteState": {"credentials": {"secretName": "creds"}}},
        r"siteState.credentials is for siteState.url",
    ),
}


def refusal(chart: helm.Chart, values: Values) -> str:
    with pytest.raises(helm.HelmError) as caught:
        chart.render(values, name="stratus", namespace=NAMESPACE)
    return str(caught.value)


@pytest.mark.parametrize("case", sorted(SCHEMA_REFUSES))
def test_the_schema_refuses_bad_values_naming_them(chart: helm.Chart, case: str) -> None:
    values, message = SCHEMA_REFUSES[case]
    assert re.search(message, refusal(chart, values))
    report = helm.lint(CHART, values, namespace=NAMESPACE)
    assert any(re.search(message, m["error"]) for m in report["messages"] if m["severity"] == 3), report


@pytest.mark.parametrize("case", sorted(CHECKS_REFUSE))
def test_values_that_do_not_fit_together_fail_with_one_line_saying_what_to_set(
    chart: helm.Chart, case: str
) -> None:
    values, message = CHECKS_REFUSE[case]
    text = refusal(chart, values)
    assert re.search(message, text), text


def test_a_broken_template_fails_lint_and_render(tmp_path: Path) -> None:
    """The checks can fail: a template that reads a value that is not there is an error."""
    broken = tmp_path / "stratus"
    shutil.copytree(CHART, broken)  # follows files/'s links: a copy of the originals
    template = broken / "templates" / "router.yaml"
    template.write_text(
        template.read_text().replace("{{ $router.replicas }}", "{{ $router.scale.replicas }}")
    )
    report = helm.lint(broken, {"router": {"autoscaling": {"enabled": False}}})
    assert any("nil pointer evaluating interface {}.replicas" in m["error"] for m in report["messages"]), (
        report
    )
    with helm.Chart.load(broken) as loaded, pytest.raises(helm.HelmRenderError):
        loaded.render({"router": {"autoscaling": {"enabled": False}}}, name="stratus", namespace=NAMESPACE)


# -- validity of what is rendered -------------------------------------------------------------------


def test_every_object_is_namespaced_to_the_release(site: Site) -> None:
    for doc in site.docs:
        assert doc["metadata"]["namespace"] == NAMESPACE, f"{doc['kind']}/{doc['metadata']['name']}"
        assert doc["metadata"]["name"].startswith(site.fullname), doc["metadata"]["name"]


def test_builtin_kinds_are_valid_kubernetes(site: Site) -> None:
    for doc in site.docs:
        if doc["kind"] in SCHEMAS:
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.path)
            pytest.fail(
                f"{site.variant}: {doc['kind']}/{doc['metadata']['name']} at {where or '(root)'}: {exc.message}"
            )


def schema_errors(doc: Doc) -> list[str]:
    path, definition = SCHEMAS[doc["kind"]]
    schema = json.loads(path.read_text())
    if definition:
        schema = {**schema, "$ref": f"#/$defs/{definition}"}
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_custom_resources_match_their_documented_fields(site: Site) -> None:
    for doc in site.docs:
        if doc["kind"] in SCHEMAS:
            assert schema_errors(doc) == [], f"{doc['kind']}/{doc['metadata']['name']}"


def test_the_schemas_catch_what_the_projects_refuse() -> None:
    """The schemas can fail: an unknown usage, an alert with record's fields, a monitor without
    a selector."""
    docs, _ = _rendered("everything")
    certificate = copy.deepcopy(next(d for d in docs if d["kind"] == "Certificate"))
    certificate["spec"]["usages"] = ["server auth", "tls server"]
    assert any("tls server" in e for e in schema_errors(certificate))
    rule = copy.deepcopy(next(d for d in docs if d["kind"] == "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["alert"] = "Both"
    assert schema_errors(rule)
    monitor = copy.deepcopy(next(d for d in docs if d["kind"] == "ServiceMonitor"))
    del monitor["spec"]["selector"]
    assert any("'selector' is a required property" in e for e in schema_errors(monitor))


def test_the_kustomize_servicemonitor_matches_the_documented_fields() -> None:
    (monitor,) = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "servicemonitor.yaml").read_text()) if d]
    assert schema_errors(monitor) == []


# -- the Stratus containers ----------------------------------------------------------------------


def test_the_site_has_every_part(site: Site) -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in site.workloads()}
    agents = site.values.get("edgeAgents", {}).get("kind", "DaemonSet")
    assert kinds == {
        ("StatefulSet", f"{site.fullname}-router"),
        ("Deployment", f"{site.fullname}-cloud"),
        (agents, f"{site.fullname}-edge-agent"),
        *([("StatefulSet", f"{site.fullname}-nats")] if site.own_store else []),
    }
    assert sorted(args.command for _, _, args in site.containers()) == ["agent", "cloud", "router"]


def test_containers_listen_probe_and_run_unprivileged(site: Site) -> None:
    for workload, container, args in site.containers():
        check_args_ports_and_probes(workload, container, args, site.services)


def test_containers_speak_mutual_tls_with_their_roles_secret(site: Site) -> None:
    """--tls-cert, --tls-key and --tls-ca come from one read-only Secret volume: the role's own
    (cert-manager's, or the one named in tls.secrets), holding tls.crt, tls.key and ca.crt."""
    tls = site.values.get("tls", {})
    for workload, container, args in site.containers():
        pod = workload["spec"]["template"]["spec"]
        found = {secret_volume_key(pod, container, path) for path in tls_paths(args)}
        (secret,) = {name for name, _ in found}
        assert sorted(key for _, key in found) == ["ca.crt", "tls.crt", "tls.key"]
        given = "" if tls.get("source") == "certManager" else tls.get("secrets", {}).get(args.command, "")
        assert secret == (given or f"{site.fullname}-{args.command}-tls")


def test_certificates_carry_each_roles_spiffe_id_and_the_names_dialled(site: Site) -> None:
    """With cert-manager: each container's Secret is a Certificate's, whose one URI SAN is
    spiffe://<domain>/<role>/<name> (what stratus.serving.auth reads); an agent's --name fits it; the
    server certificates carry every name their clients dial and the probes' 127.0.0.1."""
    certificates = {c["spec"]["secretName"]: c for c in site.of_kind("Certificate")}
    if site.values.get("tls", {}).get("source") != "certManager":
        assert not certificates
        return
    dialled_by_role = names_dialled(site)
    for workload, container, args in site.containers():
        pod = workload["spec"]["template"]["spec"]
        (secret, _) = secret_volume_key(pod, container, tls_paths(args)[0])
        spec = certificates[secret]["spec"]
        (uri,) = spec["uris"]
        identity = auth.spiffe_identity({"peer_spiffe_id": [uri.encode()]})
        assert identity is not None, f"{uri} is not a Stratus identity"
        assert identity.role == args.command and spec["commonName"] == identity.name
        assert uri.startswith(f"spiffe://{site.values['tls']['certManager'].get('trustDomain', 'stratus')}/")
        if args.command == "agent":
            assert agent_name_fits(args.name, identity.name), (
                f"--name {args.name}, certificate {identity.name}"
            )
        assert "127.0.0.1" in spec["ipAddresses"], "the probes dial 127.0.0.1"
        names = set(spec["dnsNames"]) | set(spec["ipAddresses"])
        domain = site.values["tls"]["certManager"].get("trustDomain", "stratus")
        # the role's name clients with the fleet CA check (security2 N2), and no other role's
        assert {n for n in spec["dnsNames"] if n.endswith(".spiffe.invalid")} == {
            auth.role_server_name(args.command, domain)
        }
        assert args.tls_trust_domain == domain
        missing = dialled_by_role.get(args.command, set()) - names
        assert not missing, f"the {args.command} certificate lacks {sorted(missing)}, which clients dial"
        assert {"server auth", "client auth"} <= set(spec["usages"])
    if site.own_store:  # the store's server: no Stratus identity, the name routers dial
        nats_workload, nats_container = site.nats()
        (secret, _) = secret_volume_key(
            nats_workload["spec"]["template"]["spec"], nats_container, nats_container["env"][0]["value"]
        )
        spec = certificates[secret]["spec"]
        assert "uris" not in spec and not [n for n in spec["dnsNames"] if n.endswith(".spiffe.invalid")]
        assert store_host(site) in spec["dnsNames"] and spec["usages"] == ["digital signature", "server auth"]
    check_issuer(site, certificates.values())


def store_host(site: Site) -> str:
    """The host routers dial for the site's store (--site-state tls://HOST:PORT)."""
    _, _, router = site.role("router")
    return dialled(router.site_state.removeprefix("tls://"))[0]


def names_dialled(site: Site) -> dict[str, set[str]]:
    """The names clients dial, per server role: the cloud by the routers, the routers by agents
    (inside the cluster) and by whatever is outside (router.service.hosts)."""
    _, _, router = site.role("router")
    dialled_names: dict[str, set[str]] = {"cloud": {dialled(router.cloud)[0]}, "router": set()}
    _, _, agent = site.role("agent")
    dialled_names["router"] |= {dialled(a)[0] for a in router_addresses(agent)}
    dialled_names["router"] |= set(site.values.get("router", {}).get("service", {}).get("hosts", []))
    return dialled_names


def check_issuer(site: Site, certificates: Iterable[Doc]) -> None:
    manager = site.values["tls"]["certManager"]
    refs = {(c["spec"]["issuerRef"]["name"], c["spec"]["issuerRef"]["kind"]) for c in certificates}
    if manager.get("caSecretName"):
        (issuer,) = site.of_kind("Issuer")
        assert refs == {(issuer["metadata"]["name"], "Issuer")}
        assert issuer["spec"]["ca"]["secretName"] == manager["caSecretName"]
    else:
        assert refs == {(manager["issuerRef"]["name"], manager["issuerRef"].get("kind", "Issuer"))}
        assert not site.of_kind("Issuer")


def test_notes_make_the_existing_secrets_the_pods_mount(site: Site) -> None:
    """Without cert-manager, NOTES prints `stratus certs` commands (parsed by their own parser)
    that make each role's identity with every name dialled, and `kubectl create secret` lines for
    exactly the Secrets the pods mount."""
    if site.values.get("tls", {}).get("source") == "certManager":
        assert "stratus certs" not in site.notes
        return
    commands = [
        shlex.split(line.strip())
        for line in site.notes.splitlines()
        if line.strip().startswith("stratus certs ")
    ]
    made = issued([certs_parser().parse_args(argv[1:]) for argv in commands])
    for role, hosts in names_dialled(site).items():
        (server,) = [names for who, names in made.items() if who.role == role]
        assert hosts <= server, f"the {role} certificate lacks {sorted(hosts - server)}"
    mounted = set()
    for workload, container, args in site.containers():
        secret, _ = secret_volume_key(workload["spec"]["template"]["spec"], container, tls_paths(args)[0])
        mounted.add(secret)
        if args.command == "agent":
            (name,) = [who.name for who in made if who.role == "agent"]
            assert agent_name_fits(args.name, name)
    if site.own_store:  # the store's server: its Secret, from server-cert.sh with the name dialled
        nats_workload, nats_container = site.nats()
        secret, _ = secret_volume_key(
            nats_workload["spec"]["template"]["spec"], nats_container, nats_container["env"][0]["value"]
        )
        mounted.add(secret)
        (command,) = documented_nats_cert_commands(site.notes)
        assert store_host(site) in command.host
        assert (
            "--from-file=tls.crt=certs/nats-server.pem --from-file=tls.key=certs/nats-server.key"
            in site.notes
        )
    else:
        assert not documented_nats_cert_commands(site.notes)
    created = set(re.findall(r"kubectl -n \S+ create secret generic (\S+)", site.notes))
    assert created == mounted
    # the fleet commands NOTES prints use files those certs commands write (it said operator.pem)
    written = {f"certs/{who.stem}.{ext}" for who in made for ext in ("pem", "key")} | {"certs/ca.pem"}
    fleet_lines = "\n".join(line for line in site.notes.splitlines() if "stratus fleet" in line)
    used = re.findall(r"--tls-(?:cert|key|ca) (\S+)", fleet_lines)
    assert used and set(used) <= written, sorted(set(used) - written)
    assert f"kubectl -n {NAMESPACE} " in site.notes


def test_tokens_and_keys_are_files_from_secrets(site: Site) -> None:
    """A token or key is a file in a read-only Secret volume, never an arg's value or env."""
    for workload, container, args in site.containers():
        pod = workload["spec"]["template"]["spec"]
        for flag in ("client_token_file", "cloud_token_file", "openai_api_key_file", "site_state_creds"):
            path = getattr(args, flag, None)
            if path is not None:
                secret, key = secret_volume_key(pod, container, str(path))
                assert secret in {"openai-key", "client-token", "cloud-token", "site-store-creds"}
                assert key in {"api-key", "token", "creds"}
        assert not [v for v in container.get("env", []) if "TOKEN" in v["name"] or "KEY" in v["name"]]
        assert "--insecure" not in container["args"]
    tokens = site.values.get("tokens", {})
    _, _, router = site.role("router")
    _, _, cloud = site.role("cloud")
    assert (router.cloud_token_file is None) == (cloud.client_token_file is None) == ("cloud" not in tokens)
    assert (router.client_token_file is None) == ("client" not in tokens)


# -- routers, the cloud and agents -----------------------------------------------------------------


def test_routers_spread_their_cloud_link_over_every_cloud_pod(site: Site) -> None:
    _, _, router = site.role("router")
    cloud, _, _ = site.role("cloud")
    service = check_every_pod_behind(router.cloud, site.services, cloud)
    assert dialled(router.cloud)[0] == site.fqdn(service["metadata"]["name"])


def test_routers_share_the_site_store(site: Site) -> None:
    """Every router runs on one store (--site-state): the chart's NATS server (tls:// to its
    ClusterIP Service, a name its certificate carries, the router's certificate its identity, no
    credentials file) or siteState.url with siteState.credentials; no router keeps state of its
    own (no peer flag, no volume), and agents link to every router pod through the headless Service."""
    routers, container, args = site.role("router")
    assert routers["kind"] == "StatefulSet"
    check_no_peer_flags(f"{site.variant} router", [str(a) for a in container["args"]])
    assert not routers["spec"].get("volumeClaimTemplates"), "a router keeps state of its own"
    store = site.values.get("siteState", {})
    if site.own_store:
        nats, _ = site.nats()
        names: set[str] = set()
        if site.values.get("tls", {}).get("source") == "certManager":
            names = set(site.named("Certificate", f"{site.fullname}-nats")["spec"]["dnsNames"])
        else:
            (command,) = documented_nats_cert_commands(site.notes)
            names = set(command.host)
        check_routers_dial_the_store(args, site.services, nats, names)
        assert args.site_state == f"tls://{site.fqdn(site.fullname + '-nats')}:{NATS_PORT}"
        assert args.site_state_creds is None
    else:
        assert args.site_state == store["url"]
        assert not [w for w in site.workloads() if w["metadata"]["name"].endswith("-nats")]
        secret, key = secret_volume_key(
            routers["spec"]["template"]["spec"], container, str(args.site_state_creds)
        )
        assert (secret, key) == (store["credentials"]["secretName"], store["credentials"].get("key", "creds"))
    headless = site.named("Service", routers["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    host, port = dialled(args.site_address.replace("<pod_name>", "pod"))
    assert host == f"pod.{site.fqdn(headless['metadata']['name'])}" and port == args_port(args.listen)
    _, _, agent = site.role("agent")
    assert router_addresses(agent) == [f"dns:{site.fqdn(headless['metadata']['name'])}:{port}"]


def test_the_store_runs_the_committed_config_in_the_release_trust_domain(
    site: Site, fleet: Fleet, tmp_path: Path
) -> None:
    """The store's ConfigMap is deploy/nats/nats-server.conf with the release's trust domain in its
    router users, so the routers' certificates (cert-manager's: their Certificate's URI) are users
    there; nats-server's own check takes it; the pod runs it as deploy/k8s's does."""
    if not site.own_store:
        assert not [c for c in site.of_kind("ConfigMap") if "nats-server.conf" in c["data"]]
        return
    config, secret = check_nats_pod(*site.nats(), site.configs)
    domain = site.values.get("tls", {}).get("certManager", {}).get("trustDomain", "stratus")
    assert config == NATS_CONFIG.read_text().replace("spiffe://stratus/", f"spiffe://{domain}/")
    assert nats_users(config) == {f"spiffe://{domain}/router/router"}
    if site.values.get("tls", {}).get("source") == "certManager":
        (uri,) = site.named("Certificate", f"{site.fullname}-router")["spec"]["uris"]
        assert uri in nats_users(config), f"the routers' certificate ({uri}) is no user of the store"
    tls = site.values.get("tls", {})
    given = "" if tls.get("source") == "certManager" else tls.get("secrets", {}).get("nats", "")
    assert secret == (given or f"{site.fullname}-nats-tls")
    checked = nats_check(config, fleet, tmp_path)
    assert checked.returncode == 0, checked.stderr


def args_port(address: str) -> int:
    return int(address.rpartition(":")[2])


def test_routers_replicas_autoscaling_and_disruptions(site: Site) -> None:
    routers, _, _ = site.role("router")
    router = site.values.get("router", {})
    (pdb,) = site.of_kind("PodDisruptionBudget")
    assert (
        pdb["spec"]["selector"]["matchLabels"].items()
        <= routers["spec"]["template"]["metadata"]["labels"].items()
    )
    hpas = site.of_kind("HorizontalPodAutoscaler")
    if router.get("autoscaling", {}).get("enabled", True):
        (hpa,) = hpas
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "name": routers["metadata"]["name"],
        }
        assert "replicas" not in routers["spec"], (
            "the HPA owns the count; a replicas field would reset it on upgrade"
        )
        assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"]
    else:
        assert not hpas
        assert routers["spec"]["replicas"] == router.get("replicas", 2) > pdb["spec"]["minAvailable"]


def test_router_service_type_reaches_agents_outside(site: Site) -> None:
    """router.service.type is the router Service's; NodePort numbers are the ones given; /metrics
    is never on a Service meant for outside; per-pod Services select one router pod each."""
    service_values = site.values.get("router", {}).get("service", {})
    wanted = service_values.get("type", "ClusterIP")
    routers, _, _ = site.role("router")
    front = site.named("Service", routers["metadata"]["name"])
    assert front["spec"]["type"] == wanted
    per_pod = [s for s in site.services if "statefulset.kubernetes.io/pod-name" in s["spec"]["selector"]]
    router_labels = routers["spec"]["template"]["metadata"]["labels"]
    for service in [front, *per_pod]:
        assert "metrics" not in [p["name"] for p in service["spec"]["ports"]]
        selector = dict(service["spec"]["selector"])
        assert (
            selector.pop("statefulset.kubernetes.io/pod-name", service["metadata"]["name"])
            == (service["metadata"]["name"])
        ), "a per-pod Service selects the pod of its own name"
        assert selector.items() <= router_labels.items()
    ports = {p["name"]: p.get("nodePort") for p in front["spec"]["ports"]}
    for name, number in service_values.get("nodePorts", {}).items():
        if number and (name != "openai" or site.values.get("openai", {}).get("enabled")):
            assert ports[name] == number
    if not service_values.get("perPod", {}).get("enabled"):
        assert not per_pod
        return
    autoscaling = site.values["router"].get("autoscaling", {})
    pods = 6 if autoscaling.get("enabled", True) else site.values["router"]["replicas"]
    assert [s["metadata"]["name"] for s in per_pod] == [
        f"{routers['metadata']['name']}-{i}" for i in range(pods)
    ]
    assert all(s["spec"]["type"] == wanted for s in per_pod)
    given = service_values["perPod"].get("nodePorts")
    if given:
        assert [s["spec"]["ports"][0]["nodePort"] for s in per_pod] == given


def test_openai_api_is_served_where_the_service_says(site: Site) -> None:
    routers, container, args = site.role("router")
    front = site.named("Service", routers["metadata"]["name"])
    openai = site.values.get("openai", {})
    if not openai.get("enabled"):
        assert args.openai is None and "openai" not in [p["name"] for p in front["spec"]["ports"]]
        return
    assert args.openai == f"0.0.0.0:{openai['port']}"
    (port,) = [p for p in front["spec"]["ports"] if p["name"] == "openai"]
    assert port["port"] == openai["port"] and port["targetPort"] == "openai"
    assert {"name": "openai", "containerPort": openai["port"], "protocol": "TCP"} in container["ports"]
    pod = routers["spec"]["template"]["spec"]
    assert secret_volume_key(pod, container, str(args.openai_api_key_file)) == ("openai-key", "api-key")


def test_cloud_scaling_by_keda_or_a_fixed_count(site: Site) -> None:
    """With KEDA, the ScaledObject scales the cloud Deployment on queries of its scrape job (the
    cloud Service's name label, the ServiceMonitor's jobLabel), and the Deployment leaves the
    count to it; without, a fixed count and no ScaledObject."""
    cloud, _, _ = site.role("cloud")
    keda = site.values.get("cloud", {}).get("keda", {})
    scaled = site.of_kind("ScaledObject")
    if not keda.get("enabled"):
        assert not scaled and cloud["spec"]["replicas"] == site.values.get("cloud", {}).get("replicas", 2)
        return
    (scaled_object,) = scaled
    assert "replicas" not in cloud["spec"]
    assert scaled_object["spec"]["scaleTargetRef"]["name"] == cloud["metadata"]["name"]
    scraped = [s for s in site.services if "metrics" in [p["name"] for p in s["spec"]["ports"]]]
    jobs = {
        s["metadata"]["labels"]["app.kubernetes.io/name"]
        for s in scraped
        if s["spec"]["selector"].items() <= cloud["spec"]["template"]["metadata"]["labels"].items()
    }
    for trigger in scaled_object["spec"]["triggers"]:
        assert set(re.findall(r'job="([^"]+)"', trigger["metadata"]["query"])) == jobs
        float(trigger["metadata"]["threshold"])


def test_agents_run_as_the_kind_asked_and_name_themselves_by_it(site: Site) -> None:
    agents, _, args = site.role("agent")
    env = {
        v["name"]: v["valueFrom"]["fieldRef"]["fieldPath"]
        for v in agents["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    certificate = site.values.get("edgeAgents", {}).get("certificateName", "edge-pool")
    if agents["kind"] == "DaemonSet":
        assert args.name == f"{certificate}.<node_name>" and env["NODE_NAME"] == "spec.nodeName"
        assert agents["spec"]["template"]["spec"]["nodeSelector"] == {"stratus.dev/edge-agent": "true"}
    else:
        assert args.name == f"{certificate}.<pod_name>" and env["POD_NAME"] == "metadata.name"


def test_every_container_reads_the_settings_file_and_it_passes_config_check(
    site: Site, tmp_path: Path
) -> None:
    """The chart's stratus.toml (from the values) passes `stratus config check`; every Stratus
    container mounts it from its ConfigMap and loads its flags over it into valid settings."""
    config = check_config_file(config_file_text(site.of_kind("ConfigMap")), tmp_path)
    tables = tomllib.loads(config.read_text(encoding="utf-8"))
    values = site.values
    assert tables["router"]["private_status"] is values.get("router", {}).get("privateStatus", True)
    assert tables["cloud"]["concurrency"] == values.get("cloud", {}).get("concurrency", 2)
    agents = values.get("edgeAgents", {})
    if agents.get("enabled", True):  # the pool the agents share a certificate as, bounded (N3)
        pool = f"{agents.get('certificateName', 'edge-pool')}={agents.get('maxPoolSize', 64)}"
        assert tables["router"]["agent_pools"] == [pool]
    else:
        assert "agent_pools" not in tables["router"]
    configs = {c["metadata"]["name"]: dict(c["data"]) for c in site.of_kind("ConfigMap")}
    for workload, container, args in site.containers():
        env = container_env(container, configs)
        check_container_config(workload["spec"]["template"]["spec"], container, args, env, config, tmp_path)


def test_models_come_from_the_image_or_the_volume_given(site: Site) -> None:
    volume = site.values.get("models", {}).get("volume")
    for workload, container, args in site.containers():
        # the router's copy too: every family's description comes from it (security2 F2)
        assert str(args.models) == "/app/models"
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        pod_volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        if volume:
            assert mounts["/app/models"]["readOnly"] is True
            assert {
                k: v for k, v in pod_volumes[mounts["/app/models"]["name"]].items() if k != "name"
            } == volume
        else:
            assert "/app/models" not in mounts


def test_services_select_pods_with_their_target_ports(site: Site) -> None:
    check_services_select_pods(site.services, [w["spec"]["template"] for w in site.workloads()])


# -- observability ---------------------------------------------------------------------------------


def test_every_pod_is_scraped_exactly_once(site: Site) -> None:
    monitors = site.of_kind("ServiceMonitor")
    if not site.values.get("monitoring", {}).get("serviceMonitor", {}).get("enabled"):
        assert not monitors
        return
    (monitor,) = monitors
    selector = monitor["spec"]["selector"]["matchLabels"]
    ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    assert monitor["spec"]["jobLabel"] == "app.kubernetes.io/name"
    for workload in site.stratus_workloads():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        scrapes = [
            s
            for s in site.services
            if selector.items() <= s["metadata"]["labels"].items()
            and s["spec"]["selector"].items() <= labels.items()
            and {p["name"] for p in s["spec"]["ports"]} & ports
        ]
        assert len(scrapes) == 1, f"{workload['metadata']['name']} is scraped through {len(scrapes)} Services"
        assert scrapes[0]["metadata"]["labels"]["app.kubernetes.io/name"] == labels["app.kubernetes.io/name"]


def test_prometheus_rule_is_rules_yml_and_the_dashboard_is_stratus_json() -> None:
    site = Site("everything")
    (rule,) = site.of_kind("PrometheusRule")
    assert (
        rule["spec"]["groups"] == yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())["groups"]
    )
    (dashboard,) = [c for c in site.of_kind("ConfigMap") if "stratus.json" in c.get("data", {})]
    assert json.loads(dashboard["data"]["stratus.json"]) == json.loads(
        (DEPLOY / "grafana" / "stratus.json").read_text()
    )
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert not Site("defaults").of_kind("PrometheusRule")


def test_the_charts_rules_and_dashboard_are_links_to_the_originals() -> None:
    """One source of truth: Helm reads only files inside the chart, and its loader follows links
    (and packages their contents), so files/ links to deploy/prometheus and deploy/grafana."""
    for name, original in (
        ("rules.yml", DEPLOY / "prometheus" / "rules.yml"),
        ("stratus.json", DEPLOY / "grafana" / "stratus.json"),
        ("nats-server.conf", NATS_CONFIG),
    ):
        link = CHART / "files" / name
        assert link.is_symlink(), f"{link} is a copy: it would drift from {original}"
        assert link.resolve() == original.resolve()


# -- README ------------------------------------------------------------------------------------------


def readme_helm_commands() -> list[list[str]]:
    """The `helm install`/`helm upgrade` commands in the README's "Deploy with Helm" section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### Deploy with Helm", 1)[1].split("\n### ", 1)[0]
    joined = re.sub(r"\\\n\s*", " ", section)
    return [
        shlex.split(line.split(" #", 1)[0])
        for line in joined.splitlines()
        if line.strip().startswith(("helm install", "helm upgrade"))
    ]


def readme_values(argv: list[str]) -> Values:
    """The values a README command sets, as Helm parses --set and -f."""
    values: Values = {}
    for flag, value in itertools.pairwise(argv):
        if flag == "--set":
            values = merged(values, helm.parse_set_string(value))
        elif flag == "--set-string":
            values = merged(values, helm.parse_set_string_values(value))
        elif flag in ("-f", "--values"):
            values = merged(values, yaml.safe_load((ROOT / value).read_text()))
    return values


def test_readme_helm_commands_render(chart: helm.Chart) -> None:
    """Every install command in the README is one Helm takes: its values pass the schema and
    render, from the chart's path in the repo, into the namespace it names."""
    commands = readme_helm_commands()
    assert len(commands) >= 3
    for argv in commands:
        assert "deploy/helm/stratus" in argv, shlex.join(argv)
        namespace = (
            argv[argv.index("--namespace") + 1] if "--namespace" in argv else argv[argv.index("-n") + 1]
        )
        chart.render(readme_values(argv), name=argv[2], namespace=namespace)


def test_certs_commands_in_notes_parse(site: Site) -> None:
    """Every command NOTES prints (stratus certs, stratus fleet) parses with the real CLI."""
    lines = [line.strip() for line in site.notes.splitlines() if line.strip().startswith("stratus ")]
    assert lines
    for line in lines:
        parse(shlex.split(line)[1:])
    assert "[current]" in site.notes
    if site.values.get("models", {}).get("volume"):
        assert any(line.startswith("stratus fleet reload AGENT ") for line in lines)


def test_identity_parser_refuses_a_foreign_uri() -> None:
    """The SPIFFE check above can fail: a URI of another shape is no Stratus identity."""
    assert auth.spiffe_identity({"peer_spiffe_id": [b"spiffe://stratus/robot/x"]}) is None
    assert pki.Identity("router", "router").spiffe_id == "spiffe://stratus/router/router"


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_each_pod_admits_its_own_ports_and_the_cloud_only_routers(site: Site) -> None:
    """security2: no NetworkPolicy shipped. Every pod is selected by one policy that opens each
    port it serves, no other; the cloud's gRPC and the store's client port admit this release's
    routers alone (a stranger never reaches the largest models, nor the site's desired state),
    /metrics the configured Prometheus alone (the store serves none)."""
    policies = site.of_kind("NetworkPolicy")
    metrics_from = site.values.get("networkPolicy", {}).get("metricsFrom") or [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    ]
    pods = {w["metadata"]["labels"]["app.kubernetes.io/component"]: w for w in site.workloads()}
    labels_of = {component: w["spec"]["template"]["metadata"]["labels"] for component, w in pods.items()}
    for component, workload in pods.items():
        (policy,) = [p for p in policies if selects(p["spec"]["podSelector"], labels_of[component])]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        rules = {rule["ports"][0]["port"]: rule.get("from") for rule in policy["spec"]["ingress"]}
        served = {
            p["containerPort"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c["ports"]
        }
        assert set(rules) == served, (component, rules, served)
        if component == "nats":
            assert served == {NATS_PORT}
        else:
            assert rules[9464] == metrics_from
        for port in (8002, NATS_PORT):
            if port not in rules:
                continue
            (only,) = rules[port]
            assert selects(only["podSelector"], labels_of["router"]) and set(only) == {"podSelector"}
            assert not any(selects(only["podSelector"], labels_of[c]) for c in labels_of if c != "router")
        if component == "router":
            assert rules[8001] is None  # agents dial in from outside the cluster: any source
    assert ("nats" in pods) == site.own_store
