"""A gRPC health probe over mutual TLS, for Kubernetes exec probes (its grpc probes speak only
plaintext, and every Stratus server requires a client certificate).

    python -m stratus.probe 127.0.0.1:8001 --tls-cert C --tls-key K --tls-ca CA [--service liveness]

Asks ``grpc.health.v1.Health/Check`` and exits 0 when the service is SERVING, 1 otherwise, with
one line on stderr saying why. It imports grpc and the health stubs only, so a probe every
couple of seconds stays cheap.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m stratus.probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("address", help="HOST:PORT of the server (in a pod: 127.0.0.1:PORT)")
    parser.add_argument("--tls-cert", type=Path, required=True, help="a client certificate (PEM)")
    parser.add_argument("--tls-key", type=Path, required=True, help="its private key (PEM)")
    parser.add_argument(
        "--tls-ca", type=Path, required=True, help="the CA the server's certificate chains to"
    )
    parser.add_argument("--service", default="", help='health service: "" (readiness, default) or liveness')
    parser.add_argument(
        "--timeout-s", type=float, default=2.0, help="seconds for the whole check (default 2)"
    )
    parser.add_argument(
        "--server-name",
        default=None,
        help="the name the server's certificate carries, when ADDRESS is not among its names",
    )
    return parser


def _credentials(args: argparse.Namespace) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=args.tls_ca.read_bytes(),
        private_key=args.tls_key.read_bytes(),
        certificate_chain=args.tls_cert.read_bytes(),
    )


def check(args: argparse.Namespace) -> str | None:
    """None when the service is SERVING, else why not (one line)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        credentials = _credentials(args)
    except OSError as exc:
        return f"cannot read {exc.filename}: {exc.strerror}"
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    with grpc.secure_channel(args.address, credentials, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s)
        except grpc.RpcError as exc:
            detail = " ".join(str(exc.details() or "").split())
            return f"{exc.code().name}: {detail}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    reason = check(args)
    if reason is None:
        return 0
    print(f"stratus.probe: {args.address} service {args.service!r}: {reason}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
