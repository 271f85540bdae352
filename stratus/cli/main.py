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
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from stratus import __version__
from stratus.cli.certs import add_parser as add_certs
from stratus.cli.config import add_config_check, settings_class
from stratus.cli.models import add_models
from stratus.cli.thresholds import add_parser as add_thresholds_parser
from stratus.errors import ConfigError, StratusError
from stratus.serving.channels import TlsSettings

if TYPE_CHECKING:
    from stratus.families.precision import Hardware

Handler = Callable[[argparse.Namespace], int]
T = TypeVar("T")


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


def _add_tls(parser: argparse.ArgumentParser, role: str | None = None) -> None:
    """TLS flags; on a server (``role``) they are its settings' ``tls.cert``, ``tls.key``, ``tls.ca``."""
    for name, what in (
        ("cert", "this process's certificate (PEM)"),
        ("key", "its private key (PEM)"),
        ("ca", "CA that peers' certificates must chain to; on a server this turns on mutual TLS"),
    ):
        action = parser.add_argument(f"--tls-{name}", type=Path, default=None, help=what)
        if role is not None:
            action.setting = (role, f"tls.{name}")  # type: ignore[attr-defined]


def _flag_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each setting's flag, by the setting's dest, to name it in errors."""
    names = {}
    for action in parser._actions:
        setting = getattr(action, "setting", None)
        if setting is not None:
            names[setting[1].replace(".", "_")] = action.option_strings[0]
    return names


def _router(args: argparse.Namespace) -> int:
    from router.app import serve
    from router.settings import RouterSettings
    from stratus.process import configure_logging, run

    configure_logging(args.log_level, args.log_format)
    run(serve(_settings(args, RouterSettings, "router")))
    return 0


def _cloud(args: argparse.Namespace) -> int:
    from cloud_gateway.app import serve
    from cloud_gateway.settings import CloudSettings
    from stratus.process import configure_logging, run

    configure_logging(args.log_level, args.log_format)
    run(serve(_settings(args, CloudSettings, "cloud", hardware=_hardware())))
    return 0


def _agent(args: argparse.Namespace) -> int:
    import asyncio

    from edge_agent.agent import load_models, run_agent
    from edge_agent.settings import AgentSettings
    from stratus.obs.metrics import Metrics
    from stratus.process import configure_logging, run, stop_on_signals

    configure_logging(args.log_level, args.log_format)
    settings = _settings(args, AgentSettings, "agent", hardware=_hardware())
    models = load_models(
        settings.models,
        tier=settings.tier,
        variants=_list(settings.variants),
        concurrency=settings.concurrency,
        queue_limit=settings.queue_limit,
        runtimes=_list(settings.runtimes),
        cache_dir=settings.cache_dir,
        max_batch=settings.max_batch,
        precision=settings.precision,
        hardware=settings.hardware,
        emulated_extra_ms=settings.emulated_extra_ms,
        metrics=Metrics(),
    )

    async def main() -> None:
        stop = asyncio.Event()
        stop_on_signals(stop)
        await run_agent(settings, models, stop)

    run(main())
    return 0


def _settings(args: argparse.Namespace, cls: type[T], role: str, **given: object) -> T:
    """A server's settings: its dataclass's defaults, then ``--config``'s ``[role]`` table,
    then ``STRATUS_ROLE_*``, then the flags given (stratus/config.py)."""
    from stratus.config import Flags, load

    values = dict(vars(args))
    if values.get("max_batch_delay_us") is not None:
        values["max_batch_delay_s"] = values["max_batch_delay_us"] / 1e6
    flags = Flags(values, args.flag_names)
    return load(cls, role, file=args.config, environ=os.environ, flags=flags, given=given).built


def _list(names: tuple[str, ...] | None) -> list[str] | None:
    return list(names) if names is not None else None


def _hardware() -> Hardware:
    """``STRATUS_CPU_FLAGS`` (comma-separated) stands in for the CPU's own flags: for a
    container that hides them, and for tests of the precision choice."""
    from stratus.families.precision import this_hardware

    return this_hardware()


RUNTIMES_HELP = (
    "only these runtimes, in this order, e.g. litert, or onnxruntime,openvino, or litert,llama_cpp "
    "(classifiers and generative models each use the ones of their kind; a family none can run "
    "is not served)"
)


def _fleet_status(args: argparse.Namespace) -> int:
    import math

    from stratus.cli.fleet import show_status

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
    from stratus.cli.accuracy import show_accuracy

    return show_accuracy(
        args.router,
        args.family,
        agents=args.agents,
        as_json=args.json,
        tls=_tls(args),
        token=_role_token(args, "operator"),
    )


def _fleet_thresholds(args: argparse.Namespace) -> int:
    from stratus.cli.thresholds import asked_from, run_thresholds

    return run_thresholds(args.router, asked_from(args), tls=_tls(args), token=_role_token(args, "operator"))


def _fleet_drain(args: argparse.Namespace) -> int:
    from stratus.cli.fleet import drain

    action = {"drain": "Drain", "undrain": "Undrain", "forget": "Forget"}[args.fleet_command]
    return drain(
        args.router, args.agent_id, token=_role_token(args, "operator"), tls=_tls(args), action=action
    )


def _fleet_reload(args: argparse.Namespace) -> int:
    from stratus.cli.fleet import reload

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
    from stratus.cli.fleet import rollout
    from stratus.convert.fleet import wire_tier
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
    from stratus.cli.demo import run_demo

    def sdk(router: str) -> Client:
        return Client(args.models, router=router, cache_dir=args.cache_dir)

    return run_demo(models=args.models, as_json=args.json, sdk_factory=sdk)


def _option(parser: argparse.ArgumentParser, role: str, field: str, *flags: str, **kwargs: Any) -> None:
    """A flag for one field of a role's settings, its dest the field's name (``tls.cert``:
    ``tls_cert``). Not given, it is ``None``, so that the config file, the ``STRATUS_*``
    variables and the dataclass's one default apply; its help shows that default."""
    if kwargs.get("action") not in ("store_true", "store_const"):
        kwargs.setdefault("metavar", flags[0].lstrip("-").replace("-", "_").upper())
    action = parser.add_argument(*flags, dest=field.replace(".", "_"), default=None, **kwargs)
    action.setting = (role, field)  # type: ignore[attr-defined]


