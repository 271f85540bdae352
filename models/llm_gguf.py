"""The ``arith`` models written as GGUF files, for ``models/build_llm.py``: the metadata
llama.cpp reads (context, shape, RoPE, the GPT-2 byte tokenizer), and the tensors renamed and
laid out as it expects (q/k permuted for its RoPE, norms F32, the rest F16)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from llm_decode import BOS, CONTEXT, EOS, VOCAB_SIZE, gpt2_bytes
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM


class Shape(Protocol):
    """What the writer reads of a variant (``build_llm.Variant``)."""

    @property
    def name(self) -> str: ...
    @property
    def hidden(self) -> int: ...
    @property
    def layers(self) -> int: ...
    @property
    def intermediate(self) -> int: ...
    @property
    def heads(self) -> int: ...


def write_gguf(model: LlamaForCausalLM, tokenizer: Tokenizer, variant: Shape, path: Path) -> None:
    """``variant``'s weights and tokenizer as llama.cpp and OpenVINO GenAI read them, in F16."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    _gguf_metadata(writer, variant)
    _gguf_tokenizer(writer, tokenizer)
    for name, tensor in _gguf_tensors(model, variant):
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_metadata(writer: Any, variant: Shape) -> None:
    import gguf

    writer.add_name(variant.name)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(variant.hidden)
    writer.add_block_count(variant.layers)
    writer.add_feed_forward_length(variant.intermediate)
    writer.add_head_count(variant.heads)
    writer.add_head_count_kv(variant.heads)
    writer.add_rope_dimension_count(variant.hidden // variant.heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB_SIZE)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)


def _gguf_tokenizer(writer: Any, tokenizer: Tokenizer) -> None:
    import gguf

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    assert [i for _, i in vocab] == list(range(VOCAB_SIZE))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # llama.cpp's name for GPT-2's pre-tokenizer ("gpt2" is refused)
    writer.add_token_list([t for t, _ in vocab])
    control, normal = gguf.TokenType.CONTROL, gguf.TokenType.NORMAL
    writer.add_token_types([control if t in (BOS, EOS) else normal for t, _ in vocab])
    space = gpt2_bytes()[ord(" ")]
    writer.add_token_merges([f"{space} {space}"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(1)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)


def _gguf_tensors(model: LlamaForCausalLM, variant: Shape) -> list[tuple[str, np.ndarray]]:
    """HF names and layouts to llama.cpp's: q/k permuted for its RoPE, norms F32, rest F16."""
    state = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    out = [("token_embd.weight", state["model.embed_tokens.weight"])]
    for i in range(variant.layers):
        hf = f"model.layers.{i}."
        out += [
            (f"blk.{i}.attn_norm.weight", state[hf + "input_layernorm.weight"]),
            (f"blk.{i}.attn_q.weight", _permute(state[hf + "self_attn.q_proj.weight"], variant.heads)),
            (f"blk.{i}.attn_k.weight", _permute(state[hf + "self_attn.k_proj.weight"], variant.heads)),
            (f"blk.{i}.attn_v.weight", state[hf + "self_attn.v_proj.weight"]),
            (f"blk.{i}.attn_output.weight", state[hf + "self_attn.o_proj.weight"]),
            (f"blk.{i}.ffn_norm.weight", state[hf + "post_attention_layernorm.weight"]),
            (f"blk.{i}.ffn_gate.weight", state[hf + "mlp.gate_proj.weight"]),
            (f"blk.{i}.ffn_up.weight", state[hf + "mlp.up_proj.weight"]),
            (f"blk.{i}.ffn_down.weight", state[hf + "mlp.down_proj.weight"]),
        ]
    out += [("output_norm.weight", state["model.norm.weight"]), ("output.weight", state["lm_head.weight"])]
    return [(name, t.astype(np.float32 if t.ndim == 1 else np.float16)) for name, t in out]


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: HF's rotate-half RoPE rows to interleaved pairs."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )
