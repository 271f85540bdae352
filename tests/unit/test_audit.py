"""Audits: the sampler keeps to its share and rate; audits reach the top tier, are compared and
counted; they yield to client work (a busy top tier, a full queue) and are dropped, counted."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from router.audit.agreement import AuditKey, Estimate
from router.audit.auditor import Auditor
from router.audit.climbs import text_row, tiers_missing, whole_answers
from router.audit.metrics import audit_levels
from router.audit.sampling import AuditPolicy, Sampler, WholeAnswer, same_number, same_text
from router.cascade.common import Answer, Job
from router.cascade.generate import Generation
from router.cloud.link import CloudLink, OnChunk
from router.cloud.pool import CloudPool
from router.fleet.registry import FleetRegistry
from stratus.convert import codec
from stratus.convert.fleet import audit_row_to_wire, family_from_wire
from stratus.convert.hello import hello_from_wire
from stratus.convert.parameters import RequestOptions
from stratus.convert.tensors import Tensors
from stratus.convert.text import prompt_request
from stratus.convert.work import result_from_wire
from stratus.errors import ConfigError
from stratus.families.audit import AuditSpec
from stratus.families.generation import Chunk, GenerationParams, Token
from stratus.obs.metrics import Metrics, RouterMetrics
from stratus.tiers import Tier
from stratus.tools.calibrate.from_audits import audit_scores
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb

CLASSES = 10


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scores(classes: list[int]) -> np.ndarray:
    """One probability row per item, its class at 0.9."""
    rows = np.full((len(classes), CLASSES), 0.1 / (CLASSES - 1), dtype=np.float32)
    rows[np.arange(len(classes)), classes] = 0.9
    return rows


def outputs(classes: list[int]) -> Tensors:
    response = pb.ModelInferResponse()
    codec.encode_response_outputs(response, {"probabilities": scores(classes)})
    return Tensors.from_response(response)


def inputs(items: int) -> Tensors:
    request = pb.ModelInferRequest()
    x = np.arange(items * 64, dtype=np.float32).reshape(items, 64) % 17
    codec.encode_request_inputs(request, {"input": x})
    return Tensors.from_request(request)


class CannedCloud(CloudLink):
    """A cloud link that is connected at once and answers classes by a rule (no gateway)."""

    def __init__(self, address: str, server_name: str | None = None) -> None:
        super().__init__(address, server_name=server_name, max_pending=8)
        self.classes: Callable[[np.ndarray], list[int]] = lambda x: [int(v) % CLASSES for v in x[:, 1]]
        self.text = "85.0"
        self.busy = 0
        self.asked: list[pb.ModelInferRequest] = []

    @property
    def in_flight(self) -> int:
        return self.busy

    def start(self) -> None:
        self.state = "connected"
        self.models = {"digits": True, "arith": True}

    async def close(self) -> None:
        return None

    async def infer(self, request: pb.ModelInferRequest, *, timeout_s: float | None) -> pb.ModelInferResponse:
        self.asked.append(request)
        x = codec.decode_request_inputs(request)["input"]
        response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
        codec.encode_response_outputs(response, {"probabilities": scores(self.classes(x))})
        return response

    async def generate(
        self, request: pb.ModelInferRequest, on_chunk: OnChunk, *, timeout_s: float | None
    ) -> pb.ModelInferResponse:
        self.asked.append(request)
        await on_chunk(Chunk(tokens=(Token(text=self.text, logprob=-0.1),)))
        return pb.ModelInferResponse(model_name=request.model_name, id=request.id)


def cloud_pool() -> tuple[CloudPool, CannedCloud]:
    made: list[CannedCloud] = []

    def make(address: str, server_name: str | None) -> CloudLink:
        made.append(CannedCloud(address, server_name))
        return made[-1]

    pool = CloudPool("cloud:8002", make)
    pool.start()
    return pool, made[0]


def digits_info() -> fpb.FamilyInfo:
    info = fpb.FamilyInfo(name="digits", thresholds={"device": 0.7, "edge": 0.7})
    info.outputs.add(name="probabilities", datatype="FP32", shape=[-1, CLASSES])
    info.calibrated["device"].CopyFrom(fpb.TierCalibration(accuracy=0.99, agreement=0.995, items=300))
    info.calibrated["cloud"].CopyFrom(
        fpb.TierCalibration(accuracy=0.9, items=10)
    )  # calibrated with the cloud on top
    return info


@dataclass
class View:
    """A classifier request's climb, as router.cascade.classify.ClassifyCascade holds it."""

    job: Job
    answers: list[Answer] = field(default_factory=list)
    best: dict[int, tuple[Answer, int]] = field(default_factory=dict)
    sent: list[list[int]] = field(default_factory=list)

    def answered(self, answer: Answer, items: list[int]) -> None:
        self.answers.append(answer)
        self.sent.append(items)
        for row, item in enumerate(items):
            self.best[item] = (answer, row)


