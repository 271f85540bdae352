"""An agent loads new variants without restarting: load, warm up, announce, then serve;
nothing in flight is lost, and a variant that fails to load leaves the old ones serving."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from stratus.convert import codec
from stratus.serving.channels import open_sync_channel
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import MODELS, Cluster, fleet_status, infer, ready_count, wait_until
from .load import Load
from .variants import add_device_variant, copy_digits


def reload(router: str, agent: str) -> fpb.ReloadResponse:
    with open_sync_channel(router) as channel:
        return fpb_grpc.FleetStub(channel).Reload(fpb.ReloadRequest(agent_id=agent, timeout_s=60), timeout=70)


def variants(router: str, agent: str) -> set[str]:
    return {v for a in fleet_status(router).agents if a.id == agent for v in a.variants}


def test_agent_reloads_new_variants_without_losing_work(cluster: Cluster, tmp_path: Path, digits) -> None:  # type: ignore[no-untyped-def]
    models = copy_digits(tmp_path / "models")
    config = models / "digits" / "family.toml"
    router = cluster.router().address
    agent = cluster.agent("device-1", router, "--models", str(models))
    wait_until(lambda: ready_count(router) == 1, timeout_s=60)
    before = variants(router, "device-1")
    assert not any(v.startswith("digits-small-v") for v in before)

    with Load(router, digits.held_out.x) as load:
        add_device_variant(models, "digits-small-v2")
        cli = subprocess.run(
            [sys.executable, "-m", "stratus.cli", "fleet", "reload", "device-1", "--router", router],
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        assert cli.returncode == 0, cli.stderr
        assert "device-1 reloaded" in cli.stdout and "digits-small-v2" in cli.stdout
        assert variants(router, "device-1") == before | {"digits-small-v2"}

        good_config = config.read_text()
        add_device_variant(models, "digits-small-broken", broken=True)
        refused = reload(router, "device-1")
        assert not refused.ok
        assert "digits-small-broken" in refused.message, refused.message
        assert set(refused.variants) == before | {"digits-small-v2"}

        config.write_text(good_config)
        add_device_variant(models, "digits-small-v3")
        agent.process.send_signal(signal.SIGHUP)
        wait_until(lambda: "digits-small-v3" in variants(router, "device-1"), timeout_s=30)
    assert not load.errors, load.errors
    assert len(load.answers) > 200
    # a new, non-current variant answers when named, and the family stays on the current one
    _, pinned = infer(router, digits.held_out.x[:3], model="digits-small-v3")
    _, family = infer(router, digits.held_out.x[:3], max_tier="device")
    assert pinned.variant == "digits-small-v3"
    choices = {c.split(" ")[0]: c for a in fleet_status(router).agents for c in a.variant_choices}
    assert choices["digits-small-v3"].endswith("not current: served when named or in a rollout")
    assert "not current" not in choices[family.variant]
    assert family.variant in {"digits-small", "digits-small-int8"}


def test_agent_reloads_a_generative_family_and_serves_the_new_current_variant(
    cluster: Cluster, tmp_path: Path
) -> None:
    import shutil

    from stratus.convert.parameters import Served

    from .test_llm import oip_request

    models = tmp_path / "models"
    shutil.copytree(MODELS / "arith", models / "arith", ignore=shutil.ignore_patterns("arith-large*"))
    config = models / "arith" / "family.toml"
    shipped = config.read_text()
    config.write_text(
        shipped.split('[[variants]]\nname = "arith-large"')[0].replace('cloud = "arith-large"\n', "")
    )
    router = cluster.router().address
    cluster.agent("device-1", router, "--models", str(models))
    wait_until(lambda: ready_count(router) == 1, timeout_s=60)
    assert variants(router, "device-1") >= {"arith-small"}

    def answer(prompt: str) -> tuple[str, Served]:
        with open_sync_channel(router) as channel:
            response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(oip_request(prompt), timeout=30)
        text = codec.decode_response_outputs(response)["text_output"][0].decode()
        return text, Served.read(response.parameters)

    _, before = answer("37+48=")
    assert before.variant == "arith-small"
    # a new device variant (the medium model's file), made current
    shutil.copy(models / "arith" / "arith-medium.gguf", models / "arith" / "arith-small-v2.gguf")
    entry = '\n[[variants]]\nname = "arith-small-v2"\ntier = "device"\nprecision = "FP16"\nfiles = { gguf = "arith-small-v2.gguf" }\n'
    config.write_text(
        config.read_text().replace('device = "arith-small"', 'device = "arith-small-v2"') + entry
    )
    reloaded = reload(router, "device-1")
    assert reloaded.ok, reloaded.message
    assert "arith-small-v2" in reloaded.variants
    wait_until(lambda: "arith-small-v2" in variants(router, "device-1"), timeout_s=10)
    texts = []
    for prompt in ("37+48=", "90-45=", "12+5="):
        text, served = answer(prompt)
        assert served.variant == "arith-small-v2"
        texts.append(text)
    # a variant whose file cannot load leaves the family serving as it was
    (models / "arith" / "arith-bad.gguf").write_bytes(b"not a GGUF file")
    bad = '\n[[variants]]\nname = "arith-bad"\ntier = "device"\nprecision = "FP16"\nfiles = { gguf = "arith-bad.gguf" }\n'
    config.write_text(config.read_text() + bad)
    refused = reload(router, "device-1")
    assert not refused.ok and "arith-bad" in refused.message, refused.message
    assert [answer(p)[0] for p in ("37+48=", "90-45=", "12+5=")] == texts
