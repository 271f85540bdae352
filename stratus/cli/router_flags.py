"""``stratus router``'s flags for what a router may add to its core: the OpenAI API, the cloud
link's headers and models, audits, capture, offline-first, the tier served in its own process,
``--workers``, and the peer protocol's removed flags. :mod:`stratus.cli.router` adds them."""

from __future__ import annotations

import argparse
from pathlib import Path

from stratus.cli.options import (
    RUNTIMES_HELP,
    option,
    share,
)


def add_removed(router: argparse.ArgumentParser) -> None:
    """The peer protocol's flags, hidden: given, the router stops saying what replaced each
    (``RouterSettings.check_site_state``) instead of argparse's bare "unrecognized arguments"."""
    option(router, "router", "rollout_state", "--rollout-state", type=Path, help=argparse.SUPPRESS)
    option(router, "router", "peers", "--peers", help=argparse.SUPPRESS)
    option(router, "router", "peer_token_file", "--peer-token-file", type=Path, help=argparse.SUPPRESS)


def add_openai(router: argparse.ArgumentParser) -> None:
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


def add_offline(router: argparse.ArgumentParser) -> None:
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


def add_local_tier(router: argparse.ArgumentParser) -> None:
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


def add_workers(router: argparse.ArgumentParser) -> None:
    option(router, "router", "workers", "--workers", type=int, metavar="N",
           help="serve --listen from N router processes sharing its port (SO_REUSEPORT), a core each; "
                "agents link to every one (each has an address of its own, named in the Welcome), and "
                "they share the site's state (--site-state nats://…, else a private nats-server)")  # fmt: skip
    option(router, "router", "worker_address", "--worker-address", help=argparse.SUPPRESS)
    option(router, "router", "router_workers", "--router-worker", action="append", help=argparse.SUPPRESS)


def add_capture(router: argparse.ArgumentParser) -> None:
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


def add_audits(router: argparse.ArgumentParser) -> None:
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


def agent_pool(text: str) -> tuple[str, int]:
    from stratus.serving.auth import parse_agent_pool

    try:
        return parse_agent_pool(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cloud_header(text: str) -> tuple[str, str]:
    from router.cloud.models import parse_header

    try:
        return parse_header(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cloud_models(text: str) -> str:
    from router.cloud.models import parse_cloud_models

    try:
        parse_cloud_models(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_cloud_link(router: argparse.ArgumentParser) -> None:
    """How to reach a cloud that is not a Stratus gateway (Triton, KServe, MLServer)."""
    option(
        router,
        "router",
        "cloud_models",
        "--cloud-models",
        type=cloud_models,
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
        type=cloud_header,
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