def job(items: int) -> Job:
    return Job(
        id="r1", asked_for="digits", family="digits", label="digits", pinned=None, options=RequestOptions(),
        inputs=inputs(items), outputs=(), raw=False, budget_ms=1000.0, started=0.0,
    )  # fmt: skip


def answer(tier: Tier, classes: list[int], confidences: list[float], agent: str = "device-1") -> Answer:
    return Answer(
        tier=tier, agent=agent, variant=f"digits-{tier.label}", outputs=outputs(classes),
        confidences=tuple(confidences), elapsed_ms=1.0,
    )  # fmt: skip


def auditor(
    cloud: CloudPool | None, *, clock: Clock | None = None, **policy: float
) -> tuple[Auditor, RouterMetrics, FleetRegistry]:
    registry = FleetRegistry()
    registry.describe(family_from_wire(digits_info()))
    recorder = RouterMetrics(Metrics())
    made = Auditor(
        registry, cloud, policy=AuditPolicy(**policy), metrics=recorder, rng=random.Random(3),  # type: ignore[arg-type]
        clock=clock or Clock(),
    )  # fmt: skip
    return made, recorder, registry


def counted(recorder: RouterMetrics, outcome: str, tier: str = "device") -> float:
    value = recorder.metrics.registry.get_sample_value(
        "stratus_router_audits_total", {"family": "digits", "tier": tier, "outcome": outcome}
    )
    return value or 0.0


async def settle(audits: Auditor, done: Callable[[], bool]) -> None:
    """Let the workers run until ``done()``, for at most a second of loop time."""
    for _ in range(200):
        if done():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the audits did not settle")


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())  # type: ignore[arg-type]


# -- the sampler ------------------------------------------------------------------------------------


def test_sampler_keeps_to_its_share() -> None:
    sampler = Sampler(rng=random.Random(11), clock=Clock())
    drawn = sum(sampler.draw("digits", 0.1, 1e9) for _ in range(20_000))
    # Binomial(20000, 0.1): mean 2000, sd 42.4; five sd either side.
    assert 1788 <= drawn <= 2212
    assert not any(sampler.draw("digits", 0.0, 1e9) for _ in range(1000))
    assert all(sampler.draw("digits", 1.0, 1e9) for _ in range(1000))


def test_sampler_never_exceeds_its_rate_per_family() -> None:
    clock = Clock()
    sampler = Sampler(rng=random.Random(11), clock=clock)
    drawn = {"digits": 0, "defects": 0}
    for _ in range(1000):  # 10 s of 100 items every 10 ms, for each family
        clock.now += 0.01
        for _ in range(100):
            for family in drawn:
                drawn[family] += sampler.draw(family, 1.0, 5.0)
    # 5 a second over 10 s, plus the bucket's burst of 5; neither family takes the other's
    assert all(50 <= n <= 55 for n in drawn.values()), drawn
    assert not sampler.draw("digits", 1.0, 0.0)


def test_comparators() -> None:
    assert same_text(" 85\n", "85")
    assert not same_text("85", "86")
    assert same_number("85", "85.0") and same_number("1e2", "100")
    assert not same_number("85", "86")
    assert same_number("eighty", " eighty ") and not same_number("eighty", "85")


def test_policy_refuses_what_cannot_work() -> None:
    with pytest.raises(ConfigError):
        AuditPolicy(share=1.5)
    with pytest.raises(ConfigError):
        AuditPolicy(max_per_s=-1.0)
    with pytest.raises(ConfigError):
        AuditPolicy(workers=0)


# -- classifier audits ------------------------------------------------------------------------------


def test_audits_reach_the_cloud_are_compared_and_counted() -> None:
    async def body() -> None:
        pool, link = cloud_pool()
        audits, recorder, _ = auditor(pool, share=1.0, max_per_s=1000.0)
        audits.start()
        view = View(job(4))
        x = codec.decode_request_inputs(pool_request(view))["input"]
        truth = link.classes(x)
        mine = [*truth[:3], (truth[3] + 1) % CLASSES]  # the device gets the last item wrong
        view.answered(answer(Tier.DEVICE, mine, [0.9] * 4), [0, 1, 2, 3])
        audits.classified(view)
        await settle(audits, lambda: bool(audits.book.estimates()))
        await audits.close()
        (asked,) = link.asked
        assert asked.model_name == "digits" and asked.inputs[0].shape == [4, 64]
        assert [o.name for o in asked.outputs] == ["probabilities"]
        assert audits.book.estimates() == {
            AuditKey("digits", Tier.DEVICE, "digits-device", "device-1"): Estimate(4, 3)
        }
        assert (
            counted(recorder, "agreed"),
            counted(recorder, "disagreed"),
            counted(recorder, "dropped"),
        ) == (3, 1, 0)
        assert audits.escalated.estimates() == {}

    run(body)


def pool_request(view: View) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest()
    view.job.inputs.write_request(request)
    return request


def test_only_items_settled_below_the_top_by_their_own_confidence_are_audited() -> None:
    async def body() -> None:
        pool, link = cloud_pool()
        audits, _, _ = auditor(pool, share=1.0, max_per_s=1000.0)
        view = View(job(3))
        # item 0 sure on the device; item 1 unsure there and answered by the cloud; item 2
        # unsure and kept on the device (degraded: it is not what the threshold settles)
        device = answer(Tier.DEVICE, [1, 2, 3], [0.95, 0.3, 0.2])
        view.answered(device, [0, 1, 2])
        view.answered(answer(Tier.CLOUD, [2], [1.0], agent="cloud@x"), [1])
        audits.classified(view)
        (queued,) = list(audits.workers.waiting)
        assert queued.classes == (1,) and queued.inputs is not None and queued.inputs.items == 1
        # the free, biased sample: item 1's device answer against the cloud's, kept apart
        key = AuditKey("digits", Tier.DEVICE, "digits-device", "device-1")
        assert audits.escalated.estimates() == {key: Estimate(1, 1)}
        assert audits.book.estimates() == {}
        assert not link.asked  # nothing is sent before a worker takes it

    run(body)


def test_audits_yield_when_the_cloud_is_busy_and_are_counted_as_dropped() -> None:
    async def body() -> None:
        pool, link = cloud_pool()
        audits, recorder, _ = auditor(pool, share=1.0, max_per_s=1000.0, cloud_spare=0.25)
        audits.start()
        link.busy = 2  # a quarter of max_pending 8: no room for one more
        for _ in range(3):
            view = View(job(2))
            view.answered(answer(Tier.DEVICE, [1, 2], [0.9, 0.9]), [0, 1])
            audits.classified(view)
        await settle(audits, lambda: audits.queued == 0 and audits.dropped == 6)
        assert not link.asked and counted(recorder, "dropped") == 6
        link.busy = 1  # room again
        view = View(job(1))
        view.answered(answer(Tier.DEVICE, [1], [0.9]), [0])
        audits.classified(view)
        await settle(audits, lambda: len(link.asked) == 1)
        await audits.close()

    run(body)


