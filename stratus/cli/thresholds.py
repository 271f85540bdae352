"""``stratus fleet thresholds FAMILY``: what the routers use, what the audits suggest, and pushes.

* no action: the thresholds in force, the agents' own, and the versions pushed so far;
* ``--suggest``: the thresholds calibrate would choose on the audit rows of the router and of
  every router of its site (as they registered in the site's store), each read once (``stratus.families.suggest``, through ``stratus.tools.calibrate.from_audits``) for ``--target-accuracy`` / ``--max-escalation``,
  or the goal ``[calibration]`` recorded (``--models DIR`` reads it), and what they would change;
* ``--apply device=0.9,edge=0.8`` (or ``--suggest --apply``): a new version on every router
  of the site at once (written to the site's store), only over the version read
  just before, so two operators never overwrite each other unseen;
* ``--revert``: a new version holding what was in force before the current one.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import getpass
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from stratus.errors import ConfigError
from stratus.serving.channels import NO_TLS, TlsSettings, open_sync_channel, server_options
from stratus.serving.discovery import addresses_of, server_name_of
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc

CALL_TIMEOUT_S = 10.0


@dataclass(frozen=True, kw_only=True)
class Asked:
    """What the operator asked for, from the command line."""

    family: str
    apply: str | None  # "device=0.9,edge=0.8"; "" with --suggest: the suggestion
    suggest: bool
    revert: bool
    target_accuracy: float | None = None
    max_escalation: float | None = None
    models: Path | None = None
    reason: str = ""
    author: str = ""
    as_json: bool = False


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "thresholds", help="a family's thresholds on every router: read, suggest from audits, push, revert"
    )
    parser.add_argument("family")
    parser.add_argument("--suggest", action="store_true", help="what calibrate would choose on the audits")
    parser.add_argument(
        "--apply", nargs="?", const="", default=None, metavar="TIER=VALUE,...",
        help="push these thresholds (with --suggest and no value: the suggestion) to every router",
    )  # fmt: skip
    parser.add_argument("--revert", action="store_true", help="back to the version before the current one")
    goal = parser.add_mutually_exclusive_group()
    goal.add_argument("--target-accuracy", type=float, default=None, help="the suggestion's goal")
    goal.add_argument("--max-escalation", type=float, default=None, help="the suggestion's goal")
    parser.add_argument("--models", type=Path, default=None, help="read the goal [calibration] recorded here")
    parser.add_argument("--reason", default=None, help="why, recorded with the version")
    parser.add_argument("--json", action="store_true", help="the same as JSON")
    return parser


def asked_from(args: argparse.Namespace) -> Asked:
    if args.revert and (args.apply is not None or args.suggest):
        raise ConfigError("--revert stands alone: give it without --apply and --suggest")
    if args.apply == "" and not args.suggest:
        raise ConfigError(
            "--apply needs thresholds (device=0.9,edge=0.8), or --suggest to push the suggestion"
        )
    return Asked(
        family=args.family, apply=args.apply, suggest=args.suggest, revert=args.revert,
        target_accuracy=args.target_accuracy, max_escalation=args.max_escalation, models=args.models,
        reason=args.reason or "", author=_author(), as_json=args.json,
    )  # fmt: skip


def _author() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no user name in this environment
        return "operator"


def parse_assignments(text: str) -> dict[str, float]:
    """``device=0.9,edge=0.8`` as thresholds by tier name (the router checks the values)."""
    named: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        tier, sep, value = part.partition("=")
        try:
            if not sep:
                raise ValueError(part)
            named[tier.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"'{part}' is not TIER=VALUE (for example device=0.9)") from None
    if not named:
        raise ConfigError("--apply names at least one TIER=VALUE (for example device=0.9)")
    return named


def run_thresholds(router: str, asked: Asked, *, tls: TlsSettings = NO_TLS, token: str = "") -> int:
    with open_sync_channel(router, tls, server_options("router", tls)) as channel:
        stub = fpb_grpc.FleetStub(channel)
        status = stub.Thresholds(
            fpb.ThresholdsRequest(family=asked.family, token=token, include_rows=asked.suggest),
            timeout=CALL_TIMEOUT_S,
        )
        site = site_rows(status, lambda address, name: _rows_of(address, name, asked.family, tls, token))
        suggested, notes = _suggestion(site.rows, asked) if asked.suggest else (None, ())
        changed = _change(stub, status, asked, suggested, token)
    shown = changed or status  # a change's reply carries no rows: the suggestion's count is kept
    read = site if asked.suggest else None
    before = status if changed is not None else None  # a suggestion's change is from what it replaced
    if asked.as_json:
        print(json.dumps(thresholds_json(shown, suggested, site=read, before=before, notes=notes), indent=2))
    else:
        print(thresholds_table(shown, suggested, site=read, before=before, notes=notes))
    return 0


# Routers a suggestion reads the rows of, at most: a site's, as its store lists them.
MAX_SITE_ROUTERS = 64


@dataclass
class SiteRows:
    """Every router's audit rows a suggestion is chosen on, and whom they came from."""

    rows: list[fpb.AuditRow]
    routers: list[str]  # the router ids read, the asked one first
    unreachable: list[str]  # "address: why", for each router of the site that did not answer


