"""Nobody joins, steers or stalls the fleet who should not (security review F1, F3, F8, F9,
F15, F21): ids bound to credentials, operator calls off loopback, secure defaults, the cloud
gateway's client token, bounded batches and per-client limits, against real processes."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from edge_agent.agent import REDISCOVER_S
from stratus.convert.tensors import MAX_REQUEST_ITEMS
from stratus.devtools.launcher import Launched
from stratus.serving.channels import open_sync_channel
from stratus.serving.discovery import discover_all
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import MODELS, Cluster, fleet_status, infer, ready_count, request, wait_until
from .pki import tls_args

TOKENS = {"dev-1": "dev-1-own-token-0001", "dev-2": "dev-2-own-token-0002"}
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("STRATUS_")}


def stratus(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stratus.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**CLEAN_ENV, **(env or {})},
        check=False,
    )


def refused(agent: Launched, why: str) -> bool:
    """Refused for good (a credential that retrying cannot change): the reason is in its log,
    and it stopped with status 2 instead of retrying."""
    return why in agent.log() and "not linking to it" in agent.log() and agent.process.poll() == 2


def turned_away(agent: Launched, why: str) -> bool:
    """Refused for now (an id, or a pool's room, held by a live link): it retries."""
    return why in agent.log() and "reconnecting" in agent.log() and agent.process.poll() is None


def first_answer(router: str, hello: fpb.Hello) -> str:
    """Open one AgentLink, say ``hello`` and hang up: what the router answered first."""
    with grpc.insecure_channel(router) as channel:
        try:
            answer = next(fpb_grpc.AgentLinkStub(channel).Connect(iter([fpb.AgentMessage(hello=hello)]), timeout=10))
        except grpc.RpcError as refused:
            return f"{refused.code().name}: {refused.details()}"
    return answer.WhichOneof("kind") or ""


def test_one_agent_identity_opens_at_most_six_links_a_minute(cluster: Cluster, tmp_path: Path) -> None:
    """A stolen per-agent token churning its link: each new link is a registration, a credential
    check and a Welcome, so one identity opens six a minute; another identity is not held back."""
    tokens = tmp_path / "agents.tokens"
    tokens.write_text("".join(f"{agent} {token}\n" for agent, token in TOKENS.items()))
    router = cluster.router("--agent-tokens-file", str(tokens)).address

    def hello(agent: str) -> fpb.Hello:
        return fpb.Hello(agent_id=agent, tier=fpb.TIER_DEVICE, capacity=1, token=TOKENS[agent],
                         variants=[fpb.VariantInfo(name="digits-small", family="digits")])  # fmt: skip

    answers = [first_answer(router, hello("dev-1")) for _ in range(7)]
    assert answers[:6] == ["welcome"] * 6
    assert answers[6] == (
        "RESOURCE_EXHAUSTED: token:dev-1 opened 6 links in the last 60 s, the most one agent identity "
        "may; wait before reconnecting"
    )
    assert first_answer(router, hello("dev-2")) == "welcome"


def test_per_agent_tokens_bind_each_id_to_its_own_token(cluster: Cluster, tmp_path: Path) -> None:
    tokens = tmp_path / "agents.tokens"
    tokens.write_text("".join(f"{agent} {token}\n" for agent, token in TOKENS.items()))
    router = cluster.router("--agent-tokens-file", str(tokens)).address
    cluster.agent("dev-1", router, env={"STRATUS_AGENT_TOKEN": TOKENS["dev-1"]})
    wait_until(lambda: ready_count(router) == 1)
    # dev-2 holds a valid token, but not dev-1's: it can neither join as dev-1 nor push it off.
    hijacker = cluster.agent("dev-1", router, env={"STRATUS_AGENT_TOKEN": TOKENS["dev-2"]}, tier="edge")
    stranger = cluster.agent("dev-9", router, env={"STRATUS_AGENT_TOKEN": TOKENS["dev-1"]})
    wait_until(
        lambda: refused(hijacker, "UNAUTHENTICATED: the token of agent 'dev-1' is missing, wrong or revoked")
    )
    wait_until(lambda: refused(stranger, "the token of agent 'dev-9' is missing, wrong or revoked"))
    agents = fleet_status(router).agents
    assert [(a.id, a.tier, a.state) for a in agents] == [("dev-1", fpb.TIER_DEVICE, fpb.AGENT_STATE_READY)]
    # The same identity may replace its own link (an agent that restarted before its old
    # link was noticed): the real dev-1 comes back as itself.
    cluster.agent("dev-1", router, env={"STRATUS_AGENT_TOKEN": TOKENS["dev-1"]}, tier="edge")
    wait_until(
        lambda: [(a.id, a.tier) for a in fleet_status(router).agents if a.state == 1] == [("dev-1", 2)]
    )


def test_certificates_bind_ids_and_roles(cluster: Cluster, pki) -> None:  # type: ignore[no-untyped-def]
    router = cluster.router(*tls_args(pki["router"]), "--agent-pool", "pool=4").address
    cluster.agent("dev-1", router, *tls_args(pki["dev-1"]))
    cluster.agent("pool.b", router, *tls_args(pki["pool"]))
    wait_until(lambda: len(fleet_status(router, pki["operator"]).agents) == 2)
    wrong_name = cluster.agent("dev-7", router, *tls_args(pki["dev-2"]))
    operator_as_agent = cluster.agent("operator", router, *tls_args(pki["operator"]))
    wait_until(lambda: refused(wrong_name, "agent id 'dev-7' does not match its certificate's name 'dev-2'"))
    wait_until(
        lambda: refused(operator_as_agent, "a operator 'operator' certificate cannot join as an agent")
    )
    # Two certificates that may both hold "pool.a" (the pool's, and pool.a's own): the first
    # to link holds it, and the other identity does not replace it. (A name that is also a
    # pool's member id can be locked out by the pool: noted in the README.)
    cluster.agent("pool.a", router, *tls_args(pki["pool"]))
    wait_until(lambda: "pool.a" in {a.id for a in fleet_status(router, pki["operator"]).agents})
    rival = cluster.agent("pool.a", router, *tls_args(pki["pool.a"]), tier="edge")
    wait_until(lambda: turned_away(rival, "ALREADY_EXISTS: agent id 'pool.a' is linked by another identity"))
    assert {a.id for a in fleet_status(router, pki["operator"]).agents} == {"dev-1", "pool.a", "pool.b"}
    # Roles: an operator drains, an agent's or a client's certificate does not.
    for who in ("dev-1", "client"):
        with open_sync_channel(router, pki[who]) as channel, pytest.raises(grpc.RpcError) as error:
            fpb_grpc.FleetStub(channel).Drain(fpb.DrainRequest(agent_id="dev-1"), timeout=5)
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED, who
        assert "Drain needs the operator role" in (error.value.details() or "")
    with open_sync_channel(router, pki["operator"]) as channel:
        assert fpb_grpc.FleetStub(channel).Drain(fpb.DrainRequest(agent_id="dev-1"), timeout=5).accepted
    # Another router's certificate is no operator either (routers share a store, not calls).
    with open_sync_channel(router, pki["router-2"]) as channel, pytest.raises(grpc.RpcError) as error:
        fpb_grpc.FleetStub(channel).Drain(fpb.DrainRequest(agent_id="dev-1"), timeout=5)
    assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "Drain needs the operator role; this certificate is a router" in (error.value.details() or "")


def _outside_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    for target in ("192.0.2.1", "10.254.254.254", "8.8.8.8"):  # no packet is sent: this picks a route
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((target, 9))
            except OSError:
                continue
            address = str(probe.getsockname()[0])
            if not address.startswith("127."):
                return address
    return None


def test_operator_calls_from_another_machine_need_a_credential(cluster: Cluster) -> None:
    outside = _outside_address()
    if outside is None:
        pytest.skip("no address but loopback on this machine")
    router = cluster.router("--insecure", listen="0.0.0.0:0")
    port = router.address.rsplit(":", 1)[1]
    wait_until(lambda: "runs with --insecure" in router.log())  # and again every minute
    # security2 N7: listening off loopback, no caller counts as local, not even one from
    # 127.0.0.1 (a sidecar or proxy on the machine makes every caller look so).
    for address in (f"127.0.0.1:{port}", f"{outside}:{port}"):
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as error:
            fpb_grpc.FleetStub(channel).Drain(fpb.DrainRequest(agent_id="nobody"), timeout=5)
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED, (address, error.value.details())
        assert "listens off loopback and has no credential for it" in (error.value.details() or "")
    # A router on loopback alone takes them from its own machine (a demo needs no set-up).
    local = cluster.router().address
    with grpc.insecure_channel(local) as channel, pytest.raises(grpc.RpcError) as error:
        fpb_grpc.FleetStub(channel).Drain(fpb.DrainRequest(agent_id="nobody"), timeout=5)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND, error.value.details()


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["router", "--listen", "0.0.0.0:0"], "the router would listen on 0.0.0.0:0 without TLS"),
        (["cloud", "--listen", "0.0.0.0:0", "--models", str(MODELS)], "the cloud gateway would listen"),
        (
            [
                "agent",
                "--tier",
                "device",
                "--models",
                str(MODELS),
                "--router",
                "127.0.0.1:1",
                "--serve",
                "0.0.0.0:0",
            ],
            "the agent's --serve endpoint would listen on 0.0.0.0:0 without TLS",
        ),
        (["agent", "--tier", "device", "--models", str(MODELS), "--router", "auto"], "give --tls-ca"),
        (
            ["agent", "--tier", "device", "--models", str(MODELS), "--router", "192.0.2.1:8001"],
            "router 192.0.2.1:8001 is not on this machine",
        ),
        (
            ["agent", "--tier", "device", "--models", str(MODELS)],
            # --router may come from --config's [agent] table or $STRATUS_AGENT_ROUTER too
            "agent needs router: give --router, $STRATUS_AGENT_ROUTER or router in [agent]",
        ),
    ],
)
def test_unprotected_exposure_is_refused_before_anything_starts(args: list[str], problem: str) -> None:
    done = stratus(*args, timeout=30)
    assert done.returncode == 2, done
    assert problem in done.stderr, done.stderr


