"""Everyday mistakes get one line that says what to do, never a traceback (issue 21 §3)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
    ca_only = one_line(stratus("fleet", "status", "--router", tls_router, "--tls-ca", str(pki["operator"].ca)))
    assert ca_only.startswith(  # it said "UNAVAILABLE: ... Socket closed" and nothing of certificates
        f"stratus: error: {tls_router} ended the TLS connection: a router under mutual TLS takes only "
        "callers with a certificate of its CA; give --tls-cert and --tls-key"
    ), ca_only
    shown = stratus("fleet", "status", "--router", tls_router, *tls_args(pki["operator"]))
    assert shown.returncode == 0, shown.stderr
    # The router and the command's certificate once in the shell, not on every command.
    operator = pki["operator"]
    from_env = subprocess.run(
        [sys.executable, "-m", "stratus.cli", "fleet", "status"],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "STRATUS_ROUTER": tls_router, "STRATUS_TLS_CERT": str(operator.cert),
             "STRATUS_TLS_KEY": str(operator.key), "STRATUS_TLS_CA": str(operator.ca)},
    )  # fmt: skip
    assert (from_env.returncode, from_env.stdout) == (0, shown.stdout), from_env.stderr


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
    assert done.stderr.rstrip().endswith(
        f"stratus: error: no router links this agent: {cloud} is not a Stratus router (it has no "
        "AgentLink service: a cloud gateway, or an agent's --serve port?)"
    )


@pytest.mark.parametrize("named", ["{router}", "dns:///{router}"])
def test_an_agent_whose_credential_is_refused_says_so_and_stops(
    cluster: Cluster, tmp_path: Path, named: str
) -> None:
    """A refused credential cannot change by retrying: the agent used to retry every ~1.5 s
    forever and exit 0 when stopped. It stops with the router's reason, status 2, whether it
    was given the router or found it by a DNS name (then once every router found refused it)."""
    tokens = tmp_path / "agents.tokens"
    tokens.write_text("dev-1 a-token-of-thirty-two-characters-x\n")
    router = cluster.router("--agent-tokens-file", str(tokens)).address
    done = subprocess.run(
        [sys.executable, "-m", "stratus.cli", "agent", "--tier", "device", "--models", str(MODELS),
         "--router", named.format(router=router), "--name", "dev-1"],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "STRATUS_AGENT_TOKEN": "the-wrong-token-of-thirty-two-chars"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "reconnecting" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.rstrip().endswith(
        f"stratus: error: no router links this agent: router {router} refused this agent: "
        "UNAUTHENTICATED: the token of agent 'dev-1' is missing, wrong or revoked"
    ), done.stderr[-2000:]


def test_a_bad_cloud_address_is_one_line() -> None:
    line = one_line(stratus("router", "--listen", "127.0.0.1:0", "--no-advertise", "--cloud", "a:1,b"))
    assert line == "stratus: error: --cloud 'a:1,b': 'b' is not HOST:PORT"


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["agent", "--tier", "device", "--router", "127.0.0.1:1", "--concurrency", "0"], "--concurrency: must be at least 1, not 0"),
        (["agent", "--tier", "device", "--router", "dns://10.0.0.2/routers:8001"], "a DNS server of its own (dns://SERVER/...) is not supported"),
        (["agent", "--tier", "device", "--router", "dns:///routers", "--insecure"], "--router 'dns:///routers' is not dns:///NAME:PORT"),
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
