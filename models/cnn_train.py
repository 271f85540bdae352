"""Training :mod:`models.cnn`'s network: forward with batch statistics and backward,
batch normalisation folded into the weights at the end, softmax cross-entropy, Adam with
warm-up and cosine decay and decoupled weight decay, mini-batches, and the eight flips and
quarter turns of each image as augmentation, from fixed seeds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from models.cnn import (
    EPSILON,
    Architecture,
    Network,
    Trainee,
    conv_backward,
    im2col,
    initialise,
    pool_backward,
    pool_forward,
    softmax,
)

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
