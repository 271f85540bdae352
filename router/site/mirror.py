"""This router's view of the site's store: what it watched, kept in memory where the request
path reads it, and the changes made here written back with compare-and-swap.

Its keys, and what each holds, are :mod:`router.site.keys`'s.

An operator's change (a rollout started, promoted or aborted, a threshold push or revert, a
drain) is made here, then written with the revision this router last saw of its key: if
another router changed the key first the write loses, the change is undone here and the
operator is told FAILED_PRECONDITION naming the revision it lost to; if the store cannot be
reached it is undone too, UNAVAILABLE naming the store. What the rollout judge decides on
its own (a step advanced, a candidate rolled back) is written in the background, retried
while the store is away; where it loses, the store's record is taken. The writing is
:mod:`router.site.writer`'s; the mirror makes the changes and applies. Every change any
router makes reaches every other through the watch, in the store's order, which is the
site's order: the watch is the only way state changes here besides this router's own writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar

from router.fleet.agent_handle import AgentHandle
from router.fleet.registry import FleetRegistry
from router.rollout.plan import Plan
from router.rollout.plans import Rollouts
from router.site import Entry, SiteState, StoreConflict, StoreUnavailable
from router.site.keys import (
    agent_key,
    json_bytes,
    plan_bytes,
    revoked_key,
    rollout_key,
    router_key,
    thresholds_key,
)
from router.site.lease import Lease
from router.site.writer import RETRY_S, SiteWriter
from router.thresholds.pushes import Record, ThresholdPushes
from stratus.errors import ConfigError, InvalidInput, NotFound
from stratus.serving.revocations import (
    MAX_CREDENTIAL,
    Revoked,
    SiteRevocations,
    parse_credential,
)
from stratus.tiers import Tier

log = logging.getLogger("stratus.site")

T = TypeVar("T")
MARKS: Final = ("drained", "ready", "forgotten")
JUDGE_LEASE: Final = "lease.judge"
# A router's registration is renewed this often; one older than MEMBER_STALE_S is gone.
MEMBER_EVERY_S: Final = 10.0
MEMBER_STALE_S: Final = 3 * MEMBER_EVERY_S
MAX_ADDRESS: Final = 300
# How long a starting router waits for the store, so that what the site agreed on (a drain, a
# push, a rollout) applies before its first call; past it, it serves and catches up when it can.
START_WAIT_S: Final = 5.0


class SiteMirror:
    """Owned by the router's event loop; ``start`` loads and watches, ``close`` stops."""

    def __init__(
        self,
        state: SiteState,
        *,
        rollouts: Rollouts,
        pushes: ThresholdPushes,
        registry: FleetRegistry,
        router_id: str,
        lease_s: float = 15.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state = state
        self._rollouts, self._pushes, self._registry = rollouts, pushes, registry
        self.router_id = router_id
        self.address = ""  # where the site reaches this router: set before start
        self._lease_s, self._clock = lease_s, clock
        self._lease: Lease | None = None
        self.members: dict[str, tuple[str, float]] = {}  # per router key: (address, when registered)
        self.revisions: dict[str, int] = {}  # per key, the revision last applied or written here
        self.marks: dict[str, str] = {}  # per agent id, the site's mark
        self.revocations = SiteRevocations()  # what the store revokes, checked on every call
        self._writer = SiteWriter(state, self.revisions, apply=self.apply)
        self._tasks: list[asyncio.Task[None]] = []
        rollouts.on_change = self._judged
        pushes.on_change = self._pushed
        registry.site_mark = self.marks.get
        rollouts.judging_here = self.judges_here

    async def start(self) -> None:
        await self.state.start()
        await self._load()
        self._tasks = [
            asyncio.create_task(self._watch(), name="stratus-site-watch"),
            asyncio.create_task(self._writer.run(), name="stratus-site-writer"),
        ]
        if self.state.shared:
            self._lease = Lease(self.state, JUDGE_LEASE, self.router_id, ttl_s=self._lease_s)
            self._tasks += [
                asyncio.create_task(self._lease.run(), name="stratus-site-judge-lease"),
                asyncio.create_task(self._register(), name="stratus-site-member"),
            ]

    async def _load(self) -> None:
        """Every live entry applied now, within START_WAIT_S (the watch then skips what it has)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_WAIT_S
        while not self.state.connected and loop.time() < deadline:
            await asyncio.sleep(0.05)
        try:
            entries = await self.state.entries("")
        except StoreUnavailable as exc:
            log.warning("serving before the site's state is read (%s); it applies once the store answers", exc)
            return
        for entry in entries:
            self.apply(entry)

    async def close(self) -> None:
        """Stop following the store; the lease is released (a successor takes it at once) and
        this router's registration deleted, each where the store still answers."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.state.shared:
            with contextlib.suppress(StoreUnavailable, StoreConflict):
                await self.state.delete(router_key(self.router_id))
        await self.state.close()

    # -- the site's routers, and the one that judges ----------------------------------------------
    def judges_here(self) -> bool:
        """Whether this router judges rollout steps and steps --auto-thresholds now: a lone
        router's store (a file) always; a shared one while this router holds the lease."""
        if not self.state.shared:
            return True
        return self._lease is not None and self._lease.held

    def judge(self) -> str:
        """For `fleet status`: who judges the site's rollouts, as this router knows it."""
        if not self.state.shared:
            return "this router (a lone router's store)"
        return "this router" if self.judges_here() else "another router of the site (the lease is not held here)"

    def other_routers(self) -> list[str]:
        """The addresses the site's other routers registered, fresh ones only, sorted."""
        now = self._clock()
        mine = router_key(self.router_id)
        return sorted(
            address for key, (address, at) in self.members.items() if key != mine and now - at < MEMBER_STALE_S
        )

    async def _register(self) -> None:
        """This router's address in the store, renewed while it runs (no compare-and-swap: the
        key is this router's alone, and the latest write is the truth)."""
        key = router_key(self.router_id)
        while True:
            value = json_bytes({"address": self.address, "at": self._clock()})
            try:
                await self.state.put(key, value)
            except StoreUnavailable as exc:
                log.debug("site registration not renewed: %s", exc)
            await asyncio.sleep(MEMBER_EVERY_S)

    # -- operator changes ----------------------------------------------------------------------
    async def change_rollout(self, family: str, tier: Tier, make: Callable[[], Plan]) -> Plan:
        """A rollout change made here and written; undone here when the write fails."""
        before = self._rollouts.snapshot(family, tier)
        return await self._writer.change(
            rollout_key(family, tier), make, plan_bytes, lambda: self._rollouts.restore(family, tier, before)
        )

    async def change_thresholds(self, family: str, make: Callable[[], T]) -> T:
        before = self._pushes.record(family)
        return await self._writer.change(
            thresholds_key(family),
            make,
            lambda _: self._record_bytes(family),
            lambda: self._pushes.restore(family, before),
        )

    async def mark_agent(self, agent_id: str, mark: str, apply: Callable[[], AgentHandle]) -> AgentHandle:
        """An operator's drain, undrain or forget: written for the site first, then made here."""
        key = agent_key(agent_id)
        expected = self.revisions.get(key, 0)
        handle = self._registry.check_mark(agent_id, mark)  # refused here before anything is written
        value = json_bytes({"mark": mark, "by": self.router_id, "at": time.time()})
        await self._writer.put(key, value, expected)
        self.marks[agent_id] = mark
        try:
            return apply()
        except (NotFound, ConfigError):  # the store's echo of this very write was applied first
            return handle

    async def revoke(self, credential: str, *, by: str, reason: str) -> Revoked:
        """An operator's revocation, written for the site; applied here once written (the
        watch brings it to every other router)."""
        revoked = Revoked(credential=parse_credential(credential), by=by[:MAX_CREDENTIAL], at=time.time(),
                          reason=reason[:MAX_CREDENTIAL])  # fmt: skip
        key = revoked_key(revoked.credential)
        await self._writer.put(key, json_bytes(dataclasses.asdict(revoked)))
        self.revocations.put(key, revoked)
        return revoked

    async def lift(self, credential: str) -> str:
        """An operator's lifting of a site-wide revocation: NotFound if the site has none."""
        credential = parse_credential(credential)
        key = revoked_key(credential)
        if not any(r.credential == credential for r in self.revocations.listed()):
            raise NotFound(f"{credential} is not revoked site-wide (`stratus fleet revoke --list`)")
        await self.state.delete(key)
        self.revocations.remove(key)
        return credential

    # -- changes made here on their own, which the writer writes in the background -------------
    def _judged(self, plan: Plan) -> None:
        self._writer.later(rollout_key(plan.family, plan.tier), lambda: plan_bytes(plan))

    def _pushed(self, family: str) -> None:
        self._writer.later(thresholds_key(family), lambda: self._record_bytes(family))

    def _record_bytes(self, family: str) -> bytes:
        record = self._pushes.record(family)
        assert record is not None
        return json_bytes(record.to_json())

    # -- what the store says -----------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            try:
                async for entry in self.state.watch(""):
                    self.apply(entry)
            except StoreUnavailable as exc:
                log.warning("site state watch: %s; retrying in %.0f s", exc, RETRY_S)
            except Exception:  # one bad round must not end the site's watch for good
                log.exception("site state watch failed; retrying in %.0f s", RETRY_S)
            await asyncio.sleep(RETRY_S)

    def apply(self, entry: Entry) -> None:
        """One entry of the store, applied here unless this router has it already. An entry
        that does not parse is logged and skipped: one bad record must not stop the rest."""
        if entry.revision <= self.revisions.get(entry.key, 0):
            return
        self.revisions[entry.key] = entry.revision
        if entry.deleted:
            self.members.pop(entry.key, None)
            self.revocations.remove(entry.key)
            return
        kind, _, rest = entry.key.partition(".")
        try:
            data = json.loads(entry.value)
            if kind == "rollout":
                self._rollouts.adopt(Plan.from_json(data))
            elif kind == "thresholds":
                self._pushes.adopt(Record.from_json(data))
            elif kind == "agent":
                self._apply_mark(rest, data)
            elif kind == "router":
                self._apply_member(entry.key, data)
            elif kind == "revoked":
                self._apply_revoked(entry.key, data)
        except (ValueError, KeyError, TypeError, AttributeError, ConfigError, InvalidInput) as exc:
            log.warning(
                "site state %s (revision %d) is not valid and was skipped: %s", entry.key, entry.revision, exc
            )

    def _apply_mark(self, agent_id: str, data: dict[str, Any]) -> None:
        mark = data["mark"]
        if mark not in MARKS:
            raise ValueError(f"unknown mark {mark!r}")
        self.marks[agent_id] = mark
        with contextlib.suppress(NotFound, ConfigError):  # not linked here, or already so: nothing to do
            {
                "drained": self._registry.drain,
                "ready": self._registry.undrain,
                "forgotten": self._registry.forget,
            }[mark](agent_id)

    def _apply_revoked(self, key: str, data: dict[str, Any]) -> None:
        credential = parse_credential(str(data["credential"]))
        if revoked_key(credential) != key:
            raise ValueError(f"it revokes {credential[:80]!r}, which is not the credential its key names")
        self.revocations.put(
            key,
            Revoked(credential=credential, by=str(data.get("by", ""))[:MAX_CREDENTIAL], at=float(data.get("at", 0.0)),
                    reason=str(data.get("reason", ""))[:MAX_CREDENTIAL]),
        )  # fmt: skip

    def _apply_member(self, key: str, data: dict[str, Any]) -> None:
        address, at = str(data["address"]), float(data["at"])
        if not address or len(address) > MAX_ADDRESS or ":" not in address:
            raise ValueError(f"{address[:40]!r} is not HOST:PORT")
        self.members[key] = (address, at)
