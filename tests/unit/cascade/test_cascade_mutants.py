"""What the cascades do that test_classify.py and test_generate.py do not pin down: a
rollout's arms and shadows, what a response says of where its time went, the budgets each
tier is given, and the fields of a generation's answer.

Each test is written from what the fakes are told (their confidences, latencies, what
their Hellos say) and the thresholds and budgets the test sets, so that a change of the
cascades' behaviour (a mutant of scripts/mutation.py's ``cascades`` target) fails one.
Thresholds: device 0.8 and edge 0.7 for the classifier, 0.5 for the generative family.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from router.rollout.plans import Rollouts
from stratus.convert import codec
from stratus.convert.inference import InferRequest, TextRequest
from stratus.convert.parameters import (
    COMPUTE_MS,
    COMPUTE_PRECISION,
    CONFIDENCE,
    PRECISION,
    QUEUE_MS,
    parameter_value,
)
from stratus.errors import DeadlineExceeded, Unavailable
from stratus.families.generation import (
    COMPLETION_TOKENS,
    FINAL,
    FINISH_REASON,
    PROMPT_TOKENS,
    Chunk,
    GenerationParams,
)
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb

from .fleet_fakes import (
    FAMILY,
    INPUT,
    MARK,
    TEXT_FAMILY,
    AuditRecorder,
    FakeAgent,
    Fleet,
    ReportingCloud,
    Tokens,
    classify,
    confidences,
    fleet,
    heartbeat_variant,
    line_agent,
    oip_prompt,
    prompt,
    scores,
    served,
    text_family,
    text_of,
)

DEVICE, EDGE, CLOUD = Tier.DEVICE, Tier.EDGE, Tier.CLOUD
CANDIDATE = "toy-small-v2"  # a rollout's candidate line on the device tier
SURE: tuple[Tokens, ...] = ((("4", -0.1),), ((" is", -0.1),), ((" it", -0.1),))  # exp(-0.1) = 0.90
UNSURE: tuple[Tokens, ...] = ((("5", -2.0),), ((" or", -2.0),), ((" so", -2.0),))  # exp(-2) = 0.14
FIRST_HOPELESS: tuple[Tokens, ...] = ((("5", -3.0),), ((" or", -0.1),))  # min_logprob: gone at once
# Steps of a rollout whose draw always goes one way (share 1e-9 %: never; 100 %: always),
# and which is still judging (not on its last step), so a shadow may be wanted.
NEVER_CANDIDATE = (1e-9, 100.0)
ALMOST_ALWAYS_CANDIDATE = (99.999999, 100.0)


def rollouts(f: Fleet, steps: tuple[float, ...], *, shadow: float = 0.0, tier: Tier = DEVICE) -> Rollouts:
    """Start a rollout of the candidate line on ``tier`` in the plane's own rollouts."""
    candidate = CANDIDATE if tier is DEVICE else "toy-medium-v2"
    f.plane.rollouts = Rollouts(router_id="r", rng=random.Random(7), clock=f.clock)
    f.plane.rollouts.start(FAMILY, tier, candidate, steps=steps, shadow=shadow)
    return f.plane.rollouts


def arms_counted(f: Fleet, arm: str, outcome: str, tier: Tier = DEVICE) -> float:
    return f.count("rollout_requests", family=FAMILY, tier=tier.label, arm=arm, outcome=outcome)


async def settle_background() -> None:
    """Let shadow requests (background tasks) run to their end."""
    for _ in range(50):
        await asyncio.sleep(0)


def variants_run(agent: FakeAgent) -> list[str]:
    """The variant each Work the agent got named, in order."""
    return [w.request.model_name for w in agent.works]


# -- gray release: which arm a step's items go to --------------------------------------------------


async def test_the_candidates_share_runs_the_candidate_line_and_is_recorded_as_the_candidate() -> None:
    """Item 1 is sure on the device (0.9 >= 0.8), items 2 and 3 are not (0.5): the candidate
    answered all three, two unsure; its latency is the 2 ms the agent took."""
    async with fleet() as f:
        device = line_agent(
            f, "d1", DEVICE, candidate=CANDIDATE, confidence=confidences({1: 0.9}, 0.5), latency_ms=2.0
        )
        f.agent("e1", EDGE)
        plans = rollouts(f, ALMOST_ALWAYS_CANDIDATE, shadow=100.0)
        response = await f.plane.infer(classify([1, 2, 3]), timeout_s=None)
        await settle_background()
        assert scores(response) == [MARK[DEVICE] + 1, MARK[EDGE] + 2, MARK[EDGE] + 3]
        assert variants_run(device) == [CANDIDATE]  # the candidate's items are never mirrored
        current, candidate, shadow_items, _ = plans.evidence(FAMILY, DEVICE)
        assert (candidate.requests, candidate.errors, candidate.items, candidate.unsure) == (1, 0, 3, 2)
        assert candidate.latencies_ms == [pytest.approx(2.0)]
        assert (current.requests, shadow_items) == (0, 0)
        assert arms_counted(f, "candidate", "ok") == 1 and arms_counted(f, "current", "ok") == 0


async def test_a_failed_candidate_attempt_is_recorded_as_its_error() -> None:
    async with fleet() as f:
        f.agent("e1", EDGE)
        line_agent(f, "d1", DEVICE, candidate=CANDIDATE, error=grpc.StatusCode.UNAVAILABLE)
        plans = rollouts(f, (100.0,))
        said = served(await f.plane.infer(classify([1]), timeout_s=None))
        assert said.path == (EDGE,)  # the device failed: its item climbed
        current, candidate, _, _ = plans.evidence(FAMILY, DEVICE)
        assert (candidate.requests, candidate.errors, candidate.items) == (1, 1, 0)
        assert current.requests == 0
        assert arms_counted(f, "candidate", "error") == 1 and arms_counted(f, "candidate", "ok") == 0


