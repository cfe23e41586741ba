"""Prefix-tree attention on the GPU (Tree Training, arXiv 2511.00413; the kernels generalise DualKV's, arXiv
2605.15422, to any depth): correctness of the Triton kernels in bf16/fp16 and their speed on an agentic tree. Run on
the H200 from the repository root:

    source tools/device_env.sh && python3 -P tools/prefix_tree_gpu_check.py [--quick] [--skip-flex] [--skip-flat]

1. **Numerics** (``check`` rows): forward and backward of ``kvtransform.kernels.prefix_tree`` against a float64
   reference (node by node), bf16 and fp16, on trees of depth 1-4 with odd node lengths (1, 15, 17, 97, 1025),
   GQA 32/8 at D=128, GQA 4 at D=80, MHA at D=64, GQA 7 at D=256. Rule (``docs/ARCHITECTURE.md``): kernel max error
   <= 2 x PyTorch's own error in that dtype (the reference with its matmuls in the dtype) + floor (bf16 2e-3, fp16
   5e-4). The backward run twice must be bitwise equal; the registered op (autograd) must give the kernels' bits.
2. **Timing** (``fwd``/``fwd+bwd`` rows, ``triton.testing.do_bench`` medians): an agentic shape: a 4096-token shared
   system+task prompt, then 3 turns branching 4, 2, 2 ways (16 trajectories, 29 nodes), turns 256-2048 tokens
   (seeded), H=32, H_kv=8, D=128, bf16. Methods: ``kvt_tree`` (``kvt.prefix_tree_attention``, forward and backward
   through the registered op), ``flex_tree`` (``flex_attention`` compiled for this shape, ``create_block_mask`` of
   the tree mask, GQA by ``enable_gqa``), ``sdpa_flat`` (each trajectory as its own sequence through
   ``F.scaled_dot_product_attention(is_causal=True)``: the shared tokens repeated, what training without packing
   runs).

Output: one CSV line per row, ``method,shape,mode,ms,tflops_useful,peak_mem_gib,status,detail``. Useful FLOPs are the
tree's (``4 * H * D * visible pairs`` forward, 3.5x that forward+backward) for every method, so ``tflops_useful``
compares like with like. Works with torch 2.11 / triton 3.6 and triton 3.9; no Hydra. Exit status 1 when a check
fails. Budget: well under 4 minutes on an H200 (most of it compiling flex and the kernels).
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch
import torch.nn.functional as F
import triton

import kvtransform as kvt
from kvtransform.kernels import prefix_tree as K
from kvtransform.tree_layout import PrefixTreeLayout

DEV = torch.device("cuda")
FLOOR = {torch.bfloat16: 2e-3, torch.float16: 5e-4}
HEADER = "method,shape,mode,ms,tflops_useful,peak_mem_gib,status,detail"


def row(method, shape, mode, ms=float("nan"), tflops=float("nan"), mem=float("nan"), status="ok", detail=""):
    detail = " ".join(str(detail).replace(",", ";").split())
    print(f"{method},{shape},{mode},{ms:.4f},{tflops:.1f},{mem:.3f},{status},{detail}", flush=True)


def tree(prompt, fanout, turn, seed, roots=1):
    """DFS-packed layout: ``roots`` trees, each a ``prompt``-token root then ``len(fanout)`` levels of turns
    (``fanout[l]`` children per node at level ``l``), turn lengths drawn from ``turn`` (a (lo, hi) range or a list
    of choices)."""
    rng = random.Random(seed)
    lengths, parents = [], []

    def draw():
        return rng.randint(*turn) if isinstance(turn, tuple) else rng.choice(turn)

    def grow(parent, level):
        for _ in range(fanout[level]):
            lengths.append(draw())
            parents.append(parent)
            if level + 1 < len(fanout):
                grow(len(lengths) - 1, level + 1)

    for _ in range(roots):
        lengths.append(prompt)
        parents.append(-1)
        if fanout:
            grow(len(lengths) - 1, 0)
    return PrefixTreeLayout.from_parents(lengths, parents, device=DEV)


def leaves(lay):
    has_child = set(p for p in lay.parents if p >= 0)
    return [n for n in range(lay.num_nodes) if n not in has_child]


# ====================================================================================================== numerics
def check_case(name, lay, h, h_kv, d, dtype):
    t = lay.total_tokens
    scale = d ** -0.5
    q, k, v, do = (torch.randn(t, hh, d, device=DEV, dtype=dtype) for hh in (h, h_kv, h_kv, h))
    f64 = [x.double() for x in (q, k, v, do)]
    with torch.no_grad():
        ref_out, ref_lse = K.prefix_tree_attention_reference(*f64[:3], lay, scale)
        ref_grads = K.prefix_tree_attention_reference_backward(f64[3], None, *f64[:3], lay, scale)
    qp, kp, vp = (x.clone().requires_grad_(True) for x in (q, k, v))
    pt_out, pt_lse = K.prefix_tree_attention_reference(qp, kp, vp, lay, scale, upcast=False)
    pt_grads = torch.autograd.grad(pt_out, (qp, kp, vp), do)
    del qp, kp, vp
    out, lse = K.prefix_tree_fwd(q, k, v, lay.cu_seqlens, lay.key_range_ptr, lay.key_ranges, scale)
    bargs = (lay.cu_seqlens, lay.key_range_ptr, lay.key_ranges, lay.query_range_ptr, lay.query_ranges, scale)
    grads = K.prefix_tree_bwd(do, q, k, v, out, lse, *bargs)
    again = K.prefix_tree_bwd(do, q, k, v, out, lse, *bargs)
    if q.is_cuda:
        torch.cuda.synchronize()
    ok, worst, parts = True, 0.0, []
    for nm, a, p, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (pt_out, pt_lse, *pt_grads),
                           (ref_out, ref_lse, *ref_grads)):
        e, ep = (a.double() - r).abs().max().item(), (p.double() - r).abs().max().item()
        bound = 2 * ep + FLOOR[dtype]
        ok &= e <= bound  # NaN fails
        worst = max(worst, e / bound if e == e else float("inf"))
        parts.append(f"{nm} {e:.2e}/{ep:.2e}")
    det = all(torch.equal(a, b) for a, b in zip(grads, again))
    # the registered op through autograd gives the kernels' bits
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
    op_out = kvt.prefix_tree_attention(qq, kk, vv, lay, softmax_scale=scale)
    op_grads = torch.autograd.grad(op_out, (qq, kk, vv), do)
    same = torch.equal(op_out, out) and all(torch.equal(a, b) for a, b in zip(op_grads, grads))
    status = "ok" if ok and det and same else "FAIL"
    row("kvt_tree", f"{name} T={t} depth={lay.depth} H={h}/{h_kv} D={d} {str(dtype)[6:]}", "check",
        status=status, detail=f"err/bound {worst:.3f}; kernel/pytorch max err: {' '.join(parts)}; "
                              f"deterministic {det}; op==kernel {same}")
    return status == "ok"


def numerics(quick):
    cases = [
        ("agentic-small", tree(1025, (2, 2), [97, 1025, 17], 1), 32, 8, 128),
        ("odd-2trees", tree(97, (2, 1, 2), [1, 15, 17, 97], 2, roots=2), 8, 2, 80),
        ("chain+roots", PrefixTreeLayout.from_parents([1025, 17, 1, 97, 15, 1], [-1, 0, 1, 2, -1, -1], device=DEV),
         4, 4, 64),
        ("dualkv-shape", tree(1025, (3,), [513, 1, 17], 3), 7, 1, 256),
    ]
    if quick:
        cases = cases[:2]
    ok = True
    for dtype in (torch.bfloat16, torch.float16):
        for name, lay, h, hkv, d in cases:
            ok &= check_case(name, lay, h, h_kv=hkv, d=d, dtype=dtype)
    return ok


# ====================================================================================================== timing
def bench(fn, grads_of=()):
    torch.cuda.synchronize()
    fn()  # compile / warm up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    mem = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    ms = triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=list(grads_of), return_mode="median")
    return ms, mem


def timing(skip_flex, skip_flat, quick):
    lay = tree(4096, (4, 2, 2), (256, 2048), seed=0)
    h, h_kv, d, dtype = 32, 8, 128, torch.bfloat16
    t = lay.total_tokens
    lv = leaves(lay)
    traj_lens = [sum(lay.lengths[m] for m in lay.ancestors_of(n) + [n]) for n in lv]
    shape = f"agentic P=4096 fanout=4x2x2 N={len(lv)} T={t} flat={sum(traj_lens)} H={h}/{h_kv} D={d} bf16"
    fwd_flops = 4 * h * d * lay.visible_pairs()
    scale = d ** -0.5
    q, k, v = (torch.randn(t, hh, d, device=DEV, dtype=dtype, requires_grad=True) for hh in (h, h_kv, h_kv))
    do = torch.randn(t, h, d, device=DEV, dtype=dtype)

    def report(method, fwd, step, leaves_, detail=""):
        for mode, fn, mult in (("fwd", fwd, 1.0), ("fwd+bwd", step, 3.5)):
            try:
                ms, mem = bench(fn, leaves_ if mode == "fwd+bwd" else ())
                row(method, shape, mode, ms, mult * fwd_flops / ms / 1e9, mem, detail=detail)
            except Exception as e:  # a baseline that cannot run here is a row, not a crash
                row(method, shape, mode, status="error", detail=f"{type(e).__name__}: {str(e)[:160]}")

    # ours: the registered op, forward and backward (autograd)
    def kvt_fwd():
        with torch.no_grad():
            return kvt.prefix_tree_attention(q, k, v, lay, softmax_scale=scale)

    def kvt_step():
        kvt.prefix_tree_attention(q, k, v, lay, softmax_scale=scale).backward(do)

    report("kvt_tree", kvt_fwd, kvt_step, (q, k, v), detail=f"nodes={lay.num_nodes} depth={lay.depth}")

    if not skip_flex:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            node_of = torch.repeat_interleave(torch.arange(lay.num_nodes, device=DEV),
                                              torch.tensor(lay.lengths, device=DEV))
            anc = torch.zeros(lay.num_nodes, lay.num_nodes, dtype=torch.bool, device=DEV)
            for n in range(lay.num_nodes):
                anc[n, lay.ancestors_of(n)] = True

            def tree_mask(b, hh, q_idx, kv_idx):
                nq, nk = node_of[q_idx], node_of[kv_idx]
                return anc[nq, nk] | ((nq == nk) & (kv_idx <= q_idx))

            t0 = time.perf_counter()
            try:
                bm = create_block_mask(tree_mask, None, None, t, t, device=DEV, _compile=True)
            except TypeError:  # a torch without _compile
                bm = create_block_mask(tree_mask, None, None, t, t, device=DEV)
            mask_s = time.perf_counter() - t0
            flex = torch.compile(flex_attention, dynamic=False)
            qf, kf, vf = (x.detach().transpose(0, 1)[None].requires_grad_(True) for x in (q, k, v))
            dof = do.transpose(0, 1)[None]

            def flex_fwd():
                with torch.no_grad():
                    return flex(qf, kf, vf, block_mask=bm, scale=scale, enable_gqa=True)

            def flex_step():
                flex(qf, kf, vf, block_mask=bm, scale=scale, enable_gqa=True).backward(dof)

            t0 = time.perf_counter()
            flex_step()
            torch.cuda.synchronize()
            with torch.no_grad():
                err = (flex_fwd()[0].transpose(0, 1).float() - kvt_fwd().float()).abs().max().item()
            report("flex_tree", flex_fwd, flex_step, (qf, kf, vf),
                   detail=f"block mask {mask_s:.1f} s; compile {time.perf_counter() - t0:.1f} s; "
                          f"max|flex-kvt| {err:.2e}")
            del qf, kf, vf
        except Exception as e:
            row("flex_tree", shape, "fwd+bwd", status="error", detail=f"{type(e).__name__}: {str(e)[:160]}")

    if not skip_flat:
        # each trajectory its own sequence (the shared tokens copied), (1, H, L, D) for SDPA
        seqs = [torch.cat([torch.arange(lay._cu[m], lay._cu[m + 1], device=DEV)
                           for m in lay.ancestors_of(n) + [n]]) for n in lv]
        flat = [[x.detach()[idx].transpose(0, 1)[None].contiguous().requires_grad_(True) for x in (q, k, v)]
                for idx in seqs]
        dos = [do[idx].transpose(0, 1)[None].contiguous() for idx in seqs]
        leaves_ = [x for tr in flat for x in tr]
        gqa = {"enable_gqa": True}
        try:
            F.scaled_dot_product_attention(*flat[0], is_causal=True, scale=scale, **gqa)
        except TypeError:  # older torch: no enable_gqa
            gqa = None

        def sdpa(qs, ks, vs):
            if gqa is None:
                ks, vs = (x.repeat_interleave(h // h_kv, 1) for x in (ks, vs))
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, **gqa)

        def flat_fwd():
            with torch.no_grad():
                return [sdpa(*tr) for tr in flat]

        def flat_step():
            outs = [sdpa(*tr) for tr in flat]
            torch.autograd.backward(outs, dos)

        report("sdpa_flat", flat_fwd, flat_step, leaves_,
               detail=f"{len(flat)} sequences of {min(traj_lens)}-{max(traj_lens)} tokens; "
                      f"{'enable_gqa' if gqa else 'K/V repeated'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two numerics shapes instead of four")
    ap.add_argument("--skip-flex", action="store_true", help="no FlexAttention baseline")
    ap.add_argument("--skip-flat", action="store_true", help="no flattened SDPA baseline")
    ap.add_argument("--skip-check", action="store_true", help="timing only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("prefix_tree_gpu_check: needs a CUDA device", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(f"# torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name(0)}", flush=True)
    print(HEADER, flush=True)
    torch.manual_seed(0)
    ok = True if args.skip_check else numerics(args.quick)
    print(f"# numerics {'passed' if ok else 'FAILED'} ({time.perf_counter() - t0:.0f} s)", flush=True)
    timing(args.skip_flex, args.skip_flat, args.quick)
    print(f"# total {time.perf_counter() - t0:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
