"""``--auto-thresholds``: a router that moves a family's thresholds toward what its audits suggest.

Off by default, and per family. Every ``interval_s`` the controller asks calibrate's chooser
(``stratus.families.suggest``) for the family's goal on this router's audit rows,
and pushes one bounded step toward it (``stratus fleet thresholds`` versions, author "auto",
so every step is logged, written to the site's store, shown in ``fleet accuracy`` and undone by
``--revert``):

* each threshold moves at most ``max_step`` per interval;
* only upward (more escalation, so more accuracy at more cost): a suggestion to *lower* a
  threshold is held for an operator, who approves it by pushing it
  (``stratus fleet thresholds FAMILY --suggest --apply``);
* never to where the audit rows say the share of requests reaching the cloud would pass
  ``max_cloud_share`` (the step is then not taken, and counted as capped).

Which families, and toward which goal, the operator names (``digits=target_accuracy:0.98``),
or lets the families choose: with ``families`` in the list, each family whose files name a goal
(``[audit] auto = "target_accuracy 0.98"``) steps toward it, a goal named on the router winning.
Each interval's outcome per family is counted (``stratus_router_threshold_auto_total``).
On a site whose routers share a store, it steps only on the router holding the site's judge
lease (``router/site/lease.py``), so a family is never stepped twice an interval, and moves to
another router within the lease's ttl when that one dies; it judges that router's own rows.
A family's files alone never start one: the router's flag does.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from prometheus_client.core import CounterMetricFamily

from router.thresholds.pushes import FamilyThresholds, ThresholdPushes
from stratus.errors import ConfigError
from stratus.families.audit import goal_problem
from stratus.families.suggest import AuditRow, audit_scores, cascade, goal_of, suggest
from stratus.obs.metrics import Metric
from stratus.tiers import Tier

log = logging.getLogger("stratus.thresholds.auto")

STEPPED: Final = "stepped"
HELD: Final = "held_for_approval"  # the suggestion lowers a threshold: an operator's call
CAPPED: Final = "capped"  # the step would send more than max_cloud_share to the cloud
IN_LINE: Final = "in_line"  # the thresholds in force are the suggestion
WAITING: Final = "waiting"  # no suggestion yet (too few rows, or none that reaches the goal)
# In --auto-thresholds: every family whose [audit] auto names a goal steps toward it.
FAMILIES: Final = "families"


@dataclass(frozen=True, kw_only=True)
class AutoPolicy:
    """Which families step by themselves, toward which goal, how far and how often."""

    # --auto-thresholds as given: "digits=target_accuracy:0.98,defects=max_escalation:0.05",
    # with "families" among them for the goals the families' [audit] auto name.
    goals: str = ""
    max_step: float = 0.02
    max_cloud_share: float = 0.25
    interval_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0.0 < self.max_step <= 1.0 or not 0.0 <= self.max_cloud_share <= 1.0:
            raise ConfigError("--auto-max-step lies in (0, 1] and --auto-max-cloud-share in [0, 1]")
        if self.interval_s <= 0:
            raise ConfigError("--auto-interval is a number of seconds above 0")
        for family, goal in self.by_family.items():
            if goal_problem(goal) is not None:
                raise ConfigError(
                    f"--auto-thresholds {family}: '{goal}' is not target_accuracy A or max_escalation S"
                )

    @functools.cached_property
    def by_family(self) -> dict[str, str]:
        """Each family's goal, as calibrate writes it ("target_accuracy 0.98")."""
        return parse_goals(self.goals)

    @property
    def from_families(self) -> bool:
        """Whether families choose their own goals (``families`` in --auto-thresholds)."""
        return FAMILIES in (p.strip() for p in self.goals.split(","))

    @property
    def enabled(self) -> bool:
        return bool(self.by_family) or self.from_families

    def goals_with(self, chosen: Mapping[str, str]) -> dict[str, str]:
        """The goals in force: the families' own (``chosen``, where they may choose), the
        router's named goals over them."""
        return {**(chosen if self.from_families else {}), **self.by_family}


def parse_goals(text: str) -> dict[str, str]:
    """``digits=target_accuracy:0.98,defects=max_escalation:0.05`` as goals by family
    (``families`` is a switch, not a goal: see :attr:`AutoPolicy.from_families`)."""
    goals: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if part == FAMILIES:
            continue
        family, _, goal = part.partition("=")
        name, _, value = goal.partition(":")
        if not family or not value:
            raise ConfigError(
                f"--auto-thresholds: '{part}' is not FAMILY=target_accuracy:A or FAMILY=max_escalation:S"
            )
        goals[family] = f"{name} {value}"
    return goals


@dataclass(frozen=True, kw_only=True)
class Step:
    """One interval's decision for a family: what to push (None: nothing) and why."""

    outcome: str
    thresholds: dict[Tier, float] | None = None
    reason: str = ""


