"""What `stratus fleet status` reads: each family's tiers and whether its unsure answers come
back degraded (by the cascade's rules), agents' versions and uptimes, the cloud row, and the
defaults that keep gRPC's own lines out of Stratus's logs."""

from __future__ import annotations

import math
from typing import Any

import pytest

from cloud_gateway.reload import what_changed
from router.api.family_view import DEGRADED, SERVING, UNAVAILABLE, TierSeen, family_statuses, judge
from router.api.fleet_status import agent_status, cloud_status
from router.cloud.link import CloudLink
from router.cloud.models import answered_by
from router.rollout.plans import Rollouts
from stratus.cli.fleet_views import cloud_table, duration, families_table, family_json, status_json
from stratus.convert.fleet import family_from_wire
from stratus.convert.hello import hello_from_wire
from stratus.errors import InvalidInput
from stratus.families.description import FamilyDescription
from stratus.process import process_uptime_s, quiet_grpc_core
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb

from .test_index import Clock, hello, registry


def described(**fields: Any) -> FamilyDescription:
    """A family as a router holds it, from the FamilyInfo fields a Hello would carry."""
    return family_from_wire(fpb.FamilyInfo(**fields))


def seen(tier: Tier, *, threshold: float | None = 0.8, ready: int = 1, listed: int = 1) -> TierSeen:
    because = (
        "the cloud link is down"
        if tier is Tier.CLOUD
        else f"{listed} {tier.label} agent(s) listed, none ready"
    )
    return TierSeen(
        tier=tier,
        threshold=threshold,
        current=("v",),
        ready=ready,
        listed=listed,
        unreachable_because=because,
    )


def test_a_family_with_a_reachable_tier_above_every_threshold_is_serving() -> None:
    tiers = [seen(Tier.DEVICE), seen(Tier.EDGE), seen(Tier.CLOUD, threshold=None)]
    assert judge("digits", tiers) == (SERVING, "")
    # a top agent tier without a threshold keeps every answer: nothing is degraded either
    assert judge("digits", [seen(Tier.DEVICE), seen(Tier.EDGE, threshold=None)]) == (SERVING, "")
    # a lost edge tier in between is skipped: the cloud still takes unsure device answers
    assert judge("digits", [seen(Tier.DEVICE), seen(Tier.EDGE, ready=0), seen(Tier.CLOUD)])[0] == SERVING


def test_unsure_answers_with_nowhere_to_climb_are_degraded_and_say_why() -> None:
    state, reason = judge("digits", [seen(Tier.DEVICE), seen(Tier.EDGE)])
    assert state == DEGRADED
    assert reason == "no tier above edge serves 'digits': unsure edge answers stay"  # the router's own words
    state, reason = judge("digits", [seen(Tier.DEVICE), seen(Tier.CLOUD, threshold=None, ready=0)])
    assert state == DEGRADED and reason == "unsure device answers cannot climb: the cloud link is down"
    state, reason = judge("digits", [seen(Tier.DEVICE), seen(Tier.EDGE, ready=0, listed=2)])
    assert state == DEGRADED and "2 edge agent(s) listed, none ready" in reason


def test_a_family_nothing_ready_serves_is_unavailable() -> None:
    state, reason = judge("digits", [seen(Tier.DEVICE, ready=0), seen(Tier.CLOUD, ready=0)])
    assert state == UNAVAILABLE
    assert reason == (
        "nothing ready serves 'digits': 1 device agent(s) listed, none ready; the cloud link is down"
    )


def test_family_statuses_read_thresholds_current_variants_rollouts_and_the_cloud() -> None:
    reg = registry()
    reg.register(hello_from_wire(hello("d1", threshold=0.7366)), peer="t")
    reg.register(hello_from_wire(hello("d2", variant="digits-small-int8", threshold=0.7366)), peer="t")
    cloud = CloudLink("127.0.0.1:1")
    cloud.state = "connected"
    cloud.models, cloud.variants = {"digits": True}, {"digits": "digits-large-fp16"}
    rollouts = Rollouts(router_id="r")
    rollouts.start("digits", Tier.DEVICE, "digits-small-v2", steps=[5, 50, 100])

    (digits,) = family_statuses(reg, cloud, rollouts.plans())
    device, top = digits.tiers
    assert (device.tier, device.threshold, list(device.current)) == (
        fpb.TIER_DEVICE,
        0.7366,
        ["digits-small", "digits-small-int8"],
    )
    assert (device.ready, device.listed) == (2, 2)
    assert (device.candidate, device.candidate_percent, device.rollout_state) == (
        "digits-small-v2",
        5.0,
        "running",
    )
    assert (
        top.tier == fpb.TIER_CLOUD
        and not top.HasField("threshold")
        and list(top.current) == ["digits-large-fp16"]
    )
    assert (digits.state, family_json(digits)["tiers"][1]["threshold"]) == (SERVING, None)

    cloud.state = "down"
    (digits,) = family_statuses(reg, cloud, [])
    assert digits.state == DEGRADED and "the cloud link is down" in digits.reason
    assert not digits.tiers[0].candidate


def test_a_connected_cloud_whose_queue_is_full_says_so() -> None:
    reg = registry()
    reg.register(hello_from_wire(hello("d1")), peer="t")
    cloud = CloudLink("127.0.0.1:1", max_pending=0)  # full from the start
    cloud.state, cloud.models = "connected", {"digits": True}
    (digits,) = family_statuses(reg, cloud, [])
    assert digits.state == DEGRADED
    assert (
        digits.reason
        == "unsure device answers cannot climb: the cloud link is full (0 escalations in flight)"
    )