async def test_the_current_lines_share_is_mirrored_to_the_candidate_and_compared() -> None:
    """A shadow wanted on every request (100 %): the items the current variant answered go to
    the candidate too, with the budget the step had (400 ms, nothing spent yet); its top-1
    answers (one score per item: always class 0) agree with the current ones."""
    async with fleet() as f:
        device = line_agent(f, "d1", DEVICE, candidate=CANDIDATE, confidence=confidences({1: 0.9}, 0.5))
        f.agent("e1", EDGE)
        plans = rollouts(f, NEVER_CANDIDATE, shadow=100.0)
        response = await f.plane.infer(classify([1, 2], budget_ms=400.0), timeout_s=None)
        await settle_background()
        assert scores(response) == [MARK[DEVICE] + 1, MARK[EDGE] + 2]
        assert variants_run(device) == ["toy-small", CANDIDATE]
        assert device.keys_seen == [[1, 2], [1, 2]]  # every item the current variant was sent
        assert device.works[1].budget_ms == pytest.approx(400.0)
        current, candidate, shadow_items, shadow_agreed = plans.evidence(FAMILY, DEVICE)
        assert (current.requests, current.items, current.unsure) == (1, 2, 1)
        assert candidate.requests == 0
        assert (shadow_items, shadow_agreed) == (2, 2)
        assert arms_counted(f, "current", "ok") == 1 and arms_counted(f, "candidate", "ok") == 0


async def test_a_shadow_that_fails_is_not_compared() -> None:
    """The candidate's only agent fails: the client's answer is the current one's, and the
    failed mirror adds nothing to the comparison."""
    async with fleet() as f:
        current = f.agent("d1", DEVICE)
        mirror = line_agent(f, "d2", DEVICE, candidate=CANDIDATE, error=grpc.StatusCode.UNAVAILABLE)
        current.heartbeat(mean_ms=1.0)  # predicted faster than d2: it takes the current line
        mirror.heartbeat(mean_ms=5.0)
        plans = rollouts(f, NEVER_CANDIDATE, shadow=100.0)
        said = served(await f.plane.infer(classify([1]), timeout_s=None))
        await settle_background()
        assert (said.agent, said.path) == ("d1", (DEVICE,))
        assert variants_run(mirror) == [CANDIDATE]
        assert plans.evidence(FAMILY, DEVICE)[2:] == (0, 0)


async def test_a_shadow_whose_answers_have_no_top_1_is_not_compared() -> None:
    """The candidate answers one number per item, no per-class axis: there is no top-1 to
    compare with the current variant's, so the shadow adds nothing, and ends quietly (no
    error left in the background task)."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    async with fleet() as f:
        device = line_agent(f, "d1", DEVICE, candidate=CANDIDATE, flat_variant=CANDIDATE)
        plans = rollouts(f, NEVER_CANDIDATE, shadow=100.0)
        response = await f.plane.infer(classify([1, 2]), timeout_s=None)
        await settle_background()
        assert scores(response) == [MARK[DEVICE] + 1, MARK[DEVICE] + 2]
        assert variants_run(device) == ["toy-small", CANDIDATE]
        assert plans.evidence(FAMILY, DEVICE)[2:] == (0, 0)
    gc.collect()  # a task that ended in an exception nobody retrieved reports it when freed
    await asyncio.sleep(0)
    assert errors == []


async def test_no_shadow_is_sent_when_none_is_wanted() -> None:
    async with fleet() as f:
        device = line_agent(f, "d1", DEVICE, candidate=CANDIDATE)
        plans = rollouts(f, NEVER_CANDIDATE, shadow=0.0)
        await f.plane.infer(classify([1]), timeout_s=None)
        await settle_background()
        assert variants_run(device) == ["toy-small"]
        assert plans.evidence(FAMILY, DEVICE)[2:] == (0, 0)


async def test_a_candidate_no_agent_serves_leaves_the_items_on_the_current_line() -> None:
    async with fleet() as f:
        device = f.agent("d1", DEVICE)
        plans = rollouts(f, (100.0,))
        said = served(await f.plane.infer(classify([1]), timeout_s=None))
        assert (said.variant, variants_run(device)) == ("toy-small", ["toy-small"])
        current, candidate, _, _ = plans.evidence(FAMILY, DEVICE)
        assert (current.requests, candidate.requests) == (1, 0)
        assert arms_counted(f, "current", "ok") == 1


async def test_a_rollouts_candidate_is_sought_on_its_own_tier_only() -> None:
    """The candidate line is served on the edge, not the device where the rollout is: the
    device's items stay on its current line, and the edge is never asked."""
    async with fleet() as f:
        device = f.agent("d1", DEVICE)
        edge = line_agent(f, "e1", EDGE, candidate=CANDIDATE)
        plans = rollouts(f, (100.0,))
        said = served(await f.plane.infer(classify([1]), timeout_s=None))
        assert (said.agent, variants_run(device), edge.works) == ("d1", ["toy-small"], [])
        assert plans.evidence(FAMILY, DEVICE)[0].requests == 1