Fetch = Callable[[str, str | None], fpb.ThresholdsReply]


def site_rows(first: fpb.ThresholdsReply, fetch: Fetch) -> SiteRows:
    """``first``'s rows and those of every router of the site it lists (the addresses the
    routers registered in the site's store), and any those list in turn, each router once (by
    id: a router reached at two addresses is not read twice). Each router audits only the
    traffic it routes, so one router's rows are one share of the site's."""
    site = SiteRows(rows=list(first.rows), routers=[first.router_id or "?"], unreachable=[])
    seen, specs, asked = {first.router_id}, [first.site_routers], set[str]()
    while specs and len(site.routers) < MAX_SITE_ROUTERS:
        spec = specs.pop(0)
        for address in _addresses(spec, site):
            if address in asked:
                continue
            asked.add(address)
            try:
                reply = fetch(address, server_name_of(spec))
            except grpc.RpcError as exc:
                site.unreachable.append(f"{address}: {exc.code().name}: {exc.details()}")
                continue
            if reply.router_id in seen:
                continue
            seen.add(reply.router_id)
            site.rows.extend(reply.rows)
            site.routers.append(reply.router_id)
            specs.append(reply.site_routers)
    return site


def _addresses(spec: str, site: SiteRows) -> list[str]:
    if not spec:
        return []
    try:
        return asyncio.run(addresses_of(spec))
    except OSError as exc:
        site.unreachable.append(f"{spec}: does not resolve: {exc}")
        return []


def _rows_of(address: str, name: str | None, family: str, tls: TlsSettings, token: str) -> fpb.ThresholdsReply:
    with open_sync_channel(address, tls, server_options("router", tls, name)) as channel:
        request = fpb.ThresholdsRequest(family=family, token=token, include_rows=True)
        reply: fpb.ThresholdsReply = fpb_grpc.FleetStub(channel).Thresholds(request, timeout=CALL_TIMEOUT_S)
    return reply


def _change(
    stub: fpb_grpc.FleetStub,
    status: fpb.ThresholdsReply,
    asked: Asked,
    suggested: Mapping[str, float] | None,
    token: str,
) -> fpb.ThresholdsReply | None:
    if not asked.revert and asked.apply is None:
        return None
    request = fpb.ThresholdsRequest(
        family=asked.family,
        token=token,
        author=asked.author,
        reason=asked.reason or ("suggested from the audits" if suggested is not None else ""),
        expected_version=status.history[-1].version if status.history else 0,
    )
    if asked.revert:
        request.action = fpb.THRESHOLDS_ACTION_REVERT
    else:
        request.action = fpb.THRESHOLDS_ACTION_APPLY
        request.thresholds.update(parse_assignments(asked.apply) if asked.apply else dict(suggested or {}))
    reply: fpb.ThresholdsReply = stub.Thresholds(request, timeout=CALL_TIMEOUT_S)
    return reply


def _suggestion(rows: list[fpb.AuditRow], asked: Asked) -> tuple[dict[str, float], tuple[str, ...]]:
    """The suggested thresholds by tier name, and what the operator should know of them."""
    from stratus.tools.calibrate.from_audits import suggest

    target, share = _goal(asked)
    chosen = suggest(rows, target_accuracy=target, max_escalation=share)
    top = chosen.tiers[-1].label
    predicted = (
        f"on those rows it predicts agreement with the {top} tier of {chosen.outcome.accuracy:.1%}, "
        f"{chosen.outcome.reached[-1]:.1%} of requests reaching the {top} tier"
    )
    return {tier.label: value for tier, value in chosen.thresholds.items()}, (predicted, *chosen.notes)