def test_zeroconf_is_opt_in_and_dials_only_a_router_the_ca_vouches_for(cluster: Cluster, pki, digits) -> None:  # type: ignore[no-untyped-def]
    real = cluster.start("router", ["router", "--listen", "127.0.0.1:0", *tls_args(pki["router"])])
    impostor = cluster.start("impostor", ["router", "--listen", "127.0.0.1:0", *tls_args(pki["intruder"])])
    # security2 N2: a stolen agent key from the fleet's own CA, serving as a router
    insider = cluster.start("insider", ["router", "--listen", "127.0.0.1:0", *tls_args(pki["dev-2"])])
    fakes = {impostor.address, insider.address}
    seen: set[str] = set()
    for _ in range(10):  # one look may miss an advertisement that the next one finds
        seen |= set(asyncio.run(discover_all(timeout_s=10.0)))
        if {real.address, *fakes} <= seen:
            break
    assert {real.address, *fakes} <= seen, (seen, real.address, fakes)
    agent = cluster.agent("dev-1", "auto", *tls_args(pki["dev-1"]))
    wait_until(lambda: [a.id for a in fleet_status(real.address, pki["operator"]).agents] == ["dev-1"], 30)
    # Neither fake got a Hello: the agent's TLS handshake refused the certificate first (the
    # rogue CA's, and the agent certificate that carries no router's name).
    # A fake the agent's first look missed is found by its next, REDISCOVER_S later.
    for fake, process in ((impostor.address, impostor), (insider.address, insider)):
        wait_until(lambda fake=fake: f"link to router {fake} lost" in agent.log(), REDISCOVER_S + 15)
        assert "dev-1" not in process.log() and "joined" not in process.log()
    # The operator's CLI refuses the insider too, before it sends anything.
    shown = stratus("fleet", "status", "--router", insider.address, *tls_args(pki["operator"]), timeout=30)
    assert shown.returncode != 0 and "UNAVAILABLE" in shown.stderr, shown.stderr
    _, served = infer(real.address, digits.held_out.x[:1], tls=pki["client"])
    assert served.agent == "dev-1"


