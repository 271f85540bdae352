"""``stratus fleet corrections``: the provisional answers the cloud, judging them later, disagreed with.

An application that got ``stratus.provisional = true`` with ``stratus.request_id`` learns here
(or from ``Fleet.Corrections`` itself, or the SDK's ``Client.corrections()``) which of those
answers the cloud would have given otherwise, by request id and item. ``--since`` takes seconds
since the epoch, an ISO time (``2026-12-06T10:00:00Z``) or an age (``90s``, ``15m``, ``2h``, ``1d``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import time
from pathlib import Path
from typing import Any

import grpc

from stratus.cli.options import add_router, add_tls, operator_token, role_token, tls_of
from stratus.errors import ConfigError
from stratus.wire import fleet_pb2 as fpb

_AGE = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def since_unix(text: str | None, now: float | None = None) -> float:
    """``--since`` as seconds since the epoch (0: every correction kept)."""
    if not text:
        return 0.0
    now = time.time() if now is None else now
    age = _AGE.fullmatch(text.strip())
    if age is not None:
        return max(0.0, now - float(age.group(1)) * _UNIT_S[age.group(2)])
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(
            f"--since {text!r} is neither seconds since the epoch, an ISO time nor an age (90s, 15m, 2h, 1d)"
        ) from None
    return (when if when.tzinfo else when.replace(tzinfo=dt.UTC)).timestamp()


def as_dict(correction: fpb.Correction) -> dict[str, Any]:
    def answer(a: fpb.ProvisionalAnswer) -> dict[str, Any]:
        return {
            "tier": a.tier,
            "variant": a.variant,
            "agent": a.agent,
            "label": a.label,
            "confidence": a.confidence,
        }

    return {
        "request_id": correction.request_id,
        "family": correction.family,
        "item": correction.item,
        "provisional": answer(correction.provisional),
        "cloud": answer(correction.cloud),
        "provisional_unix": correction.provisional_unix,
        "judged_unix": correction.judged_unix,
        "router": correction.router,
    }


def line(correction: fpb.Correction) -> str:
    mine, theirs = correction.provisional, correction.cloud
    when = dt.datetime.fromtimestamp(correction.judged_unix, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return (
        f"{when}  {correction.family}  {correction.request_id}[{correction.item}]  "
        f"{mine.tier} {mine.variant}: {mine.label} ({mine.confidence:.2f})  ->  "
        f"cloud {theirs.variant}: {theirs.label} ({theirs.confidence:.2f})"
    )


def corrections(args: argparse.Namespace) -> int:
    from stratus.cli.fleet_calls import fleet_stub

    request = fpb.CorrectionsRequest(
        token=operator_token(args),
        family=args.family or "",
        since_unix=since_unix(args.since),
        follow=args.follow,
    )
    client = role_token(args, "client")
    metadata = (("authorization", f"Bearer {client}"),) if client else None
    channel, stub = fleet_stub(args.router, tls_of(args))
    count = 0
    with channel:
        stream = stub.Corrections(request, metadata=metadata, timeout=None if args.follow else 30.0)
        try:
            for correction in stream:
                count += 1
                print(json.dumps(as_dict(correction)) if args.json else line(correction), flush=True)
        except KeyboardInterrupt:
            stream.cancel()
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.CANCELLED:
                raise
    if not args.json and not args.follow:
        print(f"{count} correction(s)")
    return 0


def add_corrections(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "corrections",
        help="provisional answers (given while the cloud was away) the cloud later disagreed with",
    )
    parser.add_argument("--family", default=None, help="only this family's")
    parser.add_argument(
        "--since", default=None, help="judged since: seconds since the epoch, an ISO time, or an age (15m)"
    )
    parser.add_argument(
        "--follow", action="store_true", help="then each new one as it is made, until interrupted"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object a line")
    add_router(parser)
    parser.add_argument(
        "--operator-token-file", type=Path, default=None, help="default: $STRATUS_OPERATOR_TOKEN"
    )
    parser.add_argument(
        "--client-token-file",
        type=Path,
        default=None,
        help="or the client token (default: $STRATUS_CLIENT_TOKEN)",
    )
    add_tls(parser)
    parser.set_defaults(handler=corrections)
    return parser
