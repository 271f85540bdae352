"""``stratus fleet``: the operator's calls to a router's Fleet service (status, drains, revocations,
reloads, rollouts) and what a failed one says; how the answers read is :mod:`stratus.cli.fleet_views`."""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from collections.abc import Callable
from functools import partial

import grpc

from stratus.cli.fleet_views import rollout_json, rollout_table, status_json, status_table
from stratus.serving.channels import NO_TLS, TlsSettings, open_sync_channel, server_options
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc


def fleet_stub(router: str, tls: TlsSettings) -> tuple[grpc.Channel, fpb_grpc.FleetStub]:
    channel = open_sync_channel(router, tls, server_options("router", tls))
    return channel, fpb_grpc.FleetStub(channel)


def show_status(
    router: str,
    *,
    as_json: bool,
    watch: bool,
    agents: bool = False,
    families: bool = False,
    interval_s: float | None = None,
    tls: TlsSettings = NO_TLS,
    token: str = "",
) -> int:
    """Agents and families are listed when asked for, or in JSON; the table alone stays short
    at any size. ``watch``: on every change, or with ``interval_s`` a fresh status each time
    that many seconds have passed since the last was printed."""
    channel, stub = fleet_stub(router, tls)
    agents, families = agents or as_json, families or as_json
    with channel:
        if not watch:
            status = stub.Status(_status_request(agents, families, token), timeout=5.0)
            print(json.dumps(status_json(status), indent=2) if as_json else status_table(status))
        elif interval_s is not None:
            fetch = partial(stub.Status, _status_request(agents, families, token), timeout=5.0)
            _every(interval_s, fetch, _shown_as_json if as_json else _shown_as_table)
        else:
            asked = fpb.FleetWatchRequest(include_agents=agents, include_families=families, token=token)
            for event in stub.Watch(asked):
                (_shown_as_json if as_json else _shown_as_table)(event.status)
    return 0


def _status_request(agents: bool, families: bool, token: str) -> fpb.FleetStatusRequest:
    return fpb.FleetStatusRequest(include_agents=agents, include_families=families, token=token)


def _shown_as_json(status: fpb.FleetStatus) -> None:
    print(json.dumps(status_json(status)), flush=True)


def _shown_as_table(status: fpb.FleetStatus) -> None:
    print("\033[2J\033[H" + status_table(status), flush=True)


def _every(
    interval_s: float, fetch: Callable[[], fpb.FleetStatus], show: Callable[[fpb.FleetStatus], None]
) -> None:
    """Like watch(1): fetch and show, then wait ``interval_s``, until interrupted. The wait
    comes after each print, so two prints are never closer than ``interval_s``."""
    while True:
        show(fetch())
        time.sleep(interval_s)


def drain(router: str, agent_id: str, *, token: str, tls: TlsSettings = NO_TLS, action: str = "Drain") -> int:
    """Drain an agent, or (``action``) Undrain it, or Forget a lost or left one."""
    channel, stub = fleet_stub(router, tls)
    with channel:
        call = getattr(stub, action)
        response = call(fpb.DrainRequest(agent_id=agent_id, token=token), timeout=5.0)
    print(response.message)
    return 0 if response.accepted else 1


