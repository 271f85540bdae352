"""The Fleet service: status for operators, a stream of changes, Drain, reloads and rollouts (whose
requests are read against the fleet in router/api/rollout_requests.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from router.api.accuracy import accuracy_reply
from router.api.fleet_status import fleet_status
from router.api.rollout_requests import plan_status, rollout_tier, start_plan
from router.audit.auditor import Auditor
from router.cloud.pool import CloudTier
from router.fleet.agent_handle import AgentHandle
from router.fleet.registry import MAX_RELOAD_WAIT_S, FleetRegistry
from router.offline.corrections import CorrectionLog
from router.rollout.plans import Rollouts
from router.site.mirror import SiteMirror
from router.thresholds.pushes import ThresholdPushes, steer, to_wire
from stratus.convert.work import Reloaded, reloaded_to_wire
from stratus.errors import ConfigError, InvalidInput
from stratus.serving.auth import RouterCredentials
from stratus.serving.client_limits import client_of
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc

# A watcher gets at most this many updates a second, however fast the fleet changes (a
# thousand agents rejoining after a restart would otherwise mean a thousand statuses).
WATCH_MIN_GAP_S = 0.5
# A Watch event is serialized once per watcher, every half second: its listing is kept to this
# (80 watchers of a 3.9 MB status stalled the router's loop for 2.6 s).
MAX_WATCH_STATUS_BYTES = 1024 * 1024


class FleetServicer(fpb_grpc.FleetServicer):
    def __init__(
        self,
        registry: FleetRegistry,
        cloud: CloudTier | None,
        *,
        credentials: RouterCredentials | None = None,
        private_status: bool = False,
        rollouts: Rollouts | None = None,
        audits: Auditor | None = None,
        pushes: ThresholdPushes | None = None,
        site: SiteMirror | None = None,
        corrections: CorrectionLog | None = None,
    ) -> None:
        self._site = site  # --site-state: changes are written there (router/site/mirror.py)
        self._corrections = corrections  # the cloud's verdicts on provisional answers (router/offline)
        self._audits = audits
        self._pushes = pushes or ThresholdPushes(router_id="router")
        self._registry = registry
        self._cloud = cloud
        self._credentials = credentials or RouterCredentials()
        self._private_status = private_status  # Status, Watch and rollout status need an operator
        self._rollouts = rollouts or Rollouts(router_id="router")
        # Watch's shared status, by what it lists (include_agents, include_families)
        self._built: dict[tuple[bool, bool], tuple[float, fpb.FleetStatus]] = {}

    def _authorize(self, token: str, context: Any, what: str) -> None:
        self._credentials.require_operator(token, context, what)

    def _authorize_read(self, token: str, context: Any, what: str) -> None:
        if self._private_status:
            self._authorize(token, context, what)

    async def Status(self, request: fpb.FleetStatusRequest, context: Any) -> fpb.FleetStatus:
        self._authorize_read(request.token, context, "Status")
        return fleet_status(
            self._registry,
            self._cloud,
            include_agents=request.include_agents,
            include_families=request.include_families,
            rollouts=self._rollouts,
            site=self._site,
        )

    async def Watch(self, request: fpb.FleetWatchRequest, context: Any) -> AsyncIterator[fpb.FleetEvent]:
        """A status now, then one on every change (at most every WATCH_MIN_GAP_S, changes in
        between folded into one), and at least every heartbeat interval."""
        self._authorize_read(request.token, context, "Watch")
        changes = self._registry.watch(
            address=client_of(context.peer()), operator=self._credentials.is_operator(request.token, context)
        )
        try:
            while True:
                yield fpb.FleetEvent(
                    status=self._shared_status(request.include_agents, request.include_families)
                )
                await asyncio.sleep(WATCH_MIN_GAP_S)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._registry.heartbeat_s):
                        await changes.get()
        finally:
            self._registry.unwatch(changes)

    def _shared_status(self, include_agents: bool, include_families: bool = False) -> fpb.FleetStatus:
        """One status for every watcher that asks within half a gap: building it costs
        O(fleet), and forty watchers used to build forty every half second."""
        now = time.monotonic()
        key = (include_agents, include_families)
        built = self._built.get(key)
        if built is None or now - built[0] >= WATCH_MIN_GAP_S / 2:
            status = fleet_status(
                self._registry,
                self._cloud,
                include_agents=include_agents,
                include_families=include_families,
                rollouts=self._rollouts,
                max_bytes=MAX_WATCH_STATUS_BYTES,
                site=self._site,
            )
            # Stamped when built, not when asked: a build slower than half a gap would otherwise
            # be redone by every watcher in turn (80 watchers, 80 builds a round).
            built = (time.monotonic(), status)
            self._built[key] = built
        return built[1]

    async def Accuracy(self, request: fpb.AccuracyRequest, context: Any) -> fpb.AccuracyReply:
        self._authorize_read(request.token, context, "Accuracy")
        if self._audits is None:
            raise ConfigError("this router runs no audits")
        reply = accuracy_reply(self._audits, request.family, include_agents=request.include_agents)
        record = self._pushes.record(request.family)
        if record is not None:
            reply.pushed.CopyFrom(to_wire(record.current))
        return reply

    async def Drain(self, request: fpb.DrainRequest, context: Any) -> fpb.DrainResponse:
        self._authorize(request.token, context, "Drain")
        handle = await self._mark(request.agent_id, "drained", self._registry.drain)
        return fpb.DrainResponse(accepted=True, message=f"agent {handle.id} is draining{self._site_wide}")

    async def Undrain(self, request: fpb.DrainRequest, context: Any) -> fpb.DrainResponse:
        self._authorize(request.token, context, "Undrain")
        handle = await self._mark(request.agent_id, "ready", self._registry.undrain)
        return fpb.DrainResponse(accepted=True, message=f"agent {handle.id} is ready again{self._site_wide}")

    async def Forget(self, request: fpb.DrainRequest, context: Any) -> fpb.DrainResponse:
        self._authorize(request.token, context, "Forget")
        handle = await self._mark(request.agent_id, "forgotten", self._registry.forget)
        return fpb.DrainResponse(accepted=True, message=f"agent {handle.id} is forgotten{self._site_wide}")

    async def Revoke(self, request: fpb.RevokeRequest, context: Any) -> fpb.RevokeReply:
        """A credential revoked (or lifted) for every router of the site, or the list of them."""
        if not request.credential:
            self._authorize_read(request.token, context, "listing revocations")
            return self._revocations("")
        self._authorize(request.token, context, "lifting a revocation" if request.lift else "Revoke")
        if self._site is None:
            raise ConfigError(
                "site-wide revocations are kept in the site's store and this router has none (--site-state): "
                "list the certificate in its --revoked-certificates file, or delete the agent's line from "
                "--agent-tokens-file"
            )
        if request.lift:
            lifted = await self._site.lift(request.credential)
            return self._revocations(f"{lifted} is trusted again on every router of the site")
        made = await self._site.revoke(request.credential, by=request.author, reason=request.reason)
        return self._revocations(
            f"{made.credential} is revoked on every router of the site ({self._site.state.url}): its calls "
            "are refused and an agent holding it is cut off at its next heartbeat"
        )

    async def Corrections(self, request: fpb.CorrectionsRequest, context: Any) -> AsyncIterator[fpb.Correction]:
        """The provisional answers the cloud disagreed with, from ``since_unix`` on; with
        ``follow``, then each new one until the caller cancels."""
        self._credentials.require_answers_reader(request.token, context, "Corrections")
        if self._corrections is None:
            raise ConfigError(
                "this router defers nothing and so keeps no corrections: start it with --state-dir "
                "(and give the families [offline] defer = true)"
            )
        if not math.isfinite(request.since_unix) or request.since_unix < 0:
            raise InvalidInput(f"since_unix must be a time in seconds since the epoch, not {request.since_unix}")
        reading = self._corrections.read(since_unix=request.since_unix, family=request.family, follow=request.follow)
        async for correction in reading:
            yield correction

    def _revocations(self, message: str) -> fpb.RevokeReply:
        listed = self._site.revocations.listed() if self._site is not None else []
        return fpb.RevokeReply(
            revoked=[fpb.Revocation(credential=r.credential, by=r.by, at=r.at, reason=r.reason) for r in listed],
            message=message,
        )

    async def _mark(self, agent_id: str, mark: str, apply: Callable[[str], AgentHandle]) -> AgentHandle:
        """Here alone, or, with a site store, written there for every router first."""
        if self._site is None:
            return apply(agent_id)
        return await self._site.mark_agent(agent_id, mark, lambda: apply(agent_id))

    @property
    def _site_wide(self) -> str:
        return f" on every router of the site ({self._site.state.url})" if self._site is not None else ""

    async def Reload(self, request: fpb.ReloadRequest, context: Any) -> fpb.ReloadResponse:
        self._authorize(request.token, context, "Reload")
        timeout_s = request.timeout_s if request.timeout_s > 0 else 120.0
        handle, problem = await self._registry.reload(request.agent_id, timeout_s)
        served = tuple(sorted(handle.variants))
        message = f"agent {handle.id}: {problem}" if problem else f"agent {handle.id} reloaded"
        return reloaded_to_wire(Reloaded(ok=not problem, message=message, variants=served))

    async def ReloadCloud(self, request: fpb.CloudReloadRequest, context: Any) -> fpb.ReloadResponse:
        self._authorize(request.token, context, "ReloadCloud")
        if self._cloud is None:
            raise ConfigError("this router runs without a cloud (--cloud): there is no cloud to reload")
        timeout_s = min(request.timeout_s if request.timeout_s > 0 else 120.0, MAX_RELOAD_WAIT_S)
        answer = await self._cloud.reload(timeout_s=timeout_s)
        if answer.ok:
            await self._cloud.learn_now()  # so a request for what it just loaded finds it now
        return reloaded_to_wire(answer)

    async def Rollout(self, request: fpb.RolloutRequest, context: Any) -> fpb.RolloutReply:
        action = request.action
        if action == fpb.ROLLOUT_ACTION_STATUS:
            self._authorize_read(request.token, context, "rollout status")
            plans = [p for p in self._rollouts.plans() if not request.family or p.family == request.family]
            return fpb.RolloutReply(rollouts=[plan_status(self._registry, self._rollouts, p) for p in plans])
        self._authorize(request.token, context, "changing a rollout")
        tier = rollout_tier(request.tier)
        if action == fpb.ROLLOUT_ACTION_START:
            make = functools.partial(start_plan, self._registry, self._rollouts, request, tier)
        elif action == fpb.ROLLOUT_ACTION_PROMOTE:
            make = functools.partial(self._rollouts.promote, request.family, tier)
        elif action == fpb.ROLLOUT_ACTION_ABORT:
            make = functools.partial(self._rollouts.abort, request.family, tier)
        else:
            raise InvalidInput(f"unknown rollout action {action}")
        plan = await self._site.change_rollout(request.family, tier, make) if self._site is not None else make()
        return fpb.RolloutReply(
            rollouts=[plan_status(self._registry, self._rollouts, plan)], message=plan.reason
        )

    async def Thresholds(self, request: fpb.ThresholdsRequest, context: Any) -> fpb.ThresholdsReply:
        if request.action == fpb.THRESHOLDS_ACTION_STATUS:
            self._authorize_read(request.token, context, "threshold status")
            rows = self._audits.rows.rows if self._audits is not None else None
            answer = steer(self._pushes, self._registry, request, rows)
            if request.include_rows:
                answer.router_id = self._rollouts.router_id
                answer.site_routers = ",".join(self._site.other_routers()) if self._site is not None else ""
            return answer
        self._authorize(request.token, context, "pushing thresholds")
        change = functools.partial(steer, self._pushes, self._registry, request)
        return await self._site.change_thresholds(request.family, change) if self._site is not None else change()