def _add_config(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"a TOML file whose [{role}] table holds settings; STRATUS_{role.upper()}_* variables "
        "and flags win over it (README, Configuration; check it with `stratus config check FILE`)",
    )


def _add_router(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    router = commands.add_parser("router", help="run the router (edge gateway)")
    _option(router, "router", "listen", "--listen", help="HOST:PORT for OIP, AgentLink and Fleet")
    _option(
        router,
        "router",
        "cloud",
        "--cloud",
        help="the cloud gateway: HOST:PORT, several (A:PORT,B:PORT), or dns:///NAME:PORT for every "
        "address NAME resolves to (a headless Service), re-resolved every 15 s; each call goes to "
        "the less busy of two",
    )
    _add_cloud_link(router)
    _option(
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
        ("peer", "proves rollout syncs with the other routers, both ways"),
        ("client", "inference callers must send as 'authorization: Bearer TOKEN'"),
        ("cloud", "this router sends the cloud gateway as 'authorization: Bearer TOKEN'"),
    ):
        fallback = ", else $STRATUS_TOKEN" if role in ("agent", "operator", "peer") else ""
        _option(
            router,
            "router",
            f"{role}_token_file",
            f"--{role}-token-file",
            type=Path,
            help=f"the token {what} (default: $STRATUS_{role.upper()}_TOKEN{fallback})",
        )
    _option(
        router,
        "router",
        "agent_tokens_file",
        "--agent-tokens-file",
        type=Path,
        metavar="FILE",
        help="per-agent tokens, 'AGENT_ID TOKEN' lines (re-read when changed): binds each id to "
        "its own token, so one can be revoked",
    )
    _option(
        router,
        "router",
        "private_status",
        "--private-status",
        action="store_true",
        help="fleet status, watch and rollout status need the operator role too",
    )
    _add_exposure(router, "router", "the router")
    _option(
        router,
        "router",
        "on_cloud_failure",
        "--on-cloud-failure",
        choices=["degrade", "fail"],
        help="when an escalation needs the cloud and it is away: degraded answer, or UNAVAILABLE",
    )
    _option(
        router,
        "router",
        "max_heartbeats_per_s",
        "--max-heartbeats-per-s",
        type=float,
        help="heartbeats the whole fleet may send a second; agents are asked to slow down past it",
    )
    _option(
        router,
        "router",
        "admit_per_s",
        "--admit-per-s",
        type=float,
        help="agents admitted a second (a restart's reconnect storm)",
    )
    _option(
        router,
        "router",
        "hello_timeout_s",
        "--hello-timeout-s",
        type=float,
        help="seconds a new AgentLink may stay silent before its Hello",
    )
    _option(
        router,
        "router",
        "rollout_state",
        "--rollout-state",
        type=Path,
        metavar="FILE",
        help="keep rollout state here, so it survives a restart (default: in memory only)",
    )
    _add_openai(router)
    _option(
        router,
        "router",
        "peers",
        "--peers",
        help="the site's other routers (HOST:PORT,... or dns:NAME:PORT), to share rollouts with",
    )
    _option(
        router,
        "router",
        "keepalive_s",
        "--keepalive-s",
        type=float,
        help="HTTP/2 ping interval on every link; a frozen agent is lost within this plus keepalive_timeout_s",
    )
    _add_batch_delay(router, "router")
    _add_audits(router)
    _add_capture(router)
    router.set_defaults(handler=_router)
    return router


def _add_openai(router: argparse.ArgumentParser) -> None:
    _option(
        router,
        "router",
        "openai",
        "--openai",
        metavar="HOST:PORT",
        help="serve the OpenAI API (generative families) here",
    )
    _option(
        router,
        "router",
        "openai_api_key_file",
        "--openai-api-key-file",
        type=Path,
        help="the OpenAI API's key, as clients send it (Authorization: Bearer KEY); required off "
        "loopback; default: STRATUS_OPENAI_API_KEY",
    )
    _option(
        router,
        "router",
        "openai_hosts",
        "--openai-host",
        action="append",
        help="a Host name the keyless (loopback) OpenAI API answers besides loopback's (repeatable)",
    )


def _add_capture(router: argparse.ArgumentParser) -> None:
    _option(router, "router", "capture.folder", "--capture", type=Path, metavar="DIR",
            help="write audited and escalated items of the --capture-families as Parquet files "
            "here (off by default: inputs may be sensitive)")  # fmt: skip
    _option(router, "router", "capture.families", "--capture-families", metavar="F1,F2",
            help="the families --capture writes (required with it: no family is captured unnamed)")  # fmt: skip
    _option(router, "router", "capture.max_bytes", "--capture-max-bytes", type=int,
            help="the capture folder's total size; past it the oldest files are deleted")  # fmt: skip
    _option(router, "router", "capture.file_bytes", "--capture-file-bytes", type=int,
            help="a capture file is closed (and made visible) at this size")  # fmt: skip
    _option(router, "router", "capture.file_age_s", "--capture-file-age-s", type=float,
            help="... or at this age, whichever comes first")  # fmt: skip


def _add_audits(router: argparse.ArgumentParser) -> None:
    _option(
        router,
        "router",
        "audit.share",
        "--audit-share",
        type=_share,
        help="share of the items settled below a family's top tier also asked of it in the background, "
        "to estimate each tier's live accuracy (a family's [audit] share overrides it; 0: none)",
    )
    _option(
        router,
        "router",
        "audit.max_per_s",
        "--audit-max-per-s",
        type=float,
        help="most items audited a second per family (a family's [audit] max_per_s overrides it)",
    )
    _option(
        router,
        "router",
        "auto_thresholds.goals",
        "--auto-thresholds",
        metavar="FAMILY=GOAL:VALUE,...",
        help="step these families' thresholds toward what the audits suggest (digits=target_accuracy:0.98 "
        "or digits=max_escalation:0.05), upward only, bounded (router/threshold_auto.py); off by default",
    )
    _option(router, "router", "auto_thresholds.max_step", "--auto-max-step", type=_share,
            help="most a threshold moves per interval")  # fmt: skip
    _option(router, "router", "auto_thresholds.max_cloud_share", "--auto-max-cloud-share", type=_share,
            help="no step sends more than this share to the cloud")  # fmt: skip
    _option(router, "router", "auto_thresholds.interval_s", "--auto-interval", type=float,
            help="seconds between steps")  # fmt: skip


def _add_exposure(parser: argparse.ArgumentParser, role: str, what: str) -> None:
    _option(
        parser,
        role,
        "insecure",
        "--insecure",
        action="store_true",
        help=f"let {what} run off loopback without TLS or caller authentication (warned about "
        "every minute): anyone who reaches it can use it and read its traffic",
    )
    _option(
        parser,
        role,
        "max_requests_per_client",
        "--max-requests-per-client",
        type=int,
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
    _option(
        router,
        "router",
        "cloud_models",
        "--cloud-models",
        type=_cloud_models,
        metavar="NAME,...",
        help="models the cloud serves the families with, NAME or FAMILY=NAME (e.g. digits-large); "
        "found by ModelReady/ModelMetadata where the cloud does not list them",
    )
    _option(
        router,
        "router",
        "cloud_headers",
        "--cloud-header",
        action="append",
        type=_cloud_header,
        metavar="KEY=VALUE",
        help="gRPC metadata sent on every call to the cloud (repeatable), e.g. "
        "triton-grpc-protocol-triton-access-token=TOKEN or authorization='Bearer TOKEN'",
    )


def _add_batch_delay(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument(
        "--max-batch-delay-us",
        type=float,
        default=None,
        help="longest a batch waits for more requests while its target is busy (never when idle); "
        f"max_batch_delay_s in [{role}]",
    ).setting = (role, "max_batch_delay_s")  # type: ignore[attr-defined]


def _add_models(parser: argparse.ArgumentParser, role: str, which: str) -> None:
    """What a cloud gateway or an agent serves, and how its runtimes batch."""
    _option(parser, role, "models", "--models", type=Path, help="the models folder")
    _option(parser, role, "variants", "--variants", help=f"comma-separated (default: {which})")
    _option(parser, role, "runtimes", "--runtimes", help=RUNTIMES_HELP)
    _option(parser, role, "concurrency", "--concurrency", type=int, help="runtime calls at once")
    _option(
        parser,
        role,
        "max_batch",
        "--max-batch",
        type=int,
        help="most items merged into one runtime call; 1 turns batching off",
    )
    _option(parser, role, "cache_dir", "--cache-dir", type=Path, help="runtime caches")
    _option(
        parser,
        role,
        "precision",
        "--precision",
        type=str.lower,
        choices=["fp32", "fp16", "int8"],
        help="serve this precision of each family (default: the fastest this CPU runs natively "
        "within the family's accuracy tolerance)",
    )
    _option(
        parser,
        role,
        "emulated_extra_ms",
        "--emulate-slow-ms",
        type=float,
        help="benchmarks and tests: add this much to each runtime call, as slower hardware would",
    )


def _add_upstream(cloud: argparse.ArgumentParser) -> None:
    _option(
        cloud,
        "cloud",
        "openai_upstream",
        "--openai-upstream",
        metavar="URL",
        help="an OpenAI-compatible server (vLLM), e.g. http://127.0.0.1:8000, that generates for one family",
    )
    _option(
        cloud,
        "cloud",
        "upstream_model",
        "--upstream-model",
        metavar="NAME",
        help="its model (default: the first it lists)",
    )
    _option(
        cloud,
        "cloud",
        "upstream_family",
        "--upstream-family",
        metavar="NAME",
        help="the family it serves (default: its model)",
    )


def _add_cloud(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    cloud = commands.add_parser("cloud", help="run the cloud gateway")
    _option(cloud, "cloud", "listen", "--listen", help="HOST:PORT for the escalation API")
    _add_models(cloud, "cloud", "the cloud variants")
    _option(
        cloud,
        "cloud",
        "queue_limit",
        "--queue-limit",
        type=int,
        help="items that may wait beyond those running",
    )
    _add_batch_delay(cloud, "cloud")
    _option(
        cloud,
        "cloud",
        "client_token_file",
        "--client-token-file",
        type=Path,
        help="callers (the router: --cloud-token-file) must send 'authorization: Bearer TOKEN' "
        "(default: $STRATUS_CLIENT_TOKEN)",
    )
    _add_exposure(cloud, "cloud", "the cloud gateway")
    _add_upstream(cloud)
    cloud.set_defaults(handler=_cloud)
    return cloud


def _add_agent(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    agent = commands.add_parser("agent", help="run an edge agent")
    _option(
        agent,
        "agent",
        "tier",
        "--tier",
        choices=["device", "edge"],
        help="which tier this agent serves (required: here, or tier in [agent])",
    )
    _add_models(agent, "agent", "the tier's variants")
    _option(
        agent,
        "agent",
        "router",
        "--router",
        help="HOST:PORT[,HOST:PORT...] (a link to each), dns:NAME:PORT (every address NAME resolves "
        "to, e.g. a headless Service), or auto (every router zeroconf finds; needs --tls-ca); "
        "required: here, or router in [agent]",
    )
    _option(agent, "agent", "name", "--name", help="the agent's id (default: HOSTNAME-TIER)")
    _option(
        agent,
        "agent",
        "queue_limit",
        "--queue-limit",
        type=int,
        help="work items that may wait beyond those running",
    )
    _option(agent, "agent", "serve", "--serve", help="also serve the inference API on HOST:PORT")
    _option(
        agent,
        "agent",
        "token_file",
        "--agent-token-file",
        type=Path,
        help="this agent's token, from a file (default: $STRATUS_AGENT_TOKEN, else $STRATUS_TOKEN)",
    )
    _option(
        agent,
        "agent",
        "client_token_file",
        "--client-token-file",
        type=Path,
        help="--serve's callers must send 'authorization: Bearer TOKEN' (default: $STRATUS_CLIENT_TOKEN)",
    )
    _option(
        agent,
        "agent",
        "insecure",
        "--insecure",
        action="store_true",
        help="allow plaintext links to routers on other machines, zeroconf without --tls-ca, and "
        "--serve off loopback without TLS and client authentication",
    )
    agent.set_defaults(handler=_agent)
    return agent


def _add_servers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    servers = {"router": _add_router(commands), "cloud": _add_cloud(commands), "agent": _add_agent(commands)}
    for role, parser in servers.items():
        parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
        parser.add_argument(
            "--log-format", choices=["text", "json"], default="text", help="json: one object per line"
        )
        _option(
            parser,
            role,
            "metrics",
            "--metrics",
            metavar="HOST:PORT",
            help="serve Prometheus metrics at /metrics here",
        )
        _add_tls(parser, role)
        _add_config(parser, role)
        parser.set_defaults(flag_names=_flag_names(parser))
    add_config_check(commands)
    _add_fleet(commands)


def _add_fleet(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    thresholds = add_thresholds_parser(sub)
    thresholds.set_defaults(handler=_fleet_thresholds)
    for parser in (*others, reload, rollout, accuracy, thresholds):
        _add_tls(parser)
    for parser in (reload, rollout, accuracy, thresholds):
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
        setting = getattr(action, "setting", None)
        if setting is not None and "default" not in text:
            return text + _setting_default(*setting)
        shown = action.default not in (None, False, argparse.SUPPRESS, [])
        if shown and action.option_strings and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _setting_default(role: str, field: str) -> str:
    """`` (default: X)`` for a setting's flag, X its dataclass's one default."""
    from stratus.config import default_of, show_value

    default = default_of(settings_class(role), field)
    if default is None or default is False or default in ((), ""):
        return ""
    return f" (default: {show_value(default)})".replace("%", "%%")


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
        from stratus.cli.fleet import call_error

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
