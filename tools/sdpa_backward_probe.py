"""Probe (not product): torch SDPA backends' causal GQA backward on one GPU, timed, and whether the gradients repeat
bitwise (with and without torch.use_deterministic_algorithms). Run: python3 -P tools/sdpa_backward_probe.py"""
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

print(torch.__version__, "cudnn", torch.backends.cudnn.version(), flush=True)
for name in ("_flash_attention_backward", "_scaled_dot_product_cudnn_attention_backward",
             "_scaled_dot_product_flash_attention_backward", "_efficient_attention_backward"):
    try:
        print(getattr(torch.ops.aten, name).default._schema, flush=True)
    except Exception as e:  # noqa: BLE001
        print(name, "missing", e)


def bench(fn, reps=10):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts) // 2]


for t in (8192, 32768):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 32, t, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, 8, t, 128, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, 8, t, 128, device="cuda", generator=g).bfloat16()
    do = torch.randn(1, 32, t, 128, device="cuda", generator=g).bfloat16()
    fl = 4 * 32 * 128 * t * t / 2
    for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for det in (False, True):
            torch.use_deterministic_algorithms(det, warn_only=False)
            try:
                with sdpa_kernel(be):
                    qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
                    gqa = be != SDPBackend.EFFICIENT_ATTENTION
                    kx, vx = (kk, vv) if gqa else (kk.repeat_interleave(4, 1), vv.repeat_interleave(4, 1))
                    f = lambda: torch.nn.functional.scaled_dot_product_attention(qq, kx, vx, is_causal=True,
                                                                                  enable_gqa=gqa)
                    tf = bench(f)
                    o = f()
                    grads = lambda: torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True)
                    tb = bench(grads)
                    g1, g2 = grads(), grads()
                    same = all(torch.equal(a, b) for a, b in zip(g1, g2))
                    print(f"T={t} {be.name} deterministic={det}: fwd {tf:.3f} ms ({fl / tf / 1e9:.0f} TFLOP/s) "
                          f"bwd {tb:.3f} ms ({2.5 * fl / tb / 1e9:.0f} TFLOP/s) bitwise-repeat={same}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"T={t} {be.name} deterministic={det}: failed {type(e).__name__}: {str(e)[:160]}", flush=True)
    torch.use_deterministic_algorithms(False)
