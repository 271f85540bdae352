"""``stratus certs``: its flags, its run, and its report; the CA and the certificates themselves
are :mod:`stratus.cli.pki`'s."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Final

from stratus.cli.pki import DEFAULT_DAYS, DEFAULTS, PRIVATE, Identity, Report, check_host, check_name, issue
from stratus.errors import ConfigError


def _name_arg(text: str) -> str:
    try:
        return check_name(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _host_arg(text: str) -> str:
    try:
        return check_host(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    certs = commands.add_parser(
        "certs",
        help="make the fleet's CA and certificates (mutual TLS)",
        description="Without --agent/--operator/--client/--router/--cloud: a router, a cloud, an operator, "
        f"a client and the agents {' '.join(DEFAULTS['agent'])}. An existing DIR/ca.pem is reused, with "
        "its key from --ca-key (default DIR/private/ca.key).",
    )
    certs.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="where the files go (made 0700)"
    )
    certs.add_argument(
        "--host",
        type=_host_arg,
        action="append",
        default=[],
        help="a name or IP that clients dial, in every server certificate (repeatable; "
        "localhost and 127.0.0.1 always)",
    )
    for role in ("agent", "operator", "client"):
        certs.add_argument(
            f"--{role}", type=_name_arg, action="append", default=[], metavar="NAME", help="repeatable"
        )
    certs.add_argument(
        "--router",
        type=_name_arg,
        action="append",
        default=[],
        metavar="NAME",
        help="a router's certificate name (repeatable; default: router)",
    )
    certs.add_argument(
        "--cloud",
        type=_name_arg,
        action="append",
        default=[],
        metavar="NAME",
        help="a cloud gateway's name (repeatable; default: cloud)",
    )
    certs.add_argument(
        "--days", type=int, default=DEFAULT_DAYS, help=f"leaf validity (default {DEFAULT_DAYS})"
    )
    certs.add_argument(
        "--ca-key",
        type=Path,
        metavar="FILE",
        help="the CA's private key, read or made there (default: DIR/private/ca.key, or DIR/ca.key "
        "where an older folder keeps it); it signs new identities, so no fleet machine needs it",
    )
    certs.add_argument("--force", action="store_true", help="replace leaves that exist (never the CA)")
    certs.set_defaults(handler=run)
    return certs


def identities_of(args: argparse.Namespace) -> list[Identity]:
    """The identities asked for, or the default fleet when none is."""
    asked = {
        "router": list(args.router),
        "cloud": list(args.cloud),
        "operator": list(args.operator),
        "client": list(args.client),
        "agent": list(args.agent),
    }
    chosen = asked if any(asked.values()) else {role: list(names) for role, names in DEFAULTS.items()}
    return [Identity(role, name) for role, names in chosen.items() for name in names]


def run(args: argparse.Namespace) -> int:
    report = issue(
        args.out, identities_of(args), hosts=args.host, days=args.days, force=args.force, ca_key=args.ca_key
    )
    print(format_report(report))
    return 0


def format_report(report: Report) -> str:
    ca = report.ca_cert
    lines = [
        f"CA {ca} ({'created' if report.ca_created else 'reused'}); server names: {', '.join(report.hosts)}",
        f"{'role':<9} {'name':<16} {'SPIFFE id':<40} files",
    ]
    for leaf in report.leaves:
        who = leaf.identity
        lines.append(f"{who.role:<9} {who.name:<16} {who.spiffe_id:<40} {leaf.cert.name}, {leaf.key.name}")
    lines.append("flags:")
    for leaf in report.leaves:
        hint = f" --name {leaf.identity.name}" if leaf.identity.role == "agent" else ""
        lines.append(
            f"  {leaf.identity.stem}:{hint} --tls-cert {leaf.cert} --tls-key {leaf.key} --tls-ca {ca}"
        )
    lines += [
        f"note: {MISSING_USE[role]}: stratus certs --out {ca.parent} --{role} {DEFAULTS[role][0]}"
        for role in report.missing
    ]
    lines.append(
        f"note: {report.ca_key} signs new certificates: keep it off the fleet's machines "
        f"(each needs {ca.name} and its own pair only)"
    )
    if report.ca_key.parent == ca.parent:
        private = ca.parent / PRIVATE
        lines.append(
            f"note: {report.ca_key} sits beside the leaves, so a copy of the folder carries it: move it "
            f"with `mkdir -m 700 {private} && mv {report.ca_key} {private}/` (found there from then on), "
            "or anywhere else and pass --ca-key"
        )
    return "\n".join(lines)


# What a fleet lacks without a certificate of the role, said after a run that leaves none.
MISSING_USE: Final = {
    "router": "no router certificate here (routers serve agents and clients with one)",
    "cloud": "no cloud certificate here (the cloud gateway serves the routers with one)",
    "operator": "no operator certificate here (stratus fleet drain, reload, rollout and thresholds need one)",
    "client": "no client certificate here (applications calling the router need one)",
    "agent": "no agent certificate here (each agent links with its own)",
}
