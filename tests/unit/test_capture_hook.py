"""The capture hook's own rules: opt-in per family (a clear error otherwise), and generative
items kept with their prompt and every tier's text."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.audit.capture import CaptureHook, CaptureSettings
from router.cascade.generate import Generation
from stratus.cli.main import main
from stratus.convert import codec
from stratus.convert.text import text_array
from stratus.errors import ConfigError
from stratus.obs.capture import read_rows
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb


def test_capture_names_its_families_or_the_router_refuses_to_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match="--capture needs --capture-families"):
        CaptureSettings(folder=tmp_path, families=frozenset())
    assert main(["router", "--listen", "127.0.0.1:0", "--capture", str(tmp_path)]) == 2
    assert "--capture needs --capture-families F1,F2" in capsys.readouterr().err
    assert main(["router", "--listen", "127.0.0.1:0", "--capture-families", "digits"]) == 2
    assert "--capture-families needs --capture DIR" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing was written


def generation(tier: Tier, text: str, confidence: float, finish: str = "stop") -> Generation:
    return Generation(text=text, tokens=(), tier=tier, agent=f"{tier.label}-1", variant=f"arith-{tier.label}",
                      confidence=confidence, finish_reason=finish, path=(tier,), timings_ms={})  # fmt: skip


def test_an_escalated_prompt_is_kept_with_each_tier_text(tmp_path: Path) -> None:
    hook = CaptureHook(CaptureSettings(folder=tmp_path, families=frozenset({"arith"})))
    prompt = pb.ModelInferRequest(model_name="arith", id="p-1")
    codec.encode_request_inputs(prompt, {"text_input": text_array("12+30=")})
    cloud = generation(Tier.CLOUD, "42", 0.99)
    climbed = [generation(Tier.DEVICE, "41", 0.2), generation(Tier.EDGE, "4", 0.1, finish="cancelled")]
    hook.escalated_text("arith", prompt, cloud, climbed)
    hook.escalated_text("arith", prompt, cloud, [])  # nothing climbed: nothing to learn from
    hook.writer.close()
    (row,) = read_rows(tmp_path, "arith")
    assert row["source"] == "escalated" and row["prompt"] == "12+30=" and row["request_id"] == "p-1"
    assert [(a["tier"], a["text"]) for a in row["answers"]] == [("device", "41"), ("cloud", "42")]
    assert row["top"]["text"] == "42" and row["top"]["label"] is None
