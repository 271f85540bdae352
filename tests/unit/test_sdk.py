"""The SDK's own choices, with no router at all or none reachable: where a call may answer,
and what it refuses before any hop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_agent.sdk import Client
from stratus.convert.parameters import RequestOptions
from stratus.errors import InvalidInput, Unavailable
from stratus.tiers import Tier

MODELS = Path(__file__).resolve().parents[2] / "models"
NOBODY = "127.0.0.1:1"  # nothing listens there: a call that goes to the router fails
BLANK = np.zeros((4, 64), np.float32)  # four blank images: no digit is certain of them


@pytest.fixture(params=[None, NOBODY], ids=["no-router", "unreachable-router"])
def client(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Client]:
    with Client(MODELS, router=request.param, variants=["digits-small"], cache_dir=tmp_path) as built:
        yield built


def test_max_tier_device_keeps_unsure_items_here_and_says_why(client: Client) -> None:
    result = client.infer("digits", BLANK, max_tier="device", min_confidence=1.0)
    # Not degraded: nothing was asked of the (unreachable) router, as the caller wanted.
    assert (result.path, result.agent, result.degraded) == ((Tier.DEVICE,), "sdk", False)
    assert result.reason == "stratus.max_tier=device: 4 item(s) below the device threshold were not sent higher"
    assert result.outputs["probabilities"].shape == (4, 10)
    assert client.infer("digits", BLANK, max_tier=Tier.DEVICE, min_confidence=0.0).reason == ""  # all sure


def test_max_tier_device_holds_on_the_async_path_too(client: Client) -> None:
    async def ask() -> str:
        try:
            result = await client.ainfer("digits", BLANK, max_tier="device", min_confidence=1.0)
        finally:
            await client.aclose()
        assert not result.degraded and result.path == (Tier.DEVICE,)
        return result.reason

    assert asyncio.run(ask()).startswith("stratus.max_tier=device: 4 item(s)")


def test_an_unsure_answer_that_may_climb_but_cannot_is_degraded_only_with_a_router(client: Client) -> None:
    result = client.infer("digits", BLANK, min_confidence=1.0)
    assert result.path == (Tier.DEVICE,)
    assert result.degraded is (client._router is not None)  # router=None: never escalate, as asked
    if client._router is None:
        assert result.reason == ""
    else:  # degraded, and why: which items stayed, and what each router said
        said = f"4 item(s) below the device threshold got no answer from a tier above: no router answered ({client._router}: UNAVAILABLE: "
        assert result.reason.startswith(said), result.reason


def test_min_tier_above_the_device_skips_the_local_model(client: Client) -> None:
    expected = "no router answered" if client._router else "this client has no router"
    with pytest.raises(Unavailable, match=f"min_tier=edge skips the device model here, and {expected}"):
        client.infer("digits", BLANK, min_tier="edge")


def test_tiers_and_inputs_are_checked_before_any_hop(client: Client) -> None:
    with pytest.raises(InvalidInput, match=r"'stratus.min_tier' \(cloud\) is above 'stratus.max_tier' \(edge\)"):
        client.infer("digits", BLANK, min_tier="cloud", max_tier="edge")
    with pytest.raises(InvalidInput, match="space"):
        client.infer("digits", BLANK, max_tier="space")
    with pytest.raises(InvalidInput, match="does not fit"):  # not Unavailable: refused here first
        client.infer("digits", np.zeros((1, 10), np.float32), min_tier="edge")
    with pytest.raises(InvalidInput, match="between 0 and 1"):
        client.infer("digits", BLANK, min_confidence=1.5)


def test_what_goes_to_the_router_carries_the_callers_bounds(client: Client) -> None:
    call = client._call("digits", BLANK, budget_ms=500.0, min_confidence=0.9, max_tier="edge", min_tier=None)
    escalation = call.request(np.array([1, 3]), min_tier=Tier.EDGE)  # the unsure items, above the device
    options = RequestOptions.from_parameters(escalation.parameters)
    assert (options.min_tier, options.max_tier, options.min_confidence) == (Tier.EDGE, Tier.EDGE, 0.9)
    assert options.budget_ms is not None and 0 < options.budget_ms <= 500.0
    assert list(escalation.inputs[0].shape) == [2, 64]
    whole = client._call("digits", BLANK, budget_ms=None, min_confidence=None, max_tier=None, min_tier="cloud")
    assert not whole.local  # the device model is skipped
    options = RequestOptions.from_parameters(whole.request().parameters)
    assert (options.min_tier, options.max_tier, options.budget_ms) == (Tier.CLOUD, Tier.CLOUD, None)
