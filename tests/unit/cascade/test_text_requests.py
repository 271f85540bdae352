"""A generative request's own parts of the data plane (router/cascade/text_requests.py): the
name it must resolve to, when its first text reached the client, and what its generation
tells the observer (each tier's tokens, answered or discarded, and time)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from router.cascade.text_requests import timing_first_text
from stratus.errors import NotFound
from stratus.families.generation import Chunk, Token
from stratus.tiers import Tier

from .fleet_fakes import FAMILY, TEXT_FAMILY, fleet, oip_prompt, prompt, text_family
from .test_generate import SURE, UNSURE, streamed, text_fleet, tokens_made

DEVICE, EDGE = Tier.DEVICE, Tier.EDGE


def _chunk(text: str) -> Chunk:
    return Chunk(tokens=(Token(text=text, logprob=-0.1),) if text else ())


async def test_the_first_text_is_timed_once_from_the_start_and_every_chunk_still_passes() -> None:
    now = [10.0]
    noted: list[tuple[str, float]] = []
    passed: list[str] = []
    observer = SimpleNamespace(first_text=lambda family, seconds: noted.append((family, seconds)))

    async def sink(chunk: Chunk) -> None:
        passed.append(chunk.text)

    timed = timing_first_text(sink, observer, lambda: now[0], "chat", 9.5)  # type: ignore[arg-type]
    await timed(_chunk(""))  # no text yet: not the first text
    now[0] = 10.25
    await timed(_chunk("4"))
    now[0] = 11.0
    await timed(_chunk(" is"))
    assert noted == [("chat", 0.75)]
    assert passed == ["", "4", " is"]


async def test_a_classifier_or_unknown_name_is_not_a_generative_model() -> None:
    async with fleet() as f:
        f.agent("d1", DEVICE)  # the classifier family
        f.agent("g1", DEVICE, family=text_family(), chunks=SURE)
        for name in (FAMILY, "nothing-of-that-name"):
            with pytest.raises(NotFound, match=f"'{name}' is not a generative model this fleet serves"):
                await f.plane.generate_text(prompt(model=name), timeout_s=None)
            with pytest.raises(NotFound, match=f"'{name}' is not a generative model this fleet serves"):
                async for _ in f.plane.generate(oip_prompt(model=name), timeout_s=None):
                    pass


async def test_a_climb_counts_each_tiers_tokens_by_fate_and_its_time() -> None:
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=UNSURE)
        f.agent("e1", EDGE, chunks=SURE)
        await streamed(f)
        made = {
            (tier, fate): tokens_made(f, tier, fate)
            for tier in (DEVICE, EDGE)
            for fate in ("answered", "discarded")
        }
        assert made == {
            (DEVICE, "answered"): 0, (DEVICE, "discarded"): len(UNSURE),
            (EDGE, "answered"): len(SURE), (EDGE, "discarded"): 0,
        }  # fmt: skip
        registry = f.metrics.metrics.registry
        for tier in (DEVICE, EDGE):
            timed = registry.get_sample_value(
                "stratus_router_tier_duration_seconds_count", {"family": TEXT_FAMILY, "tier": tier.label}
            )
            assert timed == 1, tier
        first = registry.get_sample_value("stratus_router_first_text_seconds_count", {"family": TEXT_FAMILY})
        assert first == 1


async def test_an_oip_request_is_read_against_its_familys_bounds_and_named_by_it() -> None:
    """The OIP door reads a text request with the family's token bound, and a refusal names the family."""
    from stratus.convert.inference import InferRequest
    from stratus.convert.text import prompt_request
    from stratus.families.generation import GenerationParams
    from stratus.families.sampling import FieldError

    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=SURE)
        asked = InferRequest.from_wire(prompt_request(TEXT_FAMILY, "gen-1", "2+2=", GenerationParams(max_tokens=9)))
        with pytest.raises(FieldError, match=f"between 1 and 8 for '{TEXT_FAMILY}'"):
            async for _ in f.plane.generate(asked, timeout_s=None):
                pass
        assert f.agents[0].works == []
