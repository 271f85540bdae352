"""One credential per role (the security review's F10): agents, operators and peer routers
each carry their own token, read from a file or the environment, and one role's token does
not open another's door."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from router.peers import sync_parts
from stratus.serving.sync_proofs import SYNC_ANSWER, SYNC_REQUEST, proof_holds, sync_proof
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc

from .cluster import Cluster, fleet_status, ready_count, wait_until

TOKENS = {"agent": "agent-secret", "operator": "operator-secret", "peer": "peer-secret"}


def fleet(router: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stratus.cli", "fleet", *args, "--router", router],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def test_each_role_needs_its_own_token(cluster: Cluster, tmp_path: Path) -> None:
    files = {}
    for role, token in TOKENS.items():
        files[role] = tmp_path / f"{role}.token"
        files[role].write_text(token + "\n")
    router = cluster.router(*(a for role, path in files.items() for a in (f"--{role}-token-file", str(path))))
    address = router.address
    cluster.agent("dev-1", address, "--agent-token-file", str(files["agent"]))
    impostor = cluster.agent("dev-2", address, env={"STRATUS_AGENT_TOKEN": TOKENS["operator"]})
    wait_until(lambda: ready_count(address) == 1)
    wait_until(lambda: "the agent token is missing or wrong" in impostor.log())  # it tried, and was refused
    assert [a.id for a in fleet_status(address).agents] == ["dev-1"]  # an operator's token makes no agent

    base = {k: v for k, v in __import__("os").environ.items() if not k.startswith("STRATUS_")}
    refused = fleet(address, "drain", "dev-1", env={**base, "STRATUS_OPERATOR_TOKEN": TOKENS["agent"]})
    assert refused.returncode != 0 and "Drain needs the operator token" in refused.stderr + refused.stdout
    drained = fleet(address, "drain", "dev-1", env={**base, "STRATUS_OPERATOR_TOKEN": TOKENS["operator"]})
    assert drained.returncode == 0, drained.stderr
    wait_until(lambda: [a.state for a in fleet_status(address).agents] == [fpb.AGENT_STATE_DRAINING])
    push = ("thresholds", "digits", "--apply", "device=0.9")
    unpushed = fleet(address, *push, env={**base, "STRATUS_OPERATOR_TOKEN": TOKENS["agent"]})
    assert unpushed.returncode != 0 and "pushing thresholds needs the operator token" in unpushed.stderr
    pushed = fleet(address, *push, env={**base, "STRATUS_OPERATOR_TOKEN": TOKENS["operator"]})
    assert pushed.returncode == 0 and "pushed version 1 in force" in pushed.stdout, pushed.stderr

    with grpc.insecure_channel(address) as channel:
        stub = fpb_grpc.FleetStub(channel)
        for wrong in (TOKENS["operator"], TOKENS["agent"], ""):
            with pytest.raises(grpc.RpcError) as unsynced:
                stub.SyncRollouts(fpb.RolloutSync(router_id="intruder", state_json="", token=wrong), timeout=5)
            assert unsynced.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert unsynced.value.details() == "SyncRollouts needs proof of the peer token"
        # The peer token itself is no longer sent: it would reach whoever answers the address.
        with pytest.raises(grpc.RpcError) as raw:
            stub.SyncRollouts(fpb.RolloutSync(router_id="peer", state_json="", token=TOKENS["peer"]), timeout=5)
        assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED
        asked = fpb.RolloutSync(router_id="peer", state_json="")
        asked.token = sync_proof(TOKENS["peer"], SYNC_REQUEST, *sync_parts(asked))
        synced = stub.SyncRollouts(asked, timeout=5)
        # security2 N6: the same proof again is a replay, and an answer's proof is no request's
        for replayed in (asked.token, synced.token):
            with pytest.raises(grpc.RpcError) as refused:
                stub.SyncRollouts(fpb.RolloutSync(router_id="peer", state_json="", token=replayed), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert synced.router_id
    # The answer proves the router holds the peer token too, over what it answered.
    assert proof_holds(TOKENS["peer"], SYNC_ANSWER, synced.token, asked.token, *sync_parts(synced))
    assert not proof_holds(TOKENS["agent"], SYNC_ANSWER, synced.token, asked.token, *sync_parts(synced))
    assert not proof_holds(TOKENS["peer"], SYNC_REQUEST, synced.token, asked.token, *sync_parts(synced))
    assert TOKENS["peer"] not in synced.token


class ScriptedPeer(fpb_grpc.FleetServicer):
    """A peer router that answers every sync with a fixed state: with a proof of the peer
    token over the request's proof when ``signed``, else with a forged one."""

    def __init__(self, answer: fpb.RolloutSync) -> None:
        self.answer, self.signed, self.asked = answer, False, 0

    def SyncRollouts(self, request: fpb.RolloutSync, context: grpc.ServicerContext) -> fpb.RolloutSync:
        self.asked += 1
        answer = fpb.RolloutSync()
        answer.CopyFrom(self.answer)
        answer.router_id = "scripted-peer"
        key = TOKENS["peer"] if self.signed else "not-the-peer-token"
        answer.token = sync_proof(key, SYNC_ANSWER, request.token, *sync_parts(answer))
        return answer


def pushes_of(router: str) -> str:
    """The threshold pushes ``router`` holds, as it answers a peer that proves the token."""
    asked = fpb.RolloutSync(router_id="probe")
    asked.token = sync_proof(TOKENS["peer"], SYNC_REQUEST, *sync_parts(asked))
    with grpc.insecure_channel(router) as channel:
        return str(fpb_grpc.FleetStub(channel).SyncRollouts(asked, timeout=5).thresholds_json)


def test_a_peers_answer_without_proof_of_the_peer_token_is_never_merged(cluster: Cluster, tmp_path: Path) -> None:
    """The requesting side of the proof (security2 N6, tests2 M3): a router that asks a peer
    merges its answer only when the answer proves the peer token over this very request."""
    token = tmp_path / "peer.token"
    token.write_text(TOKENS["peer"] + "\n")
    source = cluster.router("--peer-token-file", str(token)).address
    cluster.agent("dev-1", source)
    wait_until(lambda: ready_count(source) == 1)
    base = {k: v for k, v in __import__("os").environ.items() if not k.startswith("STRATUS_")}
    pushed = fleet(source, "thresholds", "digits", "--apply", "device=0.9", env=base)
    assert pushed.returncode == 0, pushed.stderr
    state = fpb.RolloutSync(thresholds_json=pushes_of(source))
    assert "digits" in state.thresholds_json  # the push a peer will offer

    peer = ScriptedPeer(state)
    workers = ThreadPoolExecutor(max_workers=4)
    server = grpc.server(workers)
    fpb_grpc.add_FleetServicer_to_server(peer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        router = cluster.router("--peer-token-file", str(token), "--peers", f"127.0.0.1:{port}")
        wait_until(lambda: peer.asked >= 3)  # three rounds answered with a forged proof
        assert "digits" not in pushes_of(router.address)
        assert "answered without proof of the peer token; its state is ignored" in router.log()
        peer.signed = True  # the same state, proved: now it is merged
        wait_until(lambda: "digits" in pushes_of(router.address))
    finally:
        server.stop(grace=None).wait()
        workers.shutdown(wait=True)
