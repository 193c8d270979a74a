"""Q4_K and Q6_K blocks written by hand from llama.cpp's layout (ggml-quants.c), because the
`gguf` package can read K-quants but not write them. Plain round-to-nearest quantizers: the
bytes are what matters, and `gguf.quants.dequantize` (the reference reader) checks them."""

from __future__ import annotations

import numpy as np

QK_K = 256


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols / 256 * 144] uint8: d, dmin (f16), 12 bytes of 6-bit
    scales and mins for 8 sub-blocks of 32, 128 bytes of 4-bit values."""
    blocks = x.astype(np.float32).reshape(-1, 8, 32)
    low, high = blocks.min(-1), blocks.max(-1)
    mins = np.maximum(-low, 0)
    scales = (high + mins) / 15
    d = np.maximum(scales.max(-1), 1e-12) / 63
    dmin = np.maximum(mins.max(-1), 1e-12) / 63
    sc = np.clip(np.round(scales / d[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(mins / dmin[:, None]), 0, 63).astype(np.uint8)
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    step = np.maximum(d16.astype(np.float32)[:, None] * sc, 1e-12)
    offset = dmin16.astype(np.float32)[:, None] * m
    q = np.clip(np.round((blocks + offset[..., None]) / step[..., None]), 0, 15)
    q = q.astype(np.uint8)
    packed = np.empty((len(blocks), 12), np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(len(blocks), 128)
    out = np.concatenate([d16[:, None].view(np.uint8), dmin16[:, None].view(np.uint8),
                          packed, qs], axis=1)
    return out.reshape(x.shape[0], -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols / 256 * 210] uint8: 128 bytes of low nibbles, 64 of
    high 2-bit pairs, 16 int8 scales (sub-blocks of 16), d (f16)."""
    blocks = x.astype(np.float32).reshape(-1, 16, 16)
    amax = np.abs(blocks).max(-1)
    scales = amax / 31
    d = np.maximum(np.abs(scales).max(-1), 1e-12) / 127
    sc = np.clip(np.round(scales / d[:, None]), -128, 127).astype(np.int8)
    d16 = d.astype(np.float16)
    step = np.maximum(d16.astype(np.float32)[:, None] * sc, 1e-12)
    q = (np.clip(np.round(blocks / step[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(len(blocks), 2, 4, 32)  # [half, quarter, l]: value 128*h + 32*k + l
    ql = np.concatenate([q[:, :, 0] & 0xF | ((q[:, :, 2] & 0xF) << 4),
                         q[:, :, 1] & 0xF | ((q[:, :, 3] & 0xF) << 4)], axis=2)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) \
        | ((q[:, :, 3] >> 4) << 6)
    out = np.concatenate([ql.reshape(len(blocks), 128), qh.reshape(len(blocks), 64),
                          sc.view(np.uint8), d16[:, None].view(np.uint8)], axis=1)
    return out.reshape(x.shape[0], -1)
