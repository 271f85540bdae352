"""The site's store as Stratus lays it out: each key, and what it holds (JSON).

* ``rollout.FAMILY.TIER``: a rollout's :class:`~router.rollout.plan.Plan`;
* ``thresholds.FAMILY``: a family's pushed thresholds (:class:`~router.thresholds.pushes.Record`);
* ``agent.ID``: what an operator said of an agent for the whole site, ``{"mark": "drained" |
  "ready" | "forgotten", "by", "at"}``: each router drains (undrains, forgets) its own link to
  it, and a router the agent links to later, or one restarted, drains it on its Hello;
* ``router.NAME`` (a shared store only): where each router of the site is reached,
  ``{"address", "at"}``, renewed every ``MEMBER_EVERY_S`` (:mod:`router.site.mirror`) and deleted on a clean stop, so
  ``fleet thresholds --suggest`` reads every router's audit rows (soft state, kept in each
  router's memory) without a list of peers;
* ``revoked.DIGEST``: a credential revoked for the whole site (``stratus fleet revoke``),
  ``{"credential", "by", "at", "reason"}`` (:mod:`stratus.serving.revocations`): a certificate's
  SPIFFE id or serial, or an agent id, refused by every router at its next call or heartbeat,
  and kept across restarts; lifting it deletes the key;
* ``lease.judge`` (a shared store only): the router that judges rollout steps and steps
  ``--auto-thresholds`` (:class:`~router.site.lease.Lease`): one at a time, another within
  the lease's ttl when it dies.
"""

from __future__ import annotations

import json

from router.rollout.plan import Plan
from stratus.serving.revocations import credential_key
from stratus.tiers import Tier


def rollout_key(family: str, tier: Tier) -> str:
    return f"rollout.{family}.{tier.label}"


def thresholds_key(family: str) -> str:
    return f"thresholds.{family}"


def agent_key(agent_id: str) -> str:
    return f"agent.{agent_id}"


def revoked_key(credential: str) -> str:
    return f"revoked.{credential_key(credential)}"


def router_key(name: str) -> str:
    """A router's name as one key word: the characters a key cannot hold become ``_``."""
    return "router." + "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def json_bytes(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def plan_bytes(plan: Plan) -> bytes:
    return json_bytes(plan.to_json())
