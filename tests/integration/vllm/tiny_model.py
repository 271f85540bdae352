"""Write a tiny LLaMA-shaped model with random weights, and its tokenizer, into a folder.

Run by the Python of ``.venv-vllm`` (it needs transformers, tokenizers and torch, which
the project's own environment does not have) when no trained generative model is in
models/. Nothing is downloaded: the byte-level BPE tokenizer is trained here on arithmetic
text, and its alphabet is only the characters of that text, so every token decodes to
ASCII whatever the random model picks.

    .venv-vllm/bin/python tests/integration/vllm/tiny_model.py DEST
"""

from __future__ import annotations

import random
import sys
from pathlib import Path


def corpus() -> list[str]:
    rng = random.Random(0)
    lines = []
    for _ in range(2000):
        a, b = rng.randrange(100), rng.randrange(100)
        lines.append(f"{a}+{b}={a + b}\n")
    lines.append("the sum of two numbers is a number\n")
    return lines


def main(dest: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256, special_tokens=["<s>", "</s>"], initial_alphabet=[])
    tokenizer.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
    )
    dest.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(config).save_pretrained(dest)
    fast.save_pretrained(dest)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
