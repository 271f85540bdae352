"""One credential per role (the security review's F10): agents and operators each carry their
own token, read from a file or the environment, and one role's token does not open another's
door. (Peer routers had a token too, until a site's store replaced the peer protocol.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from stratus.wire import fleet_pb2 as fpb

from .cluster import Cluster, fleet_status, ready_count, wait_until

TOKENS = {"agent": "agent-secret", "operator": "operator-secret"}


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

    with grpc.insecure_channel(address) as channel:  # the peer protocol is gone, not merely guarded
        sync = channel.unary_unary("/stratus.v1.Fleet/SyncRollouts", request_serializer=bytes, response_deserializer=bytes)
        with pytest.raises(grpc.RpcError) as gone:
            sync(b"", timeout=5)
        assert gone.value.code() == grpc.StatusCode.UNIMPLEMENTED
