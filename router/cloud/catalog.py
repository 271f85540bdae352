"""What the cloud serves, learnt over the router's link to it: ``CloudCatalog`` is the part
of :class:`router.cloud.link.CloudLink` that asks (RepositoryIndex, ModelReady, ModelMetadata,
ModelConfig) when the link opens and whenever agents bring families it did not know, and
keeps the answers (which request names the cloud serves, under which names, answered by
which variant, and which generate text). :mod:`router.cloud.models` decides from them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence

import grpc

from router.cloud.models import Found, NamedModel, answered_by, descriptions, generates, probe_names, routes
from stratus.convert.fleet import tensor_specs
from stratus.convert.parameters import VARIANT
from stratus.families.description import FamilyDescription
from stratus.families.generation import MAX_TOKENS, GenerationMethod
from stratus.families.spec import GenerationSpec
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

log = logging.getLogger("stratus.cloud-link")

Families = Callable[[], Mapping[str, FamilyDescription]]
Headers = tuple[tuple[str, str], ...]
# How often the link looks for families that agents brought since it last learnt, and for
# models it was told of but did not find (a server that listens before its models load).
FAMILIES_POLL_S = 0.5
MISSING_POLL_S = 1.0
MAX_MISSING_POLL_S = 30.0
# And at least this often whatever changed here: a gateway reloaded with SIGHUP (rather than
# through `stratus fleet reload --cloud`, which makes the router learn at once) is caught so.
RELEARN_S = 30.0
# Codes that mean the cloud cannot be reached now, not that it refused what it was asked.
LINK_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
UNDECLARED_MAX_TOKENS = 16  # a text model whose config names no max_tokens: OpenAI's default


class CloudCatalog:
    """The models the cloud serves, as the link last learnt them (``CloudLink`` holds the
    state and the channel; this part asks and keeps the answers)."""

    address: str
    server: str  # "name version", as its ServerMetadata said when the link last opened
    models: dict[str, bool]
    wire_names: dict[str, str]  # a request's model -> the name the cloud serves it under
    variants: dict[str, str]  # a request's model -> what answers it there (fleet status)
    generative: dict[str, FamilyDescription]  # the cloud's text models, as families
    described: dict[str, FamilyDescription]  # each name in ``models`` as the cloud describes it
    _headers: Headers
    _named: tuple[NamedModel, ...]
    _families: Families
    _learnt_for: frozenset[str] | None

    async def _follow_families(self, stub: pb_grpc.GRPCInferenceServiceAsyncStub) -> None:
        """Learn again when agents have brought families the last learning did not know, or
        while a family or a named model was not found there: after MISSING_POLL_S, then
        twice as long each time nothing new turns up (a server that listens before its
        models load is caught at once; one that never serves a family is asked rarely)."""
        interval, waited, since = MISSING_POLL_S, 0.0, 0.0
        while True:
            await asyncio.sleep(FAMILIES_POLL_S)
            waited += FAMILIES_POLL_S
            since += FAMILIES_POLL_S
            changed = frozenset(self._families()) != self._learnt_for
            if not changed and not (self._missing() and waited >= interval) and since < RELEARN_S:
                continue
            before, waited, since = self.wire_names, 0.0, 0.0
            try:
                await self._learn_models(stub)
            except grpc.aio.AioRpcError as exc:
                log.info("cloud %s: learning its models again failed (%s)", self.address, exc.code().name)
            same = self.wire_names == before and not changed
            interval = min(interval * 2, MAX_MISSING_POLL_S) if same else MISSING_POLL_S

    def _missing(self) -> bool:
        wanted = {*self._families(), *(entry.name for entry in self._named)}
        return not wanted <= set(self.wire_names)

    async def _learn_models(self, stub: pb_grpc.GRPCInferenceServiceAsyncStub) -> None:
        """What the cloud serves for each family, and which of it generates text (so that a
        router with no agent for a generative family still serves it, the OpenAI API too)."""
        families = dict(self._families())
        listed = await self._listed(stub)
        # All at once: over a slow link to the cloud, one round trip per model in turn adds up.
        probed = await asyncio.gather(
            *(self._probe(stub, name, listed) for name in probe_names(families, self._named, listed))
        )
        found = [entry for entry in probed if entry is not None]
        wire, refused = routes(found, families, self._named)
        self.generative = await self._generative(stub, found)
        if wire != self.wire_names or self._learnt_for is None:  # said once per change
            for reason in refused:
                log.warning("cloud %s: passed over %s", self.address, reason)
            log.info(
                "cloud %s serves %s", self.address, ", ".join(f"{k}->{v}" for k, v in sorted(wire.items()))
            )
        self.wire_names = wire
        self.described = descriptions(found, wire, self.generative)
        self.variants = answered_by(wire, await self._variants(stub, set(wire.values())))
        self.models = dict.fromkeys(wire, True)
        self._learnt_for = frozenset(families)

    async def _variants(self, stub: pb_grpc.GRPCInferenceServiceAsyncStub, names: set[str]) -> dict[str, str]:
        """The variant a Stratus gateway answers each model with (its ModelConfig's
        ``stratus.variant``); nothing from other servers, which name no variants."""
        if self.server.split(" ")[0] != "stratus":
            return {}
        configs = await asyncio.gather(
            *(stub.ModelConfig(pb.ModelConfigRequest(name=n), timeout=2.0, metadata=self._headers) for n in sorted(names)),
            return_exceptions=True,
        )
        return {
            name: config.config.parameters[VARIANT].string_value
            for name, config in zip(sorted(names), configs, strict=True)
            if isinstance(config, pb.ModelConfigResponse) and VARIANT in config.config.parameters
        }

    async def _listed(self, stub: pb_grpc.GRPCInferenceServiceAsyncStub) -> dict[str, bool]:
        """RepositoryIndex's names (ready or not), or none where the cloud restricts it
        (PyTriton without its token) or has none (KServe)."""
        try:
            index = await stub.RepositoryIndex(
                pb.RepositoryIndexRequest(ready=True), timeout=2.0, metadata=self._headers
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in LINK_DOWN and "restricted" not in (exc.details() or ""):
                raise
            log.info("cloud %s: no repository index (%s: %s)", self.address, exc.code().name, exc.details())
            return {}
        return {model.name: model.state == "READY" for model in index.models}

    async def _probe(
        self, stub: pb_grpc.GRPCInferenceServiceAsyncStub, name: str, listed: Mapping[str, bool]
    ) -> Found | None:
        """A model the cloud listed as ready, or says is ready, with its description."""
        if not (listed.get(name) or await self._ready(stub, name)):
            return None
        return Found(name=name, metadata=await self._metadata(stub, name))

    async def _ready(self, stub: pb_grpc.GRPCInferenceServiceAsyncStub, name: str) -> bool:
        """ModelReady; a model the cloud does not know (NOT_FOUND, or MLServer's UNKNOWN) is not."""
        try:
            answer = await stub.ModelReady(
                pb.ModelReadyRequest(name=name), timeout=2.0, metadata=self._headers
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in LINK_DOWN:
                raise
            return False
        return bool(answer.ready)

    async def _metadata(
        self, stub: pb_grpc.GRPCInferenceServiceAsyncStub, name: str
    ) -> pb.ModelMetadataResponse | None:
        try:
            return await stub.ModelMetadata(
                pb.ModelMetadataRequest(name=name), timeout=2.0, metadata=self._headers
            )
        except grpc.aio.AioRpcError as exc:  # a server that will not describe a model
            if exc.code() in LINK_DOWN:
                raise
            log.info("cloud %s: no description of %s (%s)", self.address, name, exc.code().name)
            return None

    async def _generative(
        self, stub: pb_grpc.GRPCInferenceServiceAsyncStub, found: Sequence[Found]
    ) -> dict[str, FamilyDescription]:
        """The cloud's text models as families, with the max_tokens their configs declare."""
        text = [entry for entry in found if entry.metadata is not None and generates(entry.metadata)]
        described = await asyncio.gather(*(self._text_family(stub, entry) for entry in text))
        return {info.name: info for info in described}

    async def _text_family(self, stub: pb_grpc.GRPCInferenceServiceAsyncStub, entry: Found) -> FamilyDescription:
        assert entry.metadata is not None
        try:
            config = await stub.ModelConfig(
                pb.ModelConfigRequest(name=entry.name), timeout=2.0, metadata=self._headers
            )
            max_tokens = _max_tokens(config.config)
        except grpc.aio.AioRpcError:
            max_tokens = UNDECLARED_MAX_TOKENS
        return FamilyDescription(
            name=entry.name,
            inputs=tensor_specs(entry.metadata.inputs),
            outputs=tensor_specs(entry.metadata.outputs),
            generation=GenerationSpec(max_tokens=max_tokens, stop=(), method=GenerationMethod.MEAN_LOGPROB),
        )


def _max_tokens(config: pb.ModelConfig) -> int:
    """The ``max_tokens`` a generative model's config declares (a Stratus cloud gateway
    does); otherwise OpenAI's default for completions, 16."""
    parameter = config.parameters.get(MAX_TOKENS)
    try:
        declared = int(parameter.string_value) if parameter is not None else 0
    except ValueError:
        declared = 0
    return declared if declared > 0 else UNDECLARED_MAX_TOKENS
