"""Probe (not product): a fused deterministic attention backward whose dQ hand-offs follow the schedule.

Plain causal attention, one sequence, GQA. One program per (key block j, KV head), launched LIGHT FIRST (the last key
block first). Each program computes dK/dV of its keys (owned) and, per query tile, its dQ share dS @ K (5 matmuls a
step, not the two-kernel backward's 3 + 4), added into an fp32 buffer in DESCENDING key-block order per query tile
(a counter per (query head, tile)). Key block j reaches tile m at step m - j: the highest j first, so with all
programs started together nobody waits; a program only waits for programs launched before it (no deadlock).
The earlier fused design ordered the adds ascending, against the schedule: program j waited for j - 1 at every tile.

MODE 0: ordered load + add + store.  MODE 1: ordered atomic add (same order, half the traffic).
MODE 2: unordered atomic add, no counters (non-deterministic; a timing reference only).
MODE 3: a plain racing store (wrong dQ; times the 5-matmul body plus one write).
MODE 4: unordered bulk tensor reduce-add through a descriptor (non-deterministic; timing reference).
MODE 5: ordered bulk tensor reduce-add.
Configs ``BLOCK_M,BLOCK_N,warps,stages,TMA,occupancy``: occupancy 0 launches one program per item, k > 0 a persistent
grid of k programs per multiprocessor. Run on one GPU from the repository root (kvtransform importable):
    python3 -P tools/fused_bwd_order_probe.py --cfgs "64,128,8,2,1,0;64,128,8,2,1,1" --modes 1,0,2,3,4,5
(``TRITON_INTERPRET=1`` on a CPU checks the one-program-per-item modes on a small shape.)
"""
import argparse
import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _step(dk, dv, k, v, offs_n, j, h, start, T, q_base, do_base, lse_base, delta_base, DQA, LOCK, ERR, NMT,
          stride_qt, stride_dqt, offs_m, offs_d, qk_scale, QD, DOD, DQD, D: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, NKB, MASK: tl.constexpr, TMA: tl.constexpr, MODE: tl.constexpr,
          SPIN_MAX: tl.constexpr):
    q_idx = start + offs_m
    rm = q_idx < T
    q_off = q_idx.to(tl.int64)
    if TMA:
        q = QD.load([start, h * D])
        do = DOD.load([start, h * D])
    else:
        q = tl.load(q_base + q_off[:, None] * stride_qt + offs_d[None, :], mask=rm[:, None], other=0.0)
        do = tl.load(do_base + q_off[:, None] * stride_qt + offs_d[None, :], mask=rm[:, None], other=0.0)
    if MASK:
        lse2 = tl.load(lse_base + q_idx, mask=rm, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_base + q_idx, mask=rm, other=0.0)
    else:
        lse2 = tl.load(lse_base + q_idx) * 1.4426950408889634
        delta = tl.load(delta_base + q_idx)
    qkT = tl.dot(k, tl.trans(q)) * qk_scale
    pT = tl.math.exp2(qkT - lse2[None, :])
    if MASK:
        pT = tl.where((q_idx[None, :] >= offs_n[:, None]) & rm[None, :], pT, 0.0)
    dv = tl.dot(pT.to(do.dtype), do, dv)
    dpT = tl.dot(v, tl.trans(do))
    dsT = pT * (dpT - delta[None, :])
    ds16 = dsT.to(q.dtype)
    dk = tl.dot(ds16, q, dk)
    dqs = tl.dot(tl.trans(ds16), k)
    ptr = DQA + q_off[:, None] * stride_dqt + h * D + offs_d[None, :]
    if MODE == 2:
        tl.atomic_add(ptr, dqs, mask=rm[:, None], sem="relaxed")
    elif MODE == 3:  # timing only: a plain racing store (wrong sums; the body plus a write)
        tl.store(ptr, dqs, mask=rm[:, None])
    elif MODE == 4:  # unordered bulk tensor reduce-add (TMA), timing only
        DQD.atomic_add([start, h * D], dqs)
    else:
        m = start // BLOCK_M
        jmax = tl.minimum((start + BLOCK_M - 1) // BLOCK_N, NKB - 1)
        rank = jmax - j
        lock = LOCK + h * NMT + m
        cnt = 0
        while (tl.atomic_cas(lock, rank, rank, sem="acquire") != rank) & (cnt < SPIN_MAX):
            cnt += 1
        if cnt >= SPIN_MAX:
            tl.atomic_add(ERR, 1)
        if MODE == 5:
            DQD.atomic_add([start, h * D], dqs)
        elif MODE == 0:
            old = tl.load(ptr, mask=rm[:, None], other=0.0, cache_modifier=".cg")
            tl.store(ptr, old + dqs, mask=rm[:, None])
        else:
            tl.atomic_add(ptr, dqs, mask=rm[:, None], sem="relaxed")
        tl.debug_barrier()
        tl.atomic_xchg(lock, rank + 1, sem="release")
    return dk, dv


@triton.jit
def _item(Q, K, V, DO, LSE, DELTA, DK, DV, DQA, LOCK, ERR, T, GROUP, NKB, NMT, qk_scale, sm_scale, j, g,
          stride_qt, stride_kt, stride_dqt, QD, DOD, DQD, D: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, TMA: tl.constexpr, MODE: tl.constexpr, SPIN_MAX: tl.constexpr):
    k_start = j * BLOCK_N
    offs_n = k_start + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    km = offs_n[:, None] < T
    krow = offs_n.to(tl.int64)[:, None]
    k = tl.load(K + krow * stride_kt + g * D + offs_d[None, :], mask=km, other=0.0)
    v = tl.load(V + krow * stride_kt + g * D + offs_d[None, :], mask=km, other=0.0)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    diag_end = tl.minimum(k_start + BLOCK_N, T)
    full_end = tl.maximum(diag_end, (T // BLOCK_M) * BLOCK_M)
    for hh in range(0, GROUP):
        h = g * GROUP + hh
        q_base = Q + h * D
        do_base = DO + h * D
        lse_base = LSE + h.to(tl.int64) * T
        delta_base = DELTA + h.to(tl.int64) * T
        for start in range(k_start, diag_end, BLOCK_M):
            dk, dv = _step(dk, dv, k, v, offs_n, j, h, start, T, q_base, do_base, lse_base, delta_base, DQA, LOCK,
                           ERR, NMT, stride_qt, stride_dqt, offs_m, offs_d, qk_scale, QD, DOD, DQD, D, BLOCK_M, BLOCK_N,
                           NKB, True, TMA, MODE, SPIN_MAX)
        for start in range(diag_end, full_end, BLOCK_M):
            dk, dv = _step(dk, dv, k, v, offs_n, j, h, start, T, q_base, do_base, lse_base, delta_base, DQA, LOCK,
                           ERR, NMT, stride_qt, stride_dqt, offs_m, offs_d, qk_scale, QD, DOD, DQD, D, BLOCK_M, BLOCK_N,
                           NKB, False, TMA, MODE, SPIN_MAX)
        for start in range(full_end, T, BLOCK_M):
            dk, dv = _step(dk, dv, k, v, offs_n, j, h, start, T, q_base, do_base, lse_base, delta_base, DQA, LOCK,
                           ERR, NMT, stride_qt, stride_dqt, offs_m, offs_d, qk_scale, QD, DOD, DQD, D, BLOCK_M, BLOCK_N,
                           NKB, True, TMA, MODE, SPIN_MAX)
    dk = dk * sm_scale
    tl.store(DK + krow * stride_kt + g * D + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=km)
    tl.store(DV + krow * stride_kt + g * D + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=km)


@triton.jit
def _fused_bwd(Q, K, V, DO, LSE, DELTA, DK, DV, DQA, LOCK, ERR, T, H_KV, GROUP, NKB, NMT, qk_scale, sm_scale,
               stride_qt, stride_kt, stride_dqt, QD, DOD, DQD, D: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, TMA: tl.constexpr, MODE: tl.constexpr, SPIN_MAX: tl.constexpr,
               SLOTS: tl.constexpr):
    """SLOTS == 0: one program per item (key block, KV head), light first. SLOTS > 0: persistent, SLOTS programs
    (all resident), item list light first, slot s taking items in a snake order (s, 2S-1-s, 2S+s, ...): an item only
    waits for items earlier in the list, so the earliest unfinished item always progresses."""
    pid = tl.program_id(0)
    if SLOTS == 0:
        _item(Q, K, V, DO, LSE, DELTA, DK, DV, DQA, LOCK, ERR, T, GROUP, NKB, NMT, qk_scale, sm_scale,
              NKB - 1 - pid // H_KV, pid % H_KV, stride_qt, stride_kt, stride_dqt, QD, DOD, DQD, D, BLOCK_M, BLOCK_N,
              TMA, MODE, SPIN_MAX)
    else:
        n_items = NKB * H_KV
        for r in range(0, tl.cdiv(n_items, SLOTS)):
            idx = r * SLOTS + tl.where(r % 2 == 0, pid, SLOTS - 1 - pid)
            if idx < n_items:
                _item(Q, K, V, DO, LSE, DELTA, DK, DV, DQA, LOCK, ERR, T, GROUP, NKB, NMT, qk_scale, sm_scale,
                      NKB - 1 - idx // H_KV, idx % H_KV, stride_qt, stride_kt, stride_dqt, QD, DOD, DQD, D, BLOCK_M,
                      BLOCK_N, TMA, MODE, SPIN_MAX)


def fused_bwd(do, q, k, v, out, lse, scale, cfg, mode):
    """q/do/out (T, H, D), k/v (T, H_kv, D) contiguous; lse (H, T) natural log. Returns dq, dk, dv, spin errors."""
    t, h, d = q.shape
    h_kv = k.shape[1]
    bm, bn, nw, ns, tma, slots = cfg
    delta = (do.float() * out.float()).sum(-1).t().contiguous()
    dqa = torch.zeros((t, h, d), dtype=torch.float32, device=q.device)
    nkb, nmt = triton.cdiv(t, bn), triton.cdiv(t, bm)
    lock = torch.zeros((h, nmt), dtype=torch.int32, device=q.device)
    err = torch.zeros((1,), dtype=torch.int32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    qd = dod = dqd = None
    if tma or mode in (4, 5):
        from triton.tools.tensor_descriptor import TensorDescriptor
        dqd = TensorDescriptor(dqa.view(t, h * d), [t, h * d], [h * d, 1], [bm, d])
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        qd, dod = (TensorDescriptor(x.view(t, h * d), [t, h * d], [h * d, 1], [bm, d]) for x in (q, do))
    grid = (slots if slots else nkb * h_kv,)
    _fused_bwd[grid](q, k, v, do, lse, delta, dk, dv, dqa, lock, err, t, h_kv, h // h_kv, nkb, nmt,
                              scale * LOG2E, scale, q.stride(0), k.stride(0), dqa.stride(0), qd, dod, dqd, D=d,
                              BLOCK_M=bm, BLOCK_N=bn, TMA=tma, MODE=mode, SPIN_MAX=1 << 20, SLOTS=slots, num_warps=nw,
                              num_stages=ns)
    return (dqa * scale).to(q.dtype), dk, dv, err


def reference(q, k, v, do, scale):
    """float64 causal attention backward (GQA), (dq, dk, dv) and (out, lse)."""
    t, h, d = q.shape
    g = h // k.shape[1]
    q64, k64, v64, do64 = (x.double() for x in (q, k, v, do))
    k64 = k64.repeat_interleave(g, 1).requires_grad_(True)
    v64 = v64.repeat_interleave(g, 1).requires_grad_(True)
    q64 = q64.requires_grad_(True)
    s = torch.einsum("thd,shd->hts", q64, k64) * scale
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", s.softmax(-1), v64)
    o.backward(do64)
    hk = k.shape[1]
    return (q64.grad, k64.grad.view(t, hk, g, d).sum(2), v64.grad.view(t, hk, g, d).sum(2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", type=int, default=1)
    ap.add_argument("--T", default="8192,16384,32768")
    ap.add_argument("--modes", default="1,0,2")
    ap.add_argument("--cfgs", default="64,64,4,2,1,0;64,128,8,2,1,0;64,64,4,2,1,2;64,128,8,2,1,1")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    from kvtransform.kernels.dualkv import dualkv_bwd, dualkv_fwd
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float16
    cfgs = [tuple(int(x) for x in c.split(",")) + (0,) for c in a.cfgs.split(";")]
    nsm = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 2
    cfgs = [(bm, bn, nw, ns, bool(tma) and dev == "cuda", occ * nsm) for bm, bn, nw, ns, tma, occ, *_ in cfgs]
    modes = [int(m) for m in a.modes.split(",")]

    def inputs(t, h=32, hk=8, d=128, seed=0):
        gen = torch.Generator(device=dev).manual_seed(seed)
        q, k, v, do = (torch.randn(t, n, d, generator=gen, device=dev).to(dt) for n in (h, hk, hk, h))
        return q, k, v, do

    if a.check:
        shapes = [(2053, 32, 8, 128), (777, 8, 2, 128), (1000, 7, 1, 128)] if dev == "cuda" else [(100, 4, 2, 64)]
        for t, h, hk, d in shapes:
            q, k, v, do = inputs(t, h, hk, d, seed=t)
            scale = 1 / math.sqrt(d)
            cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
            sp = torch.tensor([-1], dtype=torch.int32, device=dev)
            out, lse = dualkv_fwd(q, k, v, cu, sp, scale)
            ref = reference(q, k, v, do, scale)
            base = dualkv_bwd(do, q, k, v, out, lse, cu, sp, scale)
            eb = [(b.double() - r).abs().max().item() for b, r in zip(base, ref)]
            for cfg in cfgs:
                if dev == "cpu":
                    cfg = (16, 32, 4, 1, False, 0)
                for mode in modes:
                    try:
                        r1 = fused_bwd(do, q, k, v, out, lse, scale, cfg, mode)
                        r2 = fused_bwd(do, q, k, v, out, lse, scale, cfg, mode)
                    except Exception as e:  # noqa: BLE001
                        print(f"check cfg={cfg} mode={mode}: failed {type(e).__name__}: {str(e)[-200:]}", flush=True)
                        continue
                    ef = [(x.double() - r).abs().max().item() for x, r in zip(r1[:3], ref)]
                    same = all(torch.equal(x, y) for x, y in zip(r1[:3], r2[:3]))
                    print(f"check T={t} H={h}/{hk} cfg={cfg} mode={mode}: err dq/dk/dv {ef[0]:.3e} {ef[1]:.3e} "
                          f"{ef[2]:.3e} (two-kernel {eb[0]:.3e} {eb[1]:.3e} {eb[2]:.3e}) ratio "
                          f"{max(f / max(b, 1e-6) for f, b in zip(ef, eb)):.2f} bitwise-repeat={same} "
                          f"spin_err={int(r1[3].item() + r2[3].item())}", flush=True)
                pass
    if dev != "cuda":
        return
    for t in [int(x) for x in a.T.split(",")]:
        q, k, v, do = inputs(t)
        scale = 1 / math.sqrt(128)
        cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
        sp = torch.tensor([-1], dtype=torch.int32, device=dev)
        out, lse = dualkv_fwd(q, k, v, cu, sp, scale)
        flops = 2.5 * 4 * 32 * 128 * t * t / 2  # nominal backward FLOPs (5 matmuls, causal half)

        def bench(fn):
            fn()
            torch.cuda.synchronize()
            ts = []
            for _ in range(a.reps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn()
                e1.record()
                torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1))
            ts.sort()
            return ts[len(ts) // 2]

        tb = bench(lambda: dualkv_bwd(do, q, k, v, out, lse, cu, sp, scale))
        print(f"T={t}: two-kernel backward {tb:.3f} ms ({flops / tb / 1e9:.0f} TFLOP/s)", flush=True)
        for cfg in cfgs:
            for mode in modes:
                try:
                    tf = bench(lambda: fused_bwd(do, q, k, v, out, lse, scale, cfg, mode))
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                    print(f"T={t} cfg={cfg} mode={mode}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                print(f"T={t} cfg={cfg} mode={mode}: fused {tf:.3f} ms ({flops / tf / 1e9:.0f} TFLOP/s) "
                      f"= {tf / tb:.3f}x two-kernel", flush=True)
        # the bwd of torch's flash SDPA (FA2) on the same shape, for scale
        try:
            qq, kk, vv = (x.transpose(0, 1).unsqueeze(0).detach().requires_grad_(True) for x in (q, k, v))
            o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
            g = do.transpose(0, 1).unsqueeze(0)
            tfa = bench(lambda: torch.autograd.grad(o, (qq, kk, vv), g, retain_graph=True))
            print(f"T={t}: torch SDPA (GQA) backward {tfa:.3f} ms ({flops / tfa / 1e9:.0f} TFLOP/s)", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"T={t}: SDPA failed {type(e).__name__}: {str(e)[:120]}")


if __name__ == "__main__":
    main()