def test_a_full_queue_drops_the_oldest_and_stale_audits_are_dropped() -> None:
    async def body() -> None:
        pool, link = cloud_pool()
        clock = Clock()
        audits, recorder, _ = auditor(
            pool, clock=clock, share=1.0, max_per_s=1000.0, queue_limit=4, max_wait_s=5.0
        )
        for index in range(7):
            view = View(job(1))
            view.answered(answer(Tier.DEVICE, [index], [0.9]), [0])
            audits.classified(view)
        assert audits.queued == 4 and audits.dropped == 3
        assert [a.classes for a in audits.workers.waiting] == [(3,), (4,), (5,), (6,)]  # the newest kept
        clock.now += 6.0  # now all of them waited too long
        audits.start()
        await settle(audits, lambda: audits.queued == 0 and audits.dropped == 7)
        await audits.close()
        assert not link.asked and counted(recorder, "dropped") == 7

    run(body)


def test_no_audits_without_a_share_or_a_tier_above() -> None:
    async def body() -> None:
        pool, _ = cloud_pool()
        audits, _, registry = auditor(pool, share=0.0)
        view = View(job(1))
        view.answered(answer(Tier.DEVICE, [1], [0.9]), [0])
        audits.classified(view)
        assert audits.queued == 0
        lone, _, _ = auditor(None, share=1.0)  # no cloud, no agents: no top tier to ask
        lone.classified(view)
        assert lone.queued == 0
        described = registry.families["digits"]
        registry.describe(dataclasses.replace(described, audit=AuditSpec(share=1.0)))  # the family's own share wins
        audits.classified(view)
        assert audits.queued == 1

    run(body)


# -- a top tier of agents -----------------------------------------------------------------------------


def edge_hello(name: str) -> fpb.Hello:
    hello = fpb.Hello(agent_id=name, tier=fpb.TIER_EDGE, capacity=1)
    hello.variants.add(name="digits-medium", family="digits", max_batch=8, current=True, line="digits-medium")
    hello.families.append(digits_info())
    return hello


async def answer_work(registry: FleetRegistry, name: str, classes: list[int], seen: list[str]) -> None:
    handle = registry.agents[name]
    while (message := await handle.work.outbox.get()) is not None:
        if message.WhichOneof("kind") != "work":
            continue
        seen.append(name)
        result = fpb.Result(
            request_id=message.work.request_id, variant="digits-medium", batch_size=len(classes)
        )
        codec.encode_response_outputs(result.response, {"probabilities": scores(classes)})
        result.confidences.extend([0.9] * len(classes))
        registry.result(handle, result_from_wire(result, f"agent {name}"))


def test_without_a_cloud_audits_go_to_an_idle_top_tier_agent() -> None:
    async def body() -> None:
        audits, recorder, registry = auditor(None, share=1.0, max_per_s=1000.0)
        for name in ("edge-busy", "edge-idle"):
            registry.register(hello_from_wire(edge_hello(name)), peer="test")
        busy = registry.agents["edge-busy"]
        busy.work.chunks["held"] = lambda chunk: None  # a generation holds its one slot
        seen: list[str] = []
        fake = asyncio.create_task(answer_work(registry, "edge-idle", [4, 5], seen))
        audits.start()
        view = View(job(2))
        view.answered(answer(Tier.DEVICE, [4, 6], [0.9, 0.9]), [0, 1])
        audits.classified(view)
        await settle(audits, lambda: bool(audits.book.estimates()))
        assert audits.top_of("digits") is Tier.EDGE and seen == ["edge-idle"]
        assert audits.book.estimates() == {
            AuditKey("digits", Tier.DEVICE, "digits-device", "device-1"): Estimate(2, 1)
        }
        busy.work.chunks.clear()
        registry.agents["edge-idle"].work.chunks["held"] = lambda chunk: None
        busy.capacity = 0  # now neither has a free slot: the audit is dropped
        audits.classified(view)
        await settle(audits, lambda: audits.dropped == 2)
        assert counted(recorder, "dropped") == 2 and seen == ["edge-idle"]
        await audits.close()
        registry.agents["edge-idle"].work.outbox.put_nowait(None)
        await fake

    run(body)


