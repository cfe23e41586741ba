"""The prefix-tree suites (``kvtransform bench tree-attn | tree-layer``) on CPU at tiny shapes: config strictness, the
tree shapes (the H200 agentic shape's token counts), the tree masks, each method against the dense reference, a
smoke run writing the CSV / markdown / PNG, and the kernel check under TRITON_INTERPRET. Timings here mean nothing."""
from __future__ import annotations

import pytest
import torch

from kvtransform.bench import compose_jobs, masks, report, run, runner
from kvtransform.bench.tree_methods import TREE_METHODS
from kvtransform.bench.tree_shapes import TreeShape, agentic_tree, flat_index, packed_from_flat

TINY = ["prompt=13", "fanout=2x2", "turn_min=3", "turn_max=9", "hidden=64", "mlp=96", "heads=4", "kv_heads=2",
        "head_dim=16", "dtype=float32", "warmup=0", "iters=1", "device=cpu"]


def test_config_and_validation():
    from hydra.errors import ConfigCompositionException

    (_, c), = compose_jobs("tree-attn", [])
    assert (c.prompt, c.fanout, c.turn_min, c.turn_max, c.mode.value) == (4096, "4x2x2", 256, 2048, "attn")
    (_, c), = compose_jobs("tree-layer", [])
    assert c.mode.value == "layer" and c.hidden == 4096
    jobs = compose_jobs("tree-attn", ["fanout=4x2x2,4x2x2x2", "method=kvt_tree,flat"], multirun=True)
    assert len(jobs) == 4
    with pytest.raises(ConfigCompositionException):
        compose_jobs("tree-attn", ["fanuot=4x2"])
    with pytest.raises(ConfigCompositionException):
        compose_jobs("tree-attn", ["method=fa2"])
    for bad, msg in (("fanout=4x0", "fanout"), ("turn_min=9", "turn_min=9 > turn_max"), ("flat_impl=fa3", "flat_impl")):
        with pytest.raises(ValueError, match=msg):
            compose_jobs("tree-attn", [bad] + (["turn_max=3"] if "turn_min" in bad else []))


def test_shapes_match_the_h200_agentic_tree_and_dualkv_attn():
    (_, cfg), = compose_jobs("tree-attn", [])
    s = TreeShape.of(cfg)  # the tree measured on the H200 (tools/prefix_tree_gpu_check.py): T=38483, 123079 flat
    assert (s.T, s.T_rep, s.layout.num_nodes, s.trajectories, s.layout.depth) == (38483, 123079, 29, 16, 4)
    assert s.params == "prompt=4096 fanout=4x2x2 turns=256-2048 seed=0" and not s.one_level
    (_, one), = compose_jobs("tree-attn", ["shape=one_level", "P=8192", "mb=16"])
    (_, dk), = compose_jobs("dualkv-attn", ["P=8192", "mb=16"])
    t, d = TreeShape.of(one), runner.Shape.of(dk)
    assert (t.T, t.T_rep, t.pairs, t.floor_ms) == (d.T, d.T_rep, d.pairs, pytest.approx(d.floor_ms))
    assert t.one_level and t.params == "P=8192 mb=16"


def test_flat_index_round_trip():
    lay = agentic_tree(5, (2, 1, 2), [1, 3, 4], 7, trees=2)
    idx, back = flat_index(lay), packed_from_flat(lay)
    assert torch.equal(idx[back], torch.arange(lay.total_tokens))
    assert idx.numel() == sum(len(lay.path_index(n)) for n in range(lay.num_nodes) if n not in lay.parents)


def test_tree_masks_agree():
    """Dense mask, mask_mod and the block masks describe the same pairs (two trees, odd lengths, depth 4)."""
    lay = agentic_tree(9, (2, 1, 2), [1, 3, 5, 17], 3, trees=2)
    T, dense = lay.total_tokens, masks.tree_dense_mask(lay)
    i = torch.arange(T)
    assert torch.equal(masks.tree_mask_mod(lay)(0, 0, i[:, None], i[None, :]), dense)
    assert int(dense.sum()) == lay.visible_pairs()
    for block in (4, 16):
        partial, full = masks.tree_block_masks(lay, block=block)
        nb = (T + block - 1) // block
        pad = torch.zeros(nb * block, nb * block, dtype=torch.bool)
        pad[:T, :T] = dense
        b = pad.view(nb, block, nb, block).permute(0, 2, 1, 3).reshape(nb, nb, -1)
        assert torch.equal(full, b.all(-1)) and torch.equal(partial, b.any(-1) & ~b.all(-1))


@pytest.mark.parametrize("name,extra", [("kvt_tree", []), ("flat", []), ("dualkv", ["shape=one_level", "P=11", "mb=3",
                                                                                      "r_min=2", "r_max=7"])])
