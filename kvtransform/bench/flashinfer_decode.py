"""FlashInfer's batch decode kernel in our runtime's decode program: the ``flashinfer`` method of the ``decode`` suite
(BENCHMARKS.md, "Decode throughput"; FlashInfer: Ye et al., arXiv 2501.01005,
``flashinfer.BatchDecodeWithPagedKVCacheWrapper``, its ``fa2`` backend).

The method is our ``dense`` method (same compiled program, same CUDA-graph step, same prefill) with every layer's
attention, ``kvt::sparse_decode_attention`` in slot mode, replaced by ``kvt_bench::flashinfer_decode``, which calls
FlashInfer's kernel. So the two rows differ only in the attention kernel.

How the cache is handed over (no copy): a layer's cache ``(batch, H_kv, S_max, D)`` is FlashInfer's paged cache in
the ``HND`` layout with one page of ``S_max`` tokens per request (page ``b`` = row ``b``). The kernel reads each row's
length from FlashInfer's last-page-length buffer, which the op refreshes from ``cache_seqlens`` on the device at
every call, so one plan serves every step and the whole step stays one CUDA graph (FlashInfer's CUDA-graph mode:
fixed batch, buffers owned by the caller). FlashInfer's scheduler splits a request's KV by pages, so one page per
request means no split-KV: ``batch × H_kv`` thread blocks per layer (said in the row's note).

The new token's K/V are not in the cache during the step (our runtime appends them after it): the kernel's output
over the cache is merged with the new token through the kernel's log-sum-exp, which FlashInfer returns in base 2
(``m·log2(e) + log2(d)``, ``include/flashinfer/attention/state.cuh``). The first call of each plan checks every row
against :func:`~kvtransform.kernels.sparse_decode.sparse_decode_reference` and raises when one differs (the plan is
then dropped, so the next call is checked again): a change of either convention cannot give a silently wrong row.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch

__all__ = ["FlashInferDecode", "flashinfer_program", "register", "OP"]

LN2 = math.log(2.0)
CHECK_TOL = 2e-2  # first-call check: max |ours - reference| <= CHECK_TOL * max |reference| + 1e-3 (bf16 output)

_IMPLS: Dict[int, Callable] = {}  # handle -> callable(q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale)


@torch.library.custom_op("kvt_bench::flashinfer_decode", mutates_args=())
def _flashinfer_decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          cache_seqlens: torch.Tensor, k_new: Optional[torch.Tensor], v_new: Optional[torch.Tensor],
                          softmax_scale: float, handle: int) -> torch.Tensor:
    impl = _IMPLS.get(int(handle))
    if impl is None:
        raise RuntimeError(f"kvt_bench::flashinfer_decode: no implementation registered under handle {handle} "
                           f"(kvtransform.bench.flashinfer_decode.register)")
    return impl(q, k_cache, v_cache, cache_seqlens, k_new, v_new, softmax_scale)


@_flashinfer_decode_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, k_new, v_new, softmax_scale, handle):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


OP = torch.ops.kvt_bench.flashinfer_decode.default


def register(impl: Callable) -> int:
    """Register ``impl(q, k_cache, v_cache, cache_seqlens, k_new, v_new, softmax_scale) -> (batch, H, D)`` for the
    op; returns the handle that :func:`flashinfer_program` bakes into the program."""
    handle = len(_IMPLS) + 1
    _IMPLS[handle] = impl
    return handle


def merge_new_token(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k_new: torch.Tensor,
                    v_new: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Attention over the cache (``out (batch, H, D)``, natural-log ``lse (batch, H)`` of the scaled scores) merged
    with one more key/value per row, ``k_new``/``v_new (batch, H_kv, D)`` (GQA: query head ``h`` reads KV head
    ``h // (H / H_kv)``). Computed in fp32, returned in ``q.dtype``. A row with an empty cache (``lse = -inf``)
    gets ``v_new``."""
    b, h, d = q.shape
    g = h // k_new.shape[1]
    s_new = torch.einsum("bkgd,bkd->bkg", q.float().view(b, -1, g, d), k_new.float()).reshape(b, h) * softmax_scale
    lse = lse.float()
    m = torch.maximum(lse, s_new)
    w_cache, w_new = torch.exp(lse - m), torch.exp(s_new - m)
    v = v_new.float().repeat_interleave(g, dim=1)
    merged = (out.float() * w_cache[..., None] + v * w_new[..., None]) / (w_cache + w_new)[..., None]
    return merged.to(q.dtype)


