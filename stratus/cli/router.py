"""``stratus router``: its flags (one per field of RouterSettings) and its start; the router's
app is imported only when it starts."""

from __future__ import annotations

import argparse
from pathlib import Path

from stratus.cli.options import (
    add_batch_delay,
    add_exposure,
    cpu_hardware,
    option,
    settings_of,
)
from stratus.cli.router_flags import (
    add_audits,
    add_capture,
    add_cloud_link,
    add_local_tier,
    add_offline,
    add_openai,
    add_removed,
    add_workers,
    agent_pool,
)


def _router(args: argparse.Namespace) -> int:
    from router.app import serve
    from router.settings import RouterSettings
    from stratus.process import configure_logging, run

    configure_logging(args.log_level, args.log_format)
    settings = settings_of(args, RouterSettings, "router", hardware=cpu_hardware())
    if settings.workers > 1:
        from router.workers import supervise

        return run(supervise(settings, args.command_line))
    run(serve(settings))
    return 0


def add_router(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    router = commands.add_parser("router", help="run the router (edge gateway)")
    option(router, "router", "listen", "--listen", help="HOST:PORT for OIP, AgentLink and Fleet")
    option(
        router,
        "router",
        "cloud",
        "--cloud",
        help="the cloud gateway: HOST:PORT, several (A:PORT,B:PORT), or dns:///NAME:PORT for every "
        "address NAME resolves to (a headless Service), re-resolved every 15 s; each call goes to "
        "the less busy of two",
    )
    add_cloud_link(router)
    option(
        router,
        "router",
        "advertise",
        "--no-advertise",
        action="store_const",
        const=False,
        help="do not advertise over zeroconf",
    )
    for role, what in (
        ("agent", "agents' Hellos must carry (one for all)"),
        ("operator", "drain, reload and rollout changes must carry"),
        ("client", "inference callers must send as 'authorization: Bearer TOKEN'"),
        ("cloud", "this router sends the cloud gateway as 'authorization: Bearer TOKEN'"),
    ):
        fallback = ", else $STRATUS_TOKEN" if role in ("agent", "operator") else ""
        option(
            router,
            "router",
            f"{role}_token_file",
            f"--{role}-token-file",
            type=Path,
            help=f"the token {what} (default: $STRATUS_{role.upper()}_TOKEN{fallback})",
        )
    option(
        router,
        "router",
        "agent_tokens_file",
        "--agent-tokens-file",
        type=Path,
        metavar="FILE",
        help="per-agent tokens, 'AGENT_ID TOKEN' lines (re-read when changed): binds each id to "
        "its own token, so one can be revoked",
    )
    option(
        router,
        "router",
        "revoked_certificates",
        "--revoked-certificates",
        type=Path,
        metavar="FILE",
        help="certificates no longer trusted though they chain to the CA: SPIFFE ids "
        "(spiffe://stratus/agent/NAME) or serial:HEX lines, re-read when the file changes; their "
        "calls are refused and an agent's live link ends at its next heartbeat",
    )
    option(
        router,
        "router",
        "models",
        "--models",
        type=Path,
        metavar="DIR",
        help="the operator's own copy of the models folder: every family's description (tensors, "
        "thresholds) comes from it, and an agent describing one otherwise is refused for it "
        "(default: the first ready agent's description is the fleet's)",
    )
    option(
        router,
        "router",
        "anonymous_inference",
        "--anonymous-inference",
        action="store_true",
        help="off loopback, serve inference to callers who prove nothing (no client token, no mutual "
        "TLS): they may then use every tier, the cloud's included, at this router's expense",
    )
    option(
        router,
        "router",
        "agent_pools",
        "--agent-pool",
        action="append",
        type=agent_pool,
        metavar="NAME=MAX",
        help="the agent certificate NAME is a pool (a DaemonSet sharing one certificate): its agents "
        "register as NAME.SUFFIX, at most MAX linked at once, none replacing another's id "
        "(repeatable); any other agent certificate holds exactly its own name",
    )
    option(
        router,
        "router",
        "private_status",
        "--private-status",
        action="store_true",
        help="fleet status, watch and rollout status need the operator role too",
    )
    add_exposure(router, "router", "the router")
    option(
        router,
        "router",
        "max_items_per_client",
        "--max-items-per-client",
        type=int,
        help="items (dimension 0 of a request's first input) one client address may have in flight "
        "(0: no limit); a client's one request is always taken",
    )
    option(
        router,
        "router",
        "on_cloud_failure",
        "--on-cloud-failure",
        choices=["degrade", "fail"],
        help="when an escalation needs the cloud and it is away: degraded answer, or UNAVAILABLE",
    )
    option(
        router,
        "router",
        "max_heartbeats_per_s",
        "--max-heartbeats-per-s",
        type=float,
        help="heartbeats the whole fleet may send a second; agents are asked to slow down past it",
    )
    option(
        router,
        "router",
        "admit_per_s",
        "--admit-per-s",
        type=float,
        help="agents admitted a second (a restart's reconnect storm)",
    )
    option(
        router,
        "router",
        "hello_timeout_s",
        "--hello-timeout-s",
        type=float,
        help="seconds a new AgentLink may stay silent before its Hello",
    )
    add_removed(router)
    add_openai(router)
    option(
        router,
        "router",
        "site_state",
        "--site-state",
        metavar="URL",
        help="the site's shared state: nats://HOST:PORT (NATS JetStream, every router of the site on "
        "it: rollouts, threshold pushes, drains) or file:PATH (a lone router's, kept across restarts)",
    )
    option(
        router,
        "router",
        "site_state_creds",
        "--site-state-creds",
        type=Path,
        metavar="FILE",
        help="the NATS store's credentials: a .creds file (nkey and JWT) or a file of USER:PASSWORD",
    )
    option(
        router,
        "router",
        "site_address",
        "--site-address",
        metavar="HOST:PORT",
        help="where the site's other routers and `fleet thresholds --suggest` reach this router, "
        "registered in a shared store (default: --listen's address, or this host's name where it is a wildcard)",
    )
    option(
        router,
        "router",
        "keepalive_s",
        "--keepalive-s",
        type=float,
        help="HTTP/2 ping interval on every link; a frozen agent is lost within this plus keepalive_timeout_s",
    )
    add_batch_delay(router, "router")
    add_audits(router)
    add_capture(router)
    add_offline(router)
    add_local_tier(router)
    add_workers(router)
    router.set_defaults(handler=_router)
    return router
