"""``stratus config check FILE``: a settings file validated as each server would load it,
and the effective settings printed, before any pod is started with it.

Credentials are never read here: a token is shown as the file it would come from, or the
variable that holds it. The roles' dataclasses are imported only when asked for, so the
``stratus`` parser costs an agent no import of the router.
"""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path
from typing import Any

from stratus.config import ROLES, Loaded, load, read_file
from stratus.errors import ConfigError

SETTINGS = {
    "router": ("router.settings", "RouterSettings"),
    "cloud": ("cloud_gateway.settings", "CloudSettings"),
    "agent": ("edge_agent.settings", "AgentSettings"),
}


def settings_class(role: str) -> type[Any]:
    """A role's settings dataclass."""
    module, name = SETTINGS[role]
    cls: type[Any] = getattr(importlib.import_module(module), name)
    return cls


def check(path: Path, roles: list[str] | None = None) -> str:
    """The effective settings of each role ``path`` has a table for (or of ``roles``), one
    ``name = value  # origin`` line each; ConfigError on the first bad one."""
    tables = read_file(path)
    chosen = roles or [role for role in ROLES if role in tables]
    if not chosen:
        raise ConfigError(f"{path}: no [{'], ['.join(ROLES)}] table")
    return "\n".join(_report(role, _load(path, role)) for role in chosen)


def _load(path: Path, role: str) -> Loaded[Any]:
    return load(settings_class(role), role, file=path, environ=os.environ, read_secrets=False, partial=True)


def _report(role: str, loaded: Loaded[Any]) -> str:
    width = max(len(name) for name in loaded.shown)
    lines = [f"[{role}]"]
    for name, value in loaded.shown.items():
        lines.append(f"{name.ljust(width)} = {value}  # {loaded.origins[name]}")
    return "\n".join(lines) + "\n"


def _check(args: argparse.Namespace) -> int:
    print(check(args.file, [args.role] if args.role else None), end="")
    return 0


def add_config_check(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    config = commands.add_parser("config", help="settings files (--config FILE)")
    sub = config.add_subparsers(dest="config_command", required=True)
    checked = sub.add_parser(
        "check", help="validate a settings file and print each role's effective settings (no secrets)"
    )
    checked.add_argument("file", type=Path, metavar="FILE")
    checked.add_argument(
        "--role",
        choices=list(ROLES),
        default=None,
        help="check this role only, its table there or not (default: every role the file has a table for)",
    )
    checked.set_defaults(handler=_check)
