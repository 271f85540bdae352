"""What the ``stratus`` subcommands share: credentials read from files or the environment
(never the command line), TLS flags, a settings field's flag (``option``: its default is the
settings dataclass's one default, shown in ``--help``), and the help formatter that shows it."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from stratus.cli.config import settings_class
from stratus.errors import ConfigError
from stratus.serving.auth import is_loopback
from stratus.serving.channels import TlsSettings
from stratus.serving.discovery import dns_target

if TYPE_CHECKING:
    from stratus.families.cpu import Hardware

T = TypeVar("T")


def default_cache() -> Path:
    return Path.home() / ".cache" / "stratus"


def role_token(args: argparse.Namespace, role: str) -> str:
    """One role's credential (agent, operator, client, cloud): --ROLE-token-file, else
    STRATUS_ROLE_TOKEN, else (agents, operators) the fleet token STRATUS_TOKEN. Never
    from the command line, where every user of the machine can read it."""
    own = secret(getattr(args, f"{role}_token_file", None), f"STRATUS_{role.upper()}_TOKEN")
    if own or role in ("client", "cloud"):
        return own
    return os.environ.get("STRATUS_TOKEN", "")


def operator_token(args: argparse.Namespace) -> str:
    """The operator token for a ``fleet`` command, refused where it would cross the network in
    plaintext (a router on another machine without ``--tls-ca``): anyone on the path could
    read it and be the operator (security2 N14)."""
    token = role_token(args, "operator")
    router = getattr(args, "router", "") or ""
    named = dns_target(router, "--router")
    host = named.name if named is not None else router.rsplit(":", 1)[0]
    if token and not tls_of(args).enabled and host and not is_loopback(host):
        raise ConfigError(
            f"the operator token would go to {router} in plaintext: give --tls-ca (and, under mutual "
            "TLS, --tls-cert and --tls-key), or run the command on the router's machine"
        )
    return token


def secret(path: Path | None, variable: str) -> str:
    """A secret from a file (the whole file, stripped) or the environment, never from the command
    line, where every user of the machine can read it."""
    if path is None:
        return os.environ.get(variable, "")
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None


def tls_of(args: argparse.Namespace) -> TlsSettings:
    domain = getattr(args, "tls_trust_domain", None)
    return TlsSettings(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca, trust_domain=domain or "stratus")


# What an operator's shell may hold once, instead of four flags on every `fleet` command.
ROUTER_ENV = "STRATUS_ROUTER"
CLIENT_TLS_ENV = "STRATUS_TLS_{}"  # CERT, KEY, CA, TRUST_DOMAIN: a command's own certificate


def add_router(parser: argparse.ArgumentParser) -> None:
    """``--router``, required unless ``$STRATUS_ROUTER`` names it."""
    given = os.environ.get(ROUTER_ENV) or None
    parser.add_argument(
        "--router",
        default=given,
        required=given is None,
        help=f"the router's HOST:PORT (default: ${ROUTER_ENV})",
    )


def add_tls(parser: argparse.ArgumentParser, role: str | None = None) -> None:
    """TLS flags; on a server (``role``) they are its settings' ``tls.cert``, ``tls.key``, ``tls.ca``."""
    for name, what in (
        ("cert", "this process's certificate (PEM)"),
        ("key", "its private key (PEM)"),
        ("ca", "CA that peers' certificates must chain to; on a server this turns on mutual TLS"),
    ):
        # A server's come from its settings (STRATUS_ROLE_TLS_*); a command's from $STRATUS_TLS_*.
        variable = CLIENT_TLS_ENV.format(name.upper())
        given = os.environ.get(variable) if role is None else None
        shown = what if role is not None else f"{what} (default: ${variable})"
        action = parser.add_argument(f"--tls-{name}", type=Path, default=Path(given) if given else None, help=shown)
        if role is not None:
            action.setting = (role, f"tls.{name}")  # type: ignore[attr-defined]
    domain = parser.add_argument(
        "--tls-trust-domain",
        default=os.environ.get(CLIENT_TLS_ENV.format("TRUST_DOMAIN")) if role is None else None,
        metavar="DOMAIN",
        help="the fleet's SPIFFE trust domain (default: stratus): peers' certificates must be of it, "
        "and a router or cloud dialled with --tls-ca must carry its role's name in it",
    )
    if role is not None:
        domain.setting = (role, "tls.trust_domain")  # type: ignore[attr-defined]


