"""Who may join: the fleet token, TLS and mutual TLS on every link."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from stratus.devtools.launcher import Launched
from stratus.serving.channels import NO_TLS, TlsSettings, open_sync_channel
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc

from .cluster import Cluster, fleet_status, infer, ready_count, states, wait_until
from .pki import tls_args


def test_router_refuses_agents_without_the_token(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    router = cluster.router(env={"STRATUS_TOKEN": "s3cret"})
    cluster.agent("no-token", router.address)
    cluster.agent("bad-token", router.address, env={"STRATUS_AGENT_TOKEN": "guess"})
    cluster.start(
        "env-token",
        [
            "agent",
            "--tier",
            "device",
            "--models",
            str(Path(__file__).parents[2] / "models"),
            "--router",
            router.address,
            "--name",
            "env-token",
        ],
        env={"STRATUS_TOKEN": "s3cret"},
    )
    wait_until(lambda: ready_count(router.address) == 1)
    assert set(states(router.address)) == {"env-token"}
    log = router.log()
    assert "refused agent 'no-token' from ipv4:127.0.0.1" in log and "refused agent 'bad-token'" in log
    assert infer(router.address, digits.held_out.x[:1])[1].agent == "env-token"  # inference needs no token
    with open_sync_channel(router.address) as channel:
        stub = fpb_grpc.FleetStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.Drain(fpb.DrainRequest(agent_id="env-token"), timeout=5)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Drain(fpb.DrainRequest(agent_id="env-token", token="s3cret"), timeout=5).accepted


def test_mutual_tls_on_every_link(cluster: Cluster, pki: dict[str, TlsSettings], digits) -> None:  # type: ignore[no-untyped-def]
    cloud = cluster.cloud(*tls_args(pki["cloud"]))
    router = cluster.router("--cloud", cloud.address, *tls_args(pki["router"])).address
    cluster.agent("dev-1", router, *tls_args(pki["dev-1"]))
    wait_until(
        lambda: (
            fleet_status(router, pki["client"]).cloud.state == "connected"
            and len(fleet_status(router, pki["client"]).agents) == 1
        )
    )
    _, served = infer(router, digits.held_out.x[:1], min_confidence=1.0, tls=pki["client"])
    assert served.path == (Tier.DEVICE, Tier.CLOUD)
    # An operator reloads the cloud through the router, which asks it with its router certificate;
    # a client's certificate may call the cloud's inference, not its Reload.
    with open_sync_channel(router, pki["operator"]) as channel:
        answer = fpb_grpc.FleetStub(channel).ReloadCloud(fpb.CloudReloadRequest(timeout_s=60), timeout=70)
    assert answer.ok and "nothing changed" in answer.message, answer.message
    with open_sync_channel(cloud.address, pki["client"]) as channel, pytest.raises(grpc.RpcError) as reload:
        fpb_grpc.CloudGatewayStub(channel).Reload(fpb.GatewayReloadRequest(), timeout=10)
    assert reload.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "a router's or operator's certificate; this one is client 'client'" in (reload.value.details() or "")
    # Both servers refuse a client without a certificate, one from a rogue CA, and plaintext.
    for server in (router, cloud.address):
        for refused in ("no-cert", "intruder", "plaintext"):
            tls = pki.get(refused, NO_TLS)
            with pytest.raises(grpc.RpcError) as error:
                infer(server, digits.held_out.x[:1], tls=tls, timeout=5)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE, (server, refused, error.value)
    rejected = [cluster.agent("intruder", router, *tls_args(pki["intruder"])), cluster.agent("plain", router)]

    def tried_and_failed(agent: Launched) -> bool:
        log = agent.log()
        return f"link to router {router} lost" in log and "reconnecting" in log

    for agent in rejected:  # each tried, more than once, and was refused
        wait_until(lambda agent=agent: tried_and_failed(agent), timeout_s=20)
        assert "linked to router" not in agent.log(), agent.role
    assert set(a.id for a in fleet_status(router, pki["client"]).agents) == {"dev-1"}
