"""A family that keeps its inputs on the site (`[privacy] escalate = false`, issue 36 §2): none
of its items reaches the cloud, whether it climbs, is audited or names a cloud variant; its
unsure answers say why they stayed; another family's items still climb."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton

from .cluster import Cluster, infer, ready_count, wait_until
from .variants import copy_digits


def cloud_inferences(cloud: str) -> int:
    """Every inference the cloud gateway counted, over all its models."""
    stats = triton.InferenceServerClient(cloud).get_inference_statistics(as_json=True)
    return sum(int(model.get("inference_count", 0)) for model in stats.get("model_stats", []))


def keep_on_site(models: Path) -> Path:
    toml = models / "digits" / "family.toml"
    toml.write_text(toml.read_text() + "\n[privacy]\nescalate = false\n")
    return models


def test_a_family_kept_on_the_site_never_reaches_the_cloud(cluster: Cluster, tmp_path: Path, digits) -> None:  # type: ignore[no-untyped-def]
    cloud = cluster.cloud().address
    models = keep_on_site(copy_digits(tmp_path / "models"))
    router = cluster.router("--cloud", cloud, "--audit-share", "1", "--audit-max-per-s", "10000").address
    cluster.agent("dev-1", router, "--models", str(models))
    wait_until(lambda: ready_count(router) == 1, 60)
    x = digits.held_out.x[:32].astype(np.float32)
    before = cloud_inferences(cloud)
    for row in range(0, len(x), 8):
        # min_confidence 1.0: every item is unsure and would climb to the cloud
        _, served = infer(router, x[row : row + 8], min_confidence=1.0)
        assert served.tier.label == "device" and served.degraded, served
        assert "keeps its inputs on the site ([privacy] escalate = false)" in served.reason, served.reason
    with pytest.raises(grpc.RpcError) as refused:  # the cloud's own variant of it, named
        infer(router, x[:1], model="digits-large")
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "keeps its inputs on the site" in (refused.value.details() or "")
    assert cloud_inferences(cloud) == before  # nothing climbed, nothing was audited there


def test_the_same_family_without_the_setting_climbs_to_the_cloud(cluster: Cluster, tmp_path: Path, digits) -> None:  # type: ignore[no-untyped-def]
    """The positive control: the same fleet, the setting left out, does reach the cloud."""
    cloud = cluster.cloud().address
    models = copy_digits(tmp_path / "models")
    router = cluster.router("--cloud", cloud).address
    cluster.agent("dev-1", router, "--models", str(models))
    wait_until(lambda: ready_count(router) == 1, 60)
    before = cloud_inferences(cloud)
    _, served = infer(router, digits.held_out.x[:8].astype(np.float32), min_confidence=1.0)
    assert served.tier.label == "cloud", served
    wait_until(lambda: cloud_inferences(cloud) > before, 10)
