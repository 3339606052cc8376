#!/usr/bin/env python3
"""Write test vectors for Airlock's reference dequantizers (crates/kernels/src/formats).

For each GGUF tensor format Airlock loads, random blocks (each f16 scale replaced by a finite
random value) and what llama.cpp's own Python reference, gguf-py's `gguf.quants.dequantize`,
makes of them. One file per format, tests/data/formats/blocks/<FORMAT>.bin:

    u32 block count (little-endian) | the blocks' bytes | their values as f32 little-endian

Needs numpy and gguf-py (vendored in the llama-cpp-python sdist:
PYTHONPATH=<sdist>/vendor/llama.cpp/gguf-py). Not needed by CI or the tests.
Usage: python3 scripts/reference/make_format_vectors.py [--out DIR]
"""

from __future__ import annotations

import argparse
import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

REPO_ROOT = Path(__file__).resolve().parents[2]

# Format -> byte offsets of its f16 scales inside a block.
SCALES = {
    "F32": [], "F16": [0], "BF16": [], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0],
    "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}
BLOCKS = {"F32": 64, "F16": 64, "BF16": 64}


def random_blocks(name: str, rng: np.random.Generator) -> bytes:
    block_values, block_bytes = GGML_QUANT_SIZES[T[name]]
    count = BLOCKS.get(name, 8 if block_values == 256 else 16)
    raw = bytearray(rng.integers(0, 256, size=count * block_bytes, dtype=np.uint8).tobytes())
    for b in range(count):
        for offset in SCALES[name]:
            magnitude = 10 ** rng.uniform(-4, 0)
            value = np.float16(magnitude * rng.choice([-1.0, 1.0]))
            raw[b * block_bytes + offset:b * block_bytes + offset + 2] = value.tobytes()
    if name == "F32":
        raw = bytearray(rng.normal(size=count).astype("<f4").tobytes())
    if name == "BF16":  # a finite bfloat16: the high half of a normal f32
        values = rng.normal(size=count).astype("<f4").view("<u4") >> 16
        raw = bytearray(values.astype("<u2").tobytes())
    return bytes(raw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "data" / "formats" / "blocks")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(27)
    for name in SCALES:
        raw = random_blocks(name, rng)
        block_bytes = GGML_QUANT_SIZES[T[name]][1]
        count = len(raw) // block_bytes
        data = np.frombuffer(raw, dtype=np.uint8).reshape(count, block_bytes)
        values = dequantize(data, T[name]).astype("<f4").reshape(-1)
        assert np.all(np.isfinite(values)), name
        path = args.out / f"{name}.bin"
        path.write_bytes(struct.pack("<I", count) + raw + values.tobytes())
        print(f"{path}: {count} blocks, {values.size} values")


if __name__ == "__main__":
    main()
