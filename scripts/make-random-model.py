#!/usr/bin/env python3
"""Write a small random-weight model of one architecture (llama, qwen2 or qwen3) with
SmolLM2's vocabulary and the pre-tokenizer of the family's real files (`llama-bpe` for llama,
`qwen2` for both Qwens), for testing an architecture without downloading weights.

Two layers, width 64, 4 query heads and 2 K/V heads, FFN 128, untied output, Q8_0 matrices.
qwen2 adds Q/K/V biases; qwen3 adds Q/K RMSNorm and a head size of 32 (not the width over the
head count, which is 16), as its models have.

The same bytes on every run and every numpy version: the values come from a counter hashed by
splitmix64 in integer arithmetic (numpy's own generators may change their streams), and the
tests' llama.cpp references were made from those bytes (scripts/fetch-test-models.sh checks
their sha256).

Needs numpy and gguf-py (vendored in the llama-cpp-python sdist).
Usage: make-random-model.py ARCH TOKENIZER_SOURCE.gguf OUT.gguf
"""

from __future__ import annotations

import sys

import numpy as np
import gguf

DIM, FFN, LAYERS, HEADS, KV_HEADS, CONTEXT = 64, 128, 2, 4, 2, 2048


class Stream:
    """Values of unit variance, uniform on [-√3, √3): splitmix64 of a running counter, 24 bits
    of each hash, so every step is exact integer or float64 arithmetic."""

    def __init__(self, seed: int) -> None:
        self.counter = np.uint64(seed) << np.uint64(32)

    def uniform(self, count: int) -> np.ndarray:
        with np.errstate(over="ignore"):
            z = self.counter + np.arange(1, count + 1, dtype=np.uint64) * np.uint64(
                0x9E3779B97F4A7C15)
            self.counter += np.uint64(count) * np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
        unit = (z >> np.uint64(40)).astype(np.float64) / float(1 << 24)
        return (2.0 * unit - 1.0) * np.sqrt(3.0)


def main() -> None:
    arch, source, out = sys.argv[1], sys.argv[2], sys.argv[3]
    stream = Stream({"llama": 1, "qwen2": 2, "qwen3": 3}[arch])
    head_dim = 32 if arch == "qwen3" else DIM // HEADS
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(f"random {arch}")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0 if arch == "llama" else 1000000.0)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    # The pre-tokenizer each family's real files name (SmolLM2's vocabulary, their splitting).
    writer.add_tokenizer_pre("llama-bpe" if arch == "llama" else "qwen2")
    for field in reader.fields.values():
        if field.name.startswith("tokenizer.") and field.name != "tokenizer.ggml.pre":
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())

    def matrix(name: str, rows: int, cols: int, scale: float) -> None:
        values = (stream.uniform(rows * cols) * scale).astype(np.float32).reshape(rows, cols)
        writer.add_tensor(name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def vector(name: str, length: int, mean: float, scale: float) -> None:
        writer.add_tensor(name, (mean + stream.uniform(length) * scale).astype(np.float32))

    matrix("token_embd.weight", vocab, DIM, 1.0)
    for i in range(LAYERS):
        vector(f"blk.{i}.attn_norm.weight", DIM, 1.0, 0.1)
        matrix(f"blk.{i}.attn_q.weight", HEADS * head_dim, DIM, 0.3)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, DIM, 0.3)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, DIM, 0.3)
        if arch == "qwen2":
            vector(f"blk.{i}.attn_q.bias", HEADS * head_dim, 0.0, 1.0)
            vector(f"blk.{i}.attn_k.bias", KV_HEADS * head_dim, 0.0, 1.0)
            vector(f"blk.{i}.attn_v.bias", KV_HEADS * head_dim, 0.0, 1.0)
        if arch == "qwen3":
            vector(f"blk.{i}.attn_q_norm.weight", head_dim, 1.0, 0.3)
            vector(f"blk.{i}.attn_k_norm.weight", head_dim, 1.0, 0.3)
        matrix(f"blk.{i}.attn_output.weight", DIM, HEADS * head_dim, 0.2)
        vector(f"blk.{i}.ffn_norm.weight", DIM, 1.0, 0.1)
        matrix(f"blk.{i}.ffn_gate.weight", FFN, DIM, 0.3)
        matrix(f"blk.{i}.ffn_up.weight", FFN, DIM, 0.3)
        matrix(f"blk.{i}.ffn_down.weight", DIM, FFN, 0.2)
    vector("output_norm.weight", DIM, 1.0, 0.1)
    matrix("output.weight", vocab, DIM, 0.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{out}: random {arch}, head size {head_dim}")


if __name__ == "__main__":
    main()
