"""The one ``stratus`` command. Each subcommand imports its app lazily, so a device that
runs only ``stratus agent`` never imports the router or the cloud gateway."""

from __future__ import annotations

import os

from stratus.process import quiet_grpc_core

quiet_grpc_core(os.environ)  # before grpc is imported below: its C core reads its settings then

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from stratus import __version__
from stratus.certs import add_parser as add_certs
from stratus.errors import ConfigError, StratusError
from stratus.models_cli import add_models
from stratus.serving import TlsSettings

if TYPE_CHECKING:
    from stratus.precision import Hardware

Handler = Callable[[argparse.Namespace], int]


def _default_cache() -> Path:
    return Path.home() / ".cache" / "stratus"


def _role_token(args: argparse.Namespace, role: str) -> str:
    """One role's credential (agent, operator, peer, client, cloud): --ROLE-token-file, else
    STRATUS_ROLE_TOKEN, else (agents, operators, peers) the fleet token STRATUS_TOKEN. Never
    from the command line, where every user of the machine can read it."""
    own = _secret(getattr(args, f"{role}_token_file", None), f"STRATUS_{role.upper()}_TOKEN")
    if own or role in ("client", "cloud"):
        return own
    return os.environ.get("STRATUS_TOKEN", "")


def _secret(path: Path | None, variable: str) -> str:
    """A secret from a file (its first line) or the environment, never from the command
    line, where every user of the machine can read it."""
    if path is None:
        return os.environ.get(variable, "")
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None


def _tls(args: argparse.Namespace) -> TlsSettings:
    return TlsSettings(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)


