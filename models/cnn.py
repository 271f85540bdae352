"""A small convolutional network and its trainer, in numpy: what ``models/build/`` trains the
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
import time
from collections.abc import Callable, Iterator, Sequence
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


# ---------------------------------------------------------------------------------------------
# Training: forward with batch statistics, and backward
# ---------------------------------------------------------------------------------------------


@dataclass
class _Step:
    """What backward needs of one convolution: its input columns, normalised output,
    inverse standard deviation and output after ReLU."""

    columns: np.ndarray
    normalised: np.ndarray
    inverse_std: np.ndarray
    relu: np.ndarray


@dataclass
class _Cache:
    steps: list[_Step] = field(default_factory=list)
    pools: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (input, output)
    features: np.ndarray | None = None  # after the global max pool
    statistics: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # batch (mean, var)


def _forward(trainee: Trainee, x: np.ndarray) -> tuple[np.ndarray, _Cache]:
    cache = _Cache()
    for stage in trainee.stages:
        for conv in stage:
            columns = im2col(x)
            z = columns @ conv.weights.reshape(-1, conv.weights.shape[-1])
            flat = z.reshape(-1, z.shape[-1])
            mean = flat.mean(axis=0)
            centred = z - mean
            var = np.square(centred).reshape(flat.shape).mean(axis=0)
            inverse_std = 1.0 / np.sqrt(var + EPSILON)
            normalised = centred * inverse_std
            x = np.maximum(conv.gamma * normalised + conv.beta, 0.0)
            cache.steps.append(_Step(columns, normalised, inverse_std, x))
            cache.statistics.append((mean, var))
        pooled = pool_forward(x)
        cache.pools.append((x, pooled))
        x = pooled
    cache.features = x.max(axis=(1, 2))
    return cache.features @ trainee.dense.weights + trainee.dense.bias, cache


def _norm_backward(grad: np.ndarray, step: _Step, gamma: np.ndarray) -> tuple[np.ndarray, ...]:
    """(d conv output, d gamma, d beta) through batch normalisation with batch statistics."""
    channels = grad.shape[-1]
    d_gamma = (grad * step.normalised).reshape(-1, channels).sum(axis=0)
    d_beta = grad.reshape(-1, channels).sum(axis=0)
    count = grad.size // channels
    d_normalised = grad * gamma
    d_z = (step.inverse_std / count) * (
        count * d_normalised - d_beta * gamma - step.normalised * (d_gamma * gamma)
    )
    return d_z, d_gamma, d_beta


def loss_and_gradients(trainee: Trainee, x: np.ndarray, y: np.ndarray) -> tuple[float, list[np.ndarray]]:
    """Mean softmax cross-entropy over the batch and its gradient, in ``parameters()`` order."""
    out, cache = _forward(trainee, x)
    assert cache.features is not None
    p = softmax(out)
    count = len(y)
    loss = float(-np.log(np.clip(p[np.arange(count), y], 1e-30, None)).mean())
    d_logits = p
    d_logits[np.arange(count), y] -= 1.0
    d_logits /= count
    d_dense = cache.features.T @ d_logits
    d_features = d_logits @ trainee.dense.weights.T
    last = cache.pools[-1][1]
    grad = (last == cache.features[:, None, None, :]) * d_features[:, None, None, :]
    conv_grads: list[np.ndarray] = []
    index = len(cache.steps)
    for stage, (before, after) in zip(reversed(trainee.stages), reversed(cache.pools), strict=True):
        grad = pool_backward(grad, before, after)
        for conv in reversed(stage):
            index -= 1
            step = cache.steps[index]
            d_z, d_gamma, d_beta = _norm_backward(grad * (step.relu > 0), step, conv.gamma)
            d_input, d_weights = conv_backward(d_z, step.columns, conv.weights, need_input=index > 0)
            conv_grads = [d_weights, d_gamma, d_beta, *conv_grads]
            if d_input is not None:
                grad = d_input
    return loss, [*conv_grads, d_dense, d_logits.sum(axis=0)]


def settle_statistics(trainee: Trainee, x: np.ndarray, batch: int) -> None:
    """Inference's mean and variance per convolution: the average of the batch statistics
    over ``x`` with the final weights (training's own figures trail the weights)."""
    statistics = [_forward(trainee, chunk)[1].statistics for chunk in _batches(x, batch)]
    convs = [conv for stage in trainee.stages for conv in stage]
    for index, conv in enumerate(convs):
        conv.mean = np.mean([batch_statistics[index][0] for batch_statistics in statistics], axis=0)
        conv.var = np.mean([batch_statistics[index][1] for batch_statistics in statistics], axis=0)


def _batches(x: np.ndarray, size: int) -> Iterator[np.ndarray]:
    for start in range(0, len(x) - size + 1, size):
        yield x[start : start + size]


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def dihedral(x: np.ndarray, k: int) -> np.ndarray:
    """One of the eight flips and quarter turns of NHWC images."""
    turned = np.rot90(x, k % 4, axes=(1, 2))
    return turned[:, :, ::-1, :] if k >= 4 else turned


def augment(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Each image under a random one of the eight symmetries of the square."""
    out = np.empty_like(x)
    choice = rng.integers(0, 8, len(x))
    for k in range(8):
        chosen = choice == k
        out[chosen] = dihedral(x[chosen], k)
    return out


@dataclass(frozen=True)
class Schedule:
    epochs: int
    batch: int = 64
    learning_rate: float = 4e-3
    weight_decay: float = 1e-4
    warmup_steps: int = 100
    seed: int = 0

    def rate(self, step: int, total: int) -> float:
        """Linear warm-up, then cosine decay to zero."""
        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, total - self.warmup_steps)
        return self.learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))


class Adam:
    def __init__(self, parameters: Sequence[np.ndarray], beta1: float = 0.9, beta2: float = 0.999) -> None:
        self.parameters = list(parameters)
        self.first = [np.zeros_like(p) for p in parameters]
        self.second = [np.zeros_like(p) for p in parameters]
        self.beta1, self.beta2, self.steps = beta1, beta2, 0

    def step(self, gradients: Sequence[np.ndarray], rate: float, weight_decay: float) -> None:
        self.steps += 1
        correction1 = 1.0 - self.beta1**self.steps
        correction2 = 1.0 - self.beta2**self.steps
        for p, g, m, v in zip(self.parameters, gradients, self.first, self.second, strict=True):
            m[...] = self.beta1 * m + (1.0 - self.beta1) * g
            v[...] = self.beta2 * v + (1.0 - self.beta2) * g * g
            decay = rate * weight_decay * p if p.ndim > 1 else 0.0  # decoupled, on weights only
            p[...] = p - decay - rate * (m / correction1) / (np.sqrt(v / correction2) + 1e-8)


def train(
    architecture: Architecture,
    x: np.ndarray,
    y: np.ndarray,
    schedule: Schedule,
    *,
    log: Callable[[str], None] = print,
) -> Network:
    """Mini-batch Adam over shuffled, augmented copies of ``x`` (NHWC float32); the
    exported network, batch normalisation folded in."""
    rng = np.random.default_rng(schedule.seed)
    trainee = initialise(architecture, schedule.seed)
    optimiser = Adam(trainee.parameters())
    per_epoch = len(x) // schedule.batch
    total = schedule.epochs * per_epoch
    started = time.perf_counter()
    for epoch in range(schedule.epochs):
        order = rng.permutation(len(x))
        losses = []
        for index in range(per_epoch):
            chosen = order[index * schedule.batch : (index + 1) * schedule.batch]
            loss, gradients = loss_and_gradients(trainee, augment(x[chosen], rng), y[chosen])
            optimiser.step(gradients, schedule.rate(epoch * per_epoch + index, total), schedule.weight_decay)
            losses.append(loss)
        log(
            f"  epoch {epoch + 1:>2}/{schedule.epochs}  loss {np.mean(losses):.4f}"
            f"  {time.perf_counter() - started:6.1f} s"
        )
    settle_statistics(trainee, augment(x[rng.permutation(len(x))[:4096]], rng), schedule.batch)
    return trainee.folded()
