"""A threshold suggestion from the audits equals what calibrate chooses on the same items.

The rows come from the real auditor: a request's items settle on the device or climb to a
(canned) cloud; every item is drawn (share 1), the settled ones are asked of the cloud, and
the rows go over the wire as ``ThresholdsReply.rows`` do. Calibrate's chooser is then run on
the same items built the way calibrate builds a labelled split (the cloud's class as the
label), and the two must choose the same thresholds."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from router.audit.rows import RowBook
from stratus.convert import codec
from stratus.convert.fleet import audit_row_to_wire
from stratus.convert.hello import hello_from_wire
from stratus.errors import ConfigError
from stratus.families.confidence import PASS_ALL
from stratus.families.suggest import TierAnswer, TierScores, for_max_escalation, for_target_accuracy, goal_of
from stratus.tiers import Tier
from stratus.tools.calibrate.from_audits import audit_scores, suggest
from stratus.wire import fleet_pb2 as fpb
from tests.unit.test_audit import CLASSES, View, answer, auditor, cloud_pool, job, pool_request, run, settle

ITEMS = 300
DEVICE_THRESHOLD = 0.7  # digits_info()'s: what decides which items climbed


def device_answers(truth: list[int]) -> tuple[list[int], list[float]]:
    """A device that is unsure where it is more often wrong: a calibrated-looking tier."""
    rng = np.random.default_rng(7)
    confidences = rng.uniform(0.3, 1.0, len(truth))
    wrong = rng.uniform(0.0, 1.0, len(truth)) > confidences
    classes = [(t + 1) % CLASSES if bad else t for t, bad in zip(truth, wrong, strict=True)]
    return classes, [float(round(c, 4)) for c in confidences]


def audited_rows() -> tuple[list[fpb.AuditRow], list[int], list[int], list[float]]:
    """Every item of one request as a row, through the auditor; and what calibrate would see."""
    rows: list[fpb.AuditRow] = []

    async def body() -> None:
        pool, link = cloud_pool()
        audits, _, _ = auditor(pool, share=1.0, max_per_s=1e9)
        audits.start()
        view = View(job(ITEMS))
        truth.extend(link.classes(codec.decode_request_inputs(pool_request(view))["input"]))
        classes, confidences = device_answers(truth)
        mine.extend(classes)
        sure.extend(confidences)
        view.answered(answer(Tier.DEVICE, classes, confidences), list(range(ITEMS)))
        climbed = [i for i in range(ITEMS) if confidences[i] < DEVICE_THRESHOLD]
        view.answered(answer(Tier.CLOUD, [truth[i] for i in climbed], [1.0] * len(climbed), "cloud"), climbed)
        audits.classified(view)
        await settle(audits, lambda: len(audits.rows.rows("digits")) == ITEMS)
        await audits.close()
        rows.extend(
            fpb.AuditRow.FromString(audit_row_to_wire(r).SerializeToString()) for r in audits.rows.rows("digits")
        )

    truth: list[int] = []
    mine: list[int] = []
    sure: list[float] = []
    run(body)
    return rows, truth, mine, sure


def calibrate_scores(truth: list[int], mine: list[int], sure: list[float]) -> list[TierScores]:
    """The same items as a labelled split for calibrate: the top tier's class is the label."""
    labels = np.array(truth)
    device = TierScores(Tier.DEVICE, "digits-small", np.array(sure), np.array(mine) == labels, np.array(mine))
    cloud = TierScores(Tier.CLOUD, "digits-large", np.ones(ITEMS), np.ones(ITEMS, dtype=bool), labels)
    return [device, cloud]


def test_the_auditor_keeps_every_drawn_item_as_a_row_labelled_by_the_top_tier() -> None:
    rows, truth, mine, sure = audited_rows()
    assert len(rows) == ITEMS
    by_device = sorted((r.tiers[0].confidence, r.tiers[0].answer, r.label) for r in rows)
    assert by_device == sorted(zip(sure, mine, truth, strict=True))
    assert {r.top_tier for r in rows} == {"cloud"} and all(len(r.tiers) == 1 for r in rows)