async def test_an_edge_rollouts_candidate_is_not_sought_on_the_device() -> None:
    """The device serves the edge rollout's candidate line too, and answers first (unsure):
    the edge's share goes to the edge agent that serves the candidate, not back down."""
    async with fleet() as f:
        device = line_agent(f, "d1", DEVICE, candidate="toy-medium-v2", confidence=confidences({}, 0.5))
        edge = line_agent(f, "e1", EDGE, candidate="toy-medium-v2")
        plans = rollouts(f, (100.0,), tier=EDGE)
        said = served(await f.plane.infer(classify([1]), timeout_s=None))
        assert (said.tier, said.variant, said.path) == (EDGE, "toy-medium-v2", (DEVICE, EDGE))
        assert (variants_run(device), variants_run(edge)) == (["toy-small"], ["toy-medium-v2"])
        assert plans.evidence(FAMILY, EDGE)[1].requests == 1


async def test_a_candidate_agent_that_failed_is_not_asked_again() -> None:
    """Two device agents serve the candidate; the first chosen fails: the retry goes to the
    other one, never back to the one that failed."""
    async with fleet() as f:
        failing = line_agent(f, "d1", DEVICE, candidate=CANDIDATE, error=grpc.StatusCode.UNAVAILABLE)
        other = line_agent(f, "d2", DEVICE, candidate=CANDIDATE)
        heartbeat_variant(failing, CANDIDATE, 1.0)
        heartbeat_variant(other, CANDIDATE, 2.0)  # slower: d1 is chosen first
        rollouts(f, (100.0,))
        said = served(await f.plane.infer(classify([1]), timeout_s=None))
        assert (said.agent, said.variant, said.path) == ("d2", CANDIDATE, (DEVICE,))
        assert (len(failing.works), len(other.works)) == (1, 1)


@pytest.mark.parametrize("keys", [[1], [1, 2]], ids=["one item fits", "two items do not"])
async def test_a_candidate_too_slow_for_the_budget_leaves_the_items_on_the_current_line(
    keys: list[int],
) -> None:
    """The candidate is predicted at 15 ms an item, against a 20 ms budget: one item fits it,
    two (30 ms) do not; the current variant (1 ms an item, unreported) takes them then."""
    async with fleet() as f:
        device = line_agent(f, "d1", DEVICE, candidate=CANDIDATE)
        heartbeat_variant(device, CANDIDATE, 15.0)
        rollouts(f, (100.0,))
        await f.plane.infer(classify(keys, budget_ms=20.0), timeout_s=None)
        assert variants_run(device) == ([CANDIDATE] if len(keys) == 1 else ["toy-small"])


# -- what a classifier's response says ---------------------------------------------------------------


async def test_a_response_says_the_answering_variants_precision_and_where_the_time_went() -> None:
    """Device then edge answer (the device unsure of item 2): the response names the edge's
    precision and compute, and sums both tiers' queue time (1.5 + 2.5 ms, as their Results
    said) and compute time (their 2 and 3 ms of service)."""
    async with fleet() as f:
        line_agent(
            f,
            "d1",
            DEVICE,
            precision="FP16",
            compute="f32",
            queue_ms=1.5,
            confidence=confidences({1: 0.9}, 0.5),
            latency_ms=2.0,
        )
        line_agent(f, "e1", EDGE, precision="INT8", compute="int8", queue_ms=2.5, latency_ms=3.0)
        said = served(await f.plane.infer(classify([1, 2]), timeout_s=None))
        assert (said.tier, said.agent, said.precision, said.compute) == (EDGE, "e1", "INT8", "int8")
        assert said.queue_ms == pytest.approx(4.0)
        assert said.compute_ms == pytest.approx(5.0)


async def test_a_single_answer_says_its_own_times() -> None:
    async with fleet() as f:
        line_agent(f, "d1", DEVICE, precision="FP16", compute="f16", latency_ms=2.0)
        said = served(await f.plane.infer(classify([1]), timeout_s=None))
        assert (said.precision, said.compute) == ("FP16", "f16")
        assert said.queue_ms == pytest.approx(0.0) and said.compute_ms == pytest.approx(2.0)


async def test_a_cloud_answer_says_the_precision_and_times_the_cloud_reported() -> None:
    """The device (1 ms of service, no queue) climbs to the cloud, which says 4 ms queued
    and 6 ms computing: the sums are 4 and 7 ms."""
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.5))
        cloud = ReportingCloud(
            f.clock, extra={PRECISION: "BF16", COMPUTE_PRECISION: "bf16", QUEUE_MS: 4.0, COMPUTE_MS: 6.0}
        )
        f.cloud = cloud
        said = served(await f.plane.infer(classify([1]), timeout_s=None))
        assert (said.tier, said.precision, said.compute) == (CLOUD, "BF16", "bf16")
        assert said.queue_ms == pytest.approx(4.0) and said.compute_ms == pytest.approx(7.0)
        assert [r.id for r in cloud.asked] == ["req-1"]  # the client's request id travels up


async def test_a_response_keeps_the_requests_id_and_its_raw_buffers() -> None:
    async with fleet() as f:
        f.agent("d1", DEVICE)
        response = (await f.plane.infer(classify([1]), timeout_s=None)).to_wire()
        assert response.id == "req-1"
        assert len(response.raw_output_contents) == 1  # asked in raw buffers: answered so


async def test_a_typed_request_is_answered_in_typed_contents() -> None:
    async with fleet() as f:
        f.agent("d1", DEVICE)
        request = pb.ModelInferRequest(model_name=FAMILY, id="typed-1")
        codec.encode_request_inputs(request, {INPUT: np.array([[3, 0.0]], dtype=np.float32)}, raw=False)
        response = (await f.plane.infer(InferRequest.from_wire(request), timeout_s=None)).to_wire()
        assert len(response.raw_output_contents) == 0
        assert list(response.outputs[0].contents.fp32_contents) == [MARK[DEVICE] + 3]