def _add_tls(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-cert", type=Path, default=None, help="this process's certificate (PEM)")
    parser.add_argument("--tls-key", type=Path, default=None, help="its private key (PEM)")
    parser.add_argument(
        "--tls-ca",
        type=Path,
        default=None,
        help="CA that peers' certificates must chain to; on a server this turns on mutual TLS",
    )


def _router(args: argparse.Namespace) -> int:
    from router.app import RouterSettings, serve
    from router.audit import AuditPolicy
    from stratus.process import configure_logging, run

    configure_logging(args.log_level, args.log_format)
    settings = RouterSettings(
        listen=args.listen,
        cloud=args.cloud,
        advertise=not args.no_advertise,
        agent_token=_role_token(args, "agent"),
        agent_tokens_file=args.agent_tokens_file,
        operator_token=_role_token(args, "operator"),
        peer_token=_role_token(args, "peer"),
        client_token=_role_token(args, "client"),
        cloud_token=_role_token(args, "cloud"),
        insecure=args.insecure,
        private_status=args.private_status,
        max_requests_per_client=args.max_requests_per_client,
        tls=_tls(args),
        on_cloud_failure=args.on_cloud_failure,
        max_heartbeats_per_s=args.max_heartbeats_per_s,
        admit_per_s=args.admit_per_s,
        hello_timeout_s=args.hello_timeout_s,
        keepalive_s=args.keepalive_s,
        max_batch_delay_s=args.max_batch_delay_us / 1e6,
        metrics=args.metrics,
        rollout_state=args.rollout_state,
        peers=args.peers,
        openai=args.openai,
        openai_api_key=_secret(args.openai_api_key_file, "STRATUS_OPENAI_API_KEY"),
        openai_hosts=tuple(args.openai_host),
        cloud_models=args.cloud_models,
        cloud_headers=tuple(args.cloud_header),
        audit=AuditPolicy(share=args.audit_share, max_per_s=args.audit_max_per_s),
    )
    run(serve(settings))
    return 0


def _cloud(args: argparse.Namespace) -> int:
    from cloud_gateway.app import CloudSettings, serve
    from stratus.process import configure_logging, run

    configure_logging(args.log_level, args.log_format)
    settings = CloudSettings(
        listen=args.listen,
        models=args.models,
        variants=_names(args.variants),
        concurrency=args.concurrency,
        queue_limit=args.queue_limit,
        max_batch=args.max_batch,
        max_batch_delay_s=args.max_batch_delay_us / 1e6,
        cache_dir=args.cache_dir,
        precision=args.precision,
        hardware=_hardware(),
        emulated_extra_ms=args.emulate_slow_ms,
        tls=_tls(args),
        client_token=_role_token(args, "client"),
        insecure=args.insecure,
        max_requests_per_client=args.max_requests_per_client,
        metrics=args.metrics,
        openai_upstream=args.openai_upstream,
        upstream_model=args.upstream_model,
        upstream_family=args.upstream_family,
        runtimes=_names(args.runtimes),
    )
    run(serve(settings))
    return 0


def _agent(args: argparse.Namespace) -> int:
    import asyncio

    from edge_agent.agent import AgentSettings, default_name, load_models, run_agent
    from stratus.metrics import Metrics
    from stratus.process import configure_logging, run, stop_on_signals
    from stratus.tiers import Tier

    configure_logging(args.log_level, args.log_format)
    tier = Tier.parse(args.tier)
    settings = AgentSettings(
        tier=tier,
        router=args.router,
        name=args.name or default_name(tier),
        capacity=args.concurrency,
        queue_limit=args.queue_limit,
        serve=args.serve,
        token=_role_token(args, "agent"),
        tls=_tls(args),
        metrics=args.metrics,
        client_token=_role_token(args, "client"),
        insecure=args.insecure,
    )
    models = load_models(
        args.models,
        tier=tier,
        variants=_names(args.variants),
        concurrency=args.concurrency,
        queue_limit=args.queue_limit,
        runtimes=_names(args.runtimes),
        cache_dir=args.cache_dir,
        max_batch=args.max_batch,
        precision=args.precision,
        hardware=_hardware(),
        emulated_extra_ms=args.emulate_slow_ms,
        metrics=Metrics(),
    )

    async def main() -> None:
        stop = asyncio.Event()
        stop_on_signals(stop)
        await run_agent(settings, models, stop)

    run(main())
    return 0


def _hardware() -> Hardware:
    """``STRATUS_CPU_FLAGS`` (comma-separated) stands in for the CPU's own flags: for a
    container that hides them, and for tests of the precision choice."""
    from stratus.precision import this_hardware

    return this_hardware()


RUNTIMES_HELP = (
    "only these runtimes, in this order, e.g. litert, or onnxruntime,openvino, or litert,llama_cpp "
    "(classifiers and generative models each use the ones of their kind; a family none can run "
    "is not served)"
)


def _names(text: str | None) -> list[str] | None:
    return [n.strip() for n in text.split(",") if n.strip()] if text else None


def _fleet_status(args: argparse.Namespace) -> int:
    import math

    from stratus.fleetctl import show_status

    if args.interval is not None and not 0 < args.interval < math.inf:
        raise ConfigError(f"--interval is a number of seconds more than 0, not {args.interval:g}")
    if args.interval is not None and not args.watch:
        raise ConfigError("--interval sets how often --watch prints: give --watch too")
    return show_status(
        args.router,
        as_json=args.json,
        watch=args.watch,
        agents=args.agents,
        families=args.families,
        interval_s=args.interval,
        tls=_tls(args),
        token=_role_token(args, "operator"),
    )


def _fleet_accuracy(args: argparse.Namespace) -> int:
    from stratus.fleet_accuracy import show_accuracy

    return show_accuracy(
        args.router,
        args.family,
        agents=args.agents,
        as_json=args.json,
        tls=_tls(args),
        token=_role_token(args, "operator"),
    )


def _fleet_drain(args: argparse.Namespace) -> int:
    from stratus.fleetctl import drain

    action = {"drain": "Drain", "undrain": "Undrain", "forget": "Forget"}[args.fleet_command]
    return drain(
        args.router, args.agent_id, token=_role_token(args, "operator"), tls=_tls(args), action=action
    )


def _fleet_reload(args: argparse.Namespace) -> int:
    from stratus.fleetctl import reload

    if (args.agent_id is None) == (not args.cloud):
        raise ConfigError("give an AGENT_ID, or --cloud for the router's cloud gateway (one of them)")
    return reload(
        args.router,
        args.agent_id,
        token=_role_token(args, "operator"),
        timeout_s=args.timeout,
        tls=_tls(args),
    )


def _fleet_rollout(args: argparse.Namespace) -> int:
    from stratus.convert.fleet import wire_tier
    from stratus.fleetctl import rollout
    from stratus.tiers import Tier
    from stratus.wire import fleet_pb2 as fpb

    actions = {
        "status": fpb.ROLLOUT_ACTION_STATUS,
        "promote": fpb.ROLLOUT_ACTION_PROMOTE,
        "abort": fpb.ROLLOUT_ACTION_ABORT,
    }
    action = next((actions[a] for a in actions if getattr(args, a)), fpb.ROLLOUT_ACTION_START)
    if action == fpb.ROLLOUT_ACTION_START and not args.candidate:
        raise ConfigError("give --candidate VARIANT to start a rollout, or --status, --promote or --abort")
    if action != fpb.ROLLOUT_ACTION_STATUS and not args.tier:
        raise ConfigError("give --tier device or --tier edge")
    request = fpb.RolloutRequest(
        action=action,
        token=_role_token(args, "operator"),
        family=args.family,
        tier=wire_tier(Tier.parse(args.tier) if args.tier else None),
        candidate=args.candidate or "",
        steps=[float(s) for s in args.steps.split(",")] if args.steps else [],
        min_requests=args.min_requests,
        shadow_percent=args.shadow,
        max_error_increase=args.max_error_increase,
        max_p99_ratio=args.max_p99_ratio,
        max_unsure_increase=args.max_unsure_increase,
    )
    return rollout(args.router, request, as_json=args.json, tls=_tls(args))


def _demo(args: argparse.Namespace) -> int:
    from edge_agent.sdk import Client
    from stratus.demo import run_demo

    def sdk(router: str) -> Client:
        return Client(args.models, router=router, cache_dir=args.cache_dir)

    return run_demo(models=args.models, as_json=args.json, sdk_factory=sdk)


def _add_router(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    router = commands.add_parser("router", help="run the router (edge gateway)")
    router.add_argument("--listen", default="127.0.0.1:8001", help="HOST:PORT for OIP, AgentLink and Fleet")
    router.add_argument(
        "--cloud",
        default=None,
        help="the cloud gateway: HOST:PORT, several (A:PORT,B:PORT), or dns:///NAME:PORT for every "
        "address NAME resolves to (a headless Service), re-resolved every 15 s; each call goes to "
        "the less busy of two",
    )
    _add_cloud_link(router)
    router.add_argument("--no-advertise", action="store_true", help="do not advertise over zeroconf")
    for role, what in (
        ("agent", "agents' Hellos must carry (one for all)"),
        ("operator", "drain, reload and rollout changes must carry"),
        ("peer", "proves rollout syncs with the other routers, both ways"),
        ("client", "inference callers must send as 'authorization: Bearer TOKEN'"),
        ("cloud", "this router sends the cloud gateway as 'authorization: Bearer TOKEN'"),
    ):
        fallback = ", else $STRATUS_TOKEN" if role in ("agent", "operator", "peer") else ""
        router.add_argument(
            f"--{role}-token-file",
            type=Path,
            default=None,
            help=f"the token {what} (default: $STRATUS_{role.upper()}_TOKEN{fallback})",
        )
    router.add_argument(
        "--agent-tokens-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="per-agent tokens, 'AGENT_ID TOKEN' lines (re-read when changed): binds each id to "
        "its own token, so one can be revoked",
    )
    router.add_argument(
        "--private-status",
        action="store_true",
        help="fleet status, watch and rollout status need the operator role too",
    )
    _add_exposure(router, "the router")
    router.add_argument(
        "--on-cloud-failure",
        choices=["degrade", "fail"],
        default="degrade",
        help="when an escalation needs the cloud and it is away: degraded answer, or UNAVAILABLE",
    )
    router.add_argument(
        "--max-heartbeats-per-s",
        type=float,
        default=100.0,
        help="heartbeats the whole fleet may send a second; agents are asked to slow down past it",
    )
    router.add_argument(
        "--admit-per-s",
        type=float,
        default=500.0,
        help="agents admitted a second (a restart's reconnect storm)",
    )
    router.add_argument(
        "--hello-timeout-s",
        type=float,
        default=10.0,
        help="seconds a new AgentLink may stay silent before its Hello (default 10)",
    )
    router.add_argument(
        "--rollout-state",
        type=Path,
        default=None,
        metavar="FILE",
        help="keep rollout state here, so it survives a restart (default: in memory only)",
    )
    router.add_argument(
        "--openai", default=None, metavar="HOST:PORT", help="serve the OpenAI API (generative families) here"
    )
    router.add_argument(
        "--openai-api-key-file",
        type=Path,
        default=None,
        help="the OpenAI API's key, as clients send it (Authorization: Bearer KEY); required off "
        "loopback; default: STRATUS_OPENAI_API_KEY",
    )
    router.add_argument(
        "--openai-host",
        action="append",
        default=[],
        help="a Host name the keyless (loopback) OpenAI API answers besides loopback's (repeatable)",
    )
    router.add_argument(
        "--peers",
        default=None,
        help="the site's other routers (HOST:PORT,... or dns:NAME:PORT), to share rollouts with",
    )
    router.add_argument(
        "--keepalive-s",
        type=float,
        default=2.0,
        help="HTTP/2 ping interval on every link; a frozen agent is lost within this plus 1 s",
    )
    _add_batch_delay(router)
    _add_audits(router)
    router.set_defaults(handler=_router)
    return router


def _add_audits(router: argparse.ArgumentParser) -> None:
    router.add_argument(
        "--audit-share",
        type=_share,
        default=0.01,
        help="share of the items settled below a family's top tier also asked of it in the background, "
        "to estimate each tier's live accuracy (a family's [audit] share overrides it; 0: none)",
    )
    router.add_argument(
        "--audit-max-per-s",
        type=float,
        default=10.0,
        help="most items audited a second per family (a family's [audit] max_per_s overrides it)",
    )


def _add_exposure(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--insecure",
        action="store_true",
        help=f"let {what} run off loopback without TLS or caller authentication (warned about "
        "every minute): anyone who reaches it can use it and read its traffic",
    )
    parser.add_argument(
        "--max-requests-per-client",
        type=int,
        default=1024,
        help="inference requests one client address may have in flight (0: no limit)",
    )


def _cloud_header(text: str) -> tuple[str, str]:
    from router.cloud_models import parse_header

    try:
        return parse_header(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cloud_models(text: str) -> str:
    from router.cloud_models import parse_cloud_models

    try:
        parse_cloud_models(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _add_cloud_link(router: argparse.ArgumentParser) -> None:
    """How to reach a cloud that is not a Stratus gateway (Triton, KServe, MLServer)."""
    router.add_argument(
        "--cloud-models",
        default=None,
        type=_cloud_models,
        metavar="NAME,...",
        help="models the cloud serves the families with, NAME or FAMILY=NAME (e.g. digits-large); "
        "found by ModelReady/ModelMetadata where the cloud does not list them",
    )
    router.add_argument(
        "--cloud-header",
        action="append",
        default=[],
        type=_cloud_header,
        metavar="KEY=VALUE",
        help="gRPC metadata sent on every call to the cloud (repeatable), e.g. "
        "triton-grpc-protocol-triton-access-token=TOKEN or authorization='Bearer TOKEN'",
    )


def _add_batch_delay(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-batch-delay-us",
        type=float,
        default=500.0,
        help="longest a batch waits for more requests while its target is busy (never when idle)",
    )


def _add_max_batch(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-batch",
        type=int,
        default=32,
        help="most items merged into one runtime call; 1 turns batching off",
    )


def _add_upstream(cloud: argparse.ArgumentParser) -> None:
    cloud.add_argument(
        "--openai-upstream",
        default=None,
        metavar="URL",
        help="an OpenAI-compatible server (vLLM), e.g. http://127.0.0.1:8000, that generates for one family",
    )
    cloud.add_argument(
        "--upstream-model", default=None, metavar="NAME", help="its model (default: the first it lists)"
    )
    cloud.add_argument(
        "--upstream-family", default=None, metavar="NAME", help="the family it serves (default: its model)"
    )


def _add_cloud(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    cloud = commands.add_parser("cloud", help="run the cloud gateway")
    cloud.add_argument("--listen", default="127.0.0.1:8002", help="HOST:PORT for the escalation API")
    cloud.add_argument("--models", type=Path, default=Path("models"), help="the models folder")
    cloud.add_argument("--runtimes", default=None, help=RUNTIMES_HELP)
    cloud.add_argument("--variants", default=None, help="comma-separated (default: the cloud variants)")
    cloud.add_argument("--concurrency", type=int, default=2, help="runtime calls at once")
    cloud.add_argument(
        "--queue-limit", type=int, default=256, help="items that may wait beyond those running"
    )
    _add_max_batch(cloud)
    _add_batch_delay(cloud)
    cloud.add_argument("--cache-dir", type=Path, default=_default_cache(), help="runtime caches")
    cloud.add_argument(
        "--client-token-file",
        type=Path,
        default=None,
        help="callers (the router: --cloud-token-file) must send 'authorization: Bearer TOKEN' "
        "(default: $STRATUS_CLIENT_TOKEN)",
    )
    _add_exposure(cloud, "the cloud gateway")
    _add_upstream(cloud)
    cloud.set_defaults(handler=_cloud)
    return cloud


def _add_agent(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    agent = commands.add_parser("agent", help="run an edge agent")
    agent.add_argument(
        "--tier", choices=["device", "edge"], required=True, help="which tier this agent serves"
    )
    agent.add_argument("--models", type=Path, default=Path("models"), help="the models folder")
    agent.add_argument("--variants", default=None, help="comma-separated (default: the tier's variants)")
    agent.add_argument(
        "--router",
        required=True,
        help="HOST:PORT[,HOST:PORT...] (a link to each), dns:NAME:PORT (every address NAME resolves "
        "to, e.g. a headless Service), or auto (every router zeroconf finds; needs --tls-ca)",
    )
    agent.add_argument("--name", default=None, help="the agent's id (default: HOSTNAME-TIER)")
    agent.add_argument("--concurrency", type=int, default=2, help="runtime calls at once")
    agent.add_argument(
        "--queue-limit", type=int, default=64, help="work items that may wait beyond those running"
    )
    _add_max_batch(agent)
    agent.add_argument("--serve", default=None, help="also serve the inference API on HOST:PORT")
    agent.add_argument("--runtimes", default=None, help=RUNTIMES_HELP)
    agent.add_argument(
        "--agent-token-file",
        type=Path,
        default=None,
        help="this agent's token, from a file (default: $STRATUS_AGENT_TOKEN, else $STRATUS_TOKEN)",
    )
    agent.add_argument(
        "--client-token-file",
        type=Path,
        default=None,
        help="--serve's callers must send 'authorization: Bearer TOKEN' (default: $STRATUS_CLIENT_TOKEN)",
    )
    agent.add_argument(
        "--insecure",
        action="store_true",
        help="allow plaintext links to routers on other machines, zeroconf without --tls-ca, and "
        "--serve off loopback without TLS and client authentication",
    )
    agent.add_argument("--cache-dir", type=Path, default=_default_cache(), help="runtime caches")
    agent.set_defaults(handler=_agent)
    return agent


def _add_servers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    router = _add_router(commands)
    cloud = _add_cloud(commands)
    agent = _add_agent(commands)
    for parser in (cloud, agent):
        parser.add_argument(
            "--precision",
            type=str.lower,
            choices=["fp32", "fp16", "int8"],
            default=None,
            help="serve this precision of each family (default: the fastest this CPU runs natively "
            "within the family's accuracy tolerance)",
        )
        parser.add_argument(
            "--emulate-slow-ms",
            type=float,
            default=0.0,
            help="benchmarks and tests: add this much to each runtime call, as slower hardware would",
        )
    for parser in (router, cloud, agent):
        parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
        parser.add_argument(
            "--log-format", choices=["text", "json"], default="text", help="json: one object per line"
        )
        parser.add_argument(
            "--metrics", default=None, metavar="HOST:PORT", help="serve Prometheus metrics at /metrics here"
        )
        _add_tls(parser)
    fleet = commands.add_parser("fleet", help="see and steer the fleet")
    sub = fleet.add_subparsers(dest="fleet_command", required=True)
    status = sub.add_parser("status", help="agents, tiers and the cloud link")
    status.add_argument("--router", required=True, help="the router's HOST:PORT")
    status.add_argument("--json", action="store_true", help="everything, every agent included, as JSON")
    status.add_argument("--agents", action="store_true", help="list every agent, not only the summary")
    status.add_argument(
        "--families",
        action="store_true",
        help="each family too: per tier its threshold, current variants and rollout; degraded or not",
    )
    status.add_argument("--watch", action="store_true", help="print it again on every change")
    status.add_argument(
        "--interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --watch: a fresh status every SECONDS (after each print), changed or not, "
        "instead of on every change",
    )
    status.add_argument(
        "--operator-token-file",
        type=Path,
        default=None,
        help="for --private-status routers (default: $STRATUS_OPERATOR_TOKEN)",
    )
    status.set_defaults(handler=_fleet_status)
    changes = []
    for command, what in (
        ("drain", "stop sending new work to an agent"),
        ("undrain", "send an agent an operator drained new work again"),
        ("forget", "drop a lost or left agent from the status now (not after 600 s)"),
    ):
        change = sub.add_parser(command, help=what)
        change.add_argument("agent_id")
        change.add_argument("--router", required=True, help="the router's HOST:PORT")
        change.add_argument(
            "--operator-token-file", type=Path, default=None, help="default: $STRATUS_OPERATOR_TOKEN"
        )
        change.set_defaults(handler=_fleet_drain)
        changes.append(change)
    _add_fleet_changes(sub, status, *changes)
    demo = commands.add_parser("demo", help="a whole local fleet on loopback, end to end")
    demo.add_argument("--models", type=Path, default=Path("models"), help="the models folder")
    demo.add_argument("--json", action="store_true", help="the report as JSON")
    demo.add_argument("--cache-dir", type=Path, default=_default_cache(), help="runtime caches")
    demo.set_defaults(handler=_demo)


def _add_fleet_changes(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], *others: argparse.ArgumentParser
) -> None:
    reload = sub.add_parser(
        "reload", help="load new variants from an agent's (or the cloud gateway's) models folder, no restart"
    )
    reload.add_argument("agent_id", nargs="?", default=None)
    reload.add_argument(
        "--cloud",
        action="store_true",
        help="the router's cloud gateway instead of an agent (the router asks it)",
    )
    reload.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the answer")
    reload.set_defaults(handler=_fleet_reload)
    rollout = sub.add_parser("rollout", help="gray release of a candidate variant on one tier")
    rollout.add_argument("family")
    rollout.add_argument("--tier", choices=["device", "edge"], default=None, help="the tier rolled out on")
    rollout.add_argument("--candidate", default=None, help="the FP32 variant to roll out")
    rollout.add_argument("--steps", default=None, help="percent per step (default 5,25,50,100)")
    rollout.add_argument("--min-requests", type=int, default=100, help="per variant, before a step is judged")
    rollout.add_argument("--shadow", type=float, default=0.0, metavar="P", help="mirror P%% of requests")
    rollout.add_argument(
        "--max-error-increase", type=_share, default=0.01, help="rolled back past this rise in errors"
    )
    rollout.add_argument("--max-p99-ratio", type=float, default=1.5, help="rolled back past this p99 ratio")
    rollout.add_argument(
        "--max-unsure-increase",
        type=_share,
        default=0.05,
        help="rolled back past this rise in unsure answers",
    )
    steer = rollout.add_mutually_exclusive_group()
    steer.add_argument("--status", action="store_true", help="where the family's rollouts stand")
    steer.add_argument("--promote", action="store_true", help="send the candidate everything now")
    steer.add_argument("--abort", action="store_true", help="back to 0%% now")
    rollout.add_argument("--json", action="store_true", help="the rollouts as JSON")
    rollout.set_defaults(handler=_fleet_rollout)
    accuracy = _add_fleet_accuracy(sub)
    for parser in (*others, reload, rollout, accuracy):
        _add_tls(parser)
    for parser in (reload, rollout, accuracy):
        parser.add_argument("--router", required=True, help="the router's HOST:PORT")
        parser.add_argument(
            "--operator-token-file", type=Path, default=None, help="default: $STRATUS_OPERATOR_TOKEN"
        )


def _add_fleet_accuracy(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    accuracy = sub.add_parser(
        "accuracy", help="each tier's live agreement with the top tier (audits) against its calibration"
    )
    accuracy.add_argument("family")
    accuracy.add_argument("--agents", action="store_true", help="rank the agents too, the surely worst last")
    accuracy.add_argument("--json", action="store_true", help="the same as JSON")
    accuracy.set_defaults(handler=_fleet_accuracy)
    return accuracy


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a share between 0 and 1")
    return value


class _Help(argparse.HelpFormatter):
    """Every option's help ends with its default, where it has one and does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default not in (None, False, argparse.SUPPRESS, [])
        if shown and action.option_strings and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _use_help(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _Help
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _use_help(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stratus", description="Edge-cloud tiered inference router.")
    parser.add_argument("--version", action="version", version=f"stratus {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_models(commands)
    add_certs(commands)
    _add_servers(commands)
    _use_help(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except StratusError as exc:
        print(f"stratus: error: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:  # a call of `stratus fleet` or `models`: one line, not a traceback
        from stratus.fleetctl import call_error

        address = getattr(args, "router", None) or "the server"
        print(
            f"stratus: error: {call_error(exc, address, _tls(args) if hasattr(args, 'tls_ca') else TlsSettings())}",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
