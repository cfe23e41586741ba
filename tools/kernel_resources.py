"""Registers, spills and shared memory of the DualKV Triton kernels for Hopper (sm_90a), compiled on this machine:
no GPU needed (``triton.compile`` for a ``GPUTarget("cuda", 90, 32)``, then the wheel's ``ptxas -v``).

Run it when you change a DualKV kernel or consider a new launch config, before spending GPU time on it: a config
that spills registers or exceeds sm_90's shared memory shows up here.

    python tools/kernel_resources.py dkdv 64,128,8,2,1 64,64,8,2,1
    python tools/kernel_resources.py fwd 32,128,8,3,1,4 --dtype fp16 --head-dim 80
    python tools/kernel_resources.py dq 32,64,8,3,1,4 --tree      # the prefix-tree variant (CSR context ranges)

Each config is ``BLOCK_M,BLOCK_N,num_warps,num_stages[,TMA[,PACK]]`` (TMA 0/1; PACK: the forward's and dQ's packed
GQA rows, 1 = unpacked). The last column says whether ptxas serialized the wgmma pipeline (its warning C7515: a
non-wgmma instruction defines an accumulator inside a pipeline stage). The numbers are this machine's Triton (and its
ptxas) for sm_90a; the GPU may run another
Triton, whose register allocation can differ: a config is decided by timing it on the GPU
(``kvtransform bench dualkv-attn tune=true``), not by this table. BENCHMARKS.md ("DualKV attention op") has the
default's numbers.
"""
import argparse
import inspect
import os
import re
import subprocess
import tempfile

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
os.environ["TRITON_INTERPRET"] = "0"  # the kernels must be compiled, not interpreted

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvtransform.kernels import dualkv as K  # noqa: E402

KERNELS = {"fwd": K._fwd_kernel, "dq": K._bwd_dq_kernel, "dkdv": K._bwd_dkdv_kernel}
DTYPES = {"bf16": "bf16", "fp16": "fp16"}
_F32_PTRS = {"LSE", "DELTA"}
_I32_PTRS = {"CU", "KCTX_LO", "KCTX_HI", "QCTX_LO", "QCTX_HI", "WSEG", "WBLK"}
_TREE_PTRS = ("KPTR", "QPTR", "KNXT")  # the prefix tree's range pointers and whole-block table (int32)
_DATA_PTRS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV"}
SM90_SHARED_BYTES = 227 * 1024  # shared memory one block may take on sm_90 (H100/H200)
_DESCRIPTORS = {"fwd": ("KD", "VD"), "dq": ("KD", "VD"), "dkdv": ("QD", "DOD")}


def _ptxas() -> str:
    d = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):  # the newer one reads the PTX versions this Triton emits
        if os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    raise FileNotFoundError(f"no ptxas in {d}: this Triton wheel does not ship one")