@pytest.mark.parametrize(
    ("sure_on_device", "expected"),
    [
        ({2: 0.9}, [MARK[EDGE] + 1, MARK[DEVICE] + 2, MARK[EDGE] + 3]),
        ({3: 0.9}, [MARK[EDGE] + 1, MARK[EDGE] + 2, MARK[DEVICE] + 3]),
        ({1: 0.9}, [MARK[DEVICE] + 1, MARK[EDGE] + 2, MARK[EDGE] + 3]),
    ],
    ids=["middle settled below", "last settled below", "first settled below"],
)
async def test_items_settled_on_two_tiers_come_back_each_from_its_own(
    sure_on_device: dict[int, float], expected: list[int]
) -> None:
    """Three items, one sure on the device: the other two climb to the edge together, and
    each row of the response is the one its item's tier answered."""
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences(sure_on_device, 0.5))
        edge = f.agent("e1", EDGE)
        response = await f.plane.infer(classify([1, 2, 3]), timeout_s=None)
        assert scores(response) == expected
        assert len(edge.keys_seen[0]) == 2


async def test_the_items_and_time_of_each_answer_are_counted_per_tier() -> None:
    """Two items answered on the device, one of them again on the edge: three confidences
    observed, and each tier's time once."""
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({1: 0.9}, 0.5))
        f.agent("e1", EDGE)
        await f.plane.infer(classify([1, 2]), timeout_s=None)
        registry = f.metrics.metrics.registry
        for tier, items in ((DEVICE, 2), (EDGE, 1)):
            labels = {"family": FAMILY, "tier": tier.label}
            assert registry.get_sample_value("stratus_router_confidence_count", labels) == items
            assert registry.get_sample_value("stratus_router_tier_duration_seconds_count", labels) == 1


async def test_the_auditor_is_told_which_items_each_answer_was_for() -> None:
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({1: 0.9}, 0.5))
        f.agent("e1", EDGE)
        audits = AuditRecorder()
        f.plane.audits = audits  # type: ignore[assignment]
        await f.plane.infer(classify([1, 2]), timeout_s=None)
        await asyncio.sleep(0)  # the auditor is called once the answer is on its way
        (cascade,) = audits.classified_cascades
        assert cascade.sent == [[0, 1], [1]]


async def test_an_answer_of_a_rollouts_arm_carries_the_arm_to_the_audits() -> None:
    """Audits of a rollout's arms are the step's agreement evidence (router.audit.auditor): the
    answer the auditor is handed names the arm it was given for, and the candidate's
    answers the candidate."""
    async with fleet() as f:
        line_agent(f, "d1", DEVICE, candidate=CANDIDATE, confidence=confidences({1: 0.9}, 0.5))
        f.agent("e1", EDGE)
        plans = rollouts(f, ALMOST_ALWAYS_CANDIDATE)
        audits = AuditRecorder()
        f.plane.audits = audits  # type: ignore[assignment]
        await f.plane.infer(classify([1, 2]), timeout_s=None)
        await asyncio.sleep(0)
        (cascade,) = audits.classified_cascades
        device_answer, _ = cascade.best[0]
        assert device_answer.tier is DEVICE and device_answer.arm is not None
        assert device_answer.arm.candidate and device_answer.arm.plan is plans.plan(FAMILY, DEVICE)
        edge_answer, _ = cascade.best[1]
        assert edge_answer.tier is EDGE and edge_answer.arm is None  # no rollout on the edge


async def test_a_climb_stopped_by_the_budget_says_so_in_its_reason() -> None:
    """Nothing failed: the tier above was predicted too slow for what was left, and the
    degraded answer's reason says how many items stayed where, and that."""
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.5))
        f.agent("e1", EDGE).heartbeat(mean_ms=500.0)
        said = served(await f.plane.infer(classify([1], budget_ms=50.0), timeout_s=None))
        assert (said.tier, said.degraded) == (DEVICE, True)
        assert said.reason.startswith(
            "1 item(s) below the device threshold got no answer from a tier above: "
            "no tier can answer 'toy' within "
        ), said.reason
        assert f.count("degraded_answers", family=FAMILY, reason="too_slow") == 1


# -- the budget each tier is given ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget_ms", "timeout_s", "given_ms"),
    [
        (100.0, None, 95.0),  # 5 ms kept for the way back
        (20.0, None, 18.0),  # a tenth, where that is less than 5 ms
        (None, None, 30_000.0 - 5.0),  # neither: the default budget
        (100.0, 0.05, 45.0),  # the deadline (50 ms) is the tighter
        (40.0, 0.2, 36.0),  # the budget is
        (None, 0.2, 195.0),
    ],
)
async def test_a_tier_is_given_the_requests_budget_less_a_margin_for_the_way_back(
    budget_ms: float | None, timeout_s: float | None, given_ms: float
) -> None:
    async with fleet() as f:
        device = f.agent("d1", DEVICE)
        asked = classify([1]) if budget_ms is None else classify([1], budget_ms=budget_ms)
        await f.plane.infer(asked, timeout_s=timeout_s)
        assert device.works[0].budget_ms == pytest.approx(given_ms, abs=1e-6)


async def test_a_higher_tier_is_given_what_the_lower_tiers_left() -> None:
    """100 ms, of which the device took 2: the edge is given 98 less its 5 ms margin."""
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.5), latency_ms=2.0)
        edge = f.agent("e1", EDGE)
        await f.plane.infer(classify([1], budget_ms=100.0), timeout_s=None)
        assert edge.works[0].budget_ms == pytest.approx(93.0, abs=1e-6)


