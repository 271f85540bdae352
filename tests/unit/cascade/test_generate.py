"""How a generative request climbs the tiers, through ``RouterDataPlane.generate`` and
``generate_text``: lower tiers' tokens held until accepted, the final tier streamed,
hopeless lower runs cancelled.

Characterization, as test_classify.py. Thresholds: 0.5 on device and edge. The tests of
the two divergences issue 19 named (``--on-cloud-failure fail`` where the cloud was not the
way up, and the escalation metric's reason) failed before the climb was one pure rule set
(router/policy/climb.py) and pass since.
"""

from __future__ import annotations

import contextlib

import grpc
import pytest

from stratus.convert.inference import InferRequest
from stratus.convert.parameters import parameter_value
from stratus.errors import Overloaded, Unavailable
from stratus.families.generation import FINAL, FINISH_REASON, Chunk
from stratus.tiers import Tier

from .fleet_fakes import (
    TEXT_FAMILY,
    Fleet,
    Tokens,
    fill,
    fleet,
    oip_prompt,
    prompt,
    release,
    text_family,
    text_of,
)

DEVICE, EDGE, CLOUD = Tier.DEVICE, Tier.EDGE, Tier.CLOUD
SURE: tuple[Tokens, ...] = ((("4", -0.1),), ((" is", -0.1),), ((" it", -0.1),))  # exp(-0.1) = 0.90
UNSURE: tuple[Tokens, ...] = ((("5", -2.0),), ((" or", -2.0),), ((" so", -2.0),))  # exp(-2) = 0.14
FIRST_HOPELESS: tuple[Tokens, ...] = ((("5", -3.0),), ((" or", -0.1),))  # min_logprob: gone at once


def tokens_made(f: Fleet, tier: Tier, fate: str) -> float:
    return f.count("generated_tokens", family=TEXT_FAMILY, tier=tier.label, fate=fate)


def text_fleet(
    method: str = "mean_logprob", **settings: object
) -> contextlib.AbstractAsyncContextManager[Fleet]:
    """A fleet whose agents serve the generative family, judged by ``method``."""
    return fleet(family=text_family(method), **settings)


async def streamed(f: Fleet, request: InferRequest | None = None) -> tuple[list[str], dict[str, object]]:
    """What a streaming client sees: each chunk's text, then the final message's ``stratus.*``."""
    texts: list[str] = []
    final = None
    async for result in f.plane.generate(request or oip_prompt(), timeout_s=None):
        response = result.to_wire()
        if parameter_value(response.parameters[FINAL]):
            final = response
        else:
            texts.append(text_of(response))
    assert final is not None
    return texts, {key: parameter_value(value) for key, value in final.parameters.items()}


# -- sure answers ---------------------------------------------------------------------------------


async def test_the_top_tier_streams_each_chunk_as_it_comes() -> None:
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=SURE)
        texts, final = await streamed(f)
        assert texts == ["4", " is", " it"]
        assert (final["stratus.tier"], final["stratus.path"], final["stratus.degraded"]) == (
            "device",
            "device",
            False,
        )
        assert final[FINISH_REASON] == "stop"
        assert tokens_made(f, DEVICE, "answered") == 3


async def test_a_lower_tiers_sure_answer_is_held_then_shown_whole() -> None:
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=SURE)
        f.agent("e1", EDGE)
        texts, final = await streamed(f)
        assert texts == ["4 is it"]  # one chunk: held until the whole answer was accepted
        assert (final["stratus.tier"], final["stratus.agent"]) == ("device", "d1")
        assert final["stratus.confidence"] == pytest.approx(0.905, abs=1e-3)
        assert f.agents[1].works == []


# -- climbing -----------------------------------------------------------------------------------------


async def test_an_unsure_answer_climbs_and_the_client_sees_only_the_higher_tiers_text() -> None:
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=UNSURE)
        f.agent("e1", EDGE, chunks=SURE)
        texts, final = await streamed(f)
        assert texts == ["4", " is", " it"]  # the edge is the top tier: streamed as it came
        assert (final["stratus.tier"], final["stratus.path"]) == ("edge", "device>edge")
        assert f.agents[0].cancels == []  # a mean can still rise: judged only at the end
        assert (tokens_made(f, DEVICE, "discarded"), tokens_made(f, EDGE, "answered")) == (3, 3)
        assert f.climbs(DEVICE, EDGE, "unsure", family=TEXT_FAMILY) == 1