def test_routers_found_by_dns_are_verified_by_name(cluster: Cluster, pki) -> None:  # type: ignore[no-untyped-def]
    # Its certificate names "localhost" only: each address dns:localhost resolves to is
    # dialled by IP and checked against the name (a headless Service's pod IPs are unknown).
    router = cluster.router(*tls_args(pki["router-by-name"])).address
    port = router.rsplit(":", 1)[1]
    with pytest.raises(grpc.RpcError) as by_ip:  # what dialling the IP alone would meet
        fleet_status(router, pki["operator"])
    assert by_ip.value.code() == grpc.StatusCode.UNAVAILABLE
    cluster.agent("dev-1", f"dns:localhost:{port}", *tls_args(pki["dev-1"]))
    wait_until(lambda: ready_count(f"localhost:{port}", pki["operator"]) == 1, 30)


def test_the_cloud_gateway_serves_only_callers_with_its_token(
    cluster: Cluster, tmp_path: Path, digits
) -> None:  # type: ignore[no-untyped-def]
    token = tmp_path / "cloud.token"
    token.write_text("cloud-client-token-0001\n")
    cloud = cluster.cloud("--client-token-file", str(token)).address
    with grpc.insecure_channel(cloud) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=5).live  # probes need no token
        for metadata in (
            (),
            (("authorization", "Bearer guess"),),
            (("authorization", "cloud-client-token-0001"),),
        ):
            with pytest.raises(grpc.RpcError) as error:
                stub.ModelInfer(request(digits.held_out.x[:1]), metadata=metadata, timeout=5)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
            assert "needs 'authorization: Bearer TOKEN'" in (error.value.details() or "")
            # a stream is guarded as a call is (the router escalates over one)
            stream = stub.ModelStreamInfer(iter([request(digits.held_out.x[:1])]), metadata=metadata, timeout=5)
            with pytest.raises(grpc.RpcError) as error:
                list(stream)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
            assert "ModelStreamInfer needs 'authorization: Bearer TOKEN'" in (error.value.details() or "")
    router = cluster.router("--cloud", cloud, "--cloud-token-file", str(token)).address
    cluster.agent("dev-1", router)
    wait_until(lambda: ready_count(router) == 1 and fleet_status(router).cloud.state == "connected")
    _, served = infer(router, digits.held_out.x[:1], min_confidence=1.0)
    assert served.path == (Tier.DEVICE, Tier.CLOUD) and not served.degraded
    # The same credential as a header from a file (a foreign cloud's token), never on the command line.
    headers = tmp_path / "cloud.headers"
    headers.write_text("# the gateway's client token\nauthorization = Bearer cloud-client-token-0001\n")
    by_file = cluster.router("--cloud", cloud, "--cloud-header-file", str(headers), role="router-2").address
    cluster.agent("dev-2", by_file)
    wait_until(lambda: ready_count(by_file) == 1 and fleet_status(by_file).cloud.state == "connected")
    _, served = infer(by_file, digits.held_out.x[:1], min_confidence=1.0)
    assert served.path == (Tier.DEVICE, Tier.CLOUD) and not served.degraded
    headers.write_text("Bearer cloud-client-token-0001\n")  # no KEY=: refused by line, the value unshown
    refused = stratus("router", "--listen", "127.0.0.1:0", "--cloud", cloud, "--cloud-header-file", str(headers))
    assert refused.returncode != 0 and "--cloud-header-file line 1 (key \"(no '=')\")" in refused.stderr, refused.stderr
    assert "cloud-client-token-0001" not in refused.stderr + refused.stdout