class FlashInferDecode:
    """The op's FlashInfer implementation for one model shape: one ``BatchDecodeWithPagedKVCacheWrapper`` per
    ``(batch, S_max)`` (CUDA-graph mode fixes the batch), planned at its first call (outside a CUDA-graph capture)
    for ``H``/``H_kv``/``D``/dtype/``softmax_scale`` of that call. At most ``max_plans`` plans are kept (the least
    recently used is dropped with its workspace): a CUDA graph captured over a dropped plan must not be replayed,
    which our runtime never does (each ``decode_from`` captures its own graph, for one batch).

    Args:
        tensor_cores: FlashInfer's ``use_tensor_cores`` (its prefill kernel for decode; faster for large GQA groups).
        workspace_mib: FlashInfer's float workspace per wrapper.
        max_plans: plans (and workspaces) kept at once.

    Raises:
        ImportError: FlashInfer is not installed.
        RuntimeError: the first call of a plan disagrees with the reference (see the module docstring), or a plan is
            needed during a CUDA-graph capture (run one step eagerly first: our runtime does).
    """

    def __init__(self, tensor_cores: bool = False, workspace_mib: int = 128, max_plans: int = 2):
        import flashinfer

        self.flashinfer = flashinfer
        self.tensor_cores = bool(tensor_cores)
        self.workspace_mib = int(workspace_mib)
        self.max_plans = max(1, int(max_plans))
        self._plans: dict = {}  # insertion order = least recently used first

    def _plan(self, q, k_cache, softmax_scale):
        b, h, d = q.shape
        h_kv, s_max = k_cache.shape[1], k_cache.shape[2]
        key = (b, h, h_kv, d, s_max, q.dtype, k_cache.dtype, float(softmax_scale), q.device)
        plan = self._plans.pop(key, None)
        if plan is not None:
            self._plans[key] = plan  # most recently used last
            return plan, False
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("FlashInfer decode: the first call for a batch size must run outside a CUDA-graph "
                               "capture (its plan reads host data); run one eager step first")
        dev = q.device
        indptr = torch.arange(b + 1, dtype=torch.int32, device=dev)
        indices = torch.arange(b, dtype=torch.int32, device=dev)
        last = torch.full((b,), s_max, dtype=torch.int32, device=dev)
        ws = torch.zeros(self.workspace_mib << 20, dtype=torch.uint8, device=dev)
        wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, kv_layout="HND", use_cuda_graph=True, use_tensor_cores=self.tensor_cores,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last,
            backend="fa2")
        wrapper.plan(indptr, indices, last, h, h_kv, d, s_max, pos_encoding_mode="NONE", q_data_type=q.dtype,
                     kv_data_type=k_cache.dtype, sm_scale=float(softmax_scale))
        plan = dict(wrapper=wrapper, last=last, workspace=ws)
        while len(self._plans) >= self.max_plans:
            self._plans.pop(next(iter(self._plans)))  # its wrapper and workspace go with it
        self._plans[key] = plan
        return plan, True

    def __call__(self, q, k_cache, v_cache, cache_seqlens, k_new, v_new, softmax_scale):
        plan, first = self._plan(q, k_cache, softmax_scale)
        plan["last"].copy_(cache_seqlens)  # the kernel reads each row's length here (one page per row)
        out, lse2 = plan["wrapper"].run(q.contiguous(), (k_cache, v_cache), return_lse=True)
        if k_new is None:
            res = out.to(q.dtype)
        else:
            res = merge_new_token(out, lse2.float() * LN2, q, k_new, v_new, softmax_scale)
        if first:
            try:
                for row in range(q.shape[0]):  # every row of the first call: lengths and page mapping per row
                    check_row(res, q, k_cache, v_cache, cache_seqlens, k_new, v_new, softmax_scale, row)
            except RuntimeError:
                self._plans = {k: p for k, p in self._plans.items() if p is not plan}  # never used unchecked
                raise
        return res


def check_row(res, q, k_cache, v_cache, cache_seqlens, k_new, v_new, softmax_scale, row: int = 0) -> float:
    """Max abs difference of ``res[row]`` from the fp32 reference of that row; raises RuntimeError past
    :data:`CHECK_TOL` (relative to the reference's largest entry, plus 1e-3)."""
    from kvtransform.kernels.sparse_decode import sparse_decode_reference

    sl = slice(row, row + 1)
    ref = sparse_decode_reference(q[sl], k_cache[sl], v_cache[sl], None, cache_seqlens[sl],
                                  None if k_new is None else k_new[sl], None if v_new is None else v_new[sl],
                                  softmax_scale).float()
    err = float((res[sl].float() - ref).abs().max())
    bound = CHECK_TOL * float(ref.abs().max()) + 1e-3
    if not err <= bound:
        raise RuntimeError(f"FlashInfer decode disagrees with the reference on row {row}: max |diff| {err:.3g} > "
                           f"{bound:.3g}. Its LSE convention (base 2) or the one-page-per-row HND layout is not what "
                           f"kvtransform.bench.flashinfer_decode assumes for this FlashInfer version")
    return err


def flashinfer_program(slot_program: torch.fx.GraphModule, handle: int) -> torch.fx.GraphModule:
    """A copy of a slot-mode decode program (:func:`~kvtransform.passes.sparse_decode.slot_mode_program`) whose
    ``kvt::sparse_decode_attention`` sites call ``kvt_bench::flashinfer_decode`` with ``handle`` instead (same
    inputs; the unused ``indices`` dropped). Shares the program's parameters.

    Raises:
        ValueError: no slot-mode site in ``slot_program`` (a gather-mode site reads selected tokens, which the
            FlashInfer method does not do).
    """
    from kvtransform.passes.sparse_decode import rewrite_sites

    need = ("flashinfer_program needs a slot-mode decode program (every kvt::sparse_decode_attention with "
            "indices=None): pass slot_mode_program(decode_program)")

    def to_flashinfer(n):  # (on rewrite_sites' copy: a refused program is left as it was)
        q, kc, vc, idx, lens, kn, vn, scale = n.args
        if idx is not None:
            raise ValueError(need)
        n.target = OP
        n.args = (q, kc, vc, lens, kn, vn, scale, int(handle))

    return rewrite_sites(slot_program, to_flashinfer, need)
