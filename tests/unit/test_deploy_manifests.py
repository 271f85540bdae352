"""deploy/ checked offline: Kubernetes manifests against the Kubernetes schemas
(kubernetes-validate --strict), the KEDA ScaledObject against deploy/k8s/keda-scaledobject.schema.json,
and the compose file, the Dockerfile and the systemd units against what exists: the image, the real
CLI parser's subcommands and flags, the ports each process listens on, and files in the repo.

The site's store: every router of every variant runs on one NATS JetStream server
(--site-state tls://HOST:4222, the peer protocol's flags gone), whose configuration
(deploy/nats/nats-server.conf) passes nats-server's own check, and a server started from it takes a
router's fleet certificate as its user and refuses any other certificate, or none.

Trust: every Stratus process speaks mutual TLS with its own role's certificate, from a mounted
secret (a Secret, a bind mount of ./certs files, systemd credentials); nothing ships a default
token or --insecure; probes speak TLS through stratus.probe; and the documented `stratus certs`
commands make exactly the certificates mounted, with the names that clients dial."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import io
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import time
import tomllib
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from stratus import probe
from stratus.cli import certs, pki
from stratus.cli.config import check as config_check
from stratus.cli.config import settings_class
from stratus.cli.main import build_parser
from stratus.config import Flags, load
from stratus.devtools.launcher import free_port
from stratus.errors import ConfigError
from stratus.serving.channels import TlsSettings
from stratus.serving.health import Health
from tests.integration.natsd import nats_server_binary

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SCHEMA = K8S / "keda-scaledobject.schema.json"
# A version kubernetes-validate bundles; old enough for any supported cluster.
K8S_VERSION = "1.29.0"
# Custom resources: no schema in kubernetes-validate; checked below on their own.
CRD_KINDS = {"ScaledObject", "ServiceMonitor"}
STRATUS_IMAGE = "stratus"
TLS_FLAGS = ("tls_cert", "tls_key", "tls_ca")
# Where every Stratus container finds its certificate, key and the fleet CA.
TLS_DIR = "/etc/stratus/tls"
PROBE = ["/opt/stratus/bin/python", "-m", "stratus.probe"]
# The site's store: its configuration, the script that makes its server's certificate, and the
# router flags of the peer protocol it replaced (they no longer exist).
NATS_CONFIG = DEPLOY / "nats" / "nats-server.conf"
NATS_CERT_SCRIPT = "deploy/nats/server-cert.sh"
NATS_PORT = 4222
PEER_FLAGS = ("--peers", "--peer-token-file", "--rollout-state")
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
    command = parser
    for token in argv:
        subcommands = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
        if token.startswith("-") or not subcommands or token not in subcommands[0].choices:
            break
        command = subcommands[0].choices[token]
    flags = {flag for action in command._actions for flag in action.option_strings}
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"`stratus {shlex.join(argv)}` does not parse: {stderr.getvalue().strip()}")
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and flag not in flags:
            pytest.fail(f"`stratus {shlex.join(argv)}` does not parse: {flag} is not a flag of its own")
    return args


def tls_paths(args: argparse.Namespace) -> tuple[str, str, str]:
    """The certificate, key and CA a parsed server passes; all three, or the test fails."""
    paths = tuple(getattr(args, flag) for flag in TLS_FLAGS)
    missing = [
        f"--{flag.replace('_', '-')}" for flag, path in zip(TLS_FLAGS, paths, strict=True) if path is None
    ]
    assert not missing, f"`stratus {args.command}` without {', '.join(missing)}: every link is mutual TLS"
    cert, key, ca = (str(path) for path in paths)
    return cert, key, ca


def agent_name_fits(name: str | None, certificate: str) -> bool:
    """An agent certificate named N may register the id N or N.SUFFIX (the router's rule)."""
    return name is not None and (name == certificate or name.startswith(f"{certificate}."))


def certs_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stratus")
    certs.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def documented_certs_commands(path: Path) -> list[argparse.Namespace]:
    """Every ``stratus certs ...`` command in a file's comments (with ``\\`` continuations),
    parsed by the command's own parser."""
    lines = [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]
    joined: list[str] = []
    for line in lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + line
        else:
            joined.append(line)
    commands = [shlex.split(line.split("#", 1)[0]) for line in joined if line.startswith("stratus certs ")]
    assert commands, f"{path.name} documents no `stratus certs` command"
    return [certs_parser().parse_args(argv[1:]) for argv in commands]


def issued(commands: list[argparse.Namespace]) -> dict[pki.Identity, set[str]]:
    """Each identity the commands make, with the server names its certificate carries."""
    made: dict[pki.Identity, set[str]] = {}
    for args in commands:
        for who in certs.identities_of(args):
            hosts = {*pki.ALWAYS_HOSTS, *args.host} if who.role in pki.SERVER_ROLES else set()
            made[who] = hosts
    return made


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


def dialled(address: str) -> tuple[str, int]:
    """The host and port a target names: HOST:PORT, Stratus's dns:NAME:PORT (every address NAME
    resolves to) or gRPC's dns:///NAME:PORT."""
    return split_address(address.removeprefix("dns:///").removeprefix("dns:"))


def check_every_pod_behind(address: str, services: list[Doc], workload: Doc) -> Doc:
    """``dns:///NAME:PORT`` where NAME is the fully qualified name of a headless Service that
    selects the workload's pods on that port: gRPC resolves it to every ready pod. A ClusterIP
    is one address, so one connection and one pod, however many replicas KEDA adds."""
    assert address.startswith("dns:///"), f"{address}: one address holds one connection, to one pod"
    host, port = dialled(address)
    name, namespace, svc, *domain = host.split(".")
    assert svc == "svc" and domain, f"{host} is not a Service's fully qualified name"
    service = {s["metadata"]["name"]: s for s in services}[name]
    assert service["metadata"]["namespace"] == namespace, f"{name} is not in namespace {namespace}"
    assert service["spec"].get("clusterIP") == "None", f"{name} is not headless: one ClusterIP, one pod"
    assert not service["spec"].get("publishNotReadyAddresses"), f"{name} lists pods that are not ready"
    pod = workload["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items(), f"{name} selects no pod"
    (target,) = [p["targetPort"] for p in service["spec"]["ports"] if p["port"] == port]
    container_ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]}
    assert target in container_ports, f"{name}:{port} targets {target!r}, which the pods do not have"
    return service


# -- the site's store (NATS) ----------------------------------------------------------------------


def nats_cert_parser() -> argparse.ArgumentParser:
    """The flags deploy/nats/server-cert.sh takes (test_the_nats_cert_script_... runs the script
    itself with them, so the two cannot drift apart unseen)."""
    parser = argparse.ArgumentParser(prog=NATS_CERT_SCRIPT)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--host", action="append", required=True)
    parser.add_argument("--ca-key", type=Path)
    parser.add_argument("--days", type=int)
    parser.add_argument("--force", action="store_true")
    return parser


def documented_nats_cert_commands(text: str) -> list[argparse.Namespace]:
    """Every ``deploy/nats/server-cert.sh ...`` command in a text (comments or not, with ``\\``
    continuations), parsed with the script's flags."""
    joined: list[str] = []
    for raw in text.splitlines():
        line = raw.strip().lstrip("#").strip()
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + line
        else:
            joined.append(line)
    return [
        nats_cert_parser().parse_args(shlex.split(line.split(" #", 1)[0])[1:])
        for line in joined
        if line.startswith(f"{NATS_CERT_SCRIPT} ")
    ]