def compile_kernel(kind: str, bm: int, bn: int, warps: int, stages: int, tma: bool = False, pack: int = 1,
                   dtype: str = "bf16", head_dim: int = 128, softcap: bool = False, tree: bool = False):
    """The compiled kernel ``kind`` (:data:`KERNELS`) for sm_90a with the given launch config (``softcap``: the
    soft-capped variant, with the GPU's ``tanh.approx`` as bf16/fp16 inputs get it; ``tree``: the prefix-tree variant,
    ``CSR`` context ranges as ``kernels/prefix_tree.py`` launches it)."""
    fn = KERNELS[kind]
    d_pad = max(16, 1 << (head_dim - 1).bit_length())
    # the descriptor's block: K/V blocks (fwd, dQ) or Q/dO blocks (dK/dV)
    block_rows = bm if kind == "dkdv" else bn
    const = dict(D=head_dim, D_PAD=d_pad, BLOCK_M=bm, BLOCK_N=bn, EVEN_D=head_dim == d_pad, PREC="tf32", TMA=tma)
    if kind in ("fwd", "dq"):
        const["PACK"] = pack
    if kind == "fwd":
        const["SCALE_POS"] = not softcap
    if softcap:
        const["SOFTCAP"] = const["FAST_TANH"] = True
    tree_ptrs = {name for name in _TREE_PTRS if name in fn.arg_names} if tree else set()
    const["CSR"] = tree
    for name in _DESCRIPTORS[kind]:
        if not tma:
            const[name] = None
    for p in fn.params:  # the attention variants' arguments (kernels/attention_tiles.py): off, as by default
        if (p.name not in const and p.name not in _DESCRIPTORS[kind] and p.name not in tree_ptrs
                and p.default is not inspect.Parameter.empty
                and (p.is_constexpr or p.default is None)):
            const[p.name] = p.default
    sig = {}
    for p in fn.params:
        name = p.name
        if name in const:
            sig[name] = "constexpr"
        elif name in _DESCRIPTORS[kind]:
            sig[name] = f"tensordesc<{DTYPES[dtype]}[{block_rows}, {d_pad}]>"
        elif name in _DATA_PTRS:
            sig[name] = "*" + DTYPES[dtype]
        elif name in _F32_PTRS:
            sig[name] = "*fp32"
        elif name in _I32_PTRS or name in tree_ptrs:
            sig[name] = "*i32"
        elif name in ("qk_scale", "sm_scale", "cap2"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    src = ASTSource(fn, sig, const)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def resources(kernel) -> dict:
    """``ptxas -v`` of a compiled kernel: registers, spill stores / loads (bytes), shared memory (bytes), and
    ``serialized``: ptxas warned C7515 (it serialized the wgmma pipeline)."""
    with tempfile.TemporaryDirectory() as td:
        ptx = os.path.join(td, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        err = subprocess.run([_ptxas(), "-v", "-arch=sm_90a", ptx, "-o", os.path.join(td, "k.o")],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", err)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", err)
    if regs is None:
        raise RuntimeError(f"ptxas gave no resource report:\n{err[-800:]}")
    return dict(registers=int(regs.group(1)), spill_stores=int(spill.group(1)) if spill else 0,
                spill_loads=int(spill.group(2)) if spill else 0, shared=kernel.metadata.shared,
                serialized="C7515" in err)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=sorted(KERNELS))
    ap.add_argument("configs", nargs="+", help="BLOCK_M,BLOCK_N,num_warps,num_stages[,TMA[,PACK]]")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--softcap", action="store_true", help="the soft-capped variant (Gemma 2)")
    ap.add_argument("--tree", action="store_true", help="the prefix-tree variant (CSR context ranges)")
    a = ap.parse_args()
    if not 1 <= a.head_dim <= 256:
        ap.error(f"--head-dim {a.head_dim}: the kernels take head dims 1..256")
    configs = []
    for c in a.configs:
        try:
            v = [int(x) for x in c.split(",")]
        except ValueError:
            ap.error(f"config {c!r}: integers BLOCK_M,BLOCK_N,num_warps,num_stages[,TMA[,PACK]]")
        if not 4 <= len(v) <= 6:
            ap.error(f"config {c!r}: give BLOCK_M,BLOCK_N,num_warps,num_stages[,TMA[,PACK]] (4 to 6 numbers)")
        bm, bn, _, _, *rest = v
        pack = rest[1] if len(rest) > 1 else 1
        if any(b < 16 or b & (b - 1) for b in (bm, bn)) or pack < 1 or pack & (pack - 1):
            ap.error(f"config {c!r}: BLOCK_M and BLOCK_N must be powers of two >= 16, PACK a power of two >= 1 (as "
                     f"the launchers require)")
        if a.kernel == "dkdv" and bn % bm:
            ap.error(f"config {c!r}: dkdv's BLOCK_N ({bn} keys) must be a multiple of BLOCK_M ({bm} queries), as "
                     f"the launcher requires")
        configs.append((c, v))
    tma_ok = a.head_dim == max(16, 1 << (a.head_dim - 1).bit_length())
    print("| kernel | config | registers | spill stores / loads (bytes) | shared (bytes) | wgmma serialized (C7515) |\n"
          "|---|---|---|---|---|---|")
    limit = SM90_SHARED_BYTES
    for c, v in configs:
        tma = bool(v[4]) if len(v) > 4 else False
        note = " (TMA off: the launchers use it for power-of-two head dims only)" if tma and not tma_ok else ""
        try:
            r = resources(compile_kernel(a.kernel, *v[:4], tma=tma and tma_ok, pack=v[5] if len(v) > 5 else 1,
                                         dtype=a.dtype, head_dim=a.head_dim, softcap=a.softcap, tree=a.tree))
            over = f" (over sm_90's {limit // 1024} KB: fails at launch)" if r["shared"] > limit else ""
            print(f"| {a.kernel} | {c}{note} | {r['registers']} | {r['spill_stores']} / {r['spill_loads']} | "
                  f"{r['shared']}{over} | {'yes' if r['serialized'] else 'no'} |", flush=True)
        except Exception as e:  # noqa: BLE001 - one failing config (e.g. out of shared memory) is a row
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            why = lines[-1] if lines else ""  # (a CompilationError's first line is only where; its last says what)
            print(f"| {a.kernel} | {c} | error: {type(e).__name__}: {why[:160]} | | | |", flush=True)

if __name__ == "__main__":
    main()
