"""Each part of a router, built from its settings: the site's state, rollouts, threshold
pushes and steps, the cloud link, the auditor and its capture, the offline store, and the
credentials callers are held to. :func:`router.app.serve` wires them together; each builder
here knows one part's flags, so the order of the start reads in one place and its parts in
another."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from router.api.fleet_status import rollout_levels
from router.api.openai.door import check_listen, server_tls
from router.audit.auditor import Auditor
from router.audit.capture import CaptureHook
from router.cloud.link import CloudLink
from router.cloud.models import parse_cloud_models
from router.cloud.pool import CloudPool, CloudTier
from router.fleet.registry import FleetRegistry
from router.offline import Offline, OfflineSettings
from router.rollout.plan import ROLLED_BACK, Plan
from router.rollout.plans import Rollouts
from router.settings import RouterSettings
from router.site.mirror import SiteMirror
from router.site.open import open_site_state
from router.thresholds.auto import AutoThresholds, auto_levels
from router.thresholds.pushes import ThresholdPushes
from stratus.convert.fleet import family_from_wire, family_to_wire
from stratus.errors import ConfigError
from stratus.families.description import FamilyDescription, described
from stratus.families.repository import ModelRepository
from stratus.obs.metrics import Metrics, RouterMetrics
from stratus.serving.auth import RouterCredentials
from stratus.serving.revocations import AnyRevoked


def offline(
    settings: RouterSettings,
    registry: FleetRegistry,
    metrics: tuple[Metrics, RouterMetrics],
    capture: CaptureHook | None,
    site: SiteMirror | None,
    *,
    cloud: Callable[[], CloudTier | None],
) -> Offline | None:
    """Deferred requests, corrections and decision records: in the site's NATS where the router
    shares one (any router of the site judges them), else under --state-dir; neither: none."""
    shared = site.state if site is not None and site.state.shared else None
    if settings.state_dir is None and shared is None:
        if settings.decision_log is not None:
            raise ConfigError("--decision-log needs --state-dir or a nats:// --site-state (where offline state is kept)")
        return None
    store, sink = None, None
    if shared is not None:
        from router.site.deferred import NatsCorrections, NatsDeferredStore
        from router.site.nats import NatsSiteState

        assert isinstance(shared, NatsSiteState)  # the one shared kind of store
        store, sink = NatsDeferredStore(shared), NatsCorrections(shared)
    offline = OfflineSettings(
        state_dir=settings.state_dir,
        adjudicate_share=settings.adjudicate_share,
        decision_log=settings.decision_log,
        decision_log_share=settings.decision_log_share,
    )
    return Offline(offline, router="router", cloud=cloud, describe=registry.family, metrics=metrics,
                   labels=capture, store=store, sink=sink)  # fmt: skip


def with_site_revocations(credentials: RouterCredentials, site: SiteMirror | None) -> RouterCredentials:
    """The site's revocations (`fleet revoke`) checked beside the router's own file: a revoked
    certificate on every call and link under mutual TLS, a revoked agent id in any mode."""
    if site is None:
        return credentials
    lists = [r for r in (credentials.revoked, site.revocations) if r is not None]
    return replace(credentials, revoked=AnyRevoked(lists), revoked_agent=site.revocations.agent_revoked)


def credentials(settings: RouterSettings) -> RouterCredentials:
    """Everything that refuses a setting runs before anything starts, so a bad one binds no port."""
    credentials = settings.credentials()
    settings.check_exposure(credentials)
    settings.check_site_state()
    if settings.openai:
        check_listen(settings.openai, settings.openai_api_key)
        server_tls(settings.openai_tls_cert, settings.openai_tls_key)  # a bad pair stops it here
    return credentials


def auditor(
    settings: RouterSettings,
    registry: FleetRegistry,
    cloud: CloudPool | None,
    recorder: RouterMetrics,
    rollouts: Rollouts,
) -> tuple[Auditor, CaptureHook | None]:
    """The background audits, and where they keep items under --capture. Audits are a
    rollout's evidence too: a step on a tier with a tier above waits for each arm's."""
    wanted = settings.capture.resolved()
    capture = CaptureHook(wanted, recorder) if wanted is not None else None
    audits = Auditor(
        registry, cloud, policy=settings.audit, metrics=recorder, capture=capture, rollouts=rollouts
    )
    rollouts.auditable = lambda family, tier: (top := audits.top_of(family)) is not None and top > tier
    return audits, capture


def cloud(settings: RouterSettings, registry: FleetRegistry) -> CloudPool | None:
    """A link to each cloud gateway (router/cloud/pool.py), which learns what it serves for
    the families agents bring."""
    if not settings.cloud:
        return None
    headers = (
        *settings.all_cloud_headers(),
        *((("authorization", f"Bearer {settings.cloud_token}"),) if settings.cloud_token else ()),
    )
    named = parse_cloud_models(settings.cloud_models)

    def link(address: str, server_name: str | None) -> CloudLink:
        return CloudLink(
            address,
            tls=settings.tls,
            headers=headers,
            named=named,
            families=lambda: registry.families,
            server_name=server_name,
        )

    return CloudPool(settings.cloud, link, named=named)


def rollouts(settings: RouterSettings, metrics: Metrics, recorder: RouterMetrics) -> Rollouts:
    rollouts = Rollouts(router_id=settings.name)
    rollouts.listeners.append(lambda plan, why: _count_rollback(recorder, rollouts, plan))
    metrics.collect_with(lambda: rollout_levels(rollouts))
    return rollouts


def own_families(folder: Path) -> dict[str, FamilyDescription]:
    """Each family of the operator's models folder as an agent's Hello would describe it."""
    repository = ModelRepository.load(folder)
    return {name: family_from_wire(family_to_wire(described(spec))) for name, spec in repository.families.items()}


def site_mirror(
    settings: RouterSettings, rollouts: Rollouts, pushes: ThresholdPushes, registry: FleetRegistry
) -> SiteMirror | None:
    """The site's store (--site-state), mirrored here: None without one."""
    if not settings.site_state:
        return None
    # tls://: the store's server holds a certificate of the fleet CA, and this router shows its own
    tls = settings.tls if settings.site_state.startswith("tls://") else None
    state = open_site_state(settings.site_state, tls=tls, creds=settings.site_state_creds)
    return SiteMirror(
        state,
        rollouts=rollouts,
        pushes=pushes,
        registry=registry,
        router_id=settings.name or "",
        lease_s=settings.site_lease_s,
    )