@pytest.mark.parametrize("target", [0.9, 0.95, 0.98])
def test_the_suggestion_for_a_target_accuracy_is_calibrates_choice(target: float) -> None:
    rows, truth, mine, sure = audited_rows()
    expected = for_target_accuracy(calibrate_scores(truth, mine, sure), target)
    suggested = suggest(rows, target_accuracy=target)
    assert suggested.thresholds == {Tier.DEVICE: expected[0]}
    assert suggested.outcome.accuracy >= target and suggested.rows == ITEMS


@pytest.mark.parametrize("share", [0.1, 0.3])
def test_the_suggestion_for_a_cloud_share_is_calibrates_choice(share: float) -> None:
    rows, truth, mine, sure = audited_rows()
    expected = for_max_escalation(calibrate_scores(truth, mine, sure), share)
    suggested = suggest(rows, max_escalation=share)
    assert suggested.thresholds == {Tier.DEVICE: expected[0]}
    assert suggested.outcome.reached[-1] <= share


# Calibrate's grid tries 60 quantiles of the confidences, not every one: its choice may miss
# the exact optimum by one quantile step, about 1/59 of the items.
GRID_STEP = 1 / 59


def outcome_at(
    threshold: float, truth: list[int], mine: list[int], sure: list[float]
) -> tuple[float, float, float]:
    """(accuracy, cloud share, expected accuracy) of a device threshold on these items, counted
    by hand: an item the device is sure of keeps its answer (and its confidence), the others
    take the cloud's (the label, at confidence 1)."""
    kept = [c >= threshold for c in sure]
    right = [m == t if k else True for k, m, t in zip(kept, mine, truth, strict=True)]
    claimed = [c if k else 1.0 for k, c in zip(kept, sure, strict=True)]
    return sum(right) / len(right), kept.count(False) / len(kept), sum(claimed) / len(claimed)


def every_outcome(truth: list[int], mine: list[int], sure: list[float]) -> list[tuple[float, float, float]]:
    """The outcome of every threshold that draws a different line: one at each confidence seen,
    and one above them all (everything climbs)."""
    return [outcome_at(t, truth, mine, sure) for t in [*sorted(set(sure)), PASS_ALL]]


@pytest.mark.parametrize("target", [0.9, 0.95, 0.98])
def test_the_suggestion_for_a_target_accuracy_is_near_the_cheapest_that_reaches_it(target: float) -> None:
    """Against a brute force over every threshold, not the chooser calibrate and suggest share."""
    rows, truth, mine, sure = audited_rows()
    cheapest = min(share for accuracy, share, _ in every_outcome(truth, mine, sure) if accuracy >= target)
    threshold = suggest(rows, target_accuracy=target).thresholds[Tier.DEVICE]
    accuracy, share, _ = outcome_at(threshold, truth, mine, sure)
    assert accuracy >= target and cheapest <= share <= cheapest + GRID_STEP, (share, cheapest)


@pytest.mark.parametrize("limit", [0.1, 0.3])
def test_the_suggestion_for_a_cloud_share_claims_near_the_most_within_it(limit: float) -> None:
    """Within the share, the highest expected accuracy (what calibrated confidences predict,
    calibrate's first goal), by brute force."""
    rows, truth, mine, sure = audited_rows()
    most = max(expected for _, share, expected in every_outcome(truth, mine, sure) if share <= limit)
    _, share, expected = outcome_at(
        suggest(rows, max_escalation=limit).thresholds[Tier.DEVICE], truth, mine, sure
    )
    assert share <= limit and most - GRID_STEP <= expected <= most, (expected, most)


def test_too_few_rows_are_refused_saying_how_many_are_needed() -> None:
    book = RowBook()
    for i in range(10):
        book.add("digits", (TierAnswer(Tier.DEVICE, 0.8, i % 3),), Tier.CLOUD, i % 3)
    rows = [audit_row_to_wire(r) for r in book.rows("digits")]
    with pytest.raises(ConfigError, match="10 audit rows so far; a suggestion needs at least 200") as few:
        suggest(rows, target_accuracy=0.9)
    with pytest.raises(ConfigError, match="no audit rows yet") as none:
        suggest([], target_accuracy=0.9)
    for refused in (few, none):  # how to get there: rows come at the audit share, which can be raised
        assert "about 100 requests a row" in str(refused.value)
        assert "`stratus router --audit-share 0.05`" in str(refused.value)