async def test_a_hopeless_lower_run_is_cancelled_and_the_request_climbs() -> None:
    async with text_fleet("min_logprob") as f:
        f.agent("d1", DEVICE, chunks=FIRST_HOPELESS, hold_after=1)  # would wait after its first chunk
        f.agent("e1", EDGE, chunks=SURE)
        result = await f.plane.generate_text(prompt(), timeout_s=None)
        device = f.agents[0]
        assert device.cancels == [device.works[0].request_id]
        assert (result.tier, result.path, result.text) == (EDGE, (DEVICE, EDGE), "4 is it")
        assert result.generated == {DEVICE: 1, EDGE: 3}
        assert f.climbs(DEVICE, EDGE, "unsure", family=TEXT_FAMILY) == 1


async def test_a_hopeless_run_is_not_cancelled_when_nothing_above_could_take_it() -> None:
    async with text_fleet("min_logprob") as f:
        f.agent("d1", DEVICE, chunks=FIRST_HOPELESS)
        f.agent("e1", EDGE)
        f.registry.draining(f.agents[1].handle)  # listed, so the device is not the top tier
        result = await f.plane.generate_text(prompt(), timeout_s=None)
        assert f.agents[0].cancels == []
        assert (result.tier, result.text, result.degraded) == (DEVICE, "5 or", True)


async def test_an_unsure_answer_of_the_top_tier_is_degraded_as_a_classifiers_is() -> None:
    """No tier above serves the family (the cloud lists it no more): the unsure answer is all
    there is, streamed as final, and marked degraded (README: never silently unsure)."""
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=UNSURE)
        texts, final = await streamed(f)
        assert texts == ["5", " or", " so"]
        assert (final["stratus.tier"], final["stratus.degraded"]) == ("device", True)
    async with text_fleet() as f:  # the same tier sure: final and not degraded
        f.agent("d1", DEVICE, chunks=SURE)
        _, final = await streamed(f)
        assert (final["stratus.tier"], final["stratus.degraded"]) == ("device", False)


async def test_the_cloud_as_the_top_tier_streams_its_chunks() -> None:
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=UNSURE)
        f.with_cloud(serves=(TEXT_FAMILY,), chunks=((("fo", -0.01),), (("ur", -0.01),)))
        texts, final = await streamed(f)
        assert texts == ["fo", "ur"]
        assert (final["stratus.tier"], final["stratus.agent"]) == ("cloud", "cloud@cloud.test:8001")
        assert (final["stratus.variant"], final["stratus.path"]) == ("chat-large", "device>cloud")


async def test_a_failed_agent_leaves_the_path_and_the_next_tier_answers() -> None:
    async with text_fleet() as f:
        f.agent("d1", DEVICE, error=grpc.StatusCode.UNAVAILABLE)
        f.agent("e1", EDGE, chunks=SURE)
        result = await f.plane.generate_text(prompt(), timeout_s=None)
        assert (result.tier, result.path, result.degraded) == (EDGE, (EDGE,), False)


# -- the cloud fails ------------------------------------------------------------------------------------


async def test_a_failed_cloud_leaves_the_held_answer_shown_degraded() -> None:
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=UNSURE)
        cloud = f.with_cloud(serves=(TEXT_FAMILY,), error=Unavailable("cloud is away"))
        texts, final = await streamed(f)
        assert texts == ["5 or so"]
        assert (final["stratus.tier"], final["stratus.path"], final["stratus.degraded"]) == (
            "device",
            "device",
            True,
        )
        assert len(cloud.asked) == 1


async def test_on_cloud_failure_fail_refuses_and_shows_nothing() -> None:
    async with text_fleet(fail_without_cloud=True) as f:
        f.agent("d1", DEVICE, chunks=UNSURE)
        f.with_cloud(serves=(TEXT_FAMILY,), up=False)
        seen: list[Chunk] = []

        async def sink(chunk: Chunk) -> None:
            seen.append(chunk)

        with pytest.raises(
            Unavailable,
            match=r"the cloud is unavailable \(down\) and the router runs with --on-cloud-failure fail; "
            "the answer was still unsure",
        ):
            await f.plane.generate_text(prompt(), timeout_s=None, sink=sink)
        assert seen == []
        assert f.count("refusals", reason="unavailable") == 1


