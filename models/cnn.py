"""A small convolutional network in numpy (its trainer is :mod:`models.cnn_train`): what ``models/build/`` trains the
``defects`` family with.

Torch or TensorFlow would pull in hundreds of megabytes (CUDA wheels included) for three
toy networks; a few hundred lines of numpy train them in minutes on two cores and keep
the build's dependencies to the ``models`` extra.

The network, NHWC throughout: stages of 3x3 convolutions (stride 1, zero padding 1, ReLU),
each stage ending in a 2x2 max pool; then a global max pool (is the feature anywhere in the
image?), one dense layer and a softmax. Convolutions run as one matrix product over an
im2col view. Training: batch normalisation after each convolution (folded into its weights
and bias when training ends, so the exported graph has plain convolutions), softmax
cross-entropy, Adam with warm-up and cosine decay, decoupled weight decay, mini-batches,
the eight flips and quarter turns of each image as augmentation, fixed seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

KERNEL = 3
EPSILON = 1e-5  # batch normalisation's variance floor


@dataclass(frozen=True)
class Architecture:
    """Convolution widths per stage; every stage ends in a 2x2 max pool."""

    stages: tuple[tuple[int, ...], ...]
    classes: int
    channels: int = 1  # input channels

    def conv_widths(self) -> list[tuple[int, int]]:
        """(input channels, output channels) of every convolution, in order."""
        widths, previous = [], self.channels
        for stage in self.stages:
            for width in stage:
                widths.append((previous, width))
                previous = width
        return widths

    @property
    def features(self) -> int:
        return self.stages[-1][-1]

    def parameter_count(self) -> int:
        """Of the exported network (batch normalisation folded away)."""
        convs = sum(KERNEL * KERNEL * c * f + f for c, f in self.conv_widths())
        return convs + self.features * self.classes + self.classes

    def macs(self, height: int, width: int) -> int:
        """Multiply-accumulates per image: the convolutions and the dense layer."""
        total, pixels, previous = 0, height * width, self.channels
        for stage in self.stages:
            for channels in stage:
                total += pixels * KERNEL * KERNEL * previous * channels
                previous = channels
            pixels //= 4
        return total + self.features * self.classes


@dataclass
class Conv:
    """An exported convolution."""

    weights: np.ndarray  # [3, 3, in, out] (HWIO)
    bias: np.ndarray  # [out]


@dataclass
class Dense:
    weights: np.ndarray  # [in, out]
    bias: np.ndarray  # [out]


@dataclass
class Network:
    """The trained network as exported: plain convolutions, then the dense layer."""

    architecture: Architecture
    stages: list[list[Conv]]
    dense: Dense


@dataclass
class NormConv:
    """A convolution as trained: no bias, then batch normalisation."""

    weights: np.ndarray  # [3, 3, in, out]
    gamma: np.ndarray  # [out]
    beta: np.ndarray  # [out]
    mean: np.ndarray = field(init=False)  # the statistics inference uses
    var: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.mean = np.zeros_like(self.gamma)
        self.var = np.ones_like(self.gamma)

    def folded(self) -> Conv:
        """The one convolution that computes conv, then normalisation with ``mean``/``var``."""
        factor = self.gamma / np.sqrt(self.var + EPSILON)
        return Conv(
            (self.weights * factor).astype(self.weights.dtype),
            (self.beta - self.mean * factor).astype(self.weights.dtype),
        )


@dataclass
class Trainee:
    architecture: Architecture
    stages: list[list[NormConv]]
    dense: Dense

    def parameters(self) -> list[np.ndarray]:
        """Every trained array, in a fixed order (the optimiser's and the gradients' order)."""
        convs = [a for stage in self.stages for c in stage for a in (c.weights, c.gamma, c.beta)]
        return [*convs, self.dense.weights, self.dense.bias]

    def folded(self) -> Network:
        return Network(
            self.architecture,
            [[conv.folded() for conv in stage] for stage in self.stages],
            Dense(self.dense.weights.copy(), self.dense.bias.copy()),
        )


def initialise(architecture: Architecture, seed: int, dtype: type = np.float32) -> Trainee:
    """He-normal weights; batch normalisation starts as the identity; zero dense bias."""
    rng = np.random.default_rng(seed)
    stages, previous = [], architecture.channels
    for stage in architecture.stages:
        convs = []
        for width in stage:
            fan_in = KERNEL * KERNEL * previous
            weights = rng.normal(0.0, math.sqrt(2.0 / fan_in), (KERNEL, KERNEL, previous, width))
            convs.append(NormConv(weights.astype(dtype), np.ones(width, dtype), np.zeros(width, dtype)))
            previous = width
        stages.append(convs)
    dense = rng.normal(0.0, math.sqrt(1.0 / previous), (previous, architecture.classes))
    return Trainee(architecture, stages, Dense(dense.astype(dtype), np.zeros(architecture.classes, dtype)))


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


def im2col(x: np.ndarray) -> np.ndarray:
    """[N, H, W, C] -> [N, H, W, 9C]: each pixel's 3x3 neighbourhood (zero padded), row-major."""
    padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (KERNEL, KERNEL), axis=(1, 2))
    n, h, w, c = x.shape
    return np.ascontiguousarray(windows.transpose(0, 1, 2, 4, 5, 3)).reshape(n, h, w, KERNEL * KERNEL * c)