def plan_step(
    current: Mapping[Tier, float],
    suggested: Mapping[Tier, float],
    *,
    max_step: float,
    max_cloud_share: float,
    cloud_share: Callable[[Mapping[Tier, float]], float],
) -> Step:
    """Each threshold at most ``max_step`` toward the suggestion, upward only; none past the
    cloud share cap (``cloud_share`` predicts it for thresholds, from the audit rows)."""
    stepped = dict(current)
    lowered = [tier for tier, value in suggested.items() if value < current.get(tier, 0.0) - 1e-9]
    for tier, value in suggested.items():
        now = current.get(tier, 0.0)
        if value > now + 1e-9:
            stepped[tier] = round(min(value, now + max_step), 4)
    if stepped == dict(current):
        held = ", ".join(f"{t.label} {current.get(t, 0.0):.4f} -> {suggested[t]:.4f}" for t in lowered)
        return (
            Step(outcome=HELD, reason=f"lower thresholds wait for an operator: {held}")
            if lowered
            else Step(outcome=IN_LINE)
        )
    share = cloud_share(stepped)
    if share > max_cloud_share + 1e-12:
        return Step(
            outcome=CAPPED, reason=f"the step would send {share:.1%} to the cloud, past {max_cloud_share:.1%}"
        )
    moved = ", ".join(
        f"{t.label} {current.get(t, 0.0):.4f} -> {v:.4f}" for t, v in stepped.items() if v != current.get(t)
    )
    return Step(outcome=STEPPED, thresholds=stepped, reason=f"auto step: {moved}")


class AutoThresholds:
    """The background controller; ``counts`` by (family, outcome) for the metric."""

    def __init__(
        self,
        policy: AutoPolicy,
        pushes: ThresholdPushes,
        registry: FamilyThresholds,
        rows: Callable[[str], Sequence[AuditRow]],
        chosen: Callable[[], Mapping[str, str]] = dict,
        *,
        here: Callable[[], bool] = lambda: True,
    ) -> None:
        """``chosen``: each served family's own goal ([audit] auto), read at every interval;
        ``here``: whether this router steps now (it holds the site's judge lease)."""
        self.policy = policy
        self._here = here
        self._pushes = pushes
        self._registry = registry
        self._rows = rows
        self._chosen = chosen
        self.counts: Counter[tuple[str, str]] = Counter()

    def goals(self) -> dict[str, str]:
        return self.policy.goals_with(self._chosen())

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.policy.interval_s)
            if not self._here():
                continue
            for family, goal in sorted(self.goals().items()):
                self.step_once(family, goal)

    def step_once(self, family: str, goal: str | None = None) -> Step:
        """Look at the audits once and take (or not) one step toward ``goal`` (default: the
        one in force for the family); the outcome is counted."""
        goal = goal or self.goals()[family]
        step = self._decide(family, goal)
        self.counts[(family, step.outcome)] += 1
        if step.thresholds is not None:
            self._pushes.apply(family, step.thresholds, author="auto", reason=f"{step.reason} (toward {goal})")
        elif step.reason:  # held or capped: the operator's to see; waiting: every interval until rows come
            log.log(
                logging.DEBUG if step.outcome == WAITING else logging.INFO,
                "thresholds of %s: %s",
                family,
                step.reason,
            )
        return step

    def _decide(self, family: str, goal: str) -> Step:
        rows = self._rows(family)
        target, share = goal_of(goal)
        try:
            suggestion = suggest(rows, target_accuracy=target, max_escalation=share)
        except ConfigError as exc:
            return Step(outcome=WAITING, reason=str(exc))
        scores = audit_scores(rows)
        below = [s.tier for s in scores[:-1]]
        top = scores[-1].tier

        def cloud_share(thresholds: Mapping[Tier, float]) -> float:
            reached = cascade(scores, [thresholds.get(t, 0.0) for t in below]).reached
            return reached[-1] if top is Tier.CLOUD else 0.0

        current = {t: v for t, v in self._registry.thresholds(family).items() if t in below}
        return plan_step(
            current,
            suggestion.thresholds,
            max_step=self.policy.max_step,
            max_cloud_share=self.policy.max_cloud_share,
            cloud_share=cloud_share,
        )


def auto_levels(auto: AutoThresholds) -> list[Metric]:
    """Each family's controller outcomes so far, by outcome."""
    counter = CounterMetricFamily(
        "stratus_router_threshold_auto",
        "Intervals of the --auto-thresholds controller per family, by outcome (stepped, held_for_approval, "
        "capped, in_line, waiting).",
        labels=["family", "outcome"],
    )
    for (family, outcome), count in sorted(auto.counts.items()):
        counter.add_metric([family, outcome], float(count))
    return [counter]