async def test_a_budget_spent_to_the_last_millisecond_sends_nothing_more() -> None:
    """The device takes exactly the whole budget (2**-7 s, exact in binary): nothing is left
    for the edge, so the unsure device answer is all there is."""
    budget = 1000.0 / 128
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.5), latency_ms=budget)
        edge = f.agent("e1", EDGE)
        said = served(await f.plane.infer(classify([1], budget_ms=budget), timeout_s=None))
        assert (said.path, said.degraded, edge.works) == ((DEVICE,), True, [])


async def test_under_a_millisecond_left_still_goes_up() -> None:
    """An edge that reports 0.1 ms (0.6 with its 0.5 ms link) fits in the 0.8 ms the
    device left."""
    budget = 1000.0 / 128
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.5), latency_ms=budget)
        edge = f.agent("e1", EDGE)
        edge.heartbeat(mean_ms=0.1)
        said = served(await f.plane.infer(classify([1], budget_ms=budget + 0.8), timeout_s=None))
        assert (said.path, said.degraded) == ((DEVICE, EDGE), False)
        assert len(edge.works) == 1


async def test_a_deadline_already_reached_is_refused_before_any_tier() -> None:
    async with fleet() as f:
        device = f.agent("d1", DEVICE)
        with pytest.raises(DeadlineExceeded, match=r"budget of 0\.0 ms ran out before any tier answered"):
            await f.plane.infer(classify([1]), timeout_s=0.0)
        assert device.works == []


@pytest.mark.parametrize(("keys", "path"), [([1], (DEVICE,)), ([1, 2], (EDGE,))])
async def test_a_tier_is_predicted_for_all_the_items_still_to_answer(
    keys: list[int], path: tuple[Tier]
) -> None:
    """The device reports 15 ms an item against a 20 ms budget: it fits one item, not two."""
    async with fleet() as f:
        f.agent("d1", DEVICE).heartbeat(mean_ms=15.0)
        f.agent("e1", EDGE)
        said = served(await f.plane.infer(classify(keys, budget_ms=20.0), timeout_s=None))
        assert said.path == path


async def test_three_agents_of_a_tier_share_its_requests() -> None:
    """With more than two usable agents, the policy draws two of them at random."""
    async with fleet() as f:
        for name in ("d1", "d2", "d3"):
            f.agent(name, DEVICE)
        said = served(await f.plane.infer(classify([1]), timeout_s=None))
        assert said.agent in {"d1", "d2", "d3"} and sum(len(a.works) for a in f.agents) == 1


# -- how a climb ends ---------------------------------------------------------------------------------------


async def test_the_only_agents_failure_is_the_error_the_client_gets() -> None:
    async with fleet() as f:
        f.agent("d1", DEVICE, error=grpc.StatusCode.UNAVAILABLE)
        with pytest.raises(Unavailable, match="d1 failed as told"):
            await f.plane.infer(classify([1]), timeout_s=None)


async def test_a_degraded_answer_after_a_failure_counts_the_failure_as_why() -> None:
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.5))
        f.agent("e1", EDGE, error=grpc.StatusCode.UNAVAILABLE)
        said = served(await f.plane.infer(classify([1]), timeout_s=None))
        assert (said.tier, said.degraded) == (DEVICE, True)
        assert f.count("degraded_answers", family=FAMILY, reason="unavailable") == 1
        assert f.count("degraded_answers", family=FAMILY, reason="no_higher_tier") == 0


async def test_a_pinned_variant_is_not_sent_higher_however_unsure() -> None:
    """A pinned device variant whose answer is unsure, with a cloud that serves it too: the
    client chose the variant, so its answer is final."""
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.1))
        cloud = f.with_cloud(serves=(FAMILY, "toy-small"))
        said = served(await f.plane.infer(classify([1], model="toy-small"), timeout_s=None))
        assert (said.tier, said.path, said.degraded) == (DEVICE, (DEVICE,), False)
        assert cloud.asked == []


async def test_a_family_with_nowhere_higher_is_remembered_once() -> None:
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.5))
        assert f.plane.warned_short == set()
        for _ in range(2):
            said = served(await f.plane.infer(classify([1]), timeout_s=None))
            assert said.degraded
        assert f.plane.warned_short == {FAMILY}


@pytest.mark.parametrize(
    ("min_confidence", "reason"),
    [(0.5, ""), (0.7, "stratus.max_tier=device: 2 item(s) below the device threshold were not sent higher")],
)
async def test_a_held_answers_reason_counts_items_below_the_clients_own_bar(
    min_confidence: float, reason: str
) -> None:
    """Both items are 0.6 sure, the device is the highest tier asked for (an edge is above):
    under a client bar of 0.5 nothing was held below its bar; under 0.7 both were."""
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.6))
        f.agent("e1", EDGE)
        asked = classify([1, 2], max_tier=DEVICE, min_confidence=min_confidence)
        said = served(await f.plane.infer(asked, timeout_s=None))
        assert (said.path, said.reason) == ((DEVICE,), reason)


async def test_three_agents_serving_the_candidate_share_its_items() -> None:
    """More than two usable candidate agents: two are drawn at random, one answers."""
    async with fleet() as f:
        for name in ("d1", "d2", "d3"):
            line_agent(f, name, DEVICE, candidate=CANDIDATE)
        rollouts(f, (100.0,))
        said = served(await f.plane.infer(classify([1]), timeout_s=None))
        assert said.variant == CANDIDATE
        assert [variants_run(a) for a in f.agents if a.works] == [[CANDIDATE]]


# -- generation ----------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def text_fleet(method: str = "mean_logprob", **settings: object) -> AsyncIterator[Fleet]:
    async with fleet(family=text_family(method), **settings) as built:
        yield built


def stopping_at(stop: str) -> TextRequest:
    """The generative request of ``prompt``, also stopping at ``stop``."""
    import dataclasses

    return dataclasses.replace(prompt(), params=GenerationParams(max_tokens=8, stop=(stop,)))