def conv_backward(
    grad: np.ndarray, columns: np.ndarray, weights: np.ndarray, *, need_input: bool
) -> tuple[np.ndarray | None, np.ndarray]:
    """(d input, d weights) of ``im2col(x) @ weights`` from d output."""
    n, h, w, f = grad.shape
    flat = grad.reshape(-1, f)
    d_weights = (flat.T @ columns.reshape(-1, columns.shape[-1])).T.reshape(weights.shape)
    if not need_input:
        return None, d_weights
    c = weights.shape[2]
    d_columns = (flat @ weights.reshape(-1, f).T).reshape(n, h, w, KERNEL, KERNEL, c)
    d_padded = np.zeros((n, h + 2, w + 2, c), grad.dtype)
    for i in range(KERNEL):
        for j in range(KERNEL):
            d_padded[:, i : i + h, j : j + w, :] += d_columns[:, :, :, i, j, :]
    return d_padded[:, 1:-1, 1:-1, :], d_weights


def pool_forward(x: np.ndarray) -> np.ndarray:
    """2x2 max pool, stride 2: the largest of the four corners of each window."""
    top = np.maximum(x[:, 0::2, 0::2], x[:, 0::2, 1::2])
    return np.maximum(top, np.maximum(x[:, 1::2, 0::2], x[:, 1::2, 1::2]), out=top)


def pool_backward(grad: np.ndarray, x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The gradient goes to the maximum of each window (to every tied one: after ReLU only
    zeros tie, and ReLU's own gradient removes them)."""
    n, h, w, c = x.shape
    windows = x.reshape(n, h // 2, 2, w // 2, 2, c)
    mask = windows == out[:, :, None, :, None, :]
    return (mask * grad[:, :, None, :, None, :]).reshape(n, h, w, c)


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


# ---------------------------------------------------------------------------------------------
# Inference, on the exported network
# ---------------------------------------------------------------------------------------------


def activations(network: Network, x: np.ndarray) -> list[np.ndarray]:
    """Every convolution's output after ReLU, every pool's output, the global max pool's,
    then the logits: the ranges INT8 quantization must cover, in graph order."""
    outputs = []
    for stage in network.stages:
        for conv in stage:
            x = np.maximum(im2col(x) @ conv.weights.reshape(-1, conv.weights.shape[-1]) + conv.bias, 0.0)
            outputs.append(x)
        x = pool_forward(x)
        outputs.append(x)
    features = x.max(axis=(1, 2))
    return [*outputs, features, features @ network.dense.weights + network.dense.bias]


def logits(network: Network, x: np.ndarray, batch: int = 256) -> np.ndarray:
    """In batches: im2col of a whole data set would not fit in memory."""
    return np.concatenate([activations(network, x[i : i + batch])[-1] for i in range(0, len(x), batch)])


def probabilities(network: Network, x: np.ndarray) -> np.ndarray:
    """The reference forward pass every exported FP32 file must reproduce."""
    return softmax(logits(network, x).astype(np.float64))