@pytest.mark.parametrize("cloud_serves", [True, False], ids=["max_tier=edge", "cloud lacks family"])
async def test_on_cloud_failure_fail_degrades_where_the_cloud_was_not_the_way_up(cloud_serves: bool) -> None:
    """As test_classify's test of the same name: an unsure device answer whose edge is full."""
    async with text_fleet(fail_without_cloud=True) as f:
        f.agent("d1", DEVICE, chunks=UNSURE)
        f.agent("e1", EDGE, capacity=1, queue_limit=0, max_batch=1, hold_after=0)
        f.with_cloud(serves=(TEXT_FAMILY,) if cloud_serves else ())
        holder = await fill(f.agents[1], f.plane.generate_text(prompt(model="chat-medium"), timeout_s=None))
        try:
            asked = prompt(max_tier=EDGE if cloud_serves else CLOUD)
            result = await f.plane.generate_text(asked, timeout_s=None)
        finally:
            await release(holder)
        assert (result.tier, result.text, result.degraded) == (DEVICE, "5 or so", True)


# -- what the client asks for -------------------------------------------------------------------------------


async def test_max_tier_makes_the_device_final_and_streamed() -> None:
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=UNSURE)
        f.agent("e1", EDGE)
        texts, final = await streamed(f, oip_prompt(max_tier=DEVICE))
        assert texts == ["5", " or", " so"]
        assert (final["stratus.tier"], final["stratus.degraded"]) == ("device", False)
        assert f.agents[1].works == []


async def test_a_pinned_variant_generates_there_alone_however_unsure() -> None:
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=SURE)
        f.agent("e1", EDGE, chunks=UNSURE)
        f.with_cloud(serves=(TEXT_FAMILY,))
        result = await f.plane.generate_text(prompt(model="chat-medium"), timeout_s=None)
        assert (result.tier, result.variant, result.path, result.degraded) == (
            EDGE,
            "chat-medium",
            (EDGE,),
            False,
        )
        assert f.agents[0].works == [] and f.cloud is not None and f.cloud.asked == []


async def test_a_generation_whose_every_agent_is_full_is_refused_as_overloaded() -> None:
    async with text_fleet() as f:
        f.agent("d1", DEVICE, capacity=1, queue_limit=0, max_batch=1, hold_after=0)
        holder = await fill(f.agents[0], f.plane.generate_text(prompt(), timeout_s=None))
        try:
            with pytest.raises(Overloaded, match="every device agent serving 'chat' has a full work queue"):
                await f.plane.generate_text(prompt(), timeout_s=None)
        finally:
            await release(holder)


# -- the escalation metric --------------------------------------------------------------------------------


async def test_a_climb_after_a_failure_is_counted_as_failed() -> None:
    async with text_fleet() as f:
        f.agent("d1", DEVICE, error=grpc.StatusCode.UNAVAILABLE)
        f.agent("e1", EDGE, chunks=SURE)
        await f.plane.generate_text(prompt(), timeout_s=None)
        assert f.climbs(DEVICE, EDGE, "failed", family=TEXT_FAMILY) == 1


async def test_a_tier_too_slow_for_the_budget_is_counted_as_too_slow() -> None:
    async with text_fleet() as f:
        f.agent("d1", DEVICE)
        f.agent("e1", EDGE, chunks=SURE)
        f.agents[0].heartbeat(mean_ms=50.0)
        result = await f.plane.generate_text(prompt(budget_ms=20.0), timeout_s=None)
        assert result.path == (EDGE,) and f.agents[0].works == []
        assert f.climbs(DEVICE, EDGE, "too_slow", family=TEXT_FAMILY) == 1


async def test_a_request_for_more_tokens_than_the_family_allows_is_refused_before_any_tier() -> None:
    """The OpenAI API builds its requests itself: the plane still holds them to the family's bound."""
    import dataclasses

    from stratus.families.generation import GenerationParams
    from stratus.families.sampling import FieldError

    async with text_fleet() as f:
        f.agent("d1", DEVICE)
        asked = dataclasses.replace(prompt(), params=GenerationParams(max_tokens=9))
        with pytest.raises(FieldError, match="between 1 and 8 for 'chat'") as refused:
            await f.plane.generate_text(asked, timeout_s=None)
        assert refused.value.param == "max_tokens"
        assert f.agents[0].works == []