def threshold_pushes(settings: RouterSettings, registry: FleetRegistry) -> ThresholdPushes:
    """The pushed thresholds, in force as the site's store gives them (before any agent links)."""
    pushes = ThresholdPushes(router_id=settings.name)
    pushes.listeners.append(registry.override_thresholds)
    return pushes


def auto_thresholds(
    settings: RouterSettings,
    pushes: ThresholdPushes,
    registry: FleetRegistry,
    audits: Auditor,
    metrics: Metrics,
    *,
    site: SiteMirror | None,
) -> asyncio.Task[None] | None:
    """The --auto-thresholds controller, where the operator asks for one: on a site, stepping
    only while this router holds the site's judge lease."""
    if not settings.auto_thresholds.enabled:
        return None

    def chosen() -> dict[str, str]:
        return {name: info.audit.auto for name, info in registry.families.items() if info.audit.auto}

    here = site.judges_here if site is not None else (lambda: True)
    auto = AutoThresholds(settings.auto_thresholds, pushes, registry, audits.rows.rows, chosen, here=here)
    metrics.collect_with(lambda: auto_levels(auto))
    return asyncio.create_task(auto.run(), name="stratus-auto-thresholds")


def _count_rollback(recorder: RouterMetrics, rollouts: Rollouts, plan: Plan) -> None:
    """A rollback decided here (not one adopted from a peer) counts once, by what was worse."""
    if plan.state != ROLLED_BACK or plan.origin != rollouts.router_id:
        return
    detail = plan.reason.split(": ", 1)[-1]
    reason = next((r for r in ("errors", "p99", "unsure", "agreement") if detail.startswith(r)), "other")
    recorder.rollbacks.labels(plan.family, plan.tier.label, reason).inc()