# -- generative audits --------------------------------------------------------------------------------


def arith_info() -> fpb.FamilyInfo:
    info = fpb.FamilyInfo(name="arith", kind="generative", thresholds={"device": 0.8, "edge": 0.8})
    info.audit.compare = "number"
    return info


def generation(tier: Tier, text: str, confidence: float, *, degraded: bool = False) -> Generation:
    return Generation(
        text=text, tokens=(), tier=tier, agent=f"{tier.label}-1", variant=f"arith-{tier.label}",
        confidence=confidence, finish_reason="stop", path=(tier,), timings_ms={}, degraded=degraded,
    )  # fmt: skip


def test_generative_answers_are_audited_with_the_familys_comparator() -> None:
    async def body() -> None:
        pool, link = cloud_pool()
        audits, recorder, registry = auditor(pool, share=1.0, max_per_s=1000.0)
        info = family_from_wire(arith_info())
        registry.describe(info)
        audits.start()
        prompt = prompt_request("arith", "c1", "37+48=", GenerationParams(max_tokens=4))
        audits.generated(info, prompt, generation(Tier.DEVICE, "85", 0.95), [])
        audits.generated(info, prompt, generation(Tier.DEVICE, "84", 0.95), [])
        audits.generated(info, prompt, generation(Tier.DEVICE, "85", 0.5), [])  # unsure: not audited
        audits.generated(info, prompt, generation(Tier.DEVICE, "85", 0.95, degraded=True), [])
        await settle(audits, lambda: sum(e.audits for e in audits.book.estimates().values()) == 2)
        await audits.close()
        assert [r.model_name for r in link.asked] == ["arith", "arith"]
        key = AuditKey("arith", Tier.DEVICE, "arith-device", "device-1")
        assert audits.book.estimates() == {key: Estimate(2, 1)}  # "85" agrees with "85.0"
        # an unsure edge answer that climbed to the cloud: the biased sample, kept apart
        climbed = generation(Tier.EDGE, "85", 0.3)
        audits.generated(info, prompt, generation(Tier.CLOUD, "85.0", 1.0), [climbed])
        assert audits.escalated.estimates() == {
            AuditKey("arith", Tier.EDGE, "arith-edge", "edge-1"): Estimate(1, 1)
        }
        agreed = recorder.metrics.registry.get_sample_value(
            "stratus_router_audits_total", {"family": "arith", "tier": "device", "outcome": "agreed"}
        )
        assert agreed == 1

    run(body)


# -- what Prometheus reads ----------------------------------------------------------------------------


