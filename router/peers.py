"""Sharing rollout state with the other routers of a site.

Each router sends every peer what it knows (the JSON document it persists) and adopts
whatever the peer answers that is newer, per family and tier: at once after a change here,
and every SYNC_S seconds otherwise, so a router that restarted or missed a change catches
up within one interval. ``dns:NAME:PORT`` is resolved at every round, so peers that come
and go (a Deployment scaled, a pod replaced) are found; this router's own address in the
list is recognised by its id in the answer and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from router.rollout import Rollouts
from router.thresholds import ThresholdPushes
from stratus.errors import StratusError
from stratus.serving.channels import NO_TLS, TlsSettings, open_channel, server_options
from stratus.serving.discovery import addresses_of, server_name_of
from stratus.serving.sync_proofs import SYNC_ANSWER, SYNC_REQUEST, proof_holds, sync_proof
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc

log = logging.getLogger("stratus.peers")

SYNC_S = 1.0
CALL_TIMEOUT_S = 2.0


def sync_parts(message: fpb.RolloutSync) -> tuple[str, ...]:
    """What a rollout sync's proof covers: who sent it and everything it says."""
    return (message.router_id, message.state_json, message.thresholds_json)


class RolloutPeers:
    """Both directions are authenticated: with a peer token each side sends a proof over its
    message (the answer's covering the request's proof), never the token, so an impostor
    learns nothing; under mutual TLS the certificates do it."""

    def __init__(
        self,
        rollouts: Rollouts,
        peers: str,
        *,
        tls: TlsSettings = NO_TLS,
        token: str = "",
        changed: asyncio.Event | None = None,
        pushes: ThresholdPushes | None = None,
    ) -> None:
        self.rollouts = rollouts
        self.pushes = pushes or ThresholdPushes(router_id=rollouts.router_id)
        self.peers = peers
        self.tls = tls
        self.token = token
        self.changed = changed or asyncio.Event()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._self: set[str] = set()  # addresses that answered with our own id

    async def run(self) -> None:
        try:
            while True:
                self.changed.clear()
                try:
                    await self.sync_once()
                except Exception:  # one bad exchange must never end the site's syncing for good
                    log.exception("rollout sync failed; trying again in %.0f s", SYNC_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), timeout=SYNC_S)
        finally:
            for channel in self._channels.values():
                await channel.close()

    async def sync_once(self) -> None:
        try:
            addresses = await addresses_of(self.peers)
        except OSError as exc:
            log.warning("cannot resolve peers %s: %s", self.peers, exc)
            return
        await asyncio.gather(*(self._exchange(a) for a in addresses if a not in self._self))

    async def _exchange(self, address: str) -> None:
        channel = self._channels.get(address)
        if channel is None:
            named = server_options("router", self.tls, server_name_of(self.peers))
            channel = self._channels[address] = open_channel(address, self.tls, extra_options=named)
        mine = fpb.RolloutSync(
            router_id=self.rollouts.router_id,
            state_json=self.rollouts.to_json(),
            thresholds_json=self.pushes.to_json(),
        )
        if self.token:
            mine.token = sync_proof(self.token, SYNC_REQUEST, *sync_parts(mine))
        try:
            theirs = await fpb_grpc.FleetStub(channel).SyncRollouts(mine, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.debug("peer %s: %s", address, exc.code().name)
            return
        # the proof first: any responder could echo our id and stop our syncs with that address
        if self.token and not proof_holds(self.token, SYNC_ANSWER, theirs.token, mine.token, *sync_parts(theirs)):
            log.warning("peer %s answered without proof of the peer token; its state is ignored", address)
            return
        if theirs.router_id == self.rollouts.router_id:
            self._self.add(address)
            return
        try:
            self.rollouts.merge_json(theirs.state_json)
            self.pushes.merge_json(theirs.thresholds_json)
        except StratusError as exc:
            log.warning("peer %s sent rollout state this router cannot read: %s", address, exc)