def test_methods_match_reference(name, extra):
    """Output and input gradients of each method equal the dense-mask reference (fp32, GQA 2)."""
    (_, cfg), = compose_jobs("tree-attn", TINY + extra)
    shape, dev = TreeShape.of(cfg), torch.device("cpu")
    lay, T = shape.layout, shape.T
    q, do = torch.randn(T, 4, 16), torch.randn(T, 4, 16)
    k, v = torch.randn(T, 2, 16), torch.randn(T, 2, 16)

    def grads(meth):
        meth.setup(lay, cfg, dev)
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        if meth.replicated:
            idx, back = shape.replicated_index(lay), shape.packed_from_replicated(lay)
            o = meth(qq[idx], kk[idx], vv[idx])[back]
        else:
            o = meth(qq, kk, vv)
        o.backward(do)
        return o.detach(), qq.grad, kk.grad, vv.grad

    got, ref = grads(TREE_METHODS[name]()), grads(TREE_METHODS["reference"]())
    for a, b in zip(got, ref):
        if name == "flat" and b is not ref[0]:
            continue  # flat's gradients land on its own copies of the shared tokens
        assert (a - b).norm() / b.norm() < 1e-4


def test_smoke_run_writes_rows_csv_markdown_plot(tmp_path, capsys):
    out = tmp_path / "res"
    rows = run("tree-attn", TINY + [f"out_dir={out}"])
    by = {(r["method"], r["pass"]): r for r in rows}
    assert {m for m, _ in by} == {"reference", "kvt_tree", "flex_tree", "flat"}  # dualkv: not a one-level tree
    for m in ("reference", "kvt_tree", "flat"):
        for p in ("fwd", "bwd", "fwdbwd"):
            r = by[(m, p)]
            assert r["status"] == "ok" and r["check_rel_err"] < 1e-4 and r["tflops"] > 0
            assert r["cmd"].startswith("kvtransform bench tree-attn prompt=13") and f"method={m}" in r["cmd"]
    assert by[("flat", "fwd")]["T"] == by[("flat", "fwd")]["T_replicated"] > by[("kvt_tree", "fwd")]["T"]
    assert by[("flat", "fwd")]["impl"].startswith("sdpa per trajectory")
    assert by[("flex_tree", "fwd")]["status"] == "unavailable: FlexAttention runs on CUDA only here (no CPU backward; the suite times fwd and bwd)"
    for f in ("results.csv", "results.md", "results.png"):
        assert (out / f).stat().st_size > 0
    df = report.read_csv(str(out / "results.csv"))
    assert len(df) == len(rows) and {"nodes", "depth", "trajectories"} <= set(df.columns)
    md = (out / "results.md").read_text()
    # the shape, then the settings that differ from the suite's defaults (a -m sweep over them keeps its rows apart)
    assert ("| prompt=13 fanout=2x2 turns=3-9 seed=0 hidden=64 heads=4 kv_heads=2 head_dim=16 mlp=96 dtype=float32 "
            "| 7 / 3 / 4 | 51 | 105 |") in md
    assert "kvtransform bench tree-attn prompt=13" in capsys.readouterr().out

    # one-level rows (DualKV's shape) in the same CSV, with dualkv; a depth-2+ tree refuses dualkv in one line
    rows = run("tree-attn", TINY + ["shape=one_level", "P=11", "mb=3", "r_min=2", "r_max=7", "method=dualkv",
                                    "append=true", "plot=false", f"out_dir={out}"])
    assert all(r["status"] == "ok" and r["P"] == 11 and r["mb"] == 3 for r in rows)
    rows = run("tree-attn", TINY + ["method=dualkv", "plot=false", f"out_dir={tmp_path / 'x'}"])
    assert rows[0]["status"] == "unavailable: dualkv takes one-level trees only (this one has depth 3)"


def test_tree_layer_smoke(tmp_path):
    rows = run("tree-layer", TINY + ["-m", "method=kvt_tree,flat", f"out_dir={tmp_path}", "plot=false"])
    assert [(r["method"], r["pass"], r["status"]) for r in rows] == [("kvt_tree", "fwdbwd", "ok"),
                                                                     ("flat", "fwdbwd", "ok")]
    assert rows[1]["check_rel_err"] < 1e-4 and rows[0]["op"] == "decoder_layer"


@pytest.mark.parametrize("variants", [None, {"window": 3, "softcap": 5.0, "sinks": True}])
def test_kernel_check_under_the_interpreter(monkeypatch, capsys, variants):
    from kvtransform.bench.checks_tree import check_prefix_tree_kernels
    from kvtransform.ops import prefix_tree as op

    monkeypatch.setattr(op, "USE_TRITON_ON_CPU", True)  # the registered op runs the kernels, as on CUDA
    tiny = ("tiny", agentic_tree(5, (2, 1), [1, 3], 0), 2, 1, 16)
    ok, worst = check_prefix_tree_kernels("cpu", cases=[tiny], dtypes=(torch.float16,), variants=variants)
    assert ok and 0 <= worst <= 1
    assert ("dsinks" in capsys.readouterr().out) == bool(variants)