def test_levels_sum_agents_per_variant_and_carry_the_calibrated_line() -> None:
    pool, _ = cloud_pool()
    audits, _, _ = auditor(pool)
    for agent, agreed in (("device-1", True), ("device-2", False), ("device-2", True)):
        audits.book.add(AuditKey("digits", Tier.DEVICE, "digits-small", agent), agreed)
    found = {
        (family.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in audit_levels(audits)
        for sample in family.samples
    }
    labels = (("family", "digits"), ("tier", "device"), ("variant", "digits-small"))
    assert found[("stratus_router_audit_agreement", labels)] == pytest.approx(2 / 3)
    assert found[("stratus_router_audit_window_audits", labels)] == 3
    low, high = (
        found[("stratus_router_audit_agreement_lower", labels)],
        found[("stratus_router_audit_agreement_upper", labels)],
    )
    assert 0.0 < low < 2 / 3 < high < 1.0
    calibrated = (("family", "digits"), ("tier", "device"))
    assert found[("stratus_router_audit_calibrated_agreement", calibrated)] == pytest.approx(0.995)
    assert not any("agent" in dict(labels) for _, labels in found)  # agents only in the CLI
    edge_top, _, _ = auditor(None)  # no cloud: audits ask the edge, calibration asked the cloud
    edge_top.registry.register(hello_from_wire(edge_hello("edge-1")), peer="test")
    assert not [
        f
        for f in audit_levels(edge_top)
        if f.name == "stratus_router_audit_calibrated_agreement" and f.samples
    ]


# -- generative audit rows ----------------------------------------------------------------------------


def arith_hello(name: str, tier: int) -> fpb.Hello:
    hello = fpb.Hello(agent_id=name, tier=tier, capacity=1)
    label = Tier.from_wire(tier).label
    hello.variants.add(name=f"arith-{label}", family="arith", max_batch=1, current=True, line=f"arith-{label}")
    hello.families.append(arith_info())
    return hello


def test_generative_rows_hold_each_lower_tiers_agreement_and_no_text() -> None:
    """A prompt settled on the edge, audited: its row holds the device's whole answer from the
    climb and the edge's, each judged against the cloud's "85.0" by the family's comparator. A
    climb to the cloud whose lower answers are whole is a row at once; one whose device answer
    was cancelled mid-way needs the device asked again, and with no device slot free it is not
    kept (a half row would bias the suggestion)."""

    async def body() -> None:
        pool, _ = cloud_pool()
        audits, _, registry = auditor(pool, share=1.0, max_per_s=1000.0)
        info = family_from_wire(arith_info())
        registry.describe(info)
        for name, tier in (("device-1", fpb.TIER_DEVICE), ("edge-1", fpb.TIER_EDGE)):
            registry.register(hello_from_wire(arith_hello(name, tier)), peer="test")
        registry.agents["device-1"].capacity = 0  # no slot: a missing device answer cannot be asked
        audits.start()
        prompt = prompt_request("arith", "c1", "37+48=", GenerationParams(max_tokens=4))
        unsure_device = generation(Tier.DEVICE, "84", 0.6)
        audits.generated(info, prompt, generation(Tier.EDGE, "85", 0.9), [unsure_device])
        await settle(audits, lambda: len(audits.rows.rows("arith")) == 1)
        (row,) = audits.rows.rows("arith")
        assert [(a.tier, a.confidence, a.agrees) for a in row.lower] == [(Tier.DEVICE, 0.6, False), (Tier.EDGE, 0.9, True)]
        wire = audit_row_to_wire(row)
        assert [a.agrees for a in wire.tiers] == [False, True] and wire.label == 0 and "85" not in str(wire)

        whole = [generation(Tier.DEVICE, "85", 0.7), generation(Tier.EDGE, "86", 0.5)]
        audits.generated(info, prompt, generation(Tier.CLOUD, "85", 1.0), whole)
        assert [a.agrees for a in audits.rows.rows("arith")[-1].lower] == [True, False]  # at once

        cancelled = dataclasses.replace(generation(Tier.DEVICE, "8", 0.2), finish_reason="cancelled")
        audits.generated(info, prompt, generation(Tier.CLOUD, "85", 1.0), [cancelled, generation(Tier.EDGE, "85", 0.5)])
        await asyncio.sleep(0.05)
        await audits.close()
        assert len(audits.rows.rows("arith")) == 2 and audits.dropped == 0  # a row's job is not an audit
        scores = audit_scores([audit_row_to_wire(r) for r in audits.rows.rows("arith")], min_rows=1)
        assert [list(s.correct) for s in scores] == [[False, True], [True, False], [True, True]]

    run(body)


def test_finished_keeps_whole_answers_below_the_top_bottom_first() -> None:
    cancelled = dataclasses.replace(generation(Tier.EDGE, "8", 0.2), finish_reason="cancelled")
    result = generation(Tier.CLOUD, "85", 1.0)
    assert whole_answers(result, [cancelled, generation(Tier.DEVICE, "84", 0.4)], Tier.CLOUD) == (
        WholeAnswer(Tier.DEVICE, 0.4, "84"),
    )
    assert tiers_missing(whole_answers(result, [cancelled], Tier.CLOUD), [Tier.DEVICE, Tier.EDGE]) == [Tier.DEVICE, Tier.EDGE]
    settled = generation(Tier.EDGE, "85", 0.9)
    assert [s.tier for s in whole_answers(settled, [generation(Tier.DEVICE, "84", 0.4)], Tier.CLOUD)] == [
        Tier.DEVICE, Tier.EDGE,
    ]


def test_a_text_row_asks_only_the_missing_tiers_and_none_is_kept_when_one_cannot_answer() -> None:
    asked: list[Tier] = []

    async def ask(tier: Tier) -> WholeAnswer | None:
        asked.append(tier)
        return WholeAnswer(tier, 0.5, "85") if tier is Tier.EDGE else None

    known = (WholeAnswer(Tier.DEVICE, 0.9, "84"),)
    row = asyncio.run(text_row(known, [Tier.DEVICE, Tier.EDGE], "85", same=same_text, ask=ask))
    assert row is not None and [(a.tier, a.agrees) for a in row] == [(Tier.DEVICE, False), (Tier.EDGE, True)]
    assert asked == [Tier.EDGE]
    assert asyncio.run(text_row((), [Tier.DEVICE, Tier.EDGE], "85", same=same_text, ask=ask)) is None


# -- a rollout's evidence (issue 34 §1) -----------------------------------------------------------


@dataclass
class ArmEvidence:
    """What Rollouts.record_audit would be told, in order."""

    told: list[tuple[object, bool, bool]] = field(default_factory=list)

    def record_audit(self, plan: object, *, candidate: bool, agreed: bool) -> None:
        self.told.append((plan, candidate, agreed))


def test_answers_of_a_rollouts_arms_are_audited_at_the_rollout_share_and_told_to_it() -> None:
    """The family's share is 0 (no audits at all); during a judged step both arms' settled
    answers are audited anyway, each outcome told to the rollout with its arm. Once the step is
    no longer judged (complete), they are sampled as any answer: not at all here."""
    from router.cascade.common import Arm
    from router.rollout.plan import COMPLETE, Plan

    async def body() -> None:
        pool, link = cloud_pool()
        audits, _, _ = auditor(pool, share=0.0, max_per_s=1000.0)
        evidence = ArmEvidence()
        audits.rollouts = evidence
        audits.start()
        try:
            await both_arms(audits, link, evidence)
        finally:
            await audits.close()

    async def both_arms(audits: Auditor, link: CannedCloud, evidence: ArmEvidence) -> None:
        judged = Plan(family="digits", tier=Tier.DEVICE, candidate="digits-small-v2", steps=(20.0, 100.0))
        view = View(job(4))
        truth = link.classes(codec.decode_request_inputs(pool_request(view))["input"])
        wrong = [(truth[0] + 1) % CLASSES, *truth[1:2]]  # the candidate's first answer is wrong
        candidate = dataclasses.replace(answer(Tier.DEVICE, wrong, [0.9] * 2), arm=Arm(plan=judged, candidate=True))
        current = dataclasses.replace(answer(Tier.DEVICE, truth[2:], [0.9] * 2), arm=Arm(plan=judged, candidate=False))
        view.answered(candidate, [0, 1])
        view.answered(current, [2, 3])
        audits.classified(view)
        await settle(audits, lambda: len(evidence.told) == 4)
        assert sorted((c, a) for _, c, a in evidence.told) == [(False, True), (False, True), (True, False), (True, True)]
        assert all(plan is judged for plan, _, _ in evidence.told)
        done = dataclasses.replace(judged, state=COMPLETE, step=1)
        later = View(job(2))
        later.answered(dataclasses.replace(answer(Tier.DEVICE, truth[:2], [0.9] * 2), arm=Arm(plan=done, candidate=True)), [0, 1])
        audits.classified(later)
        await asyncio.sleep(0.05)
        assert len(evidence.told) == 4 and len(link.asked) == 2  # nothing more was asked

    run(body)
