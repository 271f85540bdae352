"""Rollout records from outside (a peer's SyncRollouts, the state file) are checked as an
operator's new rollout is (the security review's F4): a bad one is refused whole, never
adopted, so no request path indexes past its steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from router import rollout as rollout_module
from router.rollout import MAX_REVISION_JUMP, Plan, Rollouts
from stratus.errors import ConfigError
from stratus.tiers import Tier


def record(**changes: Any) -> dict[str, Any]:
    good = Plan(family="digits", tier=Tier.DEVICE, candidate="digits-small-v2").to_json()
    return {**good, **changes}


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
def test_a_bad_record_is_refused_whole(changes: dict[str, Any], why: str) -> None:
    rollouts = Rollouts(router_id="a")
    state = json.dumps({"rollouts": [record(family="defects"), record(**changes)]})
    with pytest.raises(ConfigError, match="a rollout record is malformed") as refused:
        rollouts.merge_json(state)
    assert why in str(refused.value)
    assert rollouts.plans() == []  # not even the good record beside it


def test_a_record_whose_revision_jumps_too_far_is_not_adopted() -> None:
    rollouts = Rollouts(router_id="a")
    assert rollouts.merge_json(json.dumps({"rollouts": [record(revision=3)]}))
    leap = record(revision=3 + MAX_REVISION_JUMP + 1, state="aborted")
    assert not rollouts.merge_json(json.dumps({"rollouts": [leap]}))
    assert [p.revision for p in rollouts.plans()] == [3]
    assert rollouts.merge_json(json.dumps({"rollouts": [record(revision=4, state="aborted")]}))


def test_records_past_the_cap_are_not_adopted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rollout_module, "MAX_PLANS", 2)
    rollouts = Rollouts(router_id="a")
    rollouts.merge_json(json.dumps({"rollouts": [record(family=f"f{i}") for i in range(5)]}))
    assert [p.family for p in rollouts.plans()] == ["f0", "f1"]


def test_a_poisoned_state_file_is_named_when_the_router_starts(tmp_path: Path) -> None:
    state = tmp_path / "rollouts.json"
    state.write_text(json.dumps({"rollouts": [record(step=9, steps=[5.0])]}))
    with pytest.raises(ConfigError, match=rf"^{state}: a rollout record is malformed"):
        Rollouts(router_id="a", state_path=state)