def nats_users(config: str) -> set[str]:
    """The users a NATS configuration lists (with verify_and_map: certificate identities)."""
    return set(re.findall(r'\{\s*user:\s*"([^"]+)"', config))


def nats_setting(config: str, name: str) -> str:
    """A top-level or block setting's one value (``name: value``) in a NATS configuration."""
    (value,) = re.findall(rf"^\s*{re.escape(name)}\s*[:=]\s*(\S+)\s*$", config, re.MULTILINE)
    return str(value)


class Fleet:
    """Throwaway certificates, as the deploy/ commands make them: `stratus certs` (the fleet CA,
    a router, an agent) and deploy/nats/server-cert.sh (the NATS server's, for 127.0.0.1)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        pki.issue(folder, [pki.Identity("router", "router"), pki.Identity("agent", "device-1")])
        self.ca = folder / "ca.pem"
        made = self.make_server_certificate("--host", "127.0.0.1")
        assert made.returncode == 0, f"{NATS_CERT_SCRIPT} failed: {made.stderr}"

    def make_server_certificate(self, *args: str) -> subprocess.CompletedProcess[str]:
        if shutil.which("openssl") is None:
            pytest.fail(f"no openssl: {NATS_CERT_SCRIPT} needs it (apt-get install openssl)")
        return subprocess.run(
            ["sh", str(ROOT / NATS_CERT_SCRIPT), "--out", str(self.folder), *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    def tls(self, stem: str | None) -> TlsSettings:
        """A client's TLS: the leaf ``stem`` (role-name) and the CA; None: the CA alone."""
        if stem is None:
            return TlsSettings(ca=self.ca)
        return TlsSettings(cert=self.folder / f"{stem}.pem", key=self.folder / f"{stem}.key", ca=self.ca)

    def environment(self) -> dict[str, str]:
        """What nats-server.conf reads its TLS files from."""
        return {
            **os.environ,
            "NATS_TLS_CERT": str(self.folder / "nats-server.pem"),
            "NATS_TLS_KEY": str(self.folder / "nats-server.key"),
            "NATS_TLS_CA": str(self.ca),
        }


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    return Fleet(tmp_path_factory.mktemp("fleet"))


def nats_check(config: str, fleet: Fleet, folder: Path) -> subprocess.CompletedProcess[str]:
    """`nats-server -t -c FILE`: the server's own check of a configuration (its TLS files read)."""
    path = folder / "nats-server.conf"
    path.write_text(config)
    return subprocess.run(
        [nats_server_binary(), "-t", "-c", str(path)],
        env=fleet.environment(),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


class RunningNats:
    def __init__(self, url: str, log: Path) -> None:
        self.url, self.log = url, log

    def violations(self) -> list[str]:
        """What the server logged of clients using subjects their permissions do not allow."""
        return [line for line in self.log.read_text().splitlines() if " violation" in line.lower()]


@contextlib.contextmanager
def nats_server(config: str, fleet: Fleet, folder: Path) -> Iterator[RunningNats]:
    """A nats-server from ``config`` on loopback ports free now, its store in ``folder`` (the one
    line that names the store rewritten: nats-server refuses -sd beside store_dir)."""
    store = nats_setting(config, "store_dir")
    path = folder / "nats-server.conf"
    path.write_text(config.replace(f"store_dir: {store}", f"store_dir: {folder / 'store'}"))
    port = free_port()
    log = folder / "nats-server.log"
    command = [
        nats_server_binary(),
        "-c",
        str(path),
        "-a",
        "127.0.0.1",
        "-p",
        str(port),
        "-m",
        str(free_port()),
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=fleet.environment(), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            assert process.poll() is None, f"nats-server exited: {log.read_text()[-2000:]}"
            with socket.socket() as probe_socket:
                if probe_socket.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, f"nats-server did not listen: {log.read_text()[-2000:]}"
            time.sleep(0.05)
        yield RunningNats(f"tls://127.0.0.1:{port}", log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def check_nats_pod(workload: Doc, container: Doc, configs: dict[str, dict[str, str]]) -> tuple[str, str]:
    """The site store's pod (deploy/k8s or the chart): one replica of a StatefulSet running the
    official image with ``--config`` on a read-only ConfigMap mount, its TLS files (NATS_TLS_*) from
    one Secret, the store on a claim of its own, unprivileged, probed on its loopback monitoring
    port, serving 4222 alone. Returns the configuration's text and the TLS Secret's name."""
    assert workload["kind"] == "StatefulSet" and workload["spec"]["replicas"] == 1
    assert container["image"].split(":")[0] == "nats", container["image"]
    args = [str(a) for a in container["args"]]
    assert args[0] in ("--config", "-c") and len(args) == 2, args
    pod = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    folder, _, name = args[1].rpartition("/")
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"].rstrip("/") == folder]
    assert mount.get("readOnly") is True and "configMap" in volumes[mount["name"]]
    config = configs[volumes[mount["name"]]["configMap"]["name"]][name]
    env = {v["name"]: v["value"] for v in container["env"]}
    found = [
        secret_volume_key(pod, container, env[var])
        for var in ("NATS_TLS_CERT", "NATS_TLS_KEY", "NATS_TLS_CA")
    ]
    (secret,) = {name for name, _ in found}
    assert [key for _, key in found] == ["tls.crt", "tls.key", "ca.crt"]
    store = nats_setting(config, "store_dir")
    (data,) = [m for m in container["volumeMounts"] if m["mountPath"].rstrip("/") == store]
    claims = {c["metadata"]["name"]: c for c in workload["spec"]["volumeClaimTemplates"]}
    assert data["name"] in claims and data["name"] not in volumes, "the store is not on the pod's own claim"
    assert claims[data["name"]]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {p["containerPort"] for p in container["ports"]} == {NATS_PORT}
    monitor = nats_setting(config, "http")
    assert monitor.startswith("127.0.0.1:"), "the monitoring port (plain HTTP) is not on loopback"
    for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
        command = container[probe_name]["exec"]["command"]
        assert command[0] == "wget" and command[-1].startswith(f"http://{monitor}/healthz"), command
    return config, secret


def check_routers_dial_the_store(
    router: argparse.Namespace, services: list[Doc], nats: Doc, hosts: set[str]
) -> None:
    """--site-state is tls://HOST:4222 (mutual TLS with the router's own certificate), HOST the
    fully qualified name of a ClusterIP Service that selects the store's pod on its client port,
    and a name the server's certificate carries."""
    assert router.site_state.startswith("tls://"), f"{router.site_state}: not mutual TLS"
    host, port = split_address(router.site_state.removeprefix("tls://"))
    name, namespace, svc, *domain = host.split(".")
    assert svc == "svc" and domain, f"{host} is not a Service's fully qualified name"
    (service,) = [s for s in services if s["metadata"]["name"] == name]
    assert service["metadata"]["namespace"] == namespace and service["spec"].get("clusterIP") != "None"
    pod = nats["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items(), (
        f"{name} selects no store"
    )
    (target,) = [p["targetPort"] for p in service["spec"]["ports"] if p["port"] == port]
    ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]}
    assert ports.get(target) == NATS_PORT == port, f"{name}:{port} reaches no NATS client port"
    assert host in hosts, f"the store's certificate carries {sorted(hosts)}, not {host}"


def check_no_peer_flags(where: str, argv: list[str]) -> None:
    flags = {token.split("=", 1)[0] for token in argv}
    assert not flags & set(PEER_FLAGS), f"{where} runs the peer protocol: {sorted(flags & set(PEER_FLAGS))}"


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
        "StatefulSet",
        "NetworkPolicy",
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


def container_env(container: Doc, configs: dict[str, dict[str, str]] | None = None) -> dict[str, str]:
    """What $(VAR) in args can expand to: envFrom ConfigMaps (by name; deploy/k8s has one), then
    env (a placeholder for values from the downward API or a Secret)."""
    configs = {"stratus-settings": settings()} if configs is None else configs
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in configs, f"envFrom names ConfigMap {name!r}, which does not exist"
        env.update(configs[name])
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", f"<{var['name'].lower()}>")
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    def one(match: re.Match[str]) -> str:
        assert match[1] in env, f"$({match[1]}) is not set in the container's env"
        return env[match[1]]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg) for arg in args]


