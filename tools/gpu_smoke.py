"""GPU smoke check of the spine: canonical transform of tiny random models of the four families, sdpa and eager, fp32
and bf16, on CUDA (capture, passes, verification gate, save, reload); then the dualkv transform (Triton DualKV
kernels) with save/reload.

Run it on a GPU after changing capture, passes, ops or kernels, and before spending GPU time on a benchmark (the CPU
test suite runs the kernels only under the Triton interpreter). On a GPU machine without network access:

    source tools/device_env.sh && python3 -P tools/gpu_smoke.py
"""
import tempfile
import time

import torch

import kvtransform as kvt


def main():
    dev = torch.device("cuda")
    rows = []
    for fam in ("llama", "qwen2", "qwen3", "mistral"):
        for impl in ("sdpa", "eager"):
            for dtype in (torch.float32, torch.bfloat16):
                m = kvt.tiny_model(fam, attn_implementation=impl).to(dev, dtype)
                t0 = time.perf_counter()
                opt = kvt.transform(m, "canonical", progress=False)
                v = opt.report.verification
                rows.append((fam, impl, str(dtype).split(".")[-1], opt.report.count("canonical"), len(opt.report.sites),
                             v.max_rel_error, v.passed, time.perf_counter() - t0))
    for r in rows:
        print("canonical %-8s %-6s %-9s sites %d/%d max_rel %.2e passed %s (%.1f s)" % r)
    with tempfile.TemporaryDirectory() as d:
        opt.save(d + "/a")
        o2 = kvt.load(d + "/a")
        ids = torch.randint(0, 100, (3, 40), device=dev)
        am = torch.ones_like(ids)
        am[2, :7] = 0
        with torch.no_grad():
            diff = (o2(ids, am) - opt(ids, am))[am.bool()].abs().max().item()
        print("canonical save/load on cuda: max diff", diff)
    m = kvt.tiny_model("qwen3").to(dev)
    dk = kvt.transform(m, "dualkv", progress=False)
    b = kvt.pack_shared_prefix(list(range(1, 30)), [list(range(40, 57)), list(range(60, 63))], device=dev)
    lp = b.response_logprobs(dk(b))
    print("dualkv on cuda: responses", [tuple(x.shape) for x in lp], "gate", dk.report.verification.passed,
          dk.report.verification.max_rel_error)
    with tempfile.TemporaryDirectory() as d:
        dk.save(d + "/b")
        d2 = kvt.load(d + "/b")
        with torch.no_grad():
            print("dualkv save/load on cuda: max diff", (d2(b) - dk(b)).abs().max().item())
    print("GPU SMOKE OK")


if __name__ == "__main__":
    main()