def _goal(asked: Asked) -> tuple[float | None, float | None]:
    """The flags' goal, else the one calibrate recorded in the family's files."""
    if asked.target_accuracy is not None or asked.max_escalation is not None:
        return asked.target_accuracy, asked.max_escalation
    if asked.models is None:
        raise ConfigError(
            "a suggestion needs a goal: --target-accuracy A or --max-escalation S, or --models DIR "
            "to use the one [calibration] recorded"
        )
    from stratus.families.repository import ModelRepository
    from stratus.families.suggest import goal_of

    record = ModelRepository.load(asked.models).family(asked.family).calibration
    if record is None:
        raise ConfigError(f"{asked.models}: '{asked.family}' records no [calibration] goal; give one")
    return goal_of(record.goal)


def _routers(ids: list[str]) -> str:
    if len(ids) <= 1:
        return "this router"
    return f"{len(ids)} routers: {', '.join(ids)}"


def _when(unix: float) -> str:
    return dt.datetime.fromtimestamp(unix, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if unix else "-"


def thresholds_json(
    reply: fpb.ThresholdsReply,
    suggested: Mapping[str, float] | None = None,
    *,
    site: SiteRows | None = None,
    before: fpb.ThresholdsReply | None = None,
    notes: Sequence[str] = (),
) -> dict[str, Any]:
    """``site``: the rows the suggestion was chosen on, and whose (default: ``reply``'s);
    ``before``: what was in force before this command pushed (None: it pushed nothing);
    ``notes``: what the suggestion says beside its thresholds."""
    read = site or SiteRows(rows=list(reply.rows), routers=[reply.router_id] if reply.router_id else [], unreachable=[])
    return {
        "family": reply.family,
        "in_force": dict(reply.in_force),
        "before_push": dict(before.in_force) if before is not None else None,
        "agents": dict(reply.agents),
        "suggested": dict(suggested) if suggested is not None else None,
        "notes": list(notes),
        "audit_rows": len(read.rows),
        "routers": read.routers,
        "unreachable": read.unreachable,
        "message": reply.message,
        "history": [
            {
                "version": v.version, "thresholds": dict(v.thresholds), "author": v.author, "reason": v.reason,
                "updated": _when(v.updated), "origin": v.origin, "base": v.base,
            }
            for v in reply.history
        ],
    }  # fmt: skip


def thresholds_table(
    reply: fpb.ThresholdsReply,
    suggested: Mapping[str, float] | None = None,
    *,
    site: SiteRows | None = None,
    before: fpb.ThresholdsReply | None = None,
    notes: Sequence[str] = (),
) -> str:
    found = thresholds_json(reply, suggested, site=site, before=before, notes=notes)
    replaced = found["before_push"] if found["before_push"] is not None else found["in_force"]
    current = found["history"][-1]["version"] if found["history"] else 0
    lines = [
        f"{found['family']}: "
        + (f"pushed version {current} in force" if current else "its agents' thresholds")
    ]
    tiers = sorted({*found["in_force"], *found["agents"], *(suggested or {})}, key=_tier_rank)
    change = "change" if found["before_push"] is None else "change from before the push"
    header = f"{'tier':<8}{'agents':>9}{'in force':>10}" + (f"{'suggested':>11}  {change}" if suggested else "")
    lines += ["", header]
    for tier in tiers:
        line = f"{tier:<8}{_value(found['agents'].get(tier)):>9}{_value(found['in_force'].get(tier)):>10}"
        if suggested is not None:
            line += f"{_value(suggested.get(tier)):>11}  {_change_word(replaced.get(tier), suggested.get(tier))}"
        lines.append(line)
    if suggested is not None:
        lines.append(f"(suggested on {found['audit_rows']} audit rows of {_routers(found['routers'])})")
        lines += [f"(router of the site not read: {problem})" for problem in found["unreachable"]]
        lines += [f"note: {note}" for note in found["notes"]]
    if found["history"]:
        lines += ["", "versions, the last in force:"]
        lines += [
            f"  v{v['version']} {_assignments(v['thresholds'])} by {v['author']} at {v['updated']} on {v['origin']}"
            f": {v['reason']}"
            for v in found["history"]
        ]
    if found["message"]:
        lines += ["", found["message"]]
    return "\n".join(lines)


def _tier_rank(name: str) -> int:
    return ("device", "edge", "cloud").index(name) if name in ("device", "edge", "cloud") else 3


def _value(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _assignments(thresholds: Mapping[str, float]) -> str:
    return ",".join(f"{t}={v:g}" for t, v in sorted(thresholds.items(), key=lambda i: _tier_rank(i[0]))) or (
        "(the agents' own)"
    )


def _change_word(now: float | None, then: float | None) -> str:
    if now is None or then is None or abs(now - then) < 1e-9:
        return "none" if now == then else "set"
    return "more escalation" if then > now else "less escalation"
