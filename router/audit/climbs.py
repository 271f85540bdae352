"""What a request's climb gives the audit rows: each tier's answer on each item, whole.

A classifier's row is built from the answers its climb already holds (:func:`item_visits`). A
generation's climb is not always whole: a tier whose running confidence turned hopeless was
cancelled mid-answer (``router.cascade.generate``), and its partial text and confidence say
nothing of what it would have answered in full, which is what calibrate simulates. So a row keeps only the finished
answers of the climb (:func:`whole_answers`) and asks each missing tier the prompt again, in the
background and only on spare capacity, as audits are asked (:func:`text_row`). A row that
cannot be completed is not kept: a half row would bias the suggestion toward the tiers that
happened to answer.

Rows hold no text (``router.audit.rows``): each tier's answer becomes whether it agreed with
the top tier's, by the family's comparator.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from router.audit.sampling import WholeAnswer
from router.cascade.generate import Generation
from stratus.convert.tensors import top1
from stratus.families.suggest import TierAnswer
from stratus.tiers import Tier

if TYPE_CHECKING:
    from router.cascade.common import Answer, Job

CANCELLED = "cancelled"


class CascadeView(Protocol):
    """What an audit reads of a classifier request's climb (``router.cascade.classify.ClassifyCascade``)."""

    job: Job
    answers: list[Answer]
    best: dict[int, tuple[Answer, int]]
    sent: list[list[int]]  # per answer, the items its rows stand for


def item_visits(view: CascadeView, output: str) -> dict[int, tuple[TierAnswer, ...]]:
    """Per item, each tier's answer on it, bottom first (a tier asked twice: its last answer)."""
    seen: dict[int, dict[Tier, TierAnswer]] = {}
    for answer, items in zip(view.answers, view.sent, strict=False):
        classes = top1(answer.outputs, output)
        if classes is None or len(classes) != len(items) or len(answer.confidences) != len(items):
            continue
        for row, item in enumerate(items):
            said = TierAnswer(answer.tier, float(answer.confidences[row]), int(classes[row]))
            seen.setdefault(item, {})[answer.tier] = said
    return {item: tuple(by_tier[t] for t in sorted(by_tier)) for item, by_tier in seen.items()}


def whole_answers(result: Generation, climbed: Sequence[Generation], top: Tier) -> tuple[WholeAnswer, ...]:
    """The whole answers below ``top`` in a generation's climb, bottom first (the answer given
    included when it came from below the top; a cancelled one is partial, so left out)."""
    answers = [*climbed, result]
    whole = {
        g.tier: WholeAnswer(g.tier, g.confidence, g.text)
        for g in answers
        if g.tier < top and g.finish_reason != CANCELLED and not g.degraded
    }
    return tuple(whole[tier] for tier in sorted(whole))


def tiers_missing(said: Iterable[WholeAnswer], below_top: Iterable[Tier]) -> list[Tier]:
    """The tiers below the top that a row still needs an answer from, bottom first."""
    known = {s.tier for s in said}
    return sorted(t for t in below_top if t not in known)


async def text_row(
    said: Sequence[WholeAnswer],
    below_top: Sequence[Tier],
    top_text: str,
    *,
    same: Callable[[str, str], bool],
    ask: Callable[[Tier], Awaitable[WholeAnswer | None]],
) -> tuple[TierAnswer, ...] | None:
    """A row from the answers known and those ``ask`` gets of the missing tiers (None: one
    could not be asked, so no row)."""
    known = {s.tier: s for s in said}
    for tier in tiers_missing(said, below_top):
        answer = await ask(tier)
        if answer is None:
            return None
        known[tier] = answer
    return agreement_row([known[tier] for tier in sorted(below_top)], top_text, same)


def agreement_row(said: Sequence[WholeAnswer], top_text: str, same: Callable[[str, str], bool]) -> tuple[TierAnswer, ...]:
    """Each tier's confidence, and whether its text agreed with the top tier's."""
    return tuple(TierAnswer(s.tier, s.confidence, 0, agrees=same(s.text, top_text)) for s in said)
