"""``stratus router``: its flags (one per field of RouterSettings) and its start; the router's
app is imported only when it starts."""

from __future__ import annotations

import argparse
from pathlib import Path

from stratus.cli.options import (
    RUNTIMES_HELP,
    add_batch_delay,
    add_exposure,
    cpu_hardware,
    option,
    settings_of,
    share,
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
    _add_cloud_link(router)
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
        type=_agent_pool,
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
    _add_removed(router)
    _add_openai(router)
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
    _add_audits(router)
    _add_capture(router)
    _add_offline(router)
    _add_local_tier(router)
    _add_workers(router)
    router.set_defaults(handler=_router)
    return router


def _add_removed(router: argparse.ArgumentParser) -> None:
    """The peer protocol's flags, hidden: given, the router stops saying what replaced each
    (``RouterSettings.check_site_state``) instead of argparse's bare "unrecognized arguments"."""
    option(router, "router", "rollout_state", "--rollout-state", type=Path, help=argparse.SUPPRESS)
    option(router, "router", "peers", "--peers", help=argparse.SUPPRESS)
    option(router, "router", "peer_token_file", "--peer-token-file", type=Path, help=argparse.SUPPRESS)


def _add_openai(router: argparse.ArgumentParser) -> None:
    option(
        router,
        "router",
        "http",
        "--http",
        metavar="HOST:PORT",
        help="serve the Open Inference Protocol over HTTP/REST here too (Triton's /v2 routes, as "
        "on its port 8000, for curl and tritonclient.http), with the gRPC port's credentials and TLS",
    )
    option(
        router,
        "router",
        "openai",
        "--openai",
        metavar="HOST:PORT",
        help="serve the OpenAI API (generative families) here",
    )
    option(
        router,
        "router",
        "openai_api_key_file",
        "--openai-api-key-file",
        type=Path,
        help="the OpenAI API's key, as clients send it (Authorization: Bearer KEY); required off "
        "loopback; default: STRATUS_OPENAI_API_KEY",
    )
    option(
        router,
        "router",
        "openai_hosts",
        "--openai-host",
        action="append",
        help="a Host name the keyless (loopback) OpenAI API answers besides loopback's (repeatable)",
    )
    for part, what in (("cert", "certificate (chain, PEM)"), ("key", "private key (PEM)")):
        option(
            router,
            "router",
            f"openai_tls_{part}",
            f"--openai-tls-{part}",
            type=Path,
            metavar="FILE",
            help=f"serve the OpenAI API over HTTPS with this {what}, for the names its clients "
            "dial (not the fleet's role-named leaf)",
        )


def _add_offline(router: argparse.ArgumentParser) -> None:
    option(router, "router", "state_dir", "--state-dir", type=Path, metavar="DIR",
           help="keep requests answered provisionally while the cloud is away (families with [offline] "
                "defer = true) and the cloud's corrections here, across restarts; without it nothing is deferred")  # fmt: skip
    option(router, "router", "adjudicate_share", "--adjudicate-share", type=float, metavar="SHARE",
           help="the share of the cloud's capacity judging deferred requests may take, out of its spare "
                "room only (default 0.01)")  # fmt: skip
    option(router, "router", "decision_log", "--decision-log", type=Path, metavar="DIR",
           help="write decision records (each tier tried, and why the climb stopped) as Parquet: every "
                "provisional request's, and --decision-log-share of the others'")  # fmt: skip
    option(router, "router", "decision_log_share", "--decision-log-share", type=float, metavar="SHARE",
           help="the share of requests not provisional whose decision records --decision-log writes (default 0)")  # fmt: skip


def _add_local_tier(router: argparse.ArgumentParser) -> None:
    option(router, "router", "local.tier", "--local-tier", choices=["device", "edge"],
           help="serve this tier's models from --models in the router's own process, one more agent of "
                "the tier beside remote ones (batching, rollouts, audits as theirs): an answer from it "
                "takes one hop, not two; off by default")  # fmt: skip
    option(router, "router", "local.name", "--local-name",
           help="its agent id (default: the router's name and the tier)")  # fmt: skip
    option(router, "router", "local.variants", "--local-variants",
           help="comma-separated (default: the tier's variants)")  # fmt: skip
    option(router, "router", "local.runtimes", "--local-runtimes", help=RUNTIMES_HELP)
    option(router, "router", "local.concurrency", "--local-concurrency", type=int,
           help="its runtime calls at once (threads)")  # fmt: skip
    option(router, "router", "local.max_batch", "--local-max-batch", type=int,
           help="most items merged into one of its runtime calls; 1 turns batching off")  # fmt: skip
    option(router, "router", "local.precision", "--local-precision", type=str.lower,
           choices=["fp32", "fp16", "int8"],
           help="serve this precision of each family (default: the fastest this CPU runs natively "
                "within the family's accuracy tolerance)")  # fmt: skip
    option(router, "router", "local.cache_dir", "--cache-dir", type=Path, help="runtime caches")


def _add_workers(router: argparse.ArgumentParser) -> None:
    option(router, "router", "workers", "--workers", type=int, metavar="N",
           help="serve --listen from N router processes sharing its port (SO_REUSEPORT), a core each; "
                "agents link to every one (each has an address of its own, named in the Welcome), and "
                "they share the site's state (--site-state nats://…, else a private nats-server)")  # fmt: skip
    option(router, "router", "worker_address", "--worker-address", help=argparse.SUPPRESS)
    option(router, "router", "router_workers", "--router-worker", action="append", help=argparse.SUPPRESS)


def _add_capture(router: argparse.ArgumentParser) -> None:
    option(router, "router", "capture.folder", "--capture", type=Path, metavar="DIR",
            help="write audited and escalated items of the --capture-families as Parquet files "
            "here (off by default: inputs may be sensitive)")  # fmt: skip
    option(router, "router", "capture.families", "--capture-families", metavar="F1,F2",
            help="the families --capture writes (required with it: no family is captured unnamed)")  # fmt: skip
    option(router, "router", "capture.max_bytes", "--capture-max-bytes", type=int,
            help="the capture folder's total size; past it the oldest files are deleted")  # fmt: skip
    option(router, "router", "capture.file_bytes", "--capture-file-bytes", type=int,
            help="a capture file is closed (and made visible) at this size")  # fmt: skip
    option(router, "router", "capture.file_age_s", "--capture-file-age-s", type=float,
            help="... or at this age, whichever comes first")  # fmt: skip


def _add_audits(router: argparse.ArgumentParser) -> None:
    option(
        router,
        "router",
        "audit.share",
        "--audit-share",
        type=share,
        help="share of the items settled below a family's top tier also asked of it in the background, "
        "to estimate each tier's live accuracy (a family's [audit] share overrides it; 0: none)",
    )
    option(
        router,
        "router",
        "audit.max_per_s",
        "--audit-max-per-s",
        type=float,
        help="most items audited a second per family (a family's [audit] max_per_s overrides it)",
    )
    option(
        router,
        "router",
        "auto_thresholds.goals",
        "--auto-thresholds",
        metavar="FAMILY=GOAL:VALUE,...",
        help="step these families' thresholds toward what the audits suggest (digits=target_accuracy:0.98 "
        "or digits=max_escalation:0.05; 'families': each family whose [audit] auto names a goal), upward "
        "only, bounded (router/thresholds/auto.py); off by default",
    )
    option(router, "router", "auto_thresholds.max_step", "--auto-max-step", type=share,
            help="most a threshold moves per interval")  # fmt: skip
    option(router, "router", "auto_thresholds.max_cloud_share", "--auto-max-cloud-share", type=share,
            help="no step sends more than this share to the cloud")  # fmt: skip
    option(router, "router", "auto_thresholds.interval_s", "--auto-interval", type=float,
            help="seconds between steps")  # fmt: skip


def _agent_pool(text: str) -> tuple[str, int]:
    from stratus.serving.auth import parse_agent_pool

    try:
        return parse_agent_pool(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cloud_header(text: str) -> tuple[str, str]:
    from router.cloud.models import parse_header

    try:
        return parse_header(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cloud_models(text: str) -> str:
    from router.cloud.models import parse_cloud_models

    try:
        parse_cloud_models(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _add_cloud_link(router: argparse.ArgumentParser) -> None:
    """How to reach a cloud that is not a Stratus gateway (Triton, KServe, MLServer)."""
    option(
        router,
        "router",
        "cloud_models",
        "--cloud-models",
        type=_cloud_models,
        metavar="NAME,...",
        help="models the cloud serves the families with, NAME or FAMILY=NAME (e.g. digits-large); "
        "found by ModelReady/ModelMetadata where the cloud does not list them",
    )
    option(
        router,
        "router",
        "cloud_headers",
        "--cloud-header",
        action="append",
        type=_cloud_header,
        metavar="KEY=VALUE",
        help="gRPC metadata sent on every call to the cloud (repeatable), e.g. "
        "triton-grpc-protocol-triton-access-token=TOKEN or authorization='Bearer TOKEN'; for a "
        "secret value use --cloud-header-file (a flag shows in ps)",
    )
    option(
        router,
        "router",
        "cloud_header_file",
        "--cloud-header-file",
        type=Path,
        metavar="FILE",
        help="more such metadata, KEY=VALUE lines ('#' comments), read at start: for values that "
        "are secrets (default: $STRATUS_CLOUD_HEADER, the same lines)",
    )