STRATUS_CONTAINERS = list(workloads())


def nats_container() -> tuple[Doc, Doc]:
    """The site store's StatefulSet (nats.yaml) and its one container."""
    (workload,) = [d for d in of_kind("StatefulSet") if d["metadata"]["name"] == "stratus-nats"]
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return workload, container


def container_id(item: tuple[Doc, Doc]) -> str:
    return f"{item[0]['kind']}/{item[0]['metadata']['name']}/{item[1]['name']}"


def secrets() -> dict[str, Doc]:
    return {s["metadata"]["name"]: s for s in of_kind("Secret")}


def secret_file(pod: Doc, container: Doc, path: str) -> tuple[Doc, str]:
    """The Secret and key that a path in a container reads (secret_volume_key), and the Secret
    must hold that key."""
    name, key = secret_volume_key(pod, container, path)
    secret = secrets()[name]
    assert key in {**secret.get("data", {}), **secret.get("stringData", {})}, f"{path}: no key {key!r}"
    return secret, key


def secret_volume_key(pod: Doc, container: Doc, path: str) -> tuple[str, str]:
    """The Secret's name and the key that a path in a container reads: the path must lie in a
    read-only mount of a secret volume that only its owner's group can read."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        folder = mount["mountPath"].rstrip("/") + "/"
        if not path.startswith(folder):
            continue
        volume = volumes[mount["name"]]
        assert "secret" in volume, f"{path} is in volume {mount['name']!r}, which is not a Secret"
        assert mount.get("readOnly") is True, f"{mount['name']} is mounted writable"
        assert volume["secret"].get("optional") is not True, "a server without its certificate must not start"
        assert volume["secret"].get("defaultMode", 0o644) & 0o007 == 0, "the key is readable by others"
        items = {i["path"]: i["key"] for i in volume["secret"].get("items", [])}
        key = items.get(path.removeprefix(folder), path.removeprefix(folder))
        return str(volume["secret"]["secretName"]), key
    pytest.fail(f"{path} is in no volume the container mounts")


def probe_args(container: Doc, which: str) -> argparse.Namespace:
    """An exec probe's stratus.probe command, parsed by stratus.probe's own parser."""
    assert "grpc" not in container[which], f"{which}: Kubernetes' grpc probes cannot speak TLS"
    command = [str(a) for a in container[which]["exec"]["command"]]
    assert command[:3] == PROBE, f"{which} does not run stratus.probe: {command}"
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            return probe.build_parser().parse_args(command[3:])
        except SystemExit:
            pytest.fail(f"{which}: {shlex.join(command)} does not parse: {stderr.getvalue().strip()}")


@pytest.mark.parametrize("item", STRATUS_CONTAINERS, ids=container_id)
def test_stratus_container_args_ports_and_probes(item: tuple[Doc, Doc]) -> None:
    workload, container = item
    args = parse(expand(container["args"], container_env(container)))
    check_args_ports_and_probes(workload, container, args, of_kind("Service"))


def check_args_ports_and_probes(
    workload: Doc, container: Doc, args: argparse.Namespace, services: list[Doc]
) -> None:
    """A Stratus container (deploy/k8s or the Helm chart): it listens where its ports and the
    Services say, its probes ask its own gRPC port over mutual TLS, it has requests and limits,
    runs unprivileged, and an agent links to every router through a headless Service."""
    assert "command" not in container, "the image's ENTRYPOINT is stratus: set args only"
    addresses = listening(args)
    assert set(addresses) == {"grpc", "metrics"}, "every Stratus container serves gRPC and /metrics"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for name, (host, port) in addresses.items():
        assert host == "0.0.0.0", f"--{name} binds {host}: unreachable from outside the pod"
        assert ports.get(name) == port, f"container port {name!r} is not {port}"
    grpc_port = addresses["grpc"][1]
    for name in (
        "livenessProbe",
        "readinessProbe",
        *(["startupProbe"] if "startupProbe" in container else []),
    ):
        asked = probe_args(container, name)
        assert asked.address == f"127.0.0.1:{grpc_port}", f"{name} does not ask the gRPC port"
        # the probe shows the server the pod's own certificate, and checks it against the fleet CA
        assert (str(asked.tls_cert), str(asked.tls_key), str(asked.tls_ca)) == tls_paths(args), name
        # readiness follows the server's readiness (""); liveness and startup ask only whether
        # the process serves ("liveness"), so a router with no agent yet is not restarted
        wanted = "" if name == "readinessProbe" else Health.LIVENESS
        assert asked.service == wanted, f"{name}: health service {wanted!r}"
        assert container[name].get("timeoutSeconds", 1) > asked.timeout_s, (
            f"{name} times out before the probe"
        )
    resources = container["resources"]
    for bound in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(resources[bound]), f"no cpu and memory {bound}"
    pod = workload["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    if args.command == "agent":
        routers = {s["metadata"]["name"]: s for s in services}
        for address in router_addresses(args):
            host, port = dialled(address)
            service = routers[host.split(".")[0]]
            assert port in [p["port"] for p in service["spec"]["ports"]]
            if address.startswith("dns:"):  # every router pod: only a headless Service lists them
                assert service["spec"].get("clusterIP") == "None", f"{host} is not headless"


CONFIG_FILE = "/etc/stratus/config/stratus.toml"


def config_file_text(configs: list[Doc]) -> str:
    """The roles' settings file, from the ConfigMap that holds it (stratus-config)."""
    (text,) = [c["data"]["stratus.toml"] for c in configs if "stratus.toml" in c.get("data", {})]
    return str(text)


def check_config_file(text: str, tmp_path: Path) -> Path:
    """The file passes `stratus config check`, with a table for every role, and holds no credential."""
    path = tmp_path / "stratus.toml"
    path.write_text(text, encoding="utf-8")
    report = config_check(path)
    assert [line for line in report.splitlines() if line.startswith("[")] == [
        "[router]",
        "[cloud]",
        "[agent]",
    ]
    assert not [
        k for table in tomllib.loads(text).values() for k in table if "token" in k and "file" not in k
    ]
    return path


