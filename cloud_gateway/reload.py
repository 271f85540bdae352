"""The cloud gateway loads what changed in its models folder without a restart.

On SIGHUP (as agents reload) or a router's ``CloudGateway.Reload`` (``stratus fleet reload
--cloud``), it re-reads the folder, loads and warms new or changed variants, and stops
announcing those gone; work in flight on a replaced variant finishes on it
(:meth:`stratus.execution.local_models.LocalModels.reload`). A folder that no longer loads leaves the old set
serving. Either way one log line says what changed, or why nothing did.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from stratus.convert.work import Reloaded, reloaded_to_wire
from stratus.errors import ConfigError, PermissionDenied, Unauthenticated
from stratus.execution.local_models import LocalModels
from stratus.process import start_collapsed
from stratus.serving.auth import caller_certificate, is_loopback_peer, same_secret
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc

log = logging.getLogger("stratus.cloud")

# Certificate roles that may reload a gateway under mutual TLS: its routers, and operators.
RELOADERS = frozenset({"router", "operator"})


def _served(models: LocalModels) -> list[str]:
    generators = models.generators
    return sorted({*models.served, *(generators.variants if generators is not None else ())})


def _runners(models: LocalModels) -> dict[str, object]:
    generators = models.generators
    return {**models.runners, **(generators.runners if generators is not None else {})}


def what_changed(before: list[str], after: list[str], replaced: list[str]) -> str:
    """What a reload did, for its log line and answer: "added x; removed y; reloaded z"."""
    parts = [
        f"{label} {', '.join(names)}"
        for label, names in (
            ("added", sorted(set(after) - set(before))),
            ("removed", sorted(set(before) - set(after))),
            ("reloaded", replaced),
        )
        if names
    ]
    return "; ".join(parts) if parts else "nothing changed"


class Reloader:
    """One reload at a time, whether a SIGHUP's or a router's."""

    def __init__(self, models: LocalModels | None) -> None:
        self._models = models
        self._lock = asyncio.Lock()
        self._pending: set[asyncio.Task[Reloaded]] = set()

    def on_hangup(self) -> None:
        if self._models is None:
            log.warning(
                "SIGHUP ignored: this gateway serves only its upstream's family, from no models folder"
            )
            return
        if not start_collapsed(self._pending, self.reload, name="stratus-cloud-reload"):
            log.info("SIGHUP: a reload is already waiting; this one joins it")

    async def reload(self) -> Reloaded:
        models = self._models
        if models is None:
            raise ConfigError("this gateway serves only its upstream's family: it has no models to reload")
        async with self._lock:
            before, runners = _served(models), _runners(models)
            try:
                after = await models.reload()
            except Exception as exc:  # any failure to load must leave the gateway serving
                message = f"reload failed; still serving {', '.join(before)}: {exc}"
                log.error("%s", message)
                return Reloaded(ok=False, message=message, variants=tuple(before))
            now = _runners(models)
            replaced = sorted(n for n in after if n in runners and now.get(n) is not runners[n])
            message = f"reloaded {models.repository.root}: {what_changed(before, after, replaced)}"
            log.info("%s; serving %s", message, ", ".join(after))
            return Reloaded(ok=True, message=message, variants=tuple(after))

    async def close(self) -> None:
        for task in self._pending:
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)


class GatewayServicer(fpb_grpc.CloudGatewayServicer):
    """Reload for a gateway's router or operator: the client token where the gateway has one,
    a router's or operator's certificate under mutual TLS, and with neither, loopback only."""

    def __init__(
        self,
        reloader: Reloader,
        *,
        client_token: str,
        mutual_tls: bool,
        trust_domain: str = "stratus",
        off_loopback: bool = False,
    ) -> None:
        self._reloader = reloader
        self._off_loopback = off_loopback  # then no caller counts as local (a proxy may front it)
        self._expected = f"Bearer {client_token}" if client_token else ""
        self._mutual_tls = mutual_tls
        self._trust_domain = trust_domain

    async def Reload(self, request: fpb.GatewayReloadRequest, context: Any) -> fpb.ReloadResponse:
        self._authorize(context)
        return reloaded_to_wire(await self._reloader.reload())

    def _authorize(self, context: Any) -> None:
        if self._mutual_tls:
            cert = caller_certificate(context, self._trust_domain)
            if cert is None or cert.role not in RELOADERS:
                shown = f"this one is {cert}" if cert else "this one has no Stratus identity"
                raise PermissionDenied(f"Reload needs a router's or operator's certificate; {shown}")
        if self._expected:
            presented = dict(context.invocation_metadata() or ()).get("authorization", "")
            if not isinstance(presented, str) or not same_secret(presented, self._expected):
                raise Unauthenticated(
                    "Reload needs 'authorization: Bearer TOKEN' (the gateway's client token)"
                )
        if not (self._mutual_tls or self._expected) and self._off_loopback:
            raise PermissionDenied(
                "Reload: this gateway listens off loopback and has no credential for it; behind a local "
                "proxy or sidecar every caller would look local: give it --client-token-file or mutual TLS"
            )
        if not (self._mutual_tls or self._expected) and not is_loopback_peer(context.peer()):
            raise PermissionDenied(
                f"Reload from {context.peer()}: this gateway has no credential for it, so only callers "
                "on its own machine may reload it; give it --client-token-file or mutual TLS"
            )