async def final_parameters(f: Fleet, request: InferRequest | None = None) -> dict[str, object]:
    """The ``stratus.*`` parameters of a streamed generation's final message."""
    final: dict[str, object] = {}
    async for result in f.plane.generate(request or oip_prompt(), timeout_s=None):
        response = result.to_wire()
        if parameter_value(response.parameters[FINAL]):
            final = {key: parameter_value(value) for key, value in response.parameters.items()}
    return final


@pytest.mark.parametrize(("said", "expected"), [("length", "length"), ("", "stop")])
async def test_a_generation_ends_for_the_reason_its_tier_gave_or_stop(said: str, expected: str) -> None:
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=UNSURE)
        f.with_cloud(serves=(TEXT_FAMILY,), finish_reason=said)
        result = await f.plane.generate_text(prompt(), timeout_s=None)
        assert (result.tier, result.finish_reason) == (CLOUD, expected)
        final = await final_parameters(f)
        assert final[FINISH_REASON] == expected


async def test_a_tier_that_stops_at_a_stop_string_ends_for_stop_and_is_judged_on_what_is_kept() -> None:
    """The cloud says its answer ran to its length and reports 0.42 sure of it, but its text
    runs past the request's stop string: the answer is cut there, ends for "stop", and its
    confidence is that of the tokens kept (exp(-0.01) each), not the cloud's own figure."""
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=UNSURE)
        f.cloud = ReportingCloud(
            f.clock,
            extra={CONFIDENCE: 0.42},
            serves=(TEXT_FAMILY,),
            chunks=((("fo", -0.01),), (("ur##x", -0.01),)),
            finish_reason="length",
        )
        result = await f.plane.generate_text(stopping_at("##"), timeout_s=None)
        assert (result.text, result.finish_reason) == ("four", "stop")
        assert result.confidence == pytest.approx(np.exp(-0.01))


async def test_a_tiers_own_confidence_is_the_answers_where_nothing_was_cut() -> None:
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=UNSURE)
        f.cloud = ReportingCloud(
            f.clock, extra={CONFIDENCE: 0.42}, serves=(TEXT_FAMILY,), finish_reason="length"
        )
        result = await f.plane.generate_text(prompt(), timeout_s=None)
        assert (result.tier, result.finish_reason) == (CLOUD, "length")
        assert result.confidence == pytest.approx(0.42)


async def test_text_held_back_as_the_start_of_a_stop_string_is_shown_at_the_end() -> None:
    """ " #" may begin the stop string "##": it is held until the generation ends without
    it, then shown and kept."""
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=((("4", -0.1),), ((" #", -0.1),)))
        seen: list[str] = []

        async def sink(chunk: Chunk) -> None:
            seen.append(chunk.text)

        result = await f.plane.generate_text(stopping_at("##"), timeout_s=None, sink=sink)
        assert (result.text, len(result.tokens), seen) == ("4 #", 2, ["4", " #"])


async def test_a_generation_the_client_cancels_is_cancelled_not_climbed() -> None:
    """The device holds after its first (sure) chunk; the client goes away: the request ends
    cancelled, the Cancel reaches the device, and the edge is never asked."""
    async with text_fleet() as f:
        device = f.agent("d1", DEVICE, chunks=SURE, hold_after=1)
        edge = f.agent("e1", EDGE, chunks=SURE)
        task = asyncio.ensure_future(f.plane.generate_text(prompt(), timeout_s=None))
        for _ in range(100):
            if device.works:
                break
            await asyncio.sleep(0)
        for _ in range(10):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(10):
            await asyncio.sleep(0)
        assert device.cancels == [device.works[0].request_id]
        assert edge.works == []


async def test_the_clients_min_confidence_decides_when_a_run_is_hopeless() -> None:
    """The first token is exp(-3) = 0.05 sure: hopeless against the family's 0.5, not against
    the client's 0.01, so the device runs to its end and its answer is accepted."""
    async with text_fleet("min_logprob") as f:
        device = f.agent("d1", DEVICE, chunks=FIRST_HOPELESS)
        edge = f.agent("e1", EDGE, chunks=SURE)
        result = await f.plane.generate_text(prompt(min_confidence=0.01), timeout_s=None)
        assert (result.tier, result.text, result.degraded) == (DEVICE, "5 or", False)
        assert device.cancels == [] and edge.works == []


async def test_a_hopeless_run_is_cancelled_when_the_highest_tier_asked_for_is_above() -> None:
    """max_tier=edge, and an edge agent is ready: the device's hopeless run is cancelled."""
    async with text_fleet("min_logprob") as f:
        device = f.agent("d1", DEVICE, chunks=FIRST_HOPELESS)
        f.agent("e1", EDGE, chunks=SURE)
        result = await f.plane.generate_text(prompt(max_tier=EDGE), timeout_s=None)
        assert (result.tier, result.text) == (EDGE, "4 is it")
        assert device.cancels == [device.works[0].request_id]


async def test_a_tier_that_generated_nothing_counts_no_tokens() -> None:
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=())
        result = await f.plane.generate_text(prompt(), timeout_s=None)
        assert (result.text, result.completion_tokens, result.generated) == ("", 0, {DEVICE: 0})


