"""Rollout and threshold records from the site's store are checked as an operator's new
rollout is (the security review's F4): a bad one is skipped and named in the log, never
adopted, so no request path indexes past its steps, and the good records beside it still
apply (one bad key must not stop a site's routers from following the rest)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from router.fleet.registry import FleetRegistry
from router.rollout import plans as rollout_module
from router.rollout.plan import Plan
from router.rollout.plans import Rollouts
from router.site import Entry
from router.site.file import FileSiteState
from router.site.keys import rollout_key, router_key, thresholds_key
from router.site.mirror import SiteMirror
from router.thresholds.pushes import ThresholdPushes
from stratus.tiers import Tier


def record(**changes: Any) -> dict[str, Any]:
    good = Plan(family="digits", tier=Tier.DEVICE, candidate="digits-small-v2").to_json()
    return {**good, **changes}


def mirror(tmp_path: Path) -> tuple[SiteMirror, Rollouts, ThresholdPushes]:
    rollouts, pushes = Rollouts(router_id="a"), ThresholdPushes(router_id="a")
    site = SiteMirror(
        FileSiteState(tmp_path / "site.json"),
        rollouts=rollouts,
        pushes=pushes,
        registry=FleetRegistry(),
        router_id="a",
    )
    return site, rollouts, pushes


def entry(key: str, value: object, revision: int) -> Entry:
    return Entry(key=key, value=json.dumps(value).encode(), revision=revision, at=0.0)


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"step": 9, "steps": [5.0]}, "rollout step 9 is outside its 1 steps"),
        ({"steps": [float(s) for s in range(1, 23)]}, "a rollout needs 1 to 20 steps, not 22"),
        ({"steps": [50.0, 10.0]}, "must rise strictly"),
        ({"tier": "cloud"}, "the cloud tier has no rollouts"),
        ({"history": ["x"] * 51}, "history of 51 is out of bounds"),
        ({"reason": "x" * 15_000}, "names and reasons are at most 1000 characters"),
        ({"shadow": 150.0}, "shadow a percent between 0 and 100"),
        ({"revision": 0}, "revision 0"),
    ],
)
def test_a_bad_rollout_record_is_skipped_and_named(
    changes: dict[str, Any], why: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    site, rollouts, _ = mirror(tmp_path)
    bad_key = rollout_key("digits", Tier.DEVICE)
    with caplog.at_level(logging.WARNING, logger="stratus.site"):
        site.apply(entry(bad_key, record(**changes), revision=1))
        site.apply(entry(rollout_key("defects", Tier.DEVICE), record(family="defects"), revision=2))
    assert [p.family for p in rollouts.plans()] == ["defects"]  # the good one beside it applies
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"site state {bad_key} (revision 1) is not valid and was skipped: ")
    assert why in warning


def test_a_bad_threshold_record_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    site, _, pushes = mirror(tmp_path)
    bad = {"family": "digits", "history": [{"version": 1, "thresholds": {"device": 7}}]}
    with caplog.at_level(logging.WARNING, logger="stratus.site"):
        site.apply(entry(thresholds_key("digits"), bad, revision=1))
    assert pushes.in_force("digits") == {}
    assert "thresholds.digits (revision 1) is not valid" in caplog.text


def test_records_past_the_cap_are_not_adopted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rollout_module, "MAX_PLANS", 2)
    site, rollouts, _ = mirror(tmp_path)
    for i in range(5):
        site.apply(entry(rollout_key(f"f{i}", Tier.DEVICE), record(family=f"f{i}"), revision=i + 1))
    assert [p.family for p in rollouts.plans()] == ["f0", "f1"]


def test_an_older_revision_of_a_key_is_not_applied_again(tmp_path: Path) -> None:
    """The watch gives each revision once; a replay of an older one (after a reconnect) is no change."""
    site, rollouts, _ = mirror(tmp_path)
    key = rollout_key("digits", Tier.DEVICE)
    site.apply(entry(key, record(state="aborted", revision=2), revision=7))
    site.apply(entry(key, record(state="running", revision=1), revision=6))
    assert [p.state for p in rollouts.plans()] == ["aborted"]


@pytest.mark.parametrize("address", ["", "no-port", "h" * 301 + ":1"])
def test_a_router_registration_without_an_address_is_skipped(tmp_path: Path, address: str) -> None:
    site, _, _ = mirror(tmp_path)
    site.apply(entry(router_key("b"), {"address": address, "at": 1e12}, revision=1))
    site.apply(entry(router_key("c"), {"address": "10.0.0.3:8001", "at": 1e12}, revision=2))
    assert site.other_routers() == ["10.0.0.3:8001"]


def test_stale_and_deleted_registrations_are_not_listed(tmp_path: Path) -> None:
    clock = [1000.0]
    site = SiteMirror(
        FileSiteState(tmp_path / "site.json"),
        rollouts=Rollouts(router_id="a"),
        pushes=ThresholdPushes(router_id="a"),
        registry=FleetRegistry(),
        router_id="a",
        clock=lambda: clock[0],
    )
    site.apply(entry(router_key("a"), {"address": "10.0.0.1:8001", "at": 1000.0}, revision=1))  # itself
    site.apply(entry(router_key("b"), {"address": "10.0.0.2:8001", "at": 1000.0}, revision=2))
    site.apply(entry(router_key("c"), {"address": "10.0.0.3:8001", "at": 975.0}, revision=3))
    assert site.other_routers() == ["10.0.0.2:8001", "10.0.0.3:8001"]
    clock[0] = 1006.0  # c's last renewal is 31 s old: gone
    assert site.other_routers() == ["10.0.0.2:8001"]
    site.apply(Entry(key=router_key("b"), value=b"", revision=4, at=0.0, deleted=True))
    assert site.other_routers() == []


def test_a_router_name_becomes_one_key_word() -> None:
    assert router_key("router-a") == "router.router-a"
    assert router_key("router-host.example-8001") == "router.router-host_example-8001"
