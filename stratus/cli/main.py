"""The one ``stratus`` command: its parser (each subcommand's flags live beside its handler:
:mod:`stratus.cli.servers`, :mod:`stratus.cli.fleet_commands`, ``models``, ``certs``,
``config``) and the one place an error becomes a one-line message and an exit status.
Each subcommand imports its app lazily, so a device that runs only ``stratus agent`` never
imports the router or the cloud gateway."""

from __future__ import annotations

import os

from stratus.process import quiet_grpc_core

quiet_grpc_core(os.environ)  # before grpc is imported below: its C core reads its settings then

import argparse
import sys
from collections.abc import Callable, Sequence

import grpc

from stratus import __version__
from stratus.cli.certs import add_parser as add_certs
from stratus.cli.config import add_config_check
from stratus.cli.fleet_commands import add_fleet
from stratus.cli.models import add_models
from stratus.cli.options import tls_of, use_help
from stratus.cli.servers import add_servers
from stratus.errors import StratusError
from stratus.serving.channels import TlsSettings

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stratus", description="Edge-cloud tiered inference router.")
    parser.add_argument("--version", action="version", version=f"stratus {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_models(commands)
    add_certs(commands)
    add_servers(commands)
    add_config_check(commands)
    add_fleet(commands)
    use_help(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = list(sys.argv[1:] if argv is None else argv)  # what --workers starts again
    handler: Handler = args.handler
    try:
        code = handler(args)
        sys.stdout.flush()  # a closed pipe is met here, where BrokenPipeError is caught, not at exit
        return code
    except StratusError as exc:
        print(f"stratus: error: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:  # a call of `stratus fleet` or `models`: one line, not a traceback
        from stratus.cli.fleet_calls import call_error

        address = getattr(args, "router", None) or "the server"
        print(
            f"stratus: error: {call_error(exc, address, tls_of(args) if hasattr(args, 'tls_ca') else TlsSettings())}",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`stratus fleet status | head`): stop quietly,
        # as Unix tools do, and keep the interpreter's last flush off the closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool the pipe ended


if __name__ == "__main__":
    sys.exit(main())
