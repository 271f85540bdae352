"""The SDK's local variants and thresholds kept to what the router serves.

The SDK answers each family with the line the router serves that family's device tier with
(``stratus.current.device`` in its ModelConfig: a promoted rollout's candidate, else the
agents' current variant) where this models folder holds it, and judges its answers by the
threshold the router uses for that tier (``stratus.threshold.device``: a fleet-wide push wins
over the folder's family.toml). :class:`RouterFollower` asks on ``Client.wait_ready`` and then,
every ``FOLLOW_EVERY_S``, at the next call; a router that does not say (or none reachable)
changes nothing, and a line this folder does not hold is logged once and left.
"""

from __future__ import annotations

import logging
import time

import grpc

from edge_agent.sdk_routers import Metadata, Routers, status_of
from stratus.convert.parameters import CONFIG_CURRENT, CONFIG_THRESHOLD
from stratus.execution.local_models import LocalModels
from stratus.families.confidence import threshold_problem
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

log = logging.getLogger("stratus.sdk")

# How often the local variants are checked against what the router serves (at the next call).
FOLLOW_EVERY_S = 30.0
# The longest a check may wait for a router's answer (it runs inside a call when due).
FOLLOW_TIMEOUT_S = 1.0
UNREACHED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class RouterFollower:
    """Which line answers each family here, and by which threshold, as the routers say."""

    def __init__(
        self, models: LocalModels, routers: Routers, metadata: Metadata, *, enabled: bool
    ) -> None:
        self._models, self._routers, self._metadata = models, routers, metadata
        self._enabled = enabled  # a client with no router has none to follow
        self._follow_at = 0.0  # when the local variants are next checked against the router's
        self._missing: dict[str, str] = {}  # family -> a line the router serves that is not here
        self._thresholds: dict[str, float] = {}  # family -> the router's threshold for its tier here

    def due(self) -> bool:
        return self._enabled and time.monotonic() >= self._follow_at

    def threshold(self, family: str) -> float | None:
        """The router's threshold for this tier's answers of ``family``, where it said one."""
        return self._thresholds.get(family)

    def follow(self) -> dict[str, str]:
        """Serve each family here with the line the router serves its tier with by default
        (a promoted rollout's candidate, else its agents' current variant), where this
        models folder has that line; returns the lines now current here, by family.

        Called by ``Client.wait_ready``, and by a call when the last look is ``FOLLOW_EVERY_S``
        old; a router that does not say (or none reachable) changes nothing."""
        self._follow_at = time.monotonic() + FOLLOW_EVERY_S
        for family in self._families():
            for address in self._routers.fresh():
                stub = pb_grpc.GRPCInferenceServiceStub(self._routers.channel(address))
                try:
                    config = stub.ModelConfig(
                        pb.ModelConfigRequest(name=family), timeout=FOLLOW_TIMEOUT_S, metadata=self._metadata
                    ).config
                except grpc.RpcError as exc:
                    self._unanswered(address, exc)
                    continue
                self._apply(config, family=family)
                break
        return self.current_lines()

    async def afollow(self) -> dict[str, str]:
        """:meth:`follow` on the caller's event loop."""
        self._follow_at = time.monotonic() + FOLLOW_EVERY_S
        for family in self._families():
            for address in self._routers.fresh():
                stub = pb_grpc.GRPCInferenceServiceStub(self._routers.achannel(address))
                try:
                    answer = await stub.ModelConfig(
                        pb.ModelConfigRequest(name=family), timeout=FOLLOW_TIMEOUT_S, metadata=self._metadata
                    )
                except grpc.aio.AioRpcError as exc:
                    self._unanswered(address, exc)
                    continue
                self._apply(answer.config, family=family)
                break
        return self.current_lines()

    def current_lines(self) -> dict[str, str]:
        """The line (FP32 variant name) answering each family here now."""
        lines = {}
        for family in self._families():
            variant = self._models.variant_for(family)[1]
            lines[family] = variant.parent or variant.name
        return lines

    def _families(self) -> list[str]:
        """The families answered here (those with a current variant loaded)."""
        models = self._models
        return sorted({models.variants[name].family for name in models.current})

    def _unanswered(self, address: str, exc: grpc.RpcError) -> None:
        """A router that cannot be reached is skipped for a while (the next family's look
        and the next escalation go elsewhere); one that answered an error was reached."""
        if status_of(exc)[0] in UNREACHED:
            self._routers.failed(address)

    def _apply(self, config: pb.ModelConfig, *, family: str) -> None:
        tier = self._models.variant_for(family)[1].tier
        self._follow_threshold(config, family=family, tier=tier)
        wanted = config.parameters.get(CONFIG_CURRENT + tier.label)
        if wanted is None or not wanted.string_value or wanted.string_value == self.current_lines()[family]:
            return
        line = wanted.string_value
        if self._models.follow(family, tier, line):
            log.info("%s: answering with %s here, as the router serves the %s tier", family, line, tier.label)
        elif self._missing.get(family) != line:  # said once per line
            self._missing[family] = line
            log.warning(
                "%s: the router serves the %s tier with %s, which %s does not hold: answering with %s here",
                family, tier.label, line, self._models.repository.root, self.current_lines()[family],
            )  # fmt: skip

    def _follow_threshold(self, config: pb.ModelConfig, *, family: str, tier: Tier) -> None:
        """Judge this tier's answers by the threshold the router uses for it (a fleet-wide push
        wins over this folder's family.toml), where the router says one."""
        said = config.parameters.get(CONFIG_THRESHOLD + tier.label)
        try:
            value = float(said.string_value) if said is not None else None
        except ValueError:
            value = None
        if value is None or threshold_problem(value) is not None:  # PASS_ALL is one: every answer climbs
            self._thresholds.pop(family, None)
            return
        if self._thresholds.get(family) != value:
            log.info("%s: judging %s answers here by the router's threshold %g", family, tier.label, value)
        self._thresholds[family] = value
