"""What one Hello may declare: checked before the router keeps anything of it (the security
review's F12). A Hello comes from a stranger; its ids and names end up in logs, status and
metrics labels, so they are a plain charset of bounded length, and its counts are bounded."""

from __future__ import annotations

import re

from stratus.convert.fleet import thresholds_from_wire
from stratus.errors import InvalidInput
from stratus.families.audit import check_family_info
from stratus.wire import fleet_pb2 as fpb

# What one Hello may declare, and what the router keeps of it: ids and names are client
# text (logged, listed, echoed), declared sizes steer how much work an agent is sent.
NAME = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
VERSION = re.compile(r"[A-Za-z0-9.+_-]{0,64}")  # a PEP 440 version ("0.1.0", "0.2.0rc1+g3f2a"), or none
MAX_VARIANTS_PER_AGENT = 64  # a shipped agent has 6; 256 let one Hello hold 77 kB of names
MAX_FAMILIES_PER_HELLO = 64


def check_hello_bounds(hello: fpb.Hello) -> None:
    """Refuse a Hello whose names or counts are past what the router keeps (INVALID_ARGUMENT):
    ids and names are a plain charset, 128 characters at most, so a log line or a status
    cannot be forged or flooded through them."""
    if not NAME.fullmatch(hello.agent_id):
        raise InvalidInput(f"Hello.agent_id {hello.agent_id[:40]!r} must be 1-128 of A-Z a-z 0-9 . _ : @ -")
    if not VERSION.fullmatch(hello.version):
        raise InvalidInput(
            f"Hello from {hello.agent_id}: version {hello.version[:40]!r} must be 0-64 of A-Z a-z 0-9 . + _ -"
        )
    if len(hello.variants) > MAX_VARIANTS_PER_AGENT or len(hello.families) > MAX_FAMILIES_PER_HELLO:
        raise InvalidInput(
            f"Hello from {hello.agent_id}: {len(hello.variants)} variants and {len(hello.families)} families; "
            f"at most {MAX_VARIANTS_PER_AGENT} and {MAX_FAMILIES_PER_HELLO}"
        )
    for family in hello.families:
        check_family_info(hello.agent_id, family)
        thresholds_from_wire(family.thresholds, f"Hello from {hello.agent_id}: family {family.name[:40]!r}")
    names = (
        [v.name for v in hello.variants]
        + [v.family for v in hello.variants]
        + [f.name for f in hello.families]
    )
    bad = next((name for name in names if not NAME.fullmatch(name)), None)
    if bad is not None:
        raise InvalidInput(
            f"Hello from {hello.agent_id}: model name {bad[:40]!r} must be 1-128 of A-Z a-z 0-9 . _ : @ -"
        )
    for family in hello.families:
        share = family.calibrated_cloud_share
        if family.HasField("calibrated_cloud_share") and not 0.0 <= share <= 1.0:  # NaN fails too
            raise InvalidInput(
                f"Hello from {hello.agent_id}: family {family.name}'s calibrated_cloud_share {share} "
                "must lie between 0 and 1"
            )