def test_a_request_over_max_batch_size_is_refused_where_it_is_advertised(fleet, digits) -> None:  # type: ignore[no-untyped-def]
    many = np.repeat(digits.held_out.x[:1], MAX_REQUEST_ITEMS + 1, axis=0)
    for server in (fleet.router.address, fleet.cloud.address):
        with grpc.insecure_channel(server) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            config = stub.ModelConfig(pb.ModelConfigRequest(name="digits"), timeout=5).config
            assert config.max_batch_size == MAX_REQUEST_ITEMS
            with pytest.raises(grpc.RpcError) as error:
                stub.ModelInfer(request(many), timeout=10)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"holds {MAX_REQUEST_ITEMS + 1} items; a request may hold at most" in (
                error.value.details() or ""
            )
            full = stub.ModelInfer(request(many[:MAX_REQUEST_ITEMS]), timeout=30)
            assert full.outputs[0].shape[0] == MAX_REQUEST_ITEMS


def test_one_client_cannot_take_every_slot(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    router = cluster.router("--max-requests-per-client", "2").address
    # each answer takes 1.5 s and the six calls leave together: they overlap on any machine
    cluster.agent("slow", router, "--emulate-slow-ms", "1500", "--concurrency", "8", "--max-batch", "1")
    wait_until(lambda: ready_count(router) == 1)
    together = threading.Barrier(6)

    def one(index: int) -> str:
        if index >= 0:
            together.wait(timeout=10)
        try:
            infer(router, digits.held_out.x[:1], timeout=10)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        return "ok"

    with ThreadPoolExecutor(6) as pool:
        outcomes = list(pool.map(one, range(6)))
    assert outcomes.count("ok") >= 2, outcomes
    refusals = [o for o in outcomes if o != "ok"]
    assert refusals and all(
        o.startswith("RESOURCE_EXHAUSTED: this client has 2 requests in flight here") for o in refusals
    ), outcomes
    assert one(-1) == "ok"  # the slots came back


def test_a_private_status_needs_the_operator(cluster: Cluster, tmp_path: Path) -> None:
    token = tmp_path / "operator.token"
    token.write_text("operator-token-0001\n")
    router = cluster.router("--private-status", "--operator-token-file", str(token)).address
    with grpc.insecure_channel(router) as channel:
        stub = fpb_grpc.FleetStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.Status(fpb.FleetStatusRequest(include_agents=True), timeout=5)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert error.value.details() == "Status needs the operator token"
        with pytest.raises(grpc.RpcError) as watched:
            next(iter(stub.Watch(fpb.FleetWatchRequest(), timeout=5)))
        assert watched.value.code() == grpc.StatusCode.UNAUTHENTICATED
    shown = stratus("fleet", "status", "--router", router, "--operator-token-file", str(token))
    assert shown.returncode == 0 and "cloud" in shown.stdout, shown
    anonymous = stratus("fleet", "status", "--router", router)
    assert anonymous.returncode != 0 and "UNAUTHENTICATED" in anonymous.stderr, anonymous


def test_one_agent_certificate_is_one_agent_and_a_pool_holds_what_its_operator_set(
    cluster: Cluster, pki
) -> None:  # type: ignore[no-untyped-def]
    """security2 N3: the suffix rule let one device's certificate register 40 agents, and pool
    members take over each other's live ids. Now a plain agent certificate holds its own name
    only; a pool (--agent-pool NAME=MAX) holds at most MAX ids, none replacing a linked one."""
    router = cluster.router(*tls_args(pki["router"]), "--agent-pool", "pool=2").address
    cluster.agent("dev-1", router, *tls_args(pki["dev-1"]))
    wait_until(lambda: ready_count(router, pki["operator"]) == 1)
    sybil = cluster.agent("dev-1.s0", router, *tls_args(pki["dev-1"]))
    wait_until(
        lambda: refused(
            sybil, "agent id 'dev-1.s0' does not match its certificate's name 'dev-1' (it may be only 'dev-1'"
        )
    )
    cluster.agent("pool.n1", router, *tls_args(pki["pool"]))
    cluster.agent("pool.n2", router, *tls_args(pki["pool"]))
    wait_until(lambda: ready_count(router, pki["operator"]) == 3)
    third = cluster.agent("pool.n3", router, *tls_args(pki["pool"]))
    wait_until(
        lambda: turned_away(
            third, "RESOURCE_EXHAUSTED: pool 'pool' has 2 agents linked, the most its operator configured (--agent-pool pool=2)"
        )
    )
    takeover = cluster.agent("pool.n1", router, *tls_args(pki["pool"]), tier="edge")
    wait_until(
        lambda: turned_away(takeover, "ALREADY_EXISTS: agent id 'pool.n1' is linked by another member of pool 'pool'")
    )
    agents = fleet_status(router, pki["operator"]).agents
    assert sorted((a.id, a.tier) for a in agents) == [
        ("dev-1", fpb.TIER_DEVICE), ("pool.n1", fpb.TIER_DEVICE), ("pool.n2", fpb.TIER_DEVICE)
    ]  # fmt: skip


def test_deleting_an_agents_line_ends_its_live_link_within_a_heartbeat(
    cluster: Cluster, tmp_path: Path, digits
) -> None:  # type: ignore[no-untyped-def]
    """security2 N4: a revoked agent kept its live link and went on answering clients."""
    tokens = tmp_path / "agents.tokens"
    tokens.write_text("".join(f"{agent} {token}\n" for agent, token in TOKENS.items()))
    router = cluster.router("--agent-tokens-file", str(tokens)).address
    dev1 = cluster.agent("dev-1", router, env={"STRATUS_AGENT_TOKEN": TOKENS["dev-1"]})
    cluster.agent("dev-2", router, env={"STRATUS_AGENT_TOKEN": TOKENS["dev-2"]})
    wait_until(lambda: ready_count(router) == 2)
    revoked = tmp_path / "agents.tokens.new"
    revoked.write_text(f"dev-2 {TOKENS['dev-2']}\n")
    revoked.replace(tokens)  # an atomic rename, as an operator's tooling would write it
    started = time.monotonic()
    wait_until(lambda: ready_count(router) == 1, timeout_s=10)
    cut_off_s = time.monotonic() - started
    assert [a.id for a in fleet_status(router).agents if a.state == fpb.AGENT_STATE_READY] == ["dev-2"]
    wait_until(lambda: refused(dev1, "the token of agent 'dev-1' is missing, wrong or revoked"))
    for _ in range(10):  # nothing is answered by the revoked agent any more
        _, served = infer(router, digits.held_out.x[:1], max_tier="device")
        assert served.agent == "dev-2"
    assert cut_off_s < 3.0, (
        f"the revoked link ended {cut_off_s:.1f} s after the change (heartbeats every 1 s)"
    )


def test_the_cloud_takes_inference_only_from_routers_and_clients_under_mutual_tls(
    cluster: Cluster, pki, digits
) -> None:  # type: ignore[no-untyped-def]
    """security2 N9: under mutual TLS the cloud answered any certificate of the CA, a device's
    included; a stolen device key then used the most expensive tier directly."""
    cloud = cluster.cloud(*tls_args(pki["cloud"])).address
    for who, expected in (
        ("router", grpc.StatusCode.OK),
        ("client", grpc.StatusCode.OK),
        ("dev-1", grpc.StatusCode.PERMISSION_DENIED),
    ):
        with open_sync_channel(cloud, pki[who]) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            assert stub.ServerLive(pb.ServerLiveRequest(), timeout=5).live  # probes are open to all
            try:
                stub.ModelInfer(request(digits.held_out.x[:1], model="digits"), timeout=10)
                code = grpc.StatusCode.OK
            except grpc.RpcError as error:
                code = error.code()
                assert "inference here needs a client or operator or router certificate" in (
                    error.details() or ""
                )
        assert code == expected, who


def test_a_familys_description_comes_from_the_routers_own_models_folder(cluster: Cluster, tmp_path: Path, digits) -> None:  # type: ignore[no-untyped-def]
    """security2 F2: the first agent to describe a family set it for everyone; a compromised
    device that spoke first (thresholds 0) locked the real agents out and answered every
    request. With --models the description is the operator's, whoever speaks first."""
    forged = tmp_path / "forged"
    shutil.copytree(MODELS / "digits", forged / "digits")
    family = forged / "digits" / "family.toml"
    text = family.read_text()
    family.write_text(text.replace("device = 0.7366", "device = 0.0").replace("edge = 0.7206", "edge = 0.0"))
    assert family.read_text() != text
    router = cluster.router("--models", str(MODELS)).address
    rogue = cluster.agent("rogue", router, models=str(forged))
    wait_until(lambda: "differs from the router's own models folder (thresholds differ)" in rogue.log(), 30)
    cluster.agent("dev-1", router)
    wait_until(lambda: ready_count(router) == 1, 30)
    assert [a.id for a in fleet_status(router).agents if a.state == fpb.AGENT_STATE_READY] == ["dev-1"]
    for _ in range(6):
        _, served = infer(router, np.zeros((1, 64), np.float32), max_tier="device")
        assert served.agent == "dev-1"


def test_a_revoked_certificate_is_refused_and_its_live_link_ends(cluster: Cluster, pki, tmp_path: Path, digits) -> None:  # type: ignore[no-untyped-def]
    """security2 N12: a stolen key stayed valid for its 825 days; now it can be revoked while
    the router runs, by SPIFFE id (every certificate of that identity) or by serial."""
    from cryptography import x509

    revoked = tmp_path / "revoked"
    revoked.write_text("# nothing revoked yet\n")
    router = cluster.router(*tls_args(pki["router"]), "--revoked-certificates", str(revoked)).address
    dev1 = cluster.agent("dev-1", router, *tls_args(pki["dev-1"]))
    cluster.agent("dev-2", router, *tls_args(pki["dev-2"]))
    wait_until(lambda: ready_count(router, pki["operator"]) == 2, 30)
    infer(router, digits.held_out.x[:1], tls=pki["client"])  # the client is trusted
    update = tmp_path / "revoked.new"
    update.write_text("spiffe://stratus/agent/dev-1\n")
    update.replace(revoked)
    started = time.monotonic()
    wait_until(lambda: ready_count(router, pki["operator"]) == 1, 10)
    cut_off_s = time.monotonic() - started
    wait_until(lambda: refused(dev1, "certificate spiffe://stratus/agent/dev-1 is revoked"), 20)
    assert [a.id for a in fleet_status(router, pki["operator"]).agents if a.state == fpb.AGENT_STATE_READY] == ["dev-2"]
    assert cut_off_s < 3.0, cut_off_s
    # One certificate by its serial: the client's calls are refused from the next one on.
    assert pki["client"].cert is not None
    serial = x509.load_pem_x509_certificate(pki["client"].cert.read_bytes()).serial_number
    update.write_text(f"spiffe://stratus/agent/dev-1\nserial:{serial:x}\n")
    update.replace(revoked)
    with pytest.raises(grpc.RpcError) as error:
        infer(router, digits.held_out.x[:1], tls=pki["client"])
    assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"certificate serial {serial:x} is revoked" in (error.value.details() or "")
