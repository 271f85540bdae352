"""`stratus fleet status` on a real fleet: the cloud row, each family's tiers (thresholds and
current variants, checked against the family.toml files and the answers themselves), agents'
versions and uptimes, `--watch --interval`; and no gRPC C-core lines in any process's log."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata

import numpy as np

from stratus.devtools.launcher import Launched

from .cluster import MODELS, Cluster, fleet_status, infer, ready_count, wait_until
from .pki import tls_args
from .test_cli_errors import one_line, stratus

# A line gRPC's C core (or another library's abseil) writes to stderr in its own format:
# "I1201 14:52:07.718657   14980 ssl_transport_security.cc:2563] ...", "E0000 00:00:17961... ]".
CORE_LINE = re.compile(
    r"^(?:[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\]|WARNING: All log messages before absl::InitializeLog)",
    re.MULTILINE,
)


def status_json(router: str, *extra: str) -> dict:  # type: ignore[type-arg]
    done = stratus("fleet", "status", "--router", router, "--json", *extra)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def stopped_cleanly(processes: list[Launched]) -> None:
    """Each process exits 0 when stopped, and its log holds only Stratus's own lines."""
    for launched in reversed(processes):
        assert launched.stop(timeout=20) == 0, launched.log()[-3000:]
        found = CORE_LINE.findall(launched.log())
        assert not found, f"{launched.role}: {found}"


def test_status_shows_the_cloud_row_each_familys_tiers_and_agents_versions(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    cloud = cluster.cloud()
    router = cluster.router("--cloud", cloud.address).address
    cluster.agent("device-1", router)
    cluster.agent("edge-1", router, tier="edge")
    wait_until(
        lambda: ready_count(router) == 2 and "digits" in {m.name for m in fleet_status(router).cloud.models},
        90,
    )
    x = digits.held_out.x[:4]
    answered = {
        tier: infer(router, x, min_tier=tier, max_tier=tier)[1].variant
        for tier in ("device", "edge", "cloud")
    }

    status = status_json(router)
    shown = status["cloud"]
    assert (shown["address"], shown["state"], shown["transport"]) == (cloud.address, "connected", "stream")
    assert shown["server"] == f"stratus {metadata.version('stratus-router')}"
    assert shown["latency_ms"]["p50"] > 0 and shown["in_flight"] == 0  # it answered once, and nothing waits
    assert {"name": "digits", "sent_as": "digits", "variant": answered["cloud"]} in shown["models"]

    family = tomllib.loads((MODELS / "digits" / "family.toml").read_text())
    (view,) = [f for f in status["families"] if f["name"] == "digits"]
    tiers = {t["tier"]: t for t in view["tiers"]}
    assert list(tiers) == ["device", "edge", "cloud"] and view["state"] == "serving"
    for tier in ("device", "edge"):
        assert tiers[tier]["threshold"] == family["thresholds"][tier]
        assert tiers[tier]["current"] == [answered[tier]] and (
            tiers[tier]["ready"],
            tiers[tier]["listed"],
        ) == (1, 1)
        assert answered[tier].startswith(family["current"][tier])  # the current variant, in some precision
    assert tiers["cloud"]["threshold"] is None and tiers["cloud"]["current"] == [answered["cloud"]]

    version = metadata.version("stratus-router")
    for agent in status["agents"]:
        assert agent["version"] == version and agent["uptime_s"] > 0, agent

    table = stratus("fleet", "status", "--router", router, "--families", "--agents").stdout
    (row,) = [line for line in table.splitlines() if line.startswith(cloud.address)]
    assert row.split()[1:4] == ["connected", "stratus", version]
    (device_row,) = [line for line in table.splitlines() if line.startswith("digits ")]
    assert f"{family['thresholds']['device']:.4f}" in device_row and answered["device"] in device_row
    assert all(
        f" {version} " in line for line in table.splitlines() if line.startswith(("device-1 ", "edge-1 "))
    )

    cloud.stop()  # unsure answers from the edge have nowhere to go now
    wait_until(lambda: fleet_status(router).cloud.state != "connected", 30)
    (view,) = [f for f in status_json(router)["families"] if f["name"] == "digits"]
    assert (
        view["state"] == "degraded"
        and "unsure edge answers cannot climb: the cloud link is" in view["reason"]
    )
    _, served = infer(router, np.full((1, 64), 0.5, np.float32), min_confidence=1.0)
    assert served.degraded  # as the view said
    stopped_cleanly(cluster.processes)


def test_watch_with_an_interval_prints_fresh_statuses_at_least_that_far_apart(cluster: Cluster) -> None:
    router = cluster.router().address
    cluster.agent("device-1", router)
    wait_until(lambda: ready_count(router) == 1, 60)
    command = [sys.executable, "-m", "stratus.cli", "fleet", "status", "--router", router]
    watching = subprocess.Popen(
        [*command, "--watch", "--interval", "1.5", "--json"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert watching.stdout is not None
        lines = [json.loads(watching.stdout.readline()) for _ in range(3)]
    finally:
        watching.kill()
        watching.wait()
    uptimes = [status["agents"][0]["uptime_s"] for status in lines]
    # the router's own clock between the statuses it built: never closer than the interval
    assert all(later - earlier >= 1.5 - 0.1 for earlier, later in itertools.pairwise(uptimes)), uptimes
    assert one_line(stratus(*command[3:], "--watch", "--interval", "0")) == (
        "stratus: error: --interval is a number of seconds more than 0, not 0"
    )
    assert "not nan" in one_line(stratus(*command[3:], "--watch", "--interval", "nan"))
    assert "give --watch too" in one_line(stratus(*command[3:], "--interval", "2"))


def test_a_failed_tls_handshake_leaves_no_grpc_line_unless_asked_for(cluster: Cluster, pki) -> None:  # type: ignore[no-untyped-def]
    quiet = cluster.router(*tls_args(pki["router"]), role="quiet")
    told = cluster.router(*tls_args(pki["router"]), role="told", env={"GRPC_VERBOSITY": "INFO"})
    for launched in (quiet, told):
        assert "it may speak TLS" in one_line(stratus("fleet", "status", "--router", launched.address))
    assert told.stop() == 0 and "ssl_transport_security" in told.log()  # what the default hides
    stopped_cleanly([quiet])
