"""The whole generative cascade with real vLLM as its cloud: the openai SDK against the router,
a device and an edge agent generating with OpenVINO GenAI, the cloud gateway forwarding to
vLLM. Unsure answers reach vLLM and come back as vLLM gives them; max_tier holds them below;
without vLLM the router degrades, or refuses with --on-cloud-failure fail."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from stratus.devtools.launcher import free_port
from tests.integration.cluster import Cluster, ready_count, wait_until
from tests.integration.vllm.direct import Gateway, Vllm, completion
from tests.integration.vllm.test_cloud_vllm import gateway_stops_serving

pytestmark = pytest.mark.vllm
PROMPTS = ["37+48=", "91-19=", "3+4="]


@dataclass
class Site:
    api: str  # the default router's OpenAI API
    failing_api: str  # a router with --on-cloud-failure fail

    def client(self, api: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://{api or self.api}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def site(gateway: Gateway, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    cluster = Cluster(tmp_path_factory.mktemp("cascade-logs"))
    try:
        api, failing = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        router = cluster.router("--cloud", gateway.address, "--openai", api).address
        strict = cluster.router(
            "--cloud",
            gateway.address,
            "--openai",
            failing,
            "--on-cloud-failure",
            "fail",
            role="strict-router",
        ).address
        both = f"{router},{strict}"
        cluster.agent("device-1", both)
        cluster.agent("edge-1", both, tier="edge")
        wait_until(lambda: ready_count(router) == 2 and ready_count(strict) == 2, timeout_s=60)
        yield Site(api=api, failing_api=failing)
    finally:
        cluster.stop_all()


def ask(client: openai.OpenAI, prompt: str, **stratus: object) -> tuple[str, dict[str, object]]:
    answer = client.completions.create(
        model="arith", prompt=prompt, max_tokens=4, extra_body={"stratus": stratus}
    )
    return answer.choices[0].text, (answer.model_extra or {})["stratus"]


def test_an_unsure_answer_climbs_to_vllm_and_comes_back_as_vllm_gives_it(site: Site, vllm: Vllm) -> None:
    client = site.client()
    for prompt in PROMPTS:
        direct = completion(vllm.url, vllm.model, prompt, max_tokens=4)["choices"][0]["text"]
        text, served = ask(client, prompt, min_confidence=1.0)
        assert (served["tier"], served["path"]) == ("cloud", ["device", "edge", "cloud"])
        assert text.strip() == direct.strip() and served["degraded"] is False
        streamed = client.completions.create(
            model="arith",
            prompt=prompt,
            max_tokens=4,
            stream=True,
            extra_body={"stratus": {"min_tier": "cloud"}},
        )
        assert "".join(c.choices[0].text for c in streamed).strip() == direct.strip()
        _, held = ask(client, prompt, min_confidence=1.0, max_tier="edge")
        assert held["tier"] == "edge" and held["degraded"] is False
        _, sure = ask(client, prompt, min_confidence=0.0)
        assert sure["path"] == ["device"]


@pytest.mark.stops_vllm
def test_without_vllm_the_gateway_is_not_ready_and_answers_degrade_or_fail_as_configured(
    site: Site, gateway: Gateway, vllm: Vllm
) -> None:
    gateway_stops_serving(gateway, vllm)  # the only test that stops the session's vLLM
    text, served = ask(site.client(), PROMPTS[0], min_confidence=1.0)
    assert served["tier"] == "edge" and served["degraded"] is True and text
    with pytest.raises(openai.APIStatusError) as refused:
        ask(site.client(site.failing_api), PROMPTS[0], min_confidence=1.0)
    assert refused.value.status_code == 503 and "--on-cloud-failure fail" in str(refused.value.body)
