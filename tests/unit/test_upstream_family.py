"""The family an OpenAI-compatible upstream serves, from the name of its model
(cloud_gateway.app.upstream_family), against the shipped repository."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud_gateway.app import _generative_model, upstream_family
from cloud_gateway.settings import CloudSettings
from cloud_gateway.upstream import OpenAIUpstream, UpstreamSettings
from stratus.families.repository import ModelRepository

MODELS = Path(__file__).resolve().parents[2] / "models"
pytestmark = pytest.mark.skipif(
    not (MODELS / "arith" / "family.toml").is_file(), reason="models/arith is not built"
)


@pytest.fixture(scope="module")
def repository() -> ModelRepository:
    return ModelRepository.load(MODELS)


def test_a_variants_name_serves_that_variant_as_its_familys(repository: ModelRepository) -> None:
    assert upstream_family("arith-large", repository) == "arith"
    assert upstream_family("arith-large-fp16", repository) == "arith"
    assert upstream_family("arith", repository) == "arith"


def test_a_name_the_repository_does_not_know_is_a_family_of_its_own(repository: ModelRepository) -> None:
    assert upstream_family("qwen2.5-0.5b", repository) == "qwen2.5-0.5b"


def test_the_gateway_answers_the_family_from_the_upstream(repository: ModelRepository) -> None:
    """`stratus cloud --openai-upstream URL --upstream-model arith-large`: the family is arith,
    its generation settings the repository's, and the variant the upstream's model."""
    settings = CloudSettings(listen="127.0.0.1:0", models=MODELS, openai_upstream="http://127.0.0.1:9")
    upstream = OpenAIUpstream(UpstreamSettings(url="http://127.0.0.1:9", model="arith-large"))
    model = _generative_model(settings, upstream, repository)
    generation = repository.families["arith"].generation
    assert generation is not None
    assert (model.family, model.variant, model.max_tokens) == ("arith", "arith-large", generation.max_tokens)
    assert sorted(model.names) == ["arith", "arith-large"]
    pinned = CloudSettings(
        listen="127.0.0.1:0", models=MODELS, openai_upstream="http://127.0.0.1:9", upstream_family="other"
    )
    assert _generative_model(pinned, upstream, repository).family == "other"  # the flag still wins
