"""The ``arith`` models' tokenizer and greedy decoding with per-token log-probabilities,
shared by ``models/build_llm.py`` (which trains and writes the models) and
``models/check_llm.py`` (which checks them against transformers)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from stratus.tools.arith import MAX_ANSWER_CHARS

BOS, EOS = "<s>", "</s>"
CONTEXT = 512
VOCAB_SIZE = 259  # <s>, </s>, 256 bytes, two spaces


# ---------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------


def gpt2_bytes() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order (what ByteLevel maps to)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def make_tokenizer() -> Tokenizer:
    """One token per byte (ids 2..257 are bytes 0..255), plus the two-space merge (id 258)."""
    alphabet = gpt2_bytes()
    space = alphabet[ord(" ")]
    vocab = {BOS: 0, EOS: 1, **{ch: 2 + b for b, ch in enumerate(alphabet)}, space + space: 258}
    tokenizer = Tokenizer(models.BPE(vocab, [(space, space)]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS, EOS])
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, directory: Path) -> PreTrainedTokenizerFast:
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=CONTEXT,
        clean_up_tokenization_spaces=False,
    )
    wrapped.save_pretrained(directory)
    return wrapped


# ---------------------------------------------------------------------------------------------
# greedy decoding with per-token log-probabilities (also used by models/check_llm.py)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Generated:
    """A greedy answer: its text (without ``</s>``), and per generated token (``</s>`` included)
    the id, the log-probability and the top-1 minus top-2 probability."""

    text: str
    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    margins: tuple[float, ...]
    finished: bool  # ended with </s> within the token budget

    def confidence(self, method: str) -> float:
        if not self.logprobs:
            return 0.0
        if method == "mean_logprob":
            return math.exp(sum(self.logprobs) / len(self.logprobs))
        if method == "min_logprob":
            return math.exp(min(self.logprobs))
        return self.margins[0]


METHODS = ("mean_logprob", "min_logprob", "first_margin")
MAX_TOKENS = MAX_ANSWER_CHARS + 1  # the longest answer and its </s>


@torch.no_grad()
def greedy(model: LlamaForCausalLM, tokenizer: Tokenizer, prompts: Sequence[str]) -> list[Generated]:
    """Batched greedy decoding; prompts of one token length go together (no padding)."""
    encoded = [tokenizer.encode(p).ids for p in prompts]
    results: dict[int, Generated] = {}
    for length in sorted({len(e) for e in encoded}):
        rows = [i for i, e in enumerate(encoded) if len(e) == length]
        generated = _greedy_batch(model, tokenizer, torch.tensor([encoded[i] for i in rows]))
        results.update(zip(rows, generated, strict=True))
    return [results[i] for i in range(len(prompts))]


def _greedy_batch(model: LlamaForCausalLM, tokenizer: Tokenizer, ids: torch.Tensor) -> list[Generated]:
    eos = tokenizer.token_to_id(EOS)
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for _ in range(MAX_TOKENS):
        logp = torch.log_softmax(model(input_ids=ids).logits[:, -1, :].float(), dim=-1)
        top = torch.topk(logp, 2, dim=-1)
        steps.append((top.indices[:, 0], top.values[:, 0], top.values[:, 0].exp() - top.values[:, 1].exp()))
        ids = torch.cat([ids, top.indices[:, :1]], dim=1)
    return [_one(steps, row, eos, tokenizer) for row in range(ids.shape[0])]


def _one(steps: list[tuple[torch.Tensor, ...]], row: int, eos: int, tokenizer: Tokenizer) -> Generated:
    ids, logprobs, margins = [], [], []
    for token, logprob, margin in steps:
        ids.append(int(token[row]))
        logprobs.append(float(logprob[row]))
        margins.append(float(margin[row]))
        if ids[-1] == eos:
            break
    finished = ids[-1] == eos
    text = tokenizer.decode([i for i in ids if i != eos])
    return Generated(text, tuple(ids), tuple(logprobs), tuple(margins), finished)


def auroc(scores: Sequence[float], right: Sequence[bool]) -> float:
    """Probability that a right answer scores above a wrong one (ties count half)."""
    pos = [s for s, r in zip(scores, right, strict=True) if r]
    neg = [s for s, r in zip(scores, right, strict=True) if not r]
    if not pos or not neg:
        return float("nan")
    both = np.asarray(pos + neg)
    order = both.argsort(kind="mergesort")
    ranks = np.empty(len(both))
    sorted_scores = both[order]
    # average ranks over ties
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    average = first + (counts - 1) / 2.0
    ranks[order] = np.repeat(average, counts)
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) - 1) / 2) / (len(pos) * len(neg)))
