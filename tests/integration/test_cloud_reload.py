"""The cloud gateway loads new variants without a restart, on SIGHUP or through its router
(`stratus fleet reload --cloud`); a folder that no longer loads leaves the old set serving."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from stratus.devtools.launcher import Launched
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc

from .cluster import Cluster, fleet_status, infer, ready_count, wait_until
from .test_cli_errors import one_line, stratus
from .test_fleet_status import stopped_cleanly
from .variants import copy_digits


def add_cloud_variant(models: Path, name: str, *, broken: bool = False) -> None:
    """A cloud variant of digits: digits-large's weights under a new name, or (``broken``) a
    file that is not a model at all."""
    folder = models / "digits"
    if broken:
        (folder / f"{name}.onnx").write_bytes(b"this is not an ONNX model")
    else:
        shutil.copy(folder / "digits-large.onnx", folder / f"{name}.onnx")
    entry = f'\n[[variants]]\nname = "{name}"\ntier = "cloud"\nfiles = {{ onnx = "{name}.onnx" }}\n'
    config = folder / "family.toml"
    config.write_text(config.read_text() + entry)


def said(cloud: Launched, text: str) -> str:
    """The cloud's log, once it says ``text``."""
    wait_until(lambda: text in cloud.log(), 60)
    return cloud.log()


def test_sighup_loads_a_new_cloud_variant_and_a_broken_one_keeps_the_old_set(
    cluster: Cluster, tmp_path: Path, digits
) -> None:  # type: ignore[no-untyped-def]
    models = copy_digits(tmp_path / "models")
    config = models / "digits" / "family.toml"
    cloud = cluster.cloud("--models", str(models))
    x = digits.held_out.x[:5]
    with pytest.raises(grpc.RpcError) as absent:
        infer(cloud.address, x, model="digits-large-v2")
    assert absent.value.code() == grpc.StatusCode.NOT_FOUND

    add_cloud_variant(models, "digits-large-v2")
    cloud.process.send_signal(signal.SIGHUP)
    assert "reloaded" in said(cloud, "added digits-large-v2")
    response, served = infer(cloud.address, x, model="digits-large-v2")
    assert served.variant == "digits-large-v2" and list(response.outputs[0].shape) == [5, 10]

    good = config.read_text()
    add_cloud_variant(models, "digits-large-broken", broken=True)
    cloud.process.send_signal(signal.SIGHUP)
    (failure,) = [line for line in said(cloud, "reload failed").splitlines() if "reload failed" in line]
    still = failure.split("still serving ", 1)[1].split(": ", 1)[0].split(", ")
    assert "digits-large-v2" in still and "digits-large-broken" not in still, failure
    assert "digits-large-broken" in failure.split("still serving ", 1)[1]  # why: the file that failed
    assert infer(cloud.address, x, model="digits-large-v2")[1].variant == "digits-large-v2"
    with pytest.raises(grpc.RpcError) as refused:
        infer(cloud.address, x, model="digits-large-broken")
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    config.write_text(good)
    assert cloud.process.poll() is None
    stopped_cleanly([cloud])  # the broken file's loaders wrote nothing of their own to stderr


def test_fleet_reload_cloud_goes_through_the_router_which_then_routes_the_new_variant(
    cluster: Cluster, tmp_path: Path, digits
) -> None:  # type: ignore[no-untyped-def]
    models = copy_digits(tmp_path / "models")
    cloud = cluster.cloud("--models", str(models))
    router = cluster.router("--cloud", cloud.address).address
    cluster.agent("device-1", router, "--models", str(models))
    wait_until(lambda: ready_count(router) == 1, 60)

    add_cloud_variant(models, "digits-large-v3")
    done = stratus("fleet", "reload", "--cloud", "--router", router)
    assert done.returncode == 0, done.stderr
    assert "added digits-large-v3" in done.stdout and "digits-large-v3" in done.stdout.splitlines()[-1]
    _, served = infer(router, digits.held_out.x[:3], model="digits-large-v3")  # at once: the router learnt it
    assert (served.variant, served.tier.label) == ("digits-large-v3", "cloud")

    add_cloud_variant(models, "digits-large-bad", broken=True)
    failed = stratus("fleet", "reload", "--cloud", "--router", router)
    assert failed.returncode == 1 and "reload failed; still serving" in failed.stdout
    assert "digits-large-v3" in failed.stdout.splitlines()[-1]  # what it still serves

    alone = cluster.router(role="alone").address
    assert "this router runs without a cloud" in one_line(
        stratus("fleet", "reload", "--cloud", "--router", alone)
    )
    assert "give an AGENT_ID, or --cloud" in one_line(stratus("fleet", "reload", "--router", router))


def test_a_cloud_reload_needs_an_operator_and_the_gateway_needs_the_routers_token(
    cluster: Cluster, tmp_path: Path
) -> None:
    tokens = {"operator": "operator-secret", "cloud": "cloud-secret"}
    files = {role: tmp_path / f"{role}.token" for role in tokens}
    for role, path in files.items():
        path.write_text(tokens[role] + "\n")
    cloud = cluster.cloud("--client-token-file", str(files["cloud"])).address
    router = cluster.router(
        "--cloud",
        cloud,
        "--operator-token-file",
        str(files["operator"]),
        "--cloud-token-file",
        str(files["cloud"]),
    ).address
    wait_until(lambda: fleet_status(router).cloud.state == "connected", 30)
    base = {k: v for k, v in os.environ.items() if not k.startswith("STRATUS_")}

    def reload_cloud(token: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "stratus.cli", "fleet", "reload", "--cloud", "--router", router]
        env = {**base, "STRATUS_OPERATOR_TOKEN": token}
        return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, check=False)

    refused = reload_cloud(tokens["cloud"])
    assert refused.returncode == 2 and "ReloadCloud needs the operator token" in refused.stderr
    done = reload_cloud(tokens["operator"])
    assert done.returncode == 0 and "nothing changed" in done.stdout, done.stderr
    with grpc.insecure_channel(cloud) as channel:
        gateway = fpb_grpc.CloudGatewayStub(channel)
        for sent in ((), (("authorization", f"Bearer {tokens['operator']}"),)):
            with pytest.raises(grpc.RpcError) as direct:
                gateway.Reload(fpb.GatewayReloadRequest(), metadata=sent, timeout=10)
            assert direct.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "the gateway's client token" in (direct.value.details() or "")