def test_the_clouds_own_text_models_are_families_but_its_variants_of_known_ones_are_not() -> None:
    reg = registry()
    reg.register(hello_from_wire(hello("d1")), peer="t")
    cloud = CloudLink("127.0.0.1:1")
    cloud.generative = {
        name: described(name=name, kind="generative") for name in ("digits-large", "llama")
    }
    assert [f.name for f in family_statuses(reg, cloud, [])] == ["digits", "llama"]


def test_an_agents_version_and_uptime_come_from_its_hello_and_the_routers_clock() -> None:
    clock = Clock()
    reg = registry(clock)
    message = hello("d1")
    message.version, message.uptime_s = "0.3.0+g1a2b", 42.0
    handle = reg.register(hello_from_wire(message), peer="t")
    clock.now += 10.0
    shown = agent_status(handle, clock.now)
    assert (shown.version, shown.uptime_s) == ("0.3.0+g1a2b", 52.0)
    reg.lose(handle, "test")
    assert agent_status(handle, clock.now).uptime_s == 0.0  # not known while it is away

    old = reg.register(hello_from_wire(hello("d2")), peer="t")  # an agent older than both fields
    listed = status_json(fpb.FleetStatus(agents=[agent_status(old, clock.now)]))["agents"][0]
    assert (listed["version"], listed["uptime_s"]) == (None, None)
    odd = hello("d3")
    odd.uptime_s = math.nan
    assert reg.register(hello_from_wire(odd), peer="t").started is None


def test_a_hello_whose_version_is_not_a_version_is_refused() -> None:
    message = hello("d1")
    message.version = "0.1\n2026-01-01 ERROR forged log line"
    with pytest.raises(InvalidInput, match="version"):
        registry().register(hello_from_wire(message), peer="t")


def test_uptimes_read_in_their_two_largest_units() -> None:
    assert [duration(s) for s in (None, 0.4, 42, 303, 7500, 3 * 86400 + 4 * 3600 + 5)] == [
        "-",
        "0s",
        "42s",
        "5m03s",
        "2h05m",
        "3d04h",
    ]


def test_the_cloud_row_says_its_state_server_and_models_and_dashes_without_data() -> None:
    cloud = CloudLink("10.0.0.7:8002")
    cloud.state, cloud.server = "connected", "stratus 0.1.0"
    cloud.wire_names = {"digits": "digits", "digits-large": "digits-large"}
    cloud.variants = {"digits": "digits-large-fp16", "digits-large": "digits-large"}
    header, _, row, serves = cloud_table(cloud_status(cloud))
    assert header.startswith("cloud link") and row.split()[:4] == [
        "10.0.0.7:8002",
        "connected",
        "stratus",
        "0.1.0",
    ]
    assert row.split()[-2:] == ["-", "-"]  # no escalation answered yet
    assert serves == "  serves digits (digits-large-fp16), digits-large"
    cloud.latency.add(2.5)
    assert cloud_table(cloud_status(cloud))[2].split()[-2:] == ["2.50", "2.50"]
    assert cloud_table(fpb.CloudStatus(state="none")) == [
        "cloud link   none (the router runs without --cloud)"
    ]


def test_the_families_table_cuts_long_names_and_explains_what_is_not_serving() -> None:
    family = fpb.FamilyStatus(
        name="a-family-with-a-long-name", state=DEGRADED, reason="no tier above edge serves it"
    )
    family.tiers.add(tier=fpb.TIER_EDGE, threshold=0.72071, current=["digits-medium-int8"], ready=1, listed=2)
    family.tiers.add(tier=fpb.TIER_CLOUD, ready=0, listed=1)
    lines = families_table([family])
    first, second = lines[2], lines[3]
    assert first.startswith("a-family-with-…") and "0.7207" in first and "1/2" in first
    assert second.split()[:3] == ["cloud", "-", "-"]
    assert lines[-1] == "a-family-with-a-long-name: degraded: no tier above edge serves it"


def test_the_cloud_names_the_variant_where_its_config_does() -> None:
    wire = {"digits": "digits", "digits-large": "digits-large"}
    assert answered_by(wire, {"digits": "digits-large-fp16"}) == {
        "digits": "digits-large-fp16",
        "digits-large": "digits-large",  # a name nothing was learnt for: what it is sent as
    }
    assert answered_by({"digits": "digits-large"}, {}) == {"digits": "digits-large"}  # Triton


def test_a_reload_says_what_it_added_removed_and_reloaded() -> None:
    assert what_changed(["a", "b"], ["b", "c"], ["b"]) == "added c; removed a; reloaded b"
    assert what_changed(["a"], ["a"], []) == "nothing changed"


def test_grpc_keeps_to_its_errors_unless_the_user_asked_for_more() -> None:
    quiet: dict[str, str] = {}
    quiet_grpc_core(quiet)
    assert quiet == {"GRPC_VERBOSITY": "ERROR"}
    for asked in ({"GRPC_VERBOSITY": "DEBUG"}, {"GRPC_TRACE": "http"}):
        kept = dict(asked)
        quiet_grpc_core(kept)
        assert kept == asked


def test_this_process_knows_how_long_it_has_run() -> None:
    uptime = process_uptime_s()
    assert uptime is not None and 0 < uptime < 24 * 3600  # pytest started it, today
