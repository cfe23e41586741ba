"""SpeContext KV offload on CUDA (arXiv 2512.00722 §5–6): offloaded decode == resident decode, elastic-loading bytes
against reloading the budget, selection overlap, copy time hidden behind compute. Run it on a GPU after changing the
offload path (KV cache manager, elastic copy kernel, memory model), from the repository root (on a GPU machine
without network access, ``tools/device_env.sh`` installs the checkout first):

    source tools/device_env.sh && python3 -P tools/specontext_offload_check.py

Model: a random-weight 8B-shaped Llama (bf16, 32 layers, 32/8 heads, head_dim 128; the decode suite's ``llama-8b``
shape, ``kvtransform.bench.decode_model.build_model``), head ``self`` (data-dependent selections; layer 0 stays on
the GPU), budget 1024. The memory pressure is **simulated**: the memory model plans for ``weights + KV of every layer up to --fit tokens`` instead of the
H200's 139 GB (a batch that truly overflows it at [2k, 32k] needs ~300 GB of pinned host memory and hours), so layers
move to CPU during the run exactly as they would on a smaller GPU.

1. **Exactness**: batch 8, prompt 2048, 160 new tokens, CUDA graphs on: tokens and selections of the offloaded run
   equal the resident run (same transformed model, ``offload`` off; both run the fused projections); the
   offloaded steps are CUDA-graph replays
   (recaptured after each layer move or cache growth).
2. **Eager timing run** (CUDA graphs off, timing events): share of the copy time hidden behind compute.
3. **Graph run** (batch 16, prompt 2048, ``--new`` tokens, both CUDA graphs): ms/step resident vs offloaded (the
   offloaded one includes its recaptures), tokens and selections equal, bytes per step vs loading all B tokens of
   every offloaded layer, overlap of consecutive selections, layers offloaded over time.

Prints a markdown table and writes ``specontext_offload_check.csv`` (into ``$OUT`` when set). Needs no Hydra; torch
2.11 / triton 3.6 / transformers 5.17. Exit status 1 when the exactness check fails.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import kvtransform as kvt
from kvtransform.bench.decode_model import build_model
from kvtransform.bench.report import save_rows


def log(*a):
    print(*a, flush=True)


def run(sp, batch, prompt, new, offload, fit, graphs=True, timing=False, chunk=64, seed=0):
    rt = sp.runtime
    rt.offload, rt.cuda_graphs, rt.offload_chunk, rt.offload_timing = offload, graphs, chunk, timing
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in rt.decode_fn.parameters()}.values())
    c = 2 * sp.info.num_kv_heads * sp.info.head_dim * 2
    rt.gpu_memory_bytes = weights + batch * sp.info.num_layers * c * fit
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, sp.info.vocab_size, (batch, prompt), generator=g).cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = sp.generate(ids, max_new_tokens=new, eos_token_id=None, return_dict_in_generate=True, progress=False)
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--new", type=int, default=1536, help="new tokens of the graph run")
    p.add_argument("--budget", type=int, default=1024)
    args = p.parse_args()
    t0 = time.perf_counter()
    model = build_model("llama-8b", torch.bfloat16, "cuda", positions=8192)
    sp = kvt.transform(model, kvt.SpeContextConfig(budget=args.budget, head="self", cuda_graphs=True),
                       progress=False)
    log(f"transform: {time.perf_counter() - t0:.1f} s, head {sp.head.name}")
    rows, ok = [], True

    # 1. exactness (CUDA graphs, layers moving during the run)
    ref, peak_ref = run(sp, 8, 2048, 160, offload=False, fit=0)
    off, peak_off = run(sp, 8, 2048, 160, offload=True, fit=2048 + 64)
    same = torch.equal(ref.sequences, off.sequences)
    same_sel = ref.stats.selection_checksums == off.stats.selection_checksums
    ok &= same and bool(off.stats.offload_moves)
    log(f"exactness: tokens equal {same}, selections equal {same_sel}, moves {len(off.stats.offload_moves)}, "
        f"peak GPU {peak_ref / 2**30:.1f} -> {peak_off / 2**30:.1f} GiB")

    # 2. eager timing: copy time hidden
    eag, _ = run(sp, 8, 2048, 96, offload=True, fit=2048 + 64, graphs=False, timing=True)
    same_eager = torch.equal(eag.sequences[:, :2048 + 96], ref.sequences[:, :2048 + 96])
    log(f"eager: hidden share {eag.stats.offload_copy_hidden}, tokens equal to resident {same_eager}")

    # 3. graph run, ms/step and bytes
    res, pr = run(sp, 16, 2048, args.new, offload=False, fit=0)
    gr, po = run(sp, 16, 2048, args.new, offload=True, fit=2048 + args.new // 2, chunk=256)  # fewer recaptures
    st = gr.stats
    same_sel16 = res.stats.selection_checksums == st.selection_checksums
    ok &= bool(torch.equal(res.sequences, gr.sequences)) and same_sel16 and bool(st.cuda_graph)
    moved, full = st.offload_bytes_per_step[1:], st.offload_full_bytes_per_step[1:]
    ratio = sum(moved) / max(sum(full), 1)
    layers = st.offload_layers_per_step
    log(f"graph run: layers offloaded at steps 0/25/50/75/100%: "
        f"{[layers[min(len(layers) - 1, i * (len(layers) - 1) // 4)] for i in range(5)]}")
    rows.append(dict(check="exact (b8, 2048+160, graphs)", tokens_equal=same, selections_equal=same_sel,
                     moves=len(off.stats.offload_moves), peak_gib_resident=peak_ref / 2**30,
                     peak_gib_offload=peak_off / 2**30))
    rows.append(dict(check="eager timing (b8, 2048+96)", tokens_equal=same_eager,
                     copy_hidden=eag.stats.offload_copy_hidden, ms_per_step=eag.stats.ms_per_step))
    rows.append(dict(check=f"b16, 2048+{args.new} (both CUDA graph)" if st.cuda_graph else
                     f"b16, 2048+{args.new} (offloaded: eager)", ms_per_step_resident=res.stats.ms_per_step,
                     ms_per_step=st.ms_per_step, overlap=st.selection_overlap, selections_equal=same_sel16,
                     bytes_per_step_mib=sum(moved) / max(len(moved), 1) / 2**20,
                     full_bytes_per_step_mib=sum(full) / max(len(full), 1) / 2**20, bytes_ratio=ratio,
                     max_layers_offloaded=max(layers) if layers else 0, moves=len(st.offload_moves),
                     peak_gib_resident=pr / 2**30, peak_gib_offload=po / 2**30,
                     tokens_equal=torch.equal(res.sequences, gr.sequences)))
    table, path = save_rows(rows, "specontext_offload_check.csv",
                            fmt=lambda v: f"{v:.4g}" if isinstance(v, float) else str(v))
    log(table)
    log(f"wrote {path}; total {time.perf_counter() - t0:.0f} s; {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