@pytest.mark.parametrize(("usage", "completion"), [((5, 7), 7), ((5, 2), 3)])
async def test_a_generations_token_counts_are_the_tiers_or_at_least_those_it_sent(
    usage: tuple[int, int], completion: int
) -> None:
    """The device says 5 prompt tokens and some completion tokens, and sent 3: the answer
    counts the larger of the two for completion (a stop string's tokens may not be sent)."""
    async with text_fleet() as f:
        line_agent(f, "d1", DEVICE, chunks=SURE, usage=usage, precision="FP16")
        result = await f.plane.generate_text(prompt(), timeout_s=None)
        assert (result.prompt_tokens, result.completion_tokens, result.precision) == (5, completion, "FP16")
        final = await final_parameters(f)
        assert (final[PROMPT_TOKENS], final[COMPLETION_TOKENS]) == (5, completion)
        assert final[PRECISION] == "FP16"
        assert final["stratus.timings_ms"]


async def test_each_tier_a_generation_climbed_is_timed() -> None:
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=UNSURE, latency_ms=2.0)
        f.agent("e1", EDGE, chunks=SURE, latency_ms=3.0)
        result = await f.plane.generate_text(prompt(), timeout_s=None)
        assert result.timings_ms == {DEVICE: pytest.approx(2.0), EDGE: pytest.approx(3.0)}


async def test_a_failed_attempt_counts_in_its_tiers_time() -> None:
    """d1 fails after 2 ms, d2 answers in 3: the device's time is both."""
    async with text_fleet() as f:
        failing = f.agent("d1", DEVICE, error=grpc.StatusCode.UNAVAILABLE, latency_ms=2.0)
        other = f.agent("d2", DEVICE, chunks=SURE, latency_ms=3.0)
        failing.heartbeat(mean_ms=1.0)  # predicted faster: chosen first
        other.heartbeat(mean_ms=2.0)
        result = await f.plane.generate_text(prompt(), timeout_s=None)
        assert (result.agent, result.path) == ("d2", (DEVICE,))
        assert result.timings_ms == {DEVICE: pytest.approx(5.0)}


async def test_a_generation_tier_is_given_what_the_lower_tiers_left() -> None:
    """100 ms, of which the device took 2: the edge is given the other 98."""
    async with text_fleet() as f:
        device = f.agent("d1", DEVICE, chunks=UNSURE, latency_ms=2.0)
        edge = f.agent("e1", EDGE, chunks=SURE)
        await f.plane.generate_text(prompt(budget_ms=100.0), timeout_s=None)
        assert device.works[0].budget_ms == pytest.approx(100.0, abs=1e-6)
        assert edge.works[0].budget_ms == pytest.approx(98.0, abs=1e-6)


async def test_a_generation_with_no_time_left_is_refused_before_any_tier() -> None:
    async with text_fleet() as f:
        device = f.agent("d1", DEVICE, chunks=SURE)
        with pytest.raises(DeadlineExceeded, match=r"budget of 0\.0 ms ran out before any tier answered"):
            await f.plane.generate_text(prompt(), timeout_s=0.0)
        assert device.works == []


async def test_a_generation_under_a_millisecond_left_still_goes_up() -> None:
    """As for classifiers: 0.8 ms left, an edge predicted at 0.6 ms takes the request."""
    budget = 1000.0 / 128
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=UNSURE, latency_ms=budget)
        edge = f.agent("e1", EDGE, chunks=SURE)
        edge.heartbeat(mean_ms=0.1)
        result = await f.plane.generate_text(prompt(budget_ms=budget + 0.8), timeout_s=None)
        assert (result.tier, result.path) == (EDGE, (DEVICE, EDGE))


async def test_three_generative_agents_of_a_tier_share_its_requests() -> None:
    async with text_fleet() as f:
        for name in ("d1", "d2", "d3"):
            f.agent(name, DEVICE, chunks=SURE)
        result = await f.plane.generate_text(prompt(), timeout_s=None)
        assert result.agent in {"d1", "d2", "d3"} and sum(len(a.works) for a in f.agents) == 1


async def test_an_unsure_cloud_answer_is_final_and_not_degraded() -> None:
    """Nothing is above the cloud: its answer under the client's 0.99 bar is the answer."""
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=UNSURE)
        f.with_cloud(serves=(TEXT_FAMILY,), chunks=((("fo", -1.0),),))
        result = await f.plane.generate_text(prompt(min_confidence=0.99), timeout_s=None)
        assert (result.tier, result.degraded) == (CLOUD, False)


async def test_the_only_generative_agents_failure_is_the_error_the_client_gets() -> None:
    async with text_fleet() as f:
        f.agent("d1", DEVICE, error=grpc.StatusCode.UNAVAILABLE)
        with pytest.raises(Unavailable, match="d1 failed as told"):
            await f.plane.generate_text(prompt(), timeout_s=None)


async def test_a_degraded_generation_counts_every_tier_tried() -> None:
    """The device's 3 unsure tokens, then a cloud that failed before any: both are counted."""
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=UNSURE)
        f.with_cloud(serves=(TEXT_FAMILY,), error=Unavailable("cloud is away"))
        result = await f.plane.generate_text(prompt(), timeout_s=None)
        assert (result.tier, result.degraded) == (DEVICE, True)
        assert result.generated == {DEVICE: 3, CLOUD: 0}


async def test_a_pinned_generation_keeps_the_clients_budget_and_stays_on_its_tier() -> None:
    """A pinned edge variant the cloud serves too, unsure: it is answered on the edge alone,
    within the client's 50 ms."""
    async with text_fleet() as f:
        edge = f.agent("e1", EDGE, chunks=UNSURE)
        cloud = f.with_cloud(serves=(TEXT_FAMILY, "chat-medium"))
        result = await f.plane.generate_text(prompt(model="chat-medium", budget_ms=50.0), timeout_s=None)
        assert (result.tier, result.path, result.degraded) == (EDGE, (EDGE,), False)
        assert cloud.asked == []
        assert edge.works[0].budget_ms == pytest.approx(50.0, abs=1e-6)


