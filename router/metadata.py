"""What the router tells a client of a model: ModelMetadata and Triton's ModelConfig, from the
one description the catalog holds (a variant's are its family's; a model only the cloud
serves, the cloud's own), and for a family, which variants may be pinned, the line each tier
serves it with by default, and its thresholds."""

from __future__ import annotations

from router.catalog import Catalog
from router.cloud.models import family_of
from router.fleet.registry import FleetRegistry
from router.rollout.plan import PROMOTED
from router.rollout.plans import Rollouts
from stratus.convert.fleet import tensor_metadata
from stratus.convert.parameters import CONFIG_CURRENT, CONFIG_THRESHOLD, CONFIG_VARIANTS, MODEL_VERSION
from stratus.convert.text import generative_config, generative_metadata
from stratus.execution.dataplane import model_config
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb


def metadata_of(catalog: Catalog, name: str) -> pb.ModelMetadataResponse:
    """The family's tensors (a variant's are its family's); a model only the cloud serves,
    the cloud's own. One version, as on every Stratus server: variants are models."""
    family, _ = catalog.family_of(name)
    info = catalog.description(family)
    if info is not None and info.generative and family in catalog.registry.families:
        return generative_metadata(name, "stratus")  # the layout its ModelConfig says
    response = pb.ModelMetadataResponse(name=name, versions=[MODEL_VERSION], platform="stratus")
    if info is not None:
        response.inputs.extend(tensor_metadata(info.inputs))
        response.outputs.extend(tensor_metadata(info.outputs))
    return response


def config_of(catalog: Catalog, rollouts: Rollouts, name: str) -> pb.ModelConfig:
    """Triton's config from the same description as the metadata; a family's also says
    which variants may be pinned and which line each tier serves it with by default."""
    family, pinned = catalog.family_of(name)
    generative = catalog.generative(family)
    spec = catalog.description(family)
    if generative is not None:  # with the max_tokens a request may ask for, as the cloud says it
        config = generative_config(name, "stratus", generative.max_tokens)
    elif spec is not None and not spec.generative:
        config = model_config(spec, name, "stratus")
    else:
        config = pb.ModelConfig(name=name, platform="stratus", backend="stratus")
    if pinned is None and family_of(family, catalog.registry.families) in (None, family):
        _describe_lines(catalog, rollouts, config, family)  # a family, not a variant only the cloud serves
    return config


def _describe_lines(catalog: Catalog, rollouts: Rollouts, config: pb.ModelConfig, family: str) -> None:
    """A family's config parameters: its pinnable variants, each tier's current line, its thresholds."""
    variants = catalog.registry.index.variants_of(family)
    if (cloud_tier := catalog.cloud) is not None:
        cloud = [n for n in cloud_tier.models if n != family and family_of(n, [family]) == family]
        variants = sorted({*variants, *cloud})
    if variants:
        config.parameters[CONFIG_VARIANTS].string_value = ",".join(variants)
    for tier, line in current_lines(catalog.registry, rollouts, family).items():
        config.parameters[CONFIG_CURRENT + tier.label].string_value = line
    for tier, threshold in catalog.registry.thresholds(family).items():
        config.parameters[CONFIG_THRESHOLD + tier.label].string_value = repr(float(threshold))


def current_lines(registry: FleetRegistry, rollouts: Rollouts, family: str) -> dict[Tier, str]:
    """The line each agents' tier serves ``family`` with by default: a promoted rollout's
    candidate, else the current variant of a ready agent there (its FP32 name)."""
    lines: dict[Tier, str] = {}
    for tier, pool in registry.index.pools(family).items():
        if pool:
            agent = pool[0]
            variant = agent.variant_for(family)
            info = agent.variants.get(variant)
            lines[tier] = info.line if info is not None and info.line else variant
    for plan in rollouts.plans():
        if plan.family == family and plan.state == PROMOTED:
            lines[plan.tier] = plan.candidate
    return lines