def revoke(
    router: str,
    credential: str,
    *,
    lift: bool,
    reason: str,
    as_json: bool,
    token: str,
    tls: TlsSettings = NO_TLS,
) -> int:
    """Revoke a credential site-wide, lift a revocation, or (no credential) list them."""
    import getpass

    request = fpb.RevokeRequest(token=token, credential=credential, lift=lift, reason=reason, author=getpass.getuser())
    channel, stub = fleet_stub(router, tls)
    with channel:
        reply = stub.Revoke(request, timeout=10.0)
    if as_json:
        listed = [{"credential": r.credential, "by": r.by, "at": r.at, "reason": r.reason} for r in reply.revoked]
        print(json.dumps({"message": reply.message, "revoked": listed}, indent=2))
        return 0
    if reply.message:
        print(reply.message)
    print(f"revoked site-wide: {len(reply.revoked) or 'none'}")
    for r in reply.revoked:
        when = dt.datetime.fromtimestamp(r.at, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        print(f"  {r.credential}  by {r.by or '?'} at {when}" + (f": {r.reason}" if r.reason else ""))
    return 0


def call_error(exc: grpc.RpcError, address: str, tls: TlsSettings = NO_TLS) -> str:
    """One line for a failed call, with what the everyday causes mean and what to do."""
    code, details = exc.code(), exc.details() or ""
    # gRPC's own words for no server there; a router's UNAVAILABLE (its site store away) is its own
    if (
        code == grpc.StatusCode.UNAVAILABLE
        and "failed to connect to all addresses" in details
        and "Connection refused" in details
    ):
        return f"nothing answers at {address}: is the router running, and is that its port?"
    if code == grpc.StatusCode.UNAVAILABLE and (hint := _tls_hint(details, address, tls)) is not None:
        return hint
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return (
            f"{address} is not a Stratus router (it has no Fleet service): is it a cloud gateway or an "
            "agent's --serve port?"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and "Deadline" in details:
        return f"{address} did not answer in time: is it a gRPC server?"
    return f"{code.name}: {details}"


def _tls_hint(details: str, address: str, tls: TlsSettings) -> str | None:
    """What an UNAVAILABLE means when TLS is likely why: plaintext to a TLS port, no client
    certificate for a router under mutual TLS, or a handshake that failed."""
    if not tls.enabled:
        if "Socket closed" in details:
            return f"{address} closed the connection: it may speak TLS; give --tls-ca (and --tls-cert, --tls-key)"
        return None
    if tls.cert is None:
        return (
            f"{address} ended the TLS connection: a router under mutual TLS takes only callers with a "
            "certificate of its CA; give --tls-cert and --tls-key (an operator's, from `stratus certs`; "
            f"or $STRATUS_TLS_CERT, $STRATUS_TLS_KEY) ({details})"
        )
    if "handshake" in details.lower():
        return (
            f"the TLS handshake with {address} failed: check --tls-ca, --tls-cert and --tls-key ({details})"
        )
    return None


def _call_failed(exc: grpc.RpcError, address: str = "the router", tls: TlsSettings = NO_TLS) -> int:
    print(f"stratus: error: {call_error(exc, address, tls)}", file=sys.stderr)
    return 2


def reload(
    router: str, agent_id: str | None, *, token: str, timeout_s: float, tls: TlsSettings = NO_TLS
) -> int:
    """Ask an agent, or (``agent_id`` None) the router's cloud gateway, through the router,
    to load what changed in its models folder."""
    channel, stub = fleet_stub(router, tls)
    try:
        with channel:
            if agent_id is None:
                asked = fpb.CloudReloadRequest(token=token, timeout_s=timeout_s)
                response = stub.ReloadCloud(asked, timeout=timeout_s + 5.0)
            else:
                request = fpb.ReloadRequest(agent_id=agent_id, token=token, timeout_s=timeout_s)
                response = stub.Reload(request, timeout=timeout_s + 5.0)
    except grpc.RpcError as exc:
        return _call_failed(exc, router, tls)
    print(response.message)
    print(f"serving: {', '.join(response.variants)}")
    return 0 if response.ok else 1


def rollout(router: str, request: fpb.RolloutRequest, *, as_json: bool, tls: TlsSettings = NO_TLS) -> int:
    """Start, read, promote or abort a rollout, and print where it stands."""
    channel, stub = fleet_stub(router, tls)
    try:
        with channel:
            reply = stub.Rollout(request, timeout=10.0)
    except grpc.RpcError as exc:
        return _call_failed(exc)
    if as_json:
        print(
            json.dumps(
                {"message": reply.message, "rollouts": [rollout_json(s) for s in reply.rollouts]}, indent=2
            )
        )
    else:
        if reply.message:
            print(reply.message)
        print(rollout_table(list(reply.rollouts)))
    return 0
