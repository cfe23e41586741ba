"""Published and calibration numbers the suites compare against (copied verbatim from ../shared/seed_tables, which
does not travel to the device machine). Lines starting with # describe the setup."""

PAPER_LAYER_H100 = """\
# DualKV paper (arXiv 2605.15422) App. F.4: one Qwen3-8B-shaped decoder layer (hidden 4096, 32 heads, 8 KV heads, head_dim 128, MLP 14336, RMSNorm, no RoPE), bf16, forward+backward of out.sum(), 1x H100-80GB, mean of 5 after 2 warm-ups, peak = torch.cuda.max_memory_allocated.
# mb = number of responses sharing one prompt; response lengths R_i = torch.randint(131, 2049, (mb,), generator=torch.Generator().manual_seed(42)); P=5K means 5059.
# FA2 = flash attention on the replicated layout N*(P+R_i) tokens (varlen); PG = the paper's own Prefix Grouper reimplementation (padded [mb, P+Rmax], prefix K/V expanded); DualKV = packed P+sum(R_i).
P,mb,fa2_ms,dualkv_ms,pg_ms,dualkv_gb,pg_gb
5059,4,93.2,36.6,72.5,4.0,9.0
5059,8,153.3,61.4,156.9,5.5,18.1
5059,16,338.9,110.4,314.2,9.0,35.4
5059,32,597.2,179.9,626.3,13.7,69.8
8192,4,148.9,57.2,124.3,4.9,12.8
8192,8,245.4,70.3,232.1,6.5,25.8
8192,16,549.2,128.2,465.4,9.9,50.7
8192,32,OOM,184.2,OOM,14.6,
16384,4,329.9,108.9,245.7,7.5,22.9
16384,8,553.0,125.4,434.9,9.0,45.9
16384,16,OOM,205.8,OOM,12.5,
32768,2,408.0,220.3,308.1,11.8,22.1
32768,4,810.2,246.4,513.6,12.5,43.0
32768,8,OOM,266.8,OOM,14.1,
65536,2,1173.5,614.1,773.3,21.9,42.3
65536,4,OOM,653.9,OOM,22.7,
65536,16,OOM,892.6,OOM,27.7,
131072,8,OOM,2096.7,OOM,44.5,
131072,32,OOM,2883.0,OOM,52.6,
"""

H200_LAYER_CALIBRATION = """\
# Measured 2026-11-30 on one H200 (torch 2.11.0+cu130): the DualKV-paper layer setup, bf16, median of 5 after 2 warm-ups.
# fa2 = flash SDPA per sequence on the replicated N*(P+R_i) tokens; flex = flex_attention (torch.compile) on packed P+sum(R_i) tokens with a shared-prefix block mask.
# floor_ms = (6 * layer matmul params * T_packed + 3.5 * 4 * head_dim * heads * visible (q,k) pairs) / 790e12.
P,mb,T_packed,T_replicated,fa2_ms,fa2_gb,flex_ms,flex_gb,floor_ms
5059,4,10026,25203,85.8,6.6,31.0,3.1,19.6
8192,8,18152,75496,231.2,17.9,56.7,4.8,38.9
8192,16,29270,152150,536.0,35.1,105.2,7.2,64.6
16384,8,26344,141032,531.3,32.6,103.2,6.6,65.7
"""

H200_ATTN_CALIBRATION = """\
# Measured 2026-11-30 on one H200 (torch 2.11.0+cu130), bf16, attention only, H=32, H_kv=8, head_dim 128.
# Packed DualKV layout [P][R1..RN], R_i = torch.randint(131, 2049, (N,), generator=torch.Generator().manual_seed(42)).
# Useful FLOPs = 4 * head_dim * H * visible (q,k) pairs; backward counted as 2.5x forward. Median of 10 after 3 warm-ups.
# flex = torch.compile(flex_attention) with a shared-prefix block mask (build time excluded from fwd/bwd, listed apart).
# flash_dense = torch flash SDPA, plain causal over the same T tokens (what a stock flash kernel reaches here).
P,N,T,mask_build_ms,flex_fwd_ms,flex_fwd_tflops,flex_bwd_ms,flex_bwd_tflops,flash_dense_fwd_tflops,flash_dense_bwd_tflops
4096,16,25174,117.3,5.12,352,16.19,279,341,302
8192,16,29270,16.2,9.57,379,28.59,318,339,313
16384,8,26344,14.1,12.87,388,37.02,337,340,311
32768,16,53846,44.2,50.94,400,153.46,332,343,315
"""


def _parse(text: str) -> list:
    """CSV text (``#`` comment lines skipped) -> list of dicts; numbers as int/float, ``OOM``/empty as None."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    head = lines[0].split(",")
    rows = []
    for ln in lines[1:]:
        row = {}
        for k, v in zip(head, ln.split(",")):
            v = v.strip()
            if v in ("", "OOM"):
                row[k] = None
            else:
                try:
                    row[k] = int(v)
                except ValueError:
                    row[k] = float(v)
        rows.append(row)
    return rows


def table(name: str) -> dict:
    """``{(P, mb_or_N): row}`` of one of the seed tables (``paper_layer``, ``h200_layer``, ``h200_attn``)."""
    text = {"paper_layer": PAPER_LAYER_H100, "h200_layer": H200_LAYER_CALIBRATION, "h200_attn": H200_ATTN_CALIBRATION}[name]
    out = {}
    for r in _parse(text):
        out[(r["P"], r.get("mb", r.get("N")))] = r
    return out