async def test_the_auditor_is_told_of_each_answer_a_generation_climbed_past() -> None:
    """The device's unsure answer (3 tokens) climbs; the edge's is the answer."""
    async with text_fleet() as f:
        f.agent("d1", DEVICE, chunks=UNSURE, latency_ms=2.0)
        f.agent("e1", EDGE, chunks=SURE)
        audits = AuditRecorder()
        f.plane.audits = audits  # type: ignore[assignment]
        await f.plane.generate_text(prompt(), timeout_s=None)
        await asyncio.sleep(0)
        ((result, climbed),) = audits.generations
        (past,) = climbed
        assert (past.tier, past.text, past.generated) == (DEVICE, "5 or so", {DEVICE: 3})
        assert past.timings_ms == {DEVICE: pytest.approx(2.0)}
        assert result.tier == EDGE


async def test_a_hopeless_run_climbed_past_is_told_as_a_cancelled_empty_answer() -> None:
    """What the auditor gets of a run cancelled once hopeless: none of its text (it was never
    finished), the agent it ran on, no variant, no confidence, "cancelled", the tier's time
    and the one token it made."""
    async with text_fleet("min_logprob") as f:
        f.agent("d1", DEVICE, chunks=FIRST_HOPELESS, hold_after=1)
        f.agent("e1", EDGE, chunks=SURE)
        audits = AuditRecorder()
        f.plane.audits = audits  # type: ignore[assignment]
        await f.plane.generate_text(prompt(), timeout_s=None)
        await asyncio.sleep(0)
        ((_, climbed),) = audits.generations
        (past,) = climbed
        said = (past.text, past.tokens, past.tier, past.agent, past.variant, past.confidence)
        assert said == ("", (), DEVICE, "d1", "", 0.0)
        assert (past.finish_reason, past.path, past.generated) == ("cancelled", (DEVICE,), {DEVICE: 1})
        assert set(past.timings_ms) == {DEVICE}


async def test_a_request_of_no_items_is_answered_by_the_tier_it_reached() -> None:
    """Zero rows, sent to the cloud alone: no item names a tier, so the response names the
    cloud that answered, and (no item being unsure) full confidence."""
    async with fleet() as f:
        cloud = f.with_cloud()
        request = pb.ModelInferRequest(model_name=FAMILY, id="empty-1")
        codec.encode_request_inputs(request, {INPUT: np.zeros((0, 2), dtype=np.float32)})
        said = served(await f.plane.infer(InferRequest.from_wire(request), timeout_s=None))
        assert (said.tier, said.item_tiers, said.confidence) == (CLOUD, (), 1.0)
        assert len(cloud.asked) == 1
        assert f.count("requests", family=FAMILY, tier="cloud", outcome="ok") == 1


async def test_a_pinned_generation_streams_as_the_final_tier_even_where_the_cloud_serves_it() -> None:
    """The cloud serves the pinned edge variant too, but a pinned variant's tier is the only
    one it may use: the edge is final, so its chunks reach the client as they come."""
    async with text_fleet() as f:
        f.agent("e1", EDGE, chunks=UNSURE)
        cloud = f.with_cloud(serves=(TEXT_FAMILY, "chat-medium"))
        texts: list[str] = []
        async for result in f.plane.generate(oip_prompt(model="chat-medium"), timeout_s=None):
            response = result.to_wire()
            if not parameter_value(response.parameters[FINAL]):
                texts.append(text_of(response))
        assert texts == ["5", " or", " so"]
        assert cloud.asked == []


async def test_tokens_of_a_failed_attempt_count_with_its_tiers_retry() -> None:
    """d1 sends 2 tokens and then fails; d2, of the same tier, answers with 2: the device
    made 4 for this request, and the answer's own completion is d2's 2."""
    async with text_fleet() as f:
        failing = line_agent(
            f, "d1", DEVICE, chunks=UNSURE[:2], error=grpc.StatusCode.UNAVAILABLE, fail_after_chunks=True
        )
        other = f.agent("d2", DEVICE, chunks=SURE[:2])
        failing.heartbeat(mean_ms=1.0)  # predicted faster: chosen first
        other.heartbeat(mean_ms=2.0)
        result = await f.plane.generate_text(prompt(), timeout_s=None)
        assert (result.agent, result.text, result.completion_tokens) == ("d2", "4 is", 2)
        assert result.generated == {DEVICE: 4}


async def test_a_streamed_attempt_that_fails_is_not_retried_under_the_text_already_shown() -> None:
    """Found by the mutation work: d1, the final tier, streams "5", " or" and then fails; a retry
    on d2 used to stream "4", " is" after them, so the client read "5 or4 is" as one answer.
    What was shown stands: the request fails with d1's error, and d2 is never asked."""
    async with text_fleet() as f:
        failing = line_agent(
            f, "d1", DEVICE, chunks=UNSURE[:2], error=grpc.StatusCode.UNAVAILABLE, fail_after_chunks=True
        )
        other = f.agent("d2", DEVICE, chunks=SURE[:2])
        failing.heartbeat(mean_ms=1.0)  # predicted faster: chosen first
        other.heartbeat(mean_ms=2.0)
        texts: list[str] = []
        with pytest.raises(Unavailable):
            async for result in f.plane.generate(oip_prompt(max_tier=DEVICE), timeout_s=None):
                texts.append(text_of(result.to_wire()))
        assert texts == ["5", " or"] and other.works == []
        # unseen (a whole answer, nothing streamed), the same failure is retried on d2
        whole = await f.plane.generate_text(prompt(), timeout_s=None)
        assert (whole.agent, whole.text) == ("d2", "4 is")
