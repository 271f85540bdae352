"""``stratus fleet`` (status, drain, undrain, forget, revoke, corrections, reload, rollout, accuracy, thresholds)
and ``stratus demo``: their flags, and each handler, which calls :mod:`stratus.cli.fleet_calls` or the
view it names."""

from __future__ import annotations

import argparse
from pathlib import Path

from stratus.cli.corrections import add_corrections
from stratus.cli.options import add_router, add_tls, default_cache, operator_token, share, tls_of
from stratus.cli.thresholds import add_parser as add_thresholds_parser
from stratus.errors import ConfigError


def _fleet_status(args: argparse.Namespace) -> int:
    import math

    from stratus.cli.fleet_calls import show_status

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
        tls=tls_of(args),
        token=operator_token(args),
    )


def _fleet_accuracy(args: argparse.Namespace) -> int:
    from stratus.cli.accuracy import show_accuracy

    return show_accuracy(
        args.router,
        args.family,
        agents=args.agents,
        as_json=args.json,
        tls=tls_of(args),
        token=operator_token(args),
    )


def _fleet_thresholds(args: argparse.Namespace) -> int:
    from stratus.cli.thresholds import asked_from, run_thresholds

    return run_thresholds(args.router, asked_from(args), tls=tls_of(args), token=operator_token(args))


def _fleet_drain(args: argparse.Namespace) -> int:
    from stratus.cli.fleet_calls import drain

    action = {"drain": "Drain", "undrain": "Undrain", "forget": "Forget"}[args.fleet_command]
    return drain(
        args.router, args.agent_id, token=operator_token(args), tls=tls_of(args), action=action
    )


def _fleet_revoke(args: argparse.Namespace) -> int:
    from stratus.cli.fleet_calls import revoke

    if args.list == (args.credential is not None):
        raise ConfigError("give a CREDENTIAL to revoke (or to --lift), or --list for the site's revocations: one of them")
    if args.lift and args.list:
        raise ConfigError("--lift names the CREDENTIAL whose revocation ends, not --list")
    return revoke(
        args.router,
        args.credential or "",
        lift=args.lift,
        reason=args.reason,
        as_json=args.json,
        token=operator_token(args),
        tls=tls_of(args),
    )


def _fleet_reload(args: argparse.Namespace) -> int:
    from stratus.cli.fleet_calls import reload

    if (args.agent_id is None) == (not args.cloud):
        raise ConfigError("give an AGENT_ID, or --cloud for the router's cloud gateway (one of them)")
    return reload(
        args.router,
        args.agent_id,
        token=operator_token(args),
        timeout_s=args.timeout,
        tls=tls_of(args),
    )


def _fleet_rollout(args: argparse.Namespace) -> int:
    from stratus.cli.fleet_calls import rollout
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
        token=operator_token(args),
        family=args.family,
        tier=wire_tier(Tier.parse(args.tier) if args.tier else None),
        candidate=args.candidate or "",
        steps=[float(s) for s in args.steps.split(",")] if args.steps else [],
        min_requests=args.min_requests,
        shadow_percent=args.shadow,
        max_error_increase=args.max_error_increase,
        max_p99_ratio=args.max_p99_ratio,
        max_unsure_increase=args.max_unsure_increase,
        min_audits=args.min_audits,
        max_disagreement_increase=args.max_disagreement_increase,
    )
    return rollout(args.router, request, as_json=args.json, tls=tls_of(args))


def _demo(args: argparse.Namespace) -> int:
    from edge_agent.sdk import Client
    from stratus.cli.demo import run_demo

    models = demo_models(args.models)

    def sdk(router: str) -> Client:
        return Client(models, router=router, cache_dir=args.cache_dir)

    return run_demo(models=models, as_json=args.json, sdk_factory=sdk)


# Where the demo's models are when --models is not given: a checkout's, then the image's.
DEMO_MODELS = (Path("models"), Path("/app/models"))


def demo_models(given: Path | None, places: tuple[Path, ...] = DEMO_MODELS) -> Path:
    """The models folder the demo runs: ``--models``, or the first of ``places`` that exists.
    The wheel carries no models (they are built into a checkout's models/ and the image's
    /app/models), so outside both the demo says where to get them rather than a bare path."""
    if given is not None:
        return given
    for place in places:
        if place.is_dir():
            return place
    raise ConfigError(
        "stratus demo runs the models of a Stratus checkout (its models/ folder) or of the image "
        f"(/app/models), and neither is here ({Path.cwd()}): run it from a checkout, in the image, "
        "or give --models DIR"
    )


def add_fleet(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fleet = commands.add_parser("fleet", help="see and steer the fleet")
    sub = fleet.add_subparsers(dest="fleet_command", required=True)
    status = sub.add_parser("status", help="agents, tiers and the cloud link")
    add_router(status)
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
        add_router(change)
        change.add_argument(
            "--operator-token-file", type=Path, default=None, help="default: $STRATUS_OPERATOR_TOKEN"
        )
        change.set_defaults(handler=_fleet_drain)
        changes.append(change)
    _add_fleet_changes(sub, status, *changes, _add_revoke(sub))
    add_corrections(sub)
    demo = commands.add_parser("demo", help="a whole local fleet on loopback, end to end")
    demo.add_argument(
        "--models", type=Path, default=None, help="the models folder (default: ./models, else the image's /app/models)"
    )
    demo.add_argument("--json", action="store_true", help="the report as JSON")
    demo.add_argument("--cache-dir", type=Path, default=default_cache(), help="runtime caches")
    demo.set_defaults(handler=_demo)


def _add_revoke(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    revoke = sub.add_parser(
        "revoke",
        help="refuse a credential on every router of the site (kept in the site's store, --site-state)",
    )
    revoke.add_argument(
        "credential",
        nargs="?",
        help="spiffe://DOMAIN/ROLE/NAME (every certificate of an identity), serial:HEX (one certificate) "
        "or agent:ID (an agent id, whatever it proves itself with)",
    )
    revoke.add_argument("--lift", action="store_true", help="trust the credential again")
    revoke.add_argument("--list", action="store_true", help="the site's revocations")
    revoke.add_argument("--reason", default="", help="why, kept with the revocation")
    revoke.add_argument("--json", action="store_true", help="the revocations as JSON")
    add_router(revoke)
    revoke.add_argument("--operator-token-file", type=Path, default=None, help="default: $STRATUS_OPERATOR_TOKEN")
    revoke.set_defaults(handler=_fleet_revoke)
    return revoke


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
        "--max-error-increase", type=share, default=0.01, help="rolled back past this rise in errors"
    )
    rollout.add_argument("--max-p99-ratio", type=float, default=1.5, help="rolled back past this p99 ratio")
    rollout.add_argument(
        "--max-unsure-increase",
        type=share,
        default=0.05,
        help="rolled back past this rise in unsure answers",
    )
    rollout.add_argument(
        "--min-audits",
        type=int,
        default=50,
        help="audits per variant (answers asked of the top tier too) before a step is judged, where a "
        "tier above audits it",
    )
    rollout.add_argument(
        "--max-disagreement-increase",
        type=share,
        default=0.01,
        help="a step advances once the candidate's agreement with the top tier is surely within this "
        "of the current's, and is rolled back once surely lower; until then it waits for more audits",
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
        add_tls(parser)
    for parser in (reload, rollout, accuracy, thresholds):
        add_router(parser)
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