def test_a_suggestion_says_what_it_predicts_on_its_rows() -> None:
    """The suggestion's agreement and top-tier share on the rows, counted here by hand: the
    table and the JSON say both (they showed only the thresholds)."""
    from stratus.cli.thresholds import Asked, _suggestion

    rows, truth, mine, sure = audited_rows()
    asked = Asked(family="digits", apply=None, suggest=True, revert=False, target_accuracy=0.95)
    thresholds, notes = _suggestion(rows, asked)
    device = thresholds["device"]
    climbs = [c < device for c in sure]
    right = sum(1 if up else int(m == t) for up, m, t in zip(climbs, mine, truth, strict=True))
    assert notes[0] == (
        f"on those rows it predicts agreement with the cloud tier of {right / ITEMS:.1%}, "
        f"{sum(climbs) / ITEMS:.1%} of requests reaching the cloud tier"
    )


def test_sure_errors_pass_the_tier_by_and_the_suggestion_says_why() -> None:
    """12 of 300 device answers are wrong with confidence 1.0: a threshold of 1 keeps them
    (288/300 = 0.96 at most), so 0.99 is reached only with the device at PASS_ALL, sending
    every request up; the note names the 12. At 0.95 the device keeps answering."""
    book = RowBook()
    for i in range(300):
        wrong = i % 25 == 0
        confidence = 1.0 if wrong else 0.5 + (i % 50) / 100
        book.add("defects", (TierAnswer(Tier.DEVICE, confidence, (i + wrong) % 4),), Tier.CLOUD, i % 4)
    rows = [audit_row_to_wire(r) for r in book.rows("defects")]
    held = suggest(rows, target_accuracy=0.99)
    assert held.thresholds == {Tier.DEVICE: PASS_ALL}
    assert held.outcome.accuracy == 1.0 and held.outcome.reached == (1.0, 1.0)
    assert len(held.notes) == 1
    assert (
        "the device tier passes every request up (1.0001): 12 of its 300 audited answers disagreed"
        in held.notes[0]
    )
    reachable = suggest(rows, target_accuracy=0.95)
    assert reachable.thresholds[Tier.DEVICE] <= 1.0 and reachable.notes == ()
    assert reachable.outcome.accuracy >= 0.95


def test_rows_missing_an_intermediate_tier_are_refused() -> None:
    full = fpb.AuditRow(
        tiers=[fpb.TierAnswer(tier="device", confidence=0.5), fpb.TierAnswer(tier="edge", confidence=0.6)],
        top_tier="cloud",
    )
    settled_low = fpb.AuditRow(tiers=[fpb.TierAnswer(tier="device", confidence=0.9)], top_tier="cloud")
    with pytest.raises(ConfigError, match="1 of 2 audit rows lack a tier below the cloud tier"):
        audit_scores([full, settled_low], min_rows=1)


def test_old_rows_leave_the_book() -> None:
    now = [0.0]
    book = RowBook(max_age_s=10.0, clock=lambda: now[0])
    book.add("digits", (TierAnswer(Tier.DEVICE, 0.8, 1),), Tier.CLOUD, 1)
    now[0] = 11.0
    book.add("digits", (TierAnswer(Tier.DEVICE, 0.7, 2),), Tier.CLOUD, 2)
    assert [r.label for r in book.rows("digits")] == [2]


def test_the_recorded_goal_is_read() -> None:
    assert goal_of("target_accuracy 0.985") == (0.985, None)
    assert goal_of("max_escalation 0.04") == (None, 0.04)
    with pytest.raises(ConfigError):
        goal_of("cheapest 1")