def check_container_config(
    pod: Doc, container: Doc, args: argparse.Namespace, env: dict[str, str], config: Path, tmp_path: Path
) -> None:
    """The container reads the file from a read-only mount of the ConfigMap, no variable in its
    env overrides a setting unseen, and its flags over the file load into valid settings."""
    assert str(args.config) == CONFIG_FILE, f"`stratus {args.command}` without --config {CONFIG_FILE}"
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = [
        m for m in container["volumeMounts"] if CONFIG_FILE.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert len(mounts) == 1, f"{len(mounts)} mounts hold {CONFIG_FILE}, not one"
    (mount,) = mounts
    assert mount.get("readOnly") is True, "the settings file is mounted writable"
    assert "configMap" in volumes[mount["name"]], f"{CONFIG_FILE} is not from a ConfigMap"
    for variable in env:
        assert not variable.startswith(f"STRATUS_{args.command.upper()}_") or variable.endswith("_ADDRESS"), (
            f"${variable} would override the settings file, unseen"
        )
    check_loads(args, config, tmp_path)


def check_loads(args: argparse.Namespace, config: Path, tmp_path: Path) -> None:
    """The command's flags over the file load into valid settings through the real loader; its
    TLS paths stand for files the deployment mounts, so stand-ins are made here."""
    values = dict(vars(args))
    for flag in TLS_FLAGS:
        (tmp_path / flag).touch()
        values[flag] = tmp_path / flag
    flags = Flags(values, args.flag_names)
    loaded = load(settings_class(args.command), args.command, file=config, flags=flags, read_secrets=False)
    assert loaded.settings is not None


def test_the_settings_file_passes_config_check(tmp_path: Path) -> None:
    check_config_file(config_file_text(of_kind("ConfigMap")), tmp_path)


@pytest.mark.parametrize("item", STRATUS_CONTAINERS, ids=container_id)
def test_stratus_container_reads_the_settings_file_from_its_configmap(
    item: tuple[Doc, Doc], tmp_path: Path
) -> None:
    workload, container = item
    config = check_config_file(config_file_text(of_kind("ConfigMap")), tmp_path)
    env = container_env(container)
    args = parse(expand(container["args"], env))
    check_container_config(workload["spec"]["template"]["spec"], container, args, env, config, tmp_path)


def test_the_settings_checks_catch_a_bad_file_and_a_missing_mount(tmp_path: Path) -> None:
    """The checks above can fail: a misspelt key, and a container that does not mount the file."""
    text = config_file_text(of_kind("ConfigMap")).replace("max_batch = 32", "max_batches = 32", 1)
    with pytest.raises(ConfigError, match=r"agent|cloud"):
        check_config_file(text, tmp_path)
    workload, container = STRATUS_CONTAINERS[0]
    config = check_config_file(config_file_text(of_kind("ConfigMap")), tmp_path)
    env = container_env(container)
    args = parse(expand(container["args"], env))
    unmounted = {**container, "volumeMounts": [m for m in container["volumeMounts"] if m["name"] != "config"]}
    pod = workload["spec"]["template"]["spec"]
    with pytest.raises(AssertionError, match=f"0 mounts hold {CONFIG_FILE}, not one"):
        check_container_config(pod, unmounted, args, env, config, tmp_path)
    with pytest.raises(AssertionError, match="would override the settings file"):
        check_container_config(
            pod, container, args, {**env, f"STRATUS_{args.command.upper()}_X": "1"}, config, tmp_path
        )


@pytest.mark.parametrize("item", STRATUS_CONTAINERS, ids=container_id)
def test_stratus_container_speaks_mutual_tls_with_its_roles_secret(item: tuple[Doc, Doc]) -> None:
    """--tls-cert, --tls-key and --tls-ca (the CA makes the server require client certificates)
    point into the role's own Secret, whose SPIFFE id names the role, and an agent's id fits
    its certificate's name."""
    workload, container = item
    args = parse(expand(container["args"], container_env(container)))
    pod = workload["spec"]["template"]["spec"]
    found = [secret_file(pod, container, path) for path in tls_paths(args)]
    (secret,) = {s["metadata"]["name"]: s for s, _ in found}.values()
    assert [key for _, key in found] == ["tls.crt", "tls.key", "ca.crt"]
    assert secret["metadata"]["name"] == f"stratus-{args.command}-tls", "a Secret of another role"
    role, name = (
        secret["metadata"]["annotations"]["stratus.dev/spiffe-id"]
        .removeprefix("spiffe://stratus/")
        .split("/")
    )
    assert role == args.command
    if args.command == "agent":
        assert agent_name_fits(args.name, name), f"--name {args.name} is not {name} or {name}.SUFFIX"


def test_secrets_and_volumes_refer_to_objects_that_exist() -> None:
    names = set(secrets())
    assert names == {f"stratus-{role}-tls" for role in ("router", "cloud", "agent", "operator", "nats")}
    for doc, container in [*STRATUS_CONTAINERS, nats_container()]:
        pod = doc["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in doc["spec"].get("volumeClaimTemplates", [])}
        for mount in container.get("volumeMounts", []):
            if mount["name"] in claims:
                continue  # the StatefulSet's own claim (the store's)
            volume = volumes[mount["name"]]
            if "secret" in volume:
                assert volume["secret"]["secretName"] in names
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] in names


def test_k8s_secrets_are_placeholders_made_by_the_documented_commands() -> None:
    """Each Secret is a placeholder for one identity that secrets.yaml's `stratus certs`
    commands make; the server certificates carry the names their clients dial."""
    made = issued(documented_certs_commands(K8S / "secrets.yaml"))
    for secret in of_kind("Secret"):
        annotations = secret["metadata"]["annotations"]
        assert annotations["stratus.dev/placeholder"] == "true"
        assert all(str(v).startswith("PLACEHOLDER-") for v in secret["stringData"].values())
        assert "data" not in secret
        if "stratus.dev/spiffe-id" not in annotations:  # the store's server: no Stratus identity
            assert annotations["stratus.dev/made-by"] == NATS_CERT_SCRIPT, secret["metadata"]["name"]
            continue
        role, name = annotations["stratus.dev/spiffe-id"].removeprefix("spiffe://stratus/").split("/")
        assert pki.Identity(role, name) in made, (
            f"{secret['metadata']['name']}: no command makes {role}/{name}"
        )
    config = settings()
    hosts_dialled = {
        "cloud": dialled(config["STRATUS_CLOUD_ADDRESS"])[0],
        "router": dialled(config["STRATUS_ROUTER_ADDRESS"])[0],
    }
    for role, host in hosts_dialled.items():
        (hosts,) = [h for who, h in made.items() if who.role == role]
        assert host in hosts, f"the {role} certificate does not carry {host}, which its clients dial"


def test_k8s_store_runs_the_committed_config_with_its_own_certificate() -> None:
    """nats.yaml's ConfigMap is deploy/nats/nats-server.conf, unchanged; the StatefulSet runs it
    (check_nats_pod) with the Secret that secrets.yaml's server-cert.sh command makes."""
    configs = {c["metadata"]["name"]: dict(c["data"]) for c in of_kind("ConfigMap")}
    config, secret = check_nats_pod(*nats_container(), configs)
    assert config == NATS_CONFIG.read_text(), (
        "deploy/k8s/nats.yaml's copy differs from deploy/nats/nats-server.conf"
    )
    assert secret == "stratus-nats-tls" and secret in secrets()
    text = (K8S / "secrets.yaml").read_text()
    assert "nats-server:nats" in text, (
        "secrets.yaml's loop does not create stratus-nats-tls from nats-server.pem"
    )


def test_k8s_routers_share_the_store_and_not_the_peer_protocol() -> None:
    """Every router runs on the one store (--site-state tls://stratus-nats...:4222), whose server
    certificate (secrets.yaml's server-cert.sh command) carries the name dialled, with none of the
    peer protocol's flags."""
    (command,) = documented_nats_cert_commands((K8S / "secrets.yaml").read_text())
    routers = [(w, c) for w, c in STRATUS_CONTAINERS if c["args"][0] == "router"]
    assert routers
    for workload, container in routers:
        args = parse(expand(container["args"], container_env(container)))
        check_routers_dial_the_store(args, of_kind("Service"), nats_container()[0], set(command.host))
        assert args.site_state_creds is None, "the router's certificate is its identity at the store"
        # the other routers reach it at its pod's IP (a Deployment's pods have no names they resolve)
        assert args.site_address == f"<pod_ip>:{listening(args)['grpc'][1]}"
        (pod_ip,) = [v for v in container["env"] if v["name"] == "POD_IP"]
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        check_no_peer_flags(container_id((workload, container)), [str(a) for a in container["args"]])


def test_the_store_checks_catch_a_wrong_service_and_a_name_not_in_the_certificate() -> None:
    """The checks above can fail: the headless Service, plain nats://, a name the certificate lacks,
    and a peer flag are each refused."""
    services, nats = of_kind("Service"), nats_container()[0]
    hosts = {"stratus-nats.stratus.svc.cluster.local"}

    def dialling(url: str) -> argparse.Namespace:
        return argparse.Namespace(site_state=url)

    with pytest.raises(AssertionError, match="not mutual TLS"):
        check_routers_dial_the_store(
            dialling("nats://stratus-nats.stratus.svc.cluster.local:4222"), services, nats, hosts
        )
    with pytest.raises(AssertionError):
        check_routers_dial_the_store(
            dialling("tls://stratus-nats-headless.stratus.svc.cluster.local:4222"), services, nats, hosts
        )
    with pytest.raises(AssertionError, match="selects no store"):
        check_routers_dial_the_store(
            dialling("tls://stratus-router.stratus.svc.cluster.local:8001"), services, nats, hosts
        )
    with pytest.raises(AssertionError, match="certificate carries"):
        check_routers_dial_the_store(
            dialling("tls://stratus-nats.stratus.svc.cluster.local:4222"), services, nats, {"nats"}
        )
    with pytest.raises(AssertionError, match="peer protocol"):
        check_no_peer_flags("router", ["router", "--peers=dns:x:8001"])


def test_services_select_pods_with_their_target_ports() -> None:
    check_services_select_pods(of_kind("Service"), workload_pods())


def check_services_select_pods(services: list[Doc], pods: list[Doc]) -> None:
    """Every Service selects some pod template, on ports its containers name."""
    for service in services:
        selector = dict(service["spec"]["selector"])
        selector.pop("statefulset.kubernetes.io/pod-name", None)  # the StatefulSet sets it on each pod
        chosen = [p for p in pods if selector.items() <= p["metadata"]["labels"].items()]
        assert chosen, f"Service {service['metadata']['name']} selects no pod"
        for pod in chosen:
            names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in names, f"{service['metadata']['name']}: {port['targetPort']}"


def test_each_pod_admits_its_own_ports_and_the_cloud_only_routers() -> None:
    """As the chart's (test_helm_chart): one policy per pod opening exactly the ports it
    serves; the cloud's gRPC and the store's client port from the routers' pods alone, /metrics
    from Prometheus alone (the store serves none)."""
    policies = of_kind("NetworkPolicy")
    pods = {p["metadata"]["labels"]["app.kubernetes.io/name"]: p for p in workload_pods()}
    assert "stratus-nats" in pods
    prometheus = [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    ]
    for name, pod in pods.items():
        labels = pod["metadata"]["labels"]
        (policy,) = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
        rules = {rule["ports"][0]["port"]: rule.get("from") for rule in policy["spec"]["ingress"]}
        assert set(rules) == {p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]}, name
        if name != "stratus-nats":
            assert rules[9464] == prometheus, name
    for port in (8002, NATS_PORT):
        (rule,) = [r for p in policies for r in p["spec"]["ingress"] if r["ports"][0]["port"] == port]
        (only,) = rule["from"]
        assert set(only) == {"podSelector"}, f"{port} admits more than pods of this namespace"
        for name, pod in pods.items():
            admitted = only["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
            assert admitted == (name == "stratus-router"), f"port {port}: {name} admitted {admitted}"


def workload_pods() -> list[Doc]:
    return [
        d["spec"]["template"] for d in of_kind("Deployment") + of_kind("DaemonSet") + of_kind("StatefulSet")
    ]


def test_routers_spread_their_cloud_link_over_every_cloud_pod() -> None:
    """--cloud is dns:/// and the headless Service of the cloud gateway's pods, so the pods KEDA
    adds take escalations too."""
    (router,) = [c for _, c in STRATUS_CONTAINERS if c["args"][0] == "router"]
    args = parse(expand(router["args"], container_env(router)))
    cloud = next(d for d in of_kind("Deployment") if d["metadata"]["name"] == "stratus-cloud")
    service = check_every_pod_behind(args.cloud, of_kind("Service"), cloud)
    assert service["metadata"]["name"] == "stratus-cloud-headless"


def test_the_cloud_target_check_catches_a_cluster_ip() -> None:
    """The check above can fail: the ClusterIP Service, or a bare HOST:PORT, is refused."""
    cloud = next(d for d in of_kind("Deployment") if d["metadata"]["name"] == "stratus-cloud")
    with pytest.raises(AssertionError, match="not headless"):
        check_every_pod_behind(
            "dns:///stratus-cloud.stratus.svc.cluster.local:8002", of_kind("Service"), cloud
        )
    with pytest.raises(AssertionError, match="one connection"):
        check_every_pod_behind("stratus-cloud:8002", of_kind("Service"), cloud)


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


def test_compose_services_read_its_settings_file(compose: Doc, tmp_path: Path) -> None:
    """deploy/stratus.toml passes `stratus config check`; each Stratus service mounts it where its
    --config points, and its command over the file loads into valid settings."""
    path = check_config_file((DEPLOY / "stratus.toml").read_text(encoding="utf-8"), tmp_path)
    assert compose["configs"]["stratus"]["file"] == "./stratus.toml"
    for name, args in stratus_services(compose).items():
        assert str(args.config) == CONFIG_FILE, f"{name} without --config {CONFIG_FILE}"
        targets = {c["target"]: c["source"] for c in compose["services"][name]["configs"]}
        assert targets.get(CONFIG_FILE) == "stratus", f"{name} does not mount the settings file"
        check_loads(args, path, tmp_path)


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
            assert str(entry).startswith("127.0.0.1:"), f"{name} publishes {entry} on every interface"
        for entry in service.get("expose", []):
            assert int(str(entry).split("/")[0]) in own, f"{name} exposes {entry}"
        targets = list(router_addresses(args)) if args.command == "agent" else []
        if args.command == "router" and args.cloud:
            targets.append(args.cloud)
        for address in targets:
            host, port = split_address(address)
            assert host in listens, f"{name}: {address} is not a Stratus service"
            assert listens[host]["grpc"][1] == port, f"{name}: {host} does not listen on {port}"


CERTS = "./certs/"  # what `stratus certs --out deploy/certs` writes, relative to deploy/


def mounts(service: Doc) -> list[tuple[str, str, bool]]:
    """(source, target, read-only) of each of a service's volumes, short syntax or long."""
    found = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            assert volume["type"] in {"bind", "volume"}
            if volume["type"] == "bind" and volume["source"].startswith(CERTS):
                # a missing file must stop compose, not become an empty folder docker makes
                assert volume["bind"]["create_host_path"] is False, volume
            found.append((volume["source"], volume["target"], volume.get("read_only") is True))
        else:
            source, target, *options = volume.split(":")
            found.append((source, target, "ro" in options))
    return found


def test_compose_mounts_files_that_exist(compose: Doc) -> None:
    declared = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        for source, target, _ in mounts(service):
            # a key is mounted only where it is used: never the whole folder, never the CA's key
            assert source.rstrip("/") != CERTS.rstrip("/"), f"{name} mounts {source}"
            assert source not in (f"{CERTS}ca.key", f"{CERTS}private/ca.key"), f"{name} mounts the CA's key"
            assert not source.startswith(f"{CERTS}private"), f"{name} mounts the CA's folder"
            if source.startswith(CERTS):
                continue  # made by `stratus certs`: test_compose_certs_command_makes_what_is_mounted
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in declared, f"{name} mounts undeclared volume {source}"
            assert target.startswith("/")


def test_compose_services_speak_mutual_tls_with_their_own_certificate(compose: Doc) -> None:
    """--tls-cert, --tls-key and --tls-ca are files bind-mounted read-only from ./certs: the
    service's own role's certificate and key, and the CA."""
    for name, args in stratus_services(compose).items():
        bound = {target: (source, ro) for source, target, ro in mounts(compose["services"][name])}
        sources = []
        for path in tls_paths(args):
            assert path in bound, f"{name}: {path} is not a mounted file"
            source, read_only = bound[path]
            assert read_only, f"{name}: {source} is mounted writable"
            sources.append(source.removeprefix(CERTS))
        cert, key, ca = sources
        assert ca == "ca.pem", f"{name}: --tls-ca is {ca}"
        assert cert.endswith(".pem") and key == cert.removesuffix(".pem") + ".key", f"{name}: {cert}, {key}"
        role, _, certificate = cert.removesuffix(".pem").partition("-")
        assert role == args.command, f"{name} ({args.command}) mounts a {role} certificate"
        if args.command == "agent":
            assert agent_name_fits(args.name, certificate), (
                f"{name}: --name {args.name}, certificate {certificate}"
            )


def test_compose_certs_command_makes_what_is_mounted(compose: Doc) -> None:
    """The header's `stratus certs` command writes into deploy/certs (git-ignored) every file
    the services mount, and the server certificates carry the names the other services dial."""
    commands = documented_certs_commands(DEPLOY / "compose.yaml")
    assert {args.out for args in commands} == {Path("deploy/certs")}
    assert "/deploy/certs/" in (ROOT / ".gitignore").read_text().splitlines()
    made = issued(commands)
    files = {"ca.pem"} | {f"{who.stem}{ext}" for who in made for ext in (".pem", ".key")}
    # the store's server: its certificate from server-cert.sh, into the same folder
    (server,) = documented_nats_cert_commands((DEPLOY / "compose.yaml").read_text())
    assert server.out == Path("deploy/certs")
    files |= {"nats-server.pem", "nats-server.key"}
    for name, service in compose["services"].items():
        for source, _, _ in mounts(service):
            if source.startswith(CERTS):
                assert source.removeprefix(CERTS) in files, f"{name} mounts {source}, which no command makes"
    services = stratus_services(compose)
    names = {}  # service -> the server names its certificate carries
    for name, args in services.items():
        cert = next(s for s, t, _ in mounts(compose["services"][name]) if t == tls_paths(args)[0])
        (names[name],) = [h for who, h in made.items() if f"{who.stem}.pem" == cert.removeprefix(CERTS)]
    for name, args in services.items():
        targets = list(router_addresses(args)) if args.command == "agent" else []
        if args.command == "router" and args.cloud:
            targets.append(args.cloud)
        for address in targets:
            host, _ = split_address(address)
            assert host in names[host], f"{name} dials {host}, whose certificate does not carry that name"
    for name in services:
        if compose["services"][name].get("ports"):
            assert "localhost" in names[name], f"{name} is published, but localhost is not in its certificate"


def test_compose_routers_share_the_store(compose: Doc) -> None:
    """Both routers run on the `nats` service (--site-state tls://nats:4222, its certificate
    carrying that name, no credentials file: the router's certificate is its user). The service
    runs the official image on deploy/nats/nats-server.conf, mounted read-only where --config
    says, with its TLS files (NATS_TLS_*) from ./certs read-only, its store on a named volume, and
    its port on the compose network only."""
    (server_cert,) = documented_nats_cert_commands((DEPLOY / "compose.yaml").read_text())
    routers = {n: a for n, a in stratus_services(compose).items() if a.command == "router"}
    assert len(routers) == 2
    for name, args in routers.items():
        assert args.site_state == f"tls://nats:{NATS_PORT}", f"{name}: --site-state {args.site_state}"
        assert args.site_state_creds is None
        # the other router reaches it by its service's name, on its gRPC port
        assert split_address(args.site_address) == (name, listening(args)["grpc"][1])
        assert "nats" in compose["services"][name]["depends_on"]
        check_no_peer_flags(f"compose {name}", [str(a) for a in compose["services"][name]["command"]])
    assert "nats" in server_cert.host, "the store's certificate does not carry the name routers dial"
    nats = compose["services"]["nats"]
    assert nats["image"].split(":")[0] == "nats"
    command = [str(a) for a in nats["command"]]
    assert command[0] in ("--config", "-c") and len(command) == 2, command
    bound = {target: (source, ro) for source, target, ro in mounts(nats)}
    assert bound[command[1]] == ("./nats/nats-server.conf", True)
    environment = nats["environment"]
    sources = []
    for var in ("NATS_TLS_CERT", "NATS_TLS_KEY", "NATS_TLS_CA"):
        source, read_only = bound[environment[var]]
        assert read_only, f"nats: {source} is mounted writable"
        sources.append(source)
    assert sources == ["./certs/nats-server.pem", "./certs/nats-server.key", "./certs/ca.pem"]
    store = nats_setting(NATS_CONFIG.read_text(), "store_dir")
    volume, _ = bound[store]
    assert volume in (compose.get("volumes") or {}), f"the store at {store} is not on a named volume"
    assert not nats.get("ports"), "the store is published outside the compose network"
    assert [int(str(p)) for p in nats["expose"]] == [NATS_PORT]


def mount_target(compose: Doc, service: str, source: str) -> str:
    for src, target, _ in mounts(compose["services"][service]):
        if src == source:
            return target
    pytest.fail(f"{service} does not mount {source}")


def test_prometheus_scrapes_every_stratus_process(compose: Doc) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert config["global"]["scrape_interval"] == "30s"
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
    assert host == "prometheus" and f"127.0.0.1:{port}:{port}" in compose["services"]["prometheus"]["ports"]


def test_a_wrong_flag_is_caught() -> None:
    """The compose, Kubernetes and systemd checks parse with the real CLI: a flag it does not
    have fails them."""
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        parse(["router", "--listen-address", "0.0.0.0:8001"])
    with pytest.raises(pytest.fail.Exception, match=r"(?s)does not parse.*--tier: invalid choice: 'cloud'"):
        parse(["agent", "--tier", "cloud"])
    with pytest.raises(pytest.fail.Exception, match="--metrics-token is not a flag"):
        parse(["cloud", "--metrics-token", "/etc/stratus/metrics"])  # argparse takes the abbreviation


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
    assert scripts["stratus"] == "stratus.cli.main:main"


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


SYSTEMD = DEPLOY / "systemd"


def unit_settings(unit: str = "stratus-agent.service") -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for raw in (SYSTEMD / unit).read_text().splitlines():
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
    assert unit["NoNewPrivileges"] == ["yes"]
    (exec_start,) = unit["ExecStart"]
    argv = shlex.split(exec_start.lstrip("-@:+!"))
    assert Path(argv[0]).name == "stratus"
    args = parse(argv[1:])
    assert args.command == "agent" and args.tier == "device"
    for address in router_addresses(args):
        split_address(address)


def test_systemd_agent_speaks_mutual_tls_from_its_credentials() -> None:
    """The agent's certificate, key and CA come from systemd credentials (%d/NAME, loaded with
    LoadCredential= from root-owned files), and its --name is what the certificate may claim."""
    unit = unit_settings()
    (exec_start,) = unit["ExecStart"]
    args = parse(shlex.split(exec_start.lstrip("-@:+!"))[1:])
    loaded = dict(entry.split(":", 1) for entry in unit["LoadCredential"])
    for path in tls_paths(args):
        assert path.startswith("%d/") and path.removeprefix("%d/") in loaded, (
            f"{path} is not a loaded credential"
        )
        assert loaded[path.removeprefix("%d/")].startswith("/etc/stratus/tls/")
    assert args.name == "%l", "the agent registers as the host name its certificate is made for"
    assert "--agent DEVICE" in (DEPLOY / "systemd" / "stratus-agent.service").read_text()


def unit_command(unit: str) -> list[str]:
    (exec_start,) = unit_settings(unit)["ExecStart"]
    return shlex.split(exec_start.lstrip("-@:+!"))


def test_systemd_routers_share_a_store_run_by_systemd_too() -> None:
    """stratus-router.service runs a router on the store (--site-state tls://HOST:4222, HOST in the
    certificate nats-server.service's server-cert.sh command makes), over mutual TLS from its
    credentials; nats-server.service runs deploy/nats/nats-server.conf from where its header
    installs it, its TLS files (NATS_TLS_*) systemd credentials, its store the StateDirectory the
    configuration names, as a user of its own."""
    router_unit = unit_settings("stratus-router.service")
    argv = unit_command("stratus-router.service")
    assert Path(argv[0]).name == "stratus"
    args = parse(argv[1:])
    assert args.command == "router" and router_unit["Restart"] == ["on-failure"]
    assert router_unit["User"][-1] not in {"root", "0"} and router_unit["NoNewPrivileges"] == ["yes"]
    loaded = dict(entry.split(":", 1) for entry in router_unit["LoadCredential"])
    for path in tls_paths(args):
        assert path.startswith("%d/") and path.removeprefix("%d/") in loaded, (
            f"{path} is not a loaded credential"
        )
    check_no_peer_flags("stratus-router.service", argv)
    nats_text = (SYSTEMD / "nats-server.service").read_text()
    (server_cert,) = documented_nats_cert_commands(nats_text)
    assert args.site_state.startswith("tls://"), args.site_state
    host, port = split_address(args.site_state.removeprefix("tls://"))
    assert port == NATS_PORT and host in server_cert.host, f"{host} is not in the store's certificate"
    assert args.site_state_creds is None
    assert split_address(args.site_address) == ("%H", listening(args)["grpc"][1])

    nats = unit_settings("nats-server.service")
    command = unit_command("nats-server.service")
    assert Path(command[0]).name == "nats-server" and command[1] in ("--config", "-c") and len(command) == 3
    assert f"install -m 0644 deploy/nats/nats-server.conf {command[2]}" in nats_text
    loaded = dict(entry.split(":", 1) for entry in nats["LoadCredential"])
    environment = dict(entry.split("=", 1) for entry in nats["Environment"])
    for var in ("NATS_TLS_CERT", "NATS_TLS_KEY", "NATS_TLS_CA"):
        path = environment[var]
        assert path.startswith("%d/") and path.removeprefix("%d/") in loaded, (
            f"{var}={path} is not a credential"
        )
        assert loaded[path.removeprefix("%d/")].startswith("/etc/stratus/tls/")
    store = nats_setting(NATS_CONFIG.read_text(), "store_dir")
    assert [f"/var/lib/{d}" for d in nats["StateDirectory"]] == [store]
    assert nats["DynamicUser"] == ["yes"] and nats["Restart"] == ["on-failure"]
    assert nats["NoNewPrivileges"] == ["yes"]


# -- the site's store: nats-server itself ---------------------------------------------------------


def test_the_nats_config_passes_nats_servers_own_check(fleet: Fleet, tmp_path: Path) -> None:
    """`nats-server -t` takes deploy/nats/nats-server.conf (its TLS files from the environment,
    as every deployment gives them), and refuses a copy with a misspelt TLS field or with its
    certificate missing: the check can fail."""
    config = NATS_CONFIG.read_text()
    checked = nats_check(config, fleet, tmp_path)
    assert checked.returncode == 0 and "is valid" in checked.stdout + checked.stderr, checked.stderr
    assert "verify_and_map: true" in config, "a client certificate is not required, or not mapped to a user"
    misspelt = nats_check(config.replace("verify_and_map:", "verify_and_mapp:"), fleet, tmp_path)
    assert misspelt.returncode != 0 and "verify_and_mapp" in misspelt.stderr
    (fleet.folder / "nats-server.pem").rename(fleet.folder / "moved.pem")
    try:
        missing = nats_check(config, fleet, tmp_path)
    finally:
        (fleet.folder / "moved.pem").rename(fleet.folder / "nats-server.pem")
    assert missing.returncode != 0 and "nats-server.pem" in missing.stderr


def test_the_nats_cert_script_signs_with_the_fleet_ca_and_keeps_what_exists(fleet: Fleet) -> None:
    """deploy/nats/server-cert.sh: the server's certificate chains to `stratus certs`' CA, carries
    the names given and no SPIFFE id (no Stratus process takes it for a router or the cloud), is
    for serving only, its key 0600; a second run refuses to overwrite it, and a bad name is refused."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    cert = x509.load_pem_x509_certificate((fleet.folder / "nats-server.pem").read_bytes())
    ca = x509.load_pem_x509_certificate(fleet.ca.read_bytes())
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert not names.get_values_for_type(x509.UniformResourceIdentifier)
    assert not [n for n in names.get_values_for_type(x509.DNSName) if n.endswith(".spiffe.invalid")]
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert (fleet.folder / "nats-server.key").stat().st_mode & 0o077 == 0
    again = fleet.make_server_certificate("--host", "nats")
    assert again.returncode != 0 and "exists" in again.stderr
    bad = fleet.make_server_certificate("--host", "nats;rm", "--force")
    assert bad.returncode != 0 and "not a host name" in bad.stderr


async def until(condition: Any, what: str, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {seconds} s"
        await asyncio.sleep(0.05)


def test_a_store_from_the_config_takes_a_router_certificate_and_refuses_others(
    fleet: Fleet, tmp_path: Path
) -> None:
    """A nats-server started from deploy/nats/nats-server.conf (its store folder and ports moved
    here): a router's own store client (router/site/nats.py) with the router's fleet certificate
    makes the bucket, writes, compares and swaps, reads history and watches, with no subject its
    permissions refuse (the server logs each refusal); an agent's certificate (same CA, not a router
    user) and no certificate are refused; and the router user may not make another stream (its
    permissions name the bucket's alone)."""
    import nats
    import nats.errors
    from nats.js.api import StreamConfig

    from router.site import StoreConflict
    from router.site.nats import NatsSiteState

    async def main(server: RunningNats) -> None:
        url = server.url
        store = NatsSiteState(url, tls=fleet.tls("router-router"))
        await store.start()
        try:
            await until(lambda: store.connected, f"connected ({store.describe()})")
            first = await store.put("agent.device-1", b"drain")
            second = await store.put("agent.device-1", b"undrain", expected=first.revision)
            with pytest.raises(StoreConflict):
                await store.put("agent.device-1", b"lost", expected=first.revision)
            await store.put("agent.device-2", b"drain", expected=0)  # made only if missing
            with pytest.raises(StoreConflict):
                await store.put("agent.device-2", b"again", expected=0)
            assert [e.value for e in await store.history("agent.device-1")] == [b"drain", b"undrain"]
            watch = store.watch("agent.")
            assert isinstance(watch, AsyncGenerator)  # closing it ends the watch's consumer
            seen = {entry.key: entry for entry in [await asyncio.wait_for(anext(watch), 5) for _ in range(2)]}
            latest = seen["agent.device-1"]
            assert (latest.value, latest.revision) == (b"undrain", second.revision)
            await watch.aclose()
            await store.delete("agent.device-1", expected=second.revision)
            assert await store.get("agent.device-1") is None
        finally:
            await store.close()
        assert not server.violations(), server.violations()
        for stem, why in (("agent-device-1", "authorization violation"), (None, "certificate required")):
            await refused_for(why, NatsSiteState(url, tls=fleet.tls(stem), reconnect_wait_s=0.1))
        errors: list[str] = []

        async def error_cb(error: Exception) -> None:
            errors.append(str(error))

        client = await nats.connect(url, tls=ssl_context(fleet.tls("router-router")), error_cb=error_cb)
        try:
            with pytest.raises((nats.errors.Error, TimeoutError)):  # no answer, or JetStream's refusal
                await client.jetstream(timeout=1).add_stream(StreamConfig(name="other", subjects=["other.>"]))
            await until(
                lambda: any("permissions violation" in e.lower() for e in errors), "a permissions violation"
            )
        finally:
            await client.close()
        assert any("STREAM.CREATE.other" in line for line in server.violations()), server.violations()

    with nats_server(NATS_CONFIG.read_text(), fleet, tmp_path) as server:
        asyncio.run(main(server))


async def refused_for(why: str, store: Any) -> None:
    """A store client the server refuses: it never connects, says why, and refuses reads at once."""
    from router.site import StoreUnavailable

    await store.start()
    try:
        await until(lambda: why in store.describe().lower(), f"refused for {why}")
        assert not store.connected, store.describe()
        with pytest.raises(StoreUnavailable):
            await store.get("agent.device-1")
    finally:
        await store.close()


def ssl_context(tls: TlsSettings) -> Any:
    from router.site.nats_config import client_context

    return client_context(tls)


# -- no default secret, no --insecure ---------------------------------------------------------


DEPLOY_FILES = [DEPLOY / "compose.yaml", *sorted(K8S.glob("*.yaml")), *sorted(SYSTEMD.iterdir()), NATS_CONFIG]


def all_commands() -> Iterator[tuple[str, list[str]]]:
    """Every Stratus command line shipped: k8s containers (unexpanded), compose, systemd."""
    for item in STRATUS_CONTAINERS:
        yield container_id(item), [str(a) for a in item[1]["args"]]
    for name, service in yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"].items():
        if service.get("image", "").split(":")[0] == STRATUS_IMAGE:
            yield f"compose {name}", [str(a) for a in service["command"]]
    for unit in ("stratus-agent.service", "stratus-router.service"):
        yield f"systemd {unit}", unit_command(unit)[1:]


def test_no_command_runs_insecure_or_takes_a_token_on_its_command_line() -> None:
    commands = list(all_commands())
    assert len(commands) == len(STRATUS_CONTAINERS) + 6 + 2
    for where, argv in commands:
        flags = {token.split("=", 1)[0] for token in argv}
        assert "--insecure" not in flags, f"{where} runs --insecure"
        assert "--token" not in flags, f"{where} passes a token on its command line"


def test_no_default_token_anywhere() -> None:
    """No token at all: identities are certificates. No compose ${VAR:-default} (a value
    everyone knows), no *TOKEN* variable set in compose, k8s or systemd."""
    for path in DEPLOY_FILES:
        text = path.read_text()
        assert not re.search(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-", text), f"{path.name}: a default for a variable"
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    for name, service in compose["services"].items():
        environment = service.get("environment") or {}
        names = environment if isinstance(environment, dict) else [e.split("=", 1)[0] for e in environment]
        assert not [n for n in names if "TOKEN" in n], f"compose {name} sets a token"
    for item in STRATUS_CONTAINERS:
        assert not [v for v in item[1].get("env", []) if "TOKEN" in v["name"]], (
            f"{container_id(item)} sets a token"
        )
    assert not [k for k in settings() if "TOKEN" in k]
    for name in ("stratus-agent.service", "stratus-router.service", "nats-server.service"):
        unit = unit_settings(name)
        assert not [e for e in unit.get("Environment", []) if "TOKEN" in e or "PASS" in e], name
        assert "EnvironmentFile" not in unit, f"{name}: nothing to read from an environment file"


def test_no_router_runs_the_peer_protocol_and_no_file_names_it() -> None:
    """The store replaced the peer protocol: every router command (k8s, compose, systemd) runs on
    --site-state, and no file of deploy/ (the chart's templates and values too) still names
    --peers, --peer-token-file or --rollout-state."""
    routers = [(where, argv) for where, argv in all_commands() if argv[0] == "router"]
    assert len(routers) == 4  # k8s, compose's two, systemd
    for where, argv in routers:
        check_no_peer_flags(where, argv)
        assert "--site-state" in argv, f"{where} keeps its state alone"
    files = [
        p
        for p in DEPLOY.rglob("*")
        if p.is_file() and p.suffix in {".yaml", ".tpl", ".txt", ".json", ".service", ".conf", ".sh"}
    ]
    assert len(files) > 20
    for path in files:
        text = path.read_text()
        for flag in PEER_FLAGS:
            assert not re.search(rf"{re.escape(flag)}\b", text), f"{path.relative_to(ROOT)} names {flag}"
        assert "rolloutState" not in text, f"{path.relative_to(ROOT)} names rolloutState"


def test_the_checks_above_catch_insecure_and_a_default_token() -> None:
    """The scans can fail: a default in the compose syntax and --insecure are both seen."""
    assert re.search(
        r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-", "STRATUS_TOKEN: ${STRATUS_TOKEN:-stratus-compose-demo-token}"
    )
    assert re.search(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-", "${X-y}")
    with pytest.raises(AssertionError, match="--tls-ca"):
        tls_paths(argparse.Namespace(command="router", tls_cert="c", tls_key="k", tls_ca=None))


def test_the_image_has_a_generative_runtime_by_default() -> None:
    """The chart's openai.enabled=true served an OpenAI API from an image without the `llm`
    extra, so no agent or gateway in it could generate anything."""
    (extras,) = [arg for op, arg in dockerfile_instructions() if op == "ARG" and arg.startswith("EXTRAS=")]
    chosen = {e.strip() for e in json.loads(extras.removeprefix("EXTRAS=")).split(",")}
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "llm" in chosen and chosen <= set(optional), chosen
    assert any(dep.startswith("openvino-genai") for dep in optional["llm"])
