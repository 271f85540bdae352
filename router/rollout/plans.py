"""Gray release: a candidate variant takes a growing share of one tier's traffic.

A rollout names a family, a tier and a candidate line (an FP32 variant that agents of
that tier serve beside the current one, in whatever precision they chose for it). Each
step sends the step's share of the tier's requests for that family to the candidate and
judges it against the current variant over the same window, once each has served
``min_requests``:

* more errors than the current variant beyond ``max_error_increase`` (absolute share),
* a p99 latency above ``max_p99_ratio`` times the current one (and ``p99_slack_ms`` more),
* more unsure answers (items that had to escalate) beyond ``max_unsure_increase``,
* a lower agreement with the family's top tier, from the audits (router.audit.auditor), which ask the
  top tier about both arms' settled answers at a raised share while a step is judged. A model
  wrong and sure of itself has no more errors, latency or unsure answers than a good one,
  and looked better on those alone. Where a tier above audits the rollout's tier, a step
  waits for ``min_audits`` of each arm, then advances only once the candidate's agreement is
  surely within ``max_disagreement_increase`` of the current's, and rolls back once it is
  surely lower at all; in between it waits, looking again at 1.5 times the audits
  (router.rollout.judge.agreement_verdict says what that costs and catches),

and any of them rolls it back to 0% at once, saying which and by how much. Shares are
compared with their sampling noise: a share rolls back only when even the lower end of a
one-sided 95% interval for (candidate - current) is past the margin, so two equal models
judged on a hundred requests each do not trip on a couple of unlucky items, while a clearly
worse one (65% unsure against 2%) is caught at the first judgement. A candidate
no worse moves to the next step; the last step is where it stays (100%: complete) until
an operator promotes it (its line becomes what the tier serves, here) or aborts it.

The plan (:mod:`router.rollout.plan`, not the windows) is the state that matters: every change
is written to the site's store (``router/site/mirror.py``: a file for a lone router, NATS
JetStream for a site), so it survives a restart and every router of the site sends the same
shares. Every router measures the requests it routes; on a site, only the router holding the
site's judge lease judges (``judging_here``), so one decision is made at a time, and the store
orders them.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

from router.rollout.judge import AUDIT_LOOK_GROWTH, ArmWindow, Margins, judge
from router.rollout.plan import (
    ABORTED,
    COMPLETE,
    DEFAULT_MIN_AUDITS,
    DEFAULT_STEPS,
    MAX_HISTORY,
    MAX_TEXT,
    PROMOTED,
    ROLLED_BACK,
    RUNNING,
    Plan,
    check_steps,
)
from stratus.errors import Conflict, InvalidInput, NotFound
from stratus.tiers import Tier

log = logging.getLogger("stratus.rollout")

# Judging sorts the window; at most this often per rollout, however busy the router.
JUDGE_EVERY_S: Final = 0.05
# Rollouts one router keeps (at most ~50 KiB each); records past it (from the site's store)
# are not adopted. A site's store holds one per family and tier being rolled out, far fewer.
MAX_PLANS: Final = 1024


# ---------------------------------------------------------------------------------------------
# Every rollout this router knows
# ---------------------------------------------------------------------------------------------


@dataclass
class _Live:
    """A rollout's plan and this router's evidence for its current step."""

    plan: Plan
    current: ArmWindow = field(default_factory=ArmWindow)
    candidate: ArmWindow = field(default_factory=ArmWindow)
    shadow_items: int = 0
    shadow_agreed: int = 0
    judged_at: float = 0.0
    audits_wanted: int = 0  # of each arm before agreement is next looked at (0: the plan's)


Listener = Callable[[Plan, str], None]


class Rollouts:
    """The rollouts one router applies and judges. Owned by its event loop."""

    def __init__(
        self,
        *,
        router_id: str,
        rng: random.Random | None = None,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.router_id = router_id
        self._rng = rng or random.Random()
        self._wall = wall_clock
        self._clock = clock
        self._live: dict[tuple[str, Tier], _Live] = {}
        self.listeners: list[Listener] = []  # told of every change: (plan, "why")
        # Told of each change made here (an operator's, the judge's), to write to the site's store.
        self.on_change: Callable[[Plan], None] | None = None
        # Whether a tier of a family has a tier above that audits it (the auditor says):
        # there a step waits for each arm's audits, elsewhere requests alone decide.
        self.auditable: Callable[[str, Tier], bool] = lambda family, tier: False
        # Whether this router judges steps now: on a site, while it holds the judge lease.
        self.judging_here: Callable[[], bool] = lambda: True

    # -- operator actions ------------------------------------------------------------------
    def start(
        self,
        family: str,
        tier: Tier,
        candidate: str,
        *,
        steps: Sequence[float] = DEFAULT_STEPS,
        min_requests: int = 100,
        min_audits: int = DEFAULT_MIN_AUDITS,
        shadow: float = 0.0,
        margins: Margins | None = None,
    ) -> Plan:
        live = self._live.get((family, tier))
        if live is not None and live.plan.state == RUNNING:
            raise Conflict(
                f"a rollout of {live.plan.candidate} on the {tier.label} tier of '{family}' is running; "
                "promote or abort it first"
            )
        if min_requests < 1 or not 0 <= shadow <= 100:
            raise InvalidInput("min_requests must be at least 1 and shadow a percent between 0 and 100")
        plan = Plan(
            family=family,
            tier=tier,
            candidate=candidate,
            steps=check_steps(steps),
            min_requests=min_requests,
            min_audits=min_audits,
            shadow=shadow,
            margins=margins or Margins(),
            state=COMPLETE if len(steps) == 1 else RUNNING,
            revision=(live.plan.revision + 1) if live else 1,
        )
        return self._change(plan, f"started by an operator at {plan.steps[0]:g}%", new=True)

    def promote(self, family: str, tier: Tier) -> Plan:
        plan = self.plan(family, tier)
        if plan.state not in (RUNNING, COMPLETE):
            raise InvalidInput(
                f"the rollout of {plan.candidate} is {plan.state}; only a live one is promoted"
            )
        return self._change(replace(plan, state=PROMOTED), "promoted by an operator: 100% from now on")

    def abort(self, family: str, tier: Tier) -> Plan:
        plan = self.plan(family, tier)
        if plan.state in (ROLLED_BACK, ABORTED):
            raise InvalidInput(f"the rollout of {plan.candidate} is already {plan.state}")
        return self._change(replace(plan, state=ABORTED), "aborted by an operator: back to 0%")

    # -- reads ---------------------------------------------------------------------------------
    def plan(self, family: str, tier: Tier) -> Plan:
        live = self._live.get((family, tier))
        if live is None:
            raise NotFound(f"no rollout on the {tier.label} tier of '{family}'")
        return live.plan

    def plans(self) -> list[Plan]:
        return [self._live[key].plan for key in sorted(self._live)]

    def evidence(self, family: str, tier: Tier) -> tuple[ArmWindow, ArmWindow, int, int]:
        live = self._live[(family, tier)]
        return live.current, live.candidate, live.shadow_items, live.shadow_agreed

    # -- the data plane's calls, per request ---------------------------------------------------
    def arm(self, family: str, tier: Tier) -> tuple[Plan, bool] | None:
        """For a request about to run on ``tier``: the rollout there, and whether this one
        goes to its candidate (by the step's share). None when there is none."""
        live = self._live.get((family, tier)) if self._live else None
        if live is None or live.plan.state in (ROLLED_BACK, ABORTED):
            return None
        share = live.plan.share
        return live.plan, share >= 100.0 or self._rng.random() * 100.0 < share

    def shadow_wanted(self, plan: Plan) -> bool:
        return plan.judging and plan.shadow > 0 and self._rng.random() * 100.0 < plan.shadow

    def record(
        self, plan: Plan, *, candidate: bool, ok: bool, latency_ms: float, items: int, unsure: int
    ) -> None:
        """One attempt on the rollout's tier; a step whose evidence suffices is judged."""
        live = self._live.get(plan.key)
        if live is None or live.plan is not plan:  # the plan changed while the request ran
            return
        (live.candidate if candidate else live.current).add(
            ok=ok, latency_ms=latency_ms, items=items, unsure=unsure
        )
        if plan.judging:
            self._judge_at_most_every(live)

    def record_audit(self, plan: Plan, *, candidate: bool, agreed: bool) -> None:
        """One audited answer of an arm: the family's top tier answered it alike, or not."""
        live = self._live.get(plan.key)
        if live is None or live.plan is not plan or not plan.judging:  # the step moved on since
            return
        (live.candidate if candidate else live.current).add_audit(agreed=agreed)
        self._judge_at_most_every(live)

    def _judge_at_most_every(self, live: _Live) -> None:
        """Judge the step on new evidence, at most every JUDGE_EVERY_S (judging sorts the window)."""
        now = self._clock()
        if now - live.judged_at >= JUDGE_EVERY_S and self.judging_here():
            live.judged_at = now
            self._judge(live)

    def record_shadow(self, plan: Plan, agreed: int, items: int) -> None:
        live = self._live.get(plan.key)
        if live is not None and live.plan is plan:
            live.shadow_items += items
            live.shadow_agreed += agreed

    def _judge(self, live: _Live) -> None:
        plan = live.plan
        min_audits = max(plan.min_audits, live.audits_wanted) if self.auditable(plan.family, plan.tier) else 0
        verdict = judge(
            live.current,
            live.candidate,
            min_requests=plan.min_requests,
            margins=plan.margins,
            min_audits=min_audits,
        )
        if verdict.inconclusive:  # looked at these audits: the next look needs more of them
            audited = min(live.current.audited, live.candidate.audited)
            live.audits_wanted = max(audited + 1, math.ceil(audited * AUDIT_LOOK_GROWTH))
        if verdict.action == "wait":
            return
        share = plan.share
        if verdict.action == "rollback":
            self._change(replace(plan, state=ROLLED_BACK), f"rolled back at {share:g}%: {verdict.reason}")
            return
        step = plan.step + 1
        state = COMPLETE if step == len(plan.steps) - 1 else RUNNING
        self._change(
            replace(plan, step=step, state=state),
            f"advanced from {share:g}% to {plan.steps[step]:g}%: {verdict.reason}",
        )

    # -- changes ---------------------------------------------------------------------------------
    def _change(self, plan: Plan, why: str, *, new: bool = False) -> Plan:
        previous = self._live.get(plan.key)
        history = () if new or previous is None else previous.plan.history
        plan = replace(
            plan,
            reason=why[:MAX_TEXT],
            revision=(previous.plan.revision + 1) if previous else plan.revision,
            updated=self._wall(),
            origin=self.router_id,
            history=(*history, why[:MAX_TEXT])[-MAX_HISTORY:],
        )
        self._adopt(plan)
        log.info("rollout of %s on %s/%s: %s", plan.candidate, plan.family, plan.tier.label, why)
        if self.on_change is not None:
            self.on_change(plan)
        return plan

    # -- the site's store (router/site/mirror.py) ------------------------------------------------
    def adopt(self, plan: Plan) -> None:
        """A record from the site's store: the site's order is the store's, so it is taken
        whatever its revision (a record that lost a compare-and-swap never gets there)."""
        if plan.key not in self._live and len(self._live) >= MAX_PLANS:
            log.warning("rollout of %r on %r not adopted: %d rollouts kept already", plan.candidate, plan.family, MAX_PLANS)
            return
        self._adopt(plan)

    def snapshot(self, family: str, tier: Tier) -> _Live | None:
        """What :meth:`restore` puts back: a change refused by the store is undone whole."""
        return self._live.get((family, tier))

    def restore(self, family: str, tier: Tier, live: _Live | None) -> None:
        if live is None:
            self._live.pop((family, tier), None)
        else:
            self._live[(family, tier)] = live

    def _adopt(self, plan: Plan) -> None:
        """Make ``plan`` the live one; a new step (or state) starts a new window."""
        live = self._live.get(plan.key)
        fresh = live is None or (live.plan.step, live.plan.state, live.plan.candidate) != (
            plan.step,
            plan.state,
            plan.candidate,
        )
        if fresh:
            self._live[plan.key] = _Live(plan=plan)
        else:
            assert live is not None
            live.plan = plan
        for listener in self.listeners:
            listener(plan, plan.reason)
