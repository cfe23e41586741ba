"""Elastic loading of offloaded KV (SpeContext, arXiv 2512.00722 §5): copy into a layer's GPU slot buffer only the
cached tokens that entered the selection, into the slots freed by those that left.

Shapes: ``src_k``/``src_v`` ``(batch, H_kv, S_max, D)`` (the layer's full K/V in pinned CPU memory; on CUDA a
device view of it through unified virtual addressing, so the kernel reads host memory over PCIe), ``dst_k``/``dst_v``
``(batch, H_kv, W, D)`` (the slot buffer, same dtype), ``pos``/``slot`` ``(batch, H_kv, W)`` int64 (source position
and destination slot of entry ``j``), ``enter`` ``(batch, H_kv, W)`` bool (entry ``j`` is copied; the others are not
read at all). Bytes moved: ``2 · enter.sum() · D · itemsize``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2

__all__ = ["elastic_copy_reference", "elastic_copy_triton"]


def elastic_copy_reference(src_k, src_v, dst_k, dst_v, pos, slot, enter) -> None:
    """PyTorch version (the CPU stand-in of the copy engine): boolean-masked gather/scatter."""
    b, h, j = enter.nonzero(as_tuple=True)
    if b.numel() == 0:
        return
    p, s = pos[b, h, j], slot[b, h, j]
    dst_k[b, h, s] = src_k[b, h, p].to(dst_k.device)
    dst_v[b, h, s] = src_v[b, h, p].to(dst_v.device)


@triton.jit
def _elastic_copy_kernel(src_k, src_v, dst_k, dst_v, pos, slot, enter, W, S, D: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    inb = w < W
    e = tl.load(enter + bh * W + w, mask=inb, other=0) != 0
    p = tl.load(pos + bh * W + w, mask=e, other=0).to(tl.int64)
    s = tl.load(slot + bh * W + w, mask=e, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = e[:, None] & (d < D)[None, :]
    src_off = bh * S * D + p[:, None] * D + d[None, :]
    dst_off = bh * W * D + s[:, None] * D + d[None, :]
    tl.store(dst_k + dst_off, tl.load(src_k + src_off, mask=m), mask=m)
    tl.store(dst_v + dst_off, tl.load(src_v + src_off, mask=m), mask=m)


def elastic_copy_triton(src_k, src_v, dst_k, dst_v, pos, slot, enter, block_w: int = 16) -> None:
    """Triton version: one program per (row, KV head, ``block_w`` entries); masked loads, so entries that did not
    enter are never read (no PCIe traffic for them). Static launch grid: capturable in a CUDA graph."""
    b, h, s_max, d = src_k.shape
    w = dst_k.shape[2]
    grid = (b * h, triton.cdiv(w, block_w))
    _elastic_copy_kernel[grid](src_k, src_v, dst_k, dst_v, pos.contiguous(), slot.contiguous(),
                               enter.to(torch.int8).contiguous(), w, s_max, D=d, BLOCK_D=next_pow2(d),
                               BLOCK_W=block_w)
