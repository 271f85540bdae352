"""``stratus router``, ``stratus cloud`` and ``stratus agent``: each server's flags (one per
field of its settings dataclass) and its start. Each imports its app lazily, so a device that
runs only ``stratus agent`` never imports the router or the cloud gateway."""

from __future__ import annotations

import argparse
from pathlib import Path

from stratus.cli.options import (
    RUNTIMES_HELP,
    add_batch_delay,
    add_config,
    add_exposure,
    add_tls,
    cpu_hardware,
    flag_names,
    option,
    settings_of,
)
from stratus.cli.router import add_router


def _cloud(args: argparse.Namespace) -> int:
    from cloud_gateway.app import serve
    from cloud_gateway.settings import CloudSettings
    from stratus.process import configure_logging, run

    configure_logging(args.log_level, args.log_format)
    run(serve(settings_of(args, CloudSettings, "cloud", hardware=cpu_hardware())))
    return 0


def _agent(args: argparse.Namespace) -> int:
    import asyncio

    from edge_agent.agent import load_models, run_agent
    from edge_agent.settings import AgentSettings
    from stratus.obs.metrics import Metrics
    from stratus.process import configure_logging, run, stop_on_signals

    configure_logging(args.log_level, args.log_format)
    settings = settings_of(args, AgentSettings, "agent", hardware=cpu_hardware())
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


def _list(names: tuple[str, ...] | None) -> list[str] | None:
    return list(names) if names is not None else None


def _add_models(parser: argparse.ArgumentParser, role: str, which: str) -> None:
    """What a cloud gateway or an agent serves, and how its runtimes batch."""
    option(parser, role, "models", "--models", type=Path, help="the models folder")
    option(parser, role, "variants", "--variants", help=f"comma-separated (default: {which})")
    option(parser, role, "runtimes", "--runtimes", help=RUNTIMES_HELP)
    option(parser, role, "concurrency", "--concurrency", type=int, help="runtime calls at once")
    option(
        parser,
        role,
        "max_batch",
        "--max-batch",
        type=int,
        help="most items merged into one runtime call; 1 turns batching off",
    )
    option(parser, role, "cache_dir", "--cache-dir", type=Path, help="runtime caches")
    option(
        parser,
        role,
        "precision",
        "--precision",
        type=str.lower,
        choices=["fp32", "fp16", "int8"],
        help="serve this precision of each family (default: the fastest this CPU runs natively "
        "within the family's accuracy tolerance)",
    )
    option(
        parser,
        role,
        "emulated_extra_ms",
        "--emulate-slow-ms",
        type=float,
        help="benchmarks and tests: add this much to each runtime call, as slower hardware would",
    )


def _add_upstream(cloud: argparse.ArgumentParser) -> None:
    option(
        cloud,
        "cloud",
        "openai_upstream",
        "--openai-upstream",
        metavar="URL",
        help="an OpenAI-compatible server (vLLM), e.g. http://127.0.0.1:8000, that generates for one family",
    )
    option(
        cloud,
        "cloud",
        "upstream_model",
        "--upstream-model",
        metavar="NAME",
        help="its model (default: the first it lists)",
    )
    option(
        cloud,
        "cloud",
        "upstream_family",
        "--upstream-family",
        metavar="NAME",
        help="the family it serves (default: its model)",
    )


def _add_cloud(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    cloud = commands.add_parser("cloud", help="run the cloud gateway")
    option(cloud, "cloud", "listen", "--listen", help="HOST:PORT for the escalation API")
    _add_models(cloud, "cloud", "the cloud variants")
    option(
        cloud,
        "cloud",
        "queue_limit",
        "--queue-limit",
        type=int,
        help="items that may wait beyond those running",
    )
    add_batch_delay(cloud, "cloud")
    option(
        cloud,
        "cloud",
        "client_token_file",
        "--client-token-file",
        type=Path,
        help="callers (the router: --cloud-token-file) must send 'authorization: Bearer TOKEN' "
        "(default: $STRATUS_CLIENT_TOKEN)",
    )
    option(
        cloud,
        "cloud",
        "revoked_certificates",
        "--revoked-certificates",
        type=Path,
        metavar="FILE",
        help="certificates no longer trusted though they chain to the CA: SPIFFE ids or serial:HEX "
        "lines, re-read when the file changes (under mutual TLS)",
    )
    add_exposure(cloud, "cloud", "the cloud gateway")
    _add_upstream(cloud)
    cloud.set_defaults(handler=_cloud)
    return cloud


def _add_agent(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    agent = commands.add_parser("agent", help="run an edge agent")
    option(
        agent,
        "agent",
        "tier",
        "--tier",
        choices=["device", "edge"],
        help="which tier this agent serves (required: here, or tier in [agent])",
    )
    _add_models(agent, "agent", "the tier's variants")
    option(
        agent,
        "agent",
        "router",
        "--router",
        help="HOST:PORT[,HOST:PORT...] (a link to each), dns:///NAME:PORT (every address NAME resolves "
        "to, e.g. a headless Service), or auto (every router zeroconf finds; needs --tls-ca); "
        "required: here, or router in [agent]",
    )
    option(agent, "agent", "name", "--name", help="the agent's id (default: HOSTNAME-TIER)")
    option(
        agent,
        "agent",
        "queue_limit",
        "--queue-limit",
        type=int,
        help="work items that may wait beyond those running",
    )
    option(agent, "agent", "serve", "--serve", help="also serve the inference API on HOST:PORT")
    option(
        agent,
        "agent",
        "token_file",
        "--agent-token-file",
        type=Path,
        help="this agent's token, from a file (default: $STRATUS_AGENT_TOKEN, else $STRATUS_TOKEN)",
    )
    option(
        agent,
        "agent",
        "client_token_file",
        "--client-token-file",
        type=Path,
        help="--serve's callers must send 'authorization: Bearer TOKEN' (default: $STRATUS_CLIENT_TOKEN)",
    )
    option(
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


def add_servers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    servers = {"router": add_router(commands), "cloud": _add_cloud(commands), "agent": _add_agent(commands)}
    for role, parser in servers.items():
        parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
        parser.add_argument(
            "--log-format", choices=["text", "json"], default="text", help="json: one object per line"
        )
        option(
            parser,
            role,
            "metrics",
            "--metrics",
            metavar="HOST:PORT",
            help="serve Prometheus metrics at /metrics here",
        )
        option(
            parser,
            role,
            "metrics_token_file",
            "--metrics-token-file",
            type=Path,
            help="off loopback, /metrics answers only 'authorization: Bearer TOKEN' (Prometheus's "
            "authorization credentials; default: $STRATUS_METRICS_TOKEN)",
        )
        option(
            parser,
            role,
            "metrics_open",
            "--metrics-open",
            action="store_true",
            help="serve /metrics off loopback with no token: it lists agent ids and load, so admit "
            "only Prometheus to the port (a network policy)",
        )
        add_tls(parser, role)
        add_config(parser, role)
        parser.set_defaults(flag_names=flag_names(parser))
