"""The numpy CNN trainer of ``models/build/``: its gradients against central differences,
and the folding of batch normalisation into the exported convolutions."""

from __future__ import annotations

import numpy as np
import pytest

from models.cnn import EPSILON, Architecture, activations, im2col, initialise, probabilities
from models.cnn_train import Schedule, dihedral, loss_and_gradients, train

ARCHITECTURE = Architecture(stages=((3,), (4, 5)), classes=4, channels=2)


def test_gradients_match_central_differences() -> None:
    trainee = initialise(ARCHITECTURE, seed=1, dtype=np.float64)
    for parameter in trainee.parameters():  # shifts too, so ReLU and pooling see both signs
        parameter[...] += np.random.default_rng(2).normal(0.0, 0.2, parameter.shape)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 8, 8, 2))
    y = np.array([0, 3, 1])
    _, gradients = loss_and_gradients(trainee, x, y)
    step = 1e-6
    for parameter, gradient in zip(trainee.parameters(), gradients, strict=True):
        assert gradient.shape == parameter.shape
        flat, grad = parameter.reshape(-1), gradient.reshape(-1)
        for index in rng.choice(flat.size, size=min(flat.size, 12), replace=False):
            original = flat[index]
            flat[index] = original + step
            above = loss_and_gradients(trainee, x, y)[0]
            flat[index] = original - step
            below = loss_and_gradients(trainee, x, y)[0]
            flat[index] = original
            numeric = (above - below) / (2 * step)
            assert grad[index] == pytest.approx(numeric, rel=1e-4, abs=1e-7)


def test_im2col_is_a_same_padded_3x3_convolution() -> None:
    x = np.arange(2 * 4 * 5 * 3, dtype=np.float64).reshape(2, 4, 5, 3)
    kernel = np.random.default_rng(0).normal(size=(3, 3, 3, 2))
    fast = im2col(x) @ kernel.reshape(-1, 2)
    padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    slow = np.zeros((2, 4, 5, 2))
    for i in range(4):
        for j in range(5):
            slow[:, i, j] = np.einsum("nhwc,hwcf->nf", padded[:, i : i + 3, j : j + 3], kernel)
    np.testing.assert_allclose(fast, slow)


def test_batch_normalisation_folds_into_the_convolution() -> None:
    trainee = initialise(Architecture(stages=((3,),), classes=2, channels=2), seed=0, dtype=np.float64)
    conv = trainee.stages[0][0]
    rng = np.random.default_rng(1)
    conv.gamma, conv.beta = rng.normal(size=3), rng.normal(size=3)
    conv.mean, conv.var = rng.normal(size=3), rng.uniform(0.5, 2.0, 3)
    x = rng.normal(size=(2, 4, 4, 2))
    z = im2col(x) @ conv.weights.reshape(-1, 3)
    expected = np.maximum((z - conv.mean) / np.sqrt(conv.var + EPSILON) * conv.gamma + conv.beta, 0.0)
    np.testing.assert_allclose(activations(trainee.folded(), x)[0], expected)


def test_counts_and_shapes() -> None:
    network = initialise(ARCHITECTURE, seed=0).folded()
    exported = [a for stage in network.stages for c in stage for a in (c.weights, c.bias)]
    assert sum(p.size for p in [*exported, network.dense.weights, network.dense.bias]) == (
        ARCHITECTURE.parameter_count()
    )
    assert ARCHITECTURE.macs(8, 8) == 64 * 9 * 2 * 3 + 16 * 9 * (3 * 4 + 4 * 5) + 5 * 4
    outputs = activations(network, np.zeros((2, 8, 8, 2), np.float32))
    assert [o.shape for o in outputs] == [
        (2, 8, 8, 3), (2, 4, 4, 3), (2, 4, 4, 4), (2, 4, 4, 5), (2, 2, 2, 5), (2, 5), (2, 4)
    ]  # fmt: skip
    assert {dihedral(np.arange(4.0).reshape(1, 2, 2, 1), k).tobytes() for k in range(8)}.__len__() == 8


def test_training_learns_a_separable_toy_problem() -> None:
    rng = np.random.default_rng(0)
    y = np.arange(256) % 2
    x = rng.normal(0.0, 0.3, (256, 8, 8, 1)).astype(np.float32)
    x[y == 1, 3:5, 3:5, 0] += 2.0  # a bright centre: class 1
    network = train(
        Architecture(stages=((4,),), classes=2),
        x,
        y,
        Schedule(epochs=12, batch=32, learning_rate=1e-2, warmup_steps=5),
        log=lambda _: None,
    )
    assert float((probabilities(network, x).argmax(axis=1) == y).mean()) > 0.95