def flag_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each setting's flag, by the setting's dest, to name it in errors."""
    names = {}
    for action in parser._actions:
        setting = getattr(action, "setting", None)
        if setting is not None:
            names[setting[1].replace(".", "_")] = action.option_strings[0]
    return names


def option(parser: argparse.ArgumentParser, role: str, field: str, *flags: str, **kwargs: Any) -> None:
    """A flag for one field of a role's settings, its dest the field's name (``tls.cert``:
    ``tls_cert``). Not given, it is ``None``, so that the config file, the ``STRATUS_*``
    variables and the dataclass's one default apply; its help shows that default."""
    if kwargs.get("action") not in ("store_true", "store_const") and "choices" not in kwargs:
        kwargs.setdefault("metavar", flags[0].lstrip("-").replace("-", "_").upper())  # choices show as {a,b}
    action = parser.add_argument(*flags, dest=field.replace(".", "_"), default=None, **kwargs)
    action.setting = (role, field)  # type: ignore[attr-defined]


def add_config(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"a TOML file whose [{role}] table holds settings; STRATUS_{role.upper()}_* variables "
        "and flags win over it (README, Configuration; check it with `stratus config check FILE`)",
    )


def share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a share between 0 and 1")
    return value


class _Help(argparse.HelpFormatter):
    """Every option's help ends with its default, where it has one and does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        setting = getattr(action, "setting", None)
        if setting is not None and action.nargs == 0:  # a switch: its help says what it does
            return text  # ("--no-advertise ... (default: true)" read as the switch's own default)
        if setting is not None and "default" not in text:
            return text + _setting_default(*setting)
        shown = action.default not in (None, False, argparse.SUPPRESS, [])
        if shown and action.option_strings and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _setting_default(role: str, field: str) -> str:
    """`` (default: X)`` for a setting's flag, X its dataclass's one default."""
    from stratus.config import default_of
    from stratus.config_values import show_value

    default = default_of(settings_class(role), field)
    if default is None or default is False or default in ((), ""):
        return ""
    return f" (default: {show_value(default)})".replace("%", "%%")


def use_help(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _Help
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                use_help(sub)


def settings_of(args: argparse.Namespace, cls: type[T], role: str, **given: object) -> T:
    """A server's settings: its dataclass's defaults, then ``--config``'s ``[role]`` table,
    then ``STRATUS_ROLE_*``, then the flags given (stratus/config.py)."""
    from stratus.config import Flags, load

    values = dict(vars(args))
    delay_us = values.get("max_batch_delay_us")
    if delay_us is not None:
        if not delay_us >= 0:  # NaN too; said in the flag's own unit
            raise ConfigError(f"--max-batch-delay-us: must not be negative, not {delay_us:g}")
        values["max_batch_delay_s"] = delay_us / 1e6
    flags = Flags(values, args.flag_names)
    return load(cls, role, file=args.config, environ=os.environ, flags=flags, given=given).built


def add_exposure(parser: argparse.ArgumentParser, role: str, what: str) -> None:
    option(
        parser,
        role,
        "insecure",
        "--insecure",
        action="store_true",
        help=f"let {what} run off loopback without TLS or caller authentication (warned about "
        "every minute): anyone who reaches it can use it and read its traffic",
    )
    option(
        parser,
        role,
        "max_requests_per_client",
        "--max-requests-per-client",
        type=int,
        help="inference requests one client address may have in flight (0: no limit)",
    )


def add_batch_delay(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument(
        "--max-batch-delay-us",
        type=float,
        default=None,
        help="longest a batch waits for more requests while its target is busy (never when idle); "
        f"max_batch_delay_s in [{role}]",
    ).setting = (role, "max_batch_delay_s")  # type: ignore[attr-defined]


RUNTIMES_HELP = (
    "only these runtimes, in this order, e.g. litert, or onnxruntime,openvino, or litert,llama_cpp "
    "(classifiers and generative models each use the ones of their kind; a family none can run "
    "is not served)"
)


def cpu_hardware() -> Hardware:
    """``STRATUS_CPU_FLAGS`` (comma-separated) stands in for the CPU's own flags: for a
    container that hides them, and for tests of the precision choice."""
    from stratus.families.cpu import this_hardware

    return this_hardware()
