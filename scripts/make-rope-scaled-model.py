#!/usr/bin/env python3
"""Write SmolLM2-135M-Instruct with Llama 3's RoPE frequency scaling: the shipped Q4_1 file,
every tensor and key unchanged, plus the `rope_freqs.weight` tensor (one factor per rotary
pair) that llama.cpp's converter writes for Llama 3.1+ models and llama.cpp divides each
pair's angle by. The factors follow Llama 3's formula (factor 8, low/high frequency factors
1 and 4), with an original context of 64 positions instead of 8,192, so most pairs are scaled
and a prompt of a few tokens already shows whether an engine applies them.

Needs numpy and gguf-py (vendored in the llama-cpp-python sdist, which
scripts/fetch-test-models.sh downloads). Run by scripts/fetch-test-models.sh.
Usage: make-rope-scaled-model.py SOURCE.gguf OUT.gguf
"""

from __future__ import annotations

import math
import sys

import numpy as np
import gguf

FACTOR, LOW_FREQ_FACTOR, HIGH_FREQ_FACTOR, ORIGINAL_CONTEXT = 8.0, 1.0, 4.0, 64


def llama3_factors(head_dim: int, base: float) -> np.ndarray:
    low_wavelen = ORIGINAL_CONTEXT / LOW_FREQ_FACTOR
    high_wavelen = ORIGINAL_CONTEXT / HIGH_FREQ_FACTOR
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / head_dim))
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(FACTOR)
        else:
            smooth = (ORIGINAL_CONTEXT / wavelen - LOW_FREQ_FACTOR) / (HIGH_FREQ_FACTOR - LOW_FREQ_FACTOR)
            factors.append(1.0 / ((1 - smooth) / FACTOR + smooth))
    return np.array(factors, dtype=np.float32)


def main() -> None:
    source, out = sys.argv[1], sys.argv[2]
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    dim = reader.fields[f"{arch}.embedding_length"].contents()
    heads = reader.fields[f"{arch}.attention.head_count"].contents()
    base = reader.fields[f"{arch}.rope.freq_base"].contents()
    factors = llama3_factors(dim // heads, base)
    tensors = list(reader.tensors)
    for tensor in tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype,
                               tensor.data.nbytes, tensor.tensor_type)
    writer.add_tensor_info("rope_freqs.weight", factors.shape, factors.dtype, factors.nbytes,
                           gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.write_tensor_data(factors)
    writer.close()
    print(f"{out}: rope_freqs {np.round(factors, 3).tolist()}")


if __name__ == "__main__":
    main()
