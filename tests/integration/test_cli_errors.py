"""Everyday mistakes get one line that says what to do, never a traceback (issue 21 §3)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .cluster import MODELS, Cluster
from .pki import tls_args


def stratus(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stratus.cli", *args], capture_output=True, text=True, timeout=60, check=False
    )


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("stratus: error:")]
    return line


def test_fleet_status_says_what_it_reached(cluster: Cluster, pki) -> None:  # type: ignore[no-untyped-def]
    cloud = cluster.cloud().address
    tls_router = cluster.router(*tls_args(pki["router"])).address
    dead = "127.0.0.1:1"
    assert one_line(stratus("fleet", "status", "--router", dead)) == (
        f"stratus: error: nothing answers at {dead}: is the router running, and is that its port?"
    )
    assert f"{cloud} is not a Stratus router (it has no Fleet service)" in one_line(
        stratus("fleet", "status", "--router", cloud)
    )
    assert "it may speak TLS; give --tls-ca" in one_line(stratus("fleet", "status", "--router", tls_router))
    shown = stratus("fleet", "status", "--router", tls_router, *tls_args(pki["operator"]))
    assert shown.returncode == 0, shown.stderr


@pytest.mark.parametrize("role", ["router", "cloud"])
def test_a_port_in_use_is_one_line(cluster: Cluster, role: str) -> None:
    taken = cluster.router().address
    extra = ["--models", str(MODELS)] if role == "cloud" else []
    line = one_line(stratus(role, "--listen", taken, *extra))
    assert line.startswith(f"stratus: error: cannot listen on {taken}: the port is in use"), line


def test_an_agent_pointed_at_a_cloud_gateway_says_so_and_stops(cluster: Cluster) -> None:
    cloud = cluster.cloud().address
    done = subprocess.run(
        [sys.executable, "-m", "stratus.cli", "agent", "--tier", "device", "--models", str(MODELS),
         "--router", cloud, "--name", "lost-1"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    said = done.stderr.splitlines()
    refused = [i for i, line in enumerate(said) if f"{cloud} is not a Stratus router (it has no AgentLink service" in line]
    assert refused, done.stderr[-2000:]
    # it did not retry what cannot change: nothing after the refusal. (A link that broke before
    # the gateway's UNIMPLEMENTED came back, seen twice under load, is retried, rightly, once.)
    assert not any("reconnecting" in line for line in said[refused[0] :]), done.stderr[-2000:]
    assert sum("reconnecting" in line for line in said) <= 1, done.stderr[-2000:]
    assert done.stderr.rstrip().endswith(f"stratus: error: none of {cloud} is a Stratus router (see the log)")


def test_a_bad_cloud_address_is_one_line() -> None:
    line = one_line(stratus("router", "--listen", "127.0.0.1:0", "--no-advertise", "--cloud", "a:1,b"))
    assert line == "stratus: error: --cloud 'a:1,b': 'b' is not HOST:PORT"


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["agent", "--tier", "device", "--router", "127.0.0.1:1", "--concurrency", "0"], "--concurrency: must be at least 1, not 0"),
        (["agent", "--tier", "device", "--router", "127.0.0.1:1", "--queue-limit", "-1"], "--queue-limit: must not be negative, not -1"),
        (["cloud", "--listen", "127.0.0.1:0", "--concurrency", "0"], "--concurrency: must be at least 1"),
        (
            ["cloud", "--listen", "127.0.0.1:0", "--openai-upstream", "ftp://u", "--upstream-model", "m"],
            "--openai-upstream: is an http:// or https:// URL, not 'ftp://u'",
        ),
        (["router", "--listen", "127.0.0.1:0", "--no-advertise", "--admit-per-s", "0"], "--admit-per-s: must be more than 0"),
    ],
)
def test_a_setting_out_of_range_is_one_line(args: list[str], why: str) -> None:
    """Settings refuse themselves with a ConfigError naming the flag, which the CLI prints as
    one line (the settings loader, stratus/config.py)."""
    extra = ["--models", str(MODELS)] if args[0] in ("agent", "cloud") else []
    line = one_line(stratus(*args, *extra))
    assert line.startswith("stratus: error: ") and why in line, line