def test_an_item_settled_on_the_device_is_asked_of_the_edge_too_so_its_row_holds_every_tier() -> None:
    from tests.unit.test_audit import answer_work, edge_hello

    async def body() -> None:
        pool, link = cloud_pool()
        audits, _, registry = auditor(pool, share=1.0, max_per_s=1e9)
        registry.register(hello_from_wire(edge_hello("edge-1")), peer="test")
        seen: list[str] = []
        fake = asyncio.create_task(answer_work(registry, "edge-1", [4, 5], seen))
        audits.start()
        view = View(job(2))
        truth = link.classes(codec.decode_request_inputs(pool_request(view))["input"])
        view.answered(answer(Tier.DEVICE, [4, 6], [0.9, 0.8]), [0, 1])
        audits.classified(view)
        await settle(audits, lambda: len(audits.rows.rows("digits")) == 2)
        await audits.close()
        registry.agents["edge-1"].work.outbox.put_nowait(None)
        await fake
        rows = [audit_row_to_wire(r) for r in audits.rows.rows("digits")]
        assert seen == ["edge-1"]
        assert [[(a.tier, a.answer) for a in r.tiers] for r in rows] == [
            [("device", 4), ("edge", 4)],
            [("device", 6), ("edge", 5)],
        ]
        assert [r.label for r in rows] == truth and {r.top_tier for r in rows} == {"cloud"}
        assert len(audit_scores(rows, min_rows=2)) == 3  # device, edge and the top

    run(body)


def test_without_a_free_edge_slot_the_agreement_is_kept_and_the_incomplete_row_is_not() -> None:
    from tests.unit.test_audit import edge_hello

    async def body() -> None:
        pool, _ = cloud_pool()
        audits, _, registry = auditor(pool, share=1.0, max_per_s=1e9)
        registry.register(hello_from_wire(edge_hello("edge-1")), peer="test")
        registry.agents["edge-1"].capacity = 0
        audits.start()
        view = View(job(2))
        view.answered(answer(Tier.DEVICE, [4, 6], [0.9, 0.8]), [0, 1])
        audits.classified(view)
        await settle(audits, lambda: bool(audits.book.estimates()))
        await audits.close()
        assert audits.rows.rows("digits") == []

    run(body)


def test_a_generative_familys_suggestion_is_calibrates_choice_on_agreement() -> None:
    """Generative rows say whether each tier's text agreed with the top's: calibrate, given
    that agreement as its correctness, chooses the same thresholds."""
    rng = np.random.default_rng(11)
    device, edge = rng.uniform(0.3, 1.0, ITEMS).round(4), rng.uniform(0.5, 1.0, ITEMS).round(4)
    device_agrees = rng.uniform(0.0, 1.0, ITEMS) < device
    edge_agrees = rng.uniform(0.0, 1.0, ITEMS) < edge
    book = RowBook()
    for i in range(ITEMS):
        lower = (TierAnswer(Tier.DEVICE, float(device[i]), 0, agrees=bool(device_agrees[i])),
                 TierAnswer(Tier.EDGE, float(edge[i]), 0, agrees=bool(edge_agrees[i])))  # fmt: skip
        book.add("arith", lower, Tier.CLOUD, 0)
    rows = [fpb.AuditRow.FromString(audit_row_to_wire(r).SerializeToString()) for r in book.rows("arith")]
    scores = [
        TierScores(Tier.DEVICE, "arith-small", device, device_agrees),
        TierScores(Tier.EDGE, "arith-medium", edge, edge_agrees),
        TierScores(Tier.CLOUD, "arith-large", np.ones(ITEMS), np.ones(ITEMS, dtype=bool)),
    ]
    for target in (0.9, 0.97):
        expected = for_target_accuracy(scores, target)
        assert suggest(rows, target_accuracy=target).thresholds == {
            Tier.DEVICE: expected[0],
            Tier.EDGE: expected[1],
        }
    expected = for_max_escalation(scores, 0.2)
    assert suggest(rows, max_escalation=0.2).thresholds == {Tier.DEVICE: expected[0], Tier.EDGE: expected[1]}


def test_rows_mixing_classes_and_texts_are_refused() -> None:
    judged = fpb.AuditRow(
        tiers=[fpb.TierAnswer(tier="device", confidence=0.5, agrees=True)], top_tier="cloud"
    )
    classed = fpb.AuditRow(tiers=[fpb.TierAnswer(tier="device", confidence=0.5, answer=3)], top_tier="cloud")
    with pytest.raises(ConfigError, match="mix classes and texts"):
        audit_scores([judged, classed], min_rows=1)
