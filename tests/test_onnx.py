"""ONNX emission: kvt ops translated into standard ONNX, run in onnxruntime against the PyTorch modules."""
import os
import stat

import pytest
import torch

import kvtransform as kvt
from kvtransform import onnx_export as ox
from kvtransform.ops.attention import attention_reference

ort = pytest.importorskip("onnxruntime")


class _Attn(torch.nn.Module):
    def __init__(self, causal, scale, use_kp, mask_kind):
        super().__init__()
        self.causal, self.scale, self.use_kp, self.mask_kind = causal, scale, use_kp, mask_kind

    def forward(self, q, k, v, kp, mask):
        return torch.ops.kvt.attention(q, k, v, mask if self.mask_kind else None, kp if self.use_kp else None,
                                       self.scale, self.causal)


def _mask(kind, b, sq, sk, gen):
    if kind == "bool":
        m = torch.rand(b, 1, sq, sk, generator=gen) > 0.3
        m[..., 0] = True
        return m
    if kind == "float":
        return torch.randn(b, 1, sq, sk, generator=gen)
    return torch.zeros(1)


@pytest.mark.parametrize("causal,use_kp,mask_kind", [(True, True, None), (False, True, "bool"), (True, True, "float")])
def test_attention_translation_matches_reference(tmp_path, causal, use_kp, mask_kind):
    """kvt.attention → Attention (opset 23): GQA, bottom-right causal (S_q < S_k), key padding with fully masked
    query rows (zeros), bool and additive masks; dynamic batch and lengths."""
    gen = torch.Generator().manual_seed(0)

    def inputs(b, sq, sk):
        q = torch.randn(b, 4, sq, 8, generator=gen)
        k, v = torch.randn(b, 2, sk, 8, generator=gen), torch.randn(b, 2, sk, 8, generator=gen)
        kp = torch.ones(b, sk, dtype=torch.bool)
        kp[-1, : sk - 1] = False  # last batch row: only its final key is real → early causal rows see nothing
        return q, k, v, kp, _mask(mask_kind, b, sq, sk, gen)

    mod = _Attn(causal, 0.3, use_kp, mask_kind)
    b, s = torch.export.Dim("b", min=1, max=64), torch.export.Dim("s", min=2, max=512)
    sk = torch.export.Dim("sk", min=2, max=512) if not causal else s
    mdyn = {0: b, 2: s, 3: sk} if mask_kind else None
    ep = torch.export.export(mod, inputs(2, 5, 5), dynamic_shapes=(
        {0: b, 2: s}, {0: b, 2: sk}, {0: b, 2: sk}, {0: b, 1: sk}, mdyn))
    names = ("q", "k", "v", "kp", "mask")
    path = ox.export_onnx(ep, tmp_path / "attn.onnx", names, output_names=("out",))
    sess = ort.InferenceSession(str(path))
    feeds_names = [i.name for i in sess.get_inputs()]
    for b_, sq, sk_ in [(1, 3, 3), (3, 7, 7)] + ([(2, 3, 9)] if not causal else []):
        args = inputs(b_, sq, sk_)
        ref = attention_reference(*args[:3], args[4] if mask_kind else None, args[3] if use_kp else None, 0.3, causal)
        got = ox.run_onnx(path, {n: a for n, a in zip(names, args) if n in feeds_names}, sess)
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (b_, sq, sk_, (got - ref).abs().max())


class _Variants(torch.nn.Module):
    def __init__(self, kw, sinks):
        super().__init__()
        self.kw = kw
        self.sinks = torch.nn.Parameter(torch.randn(4)) if sinks else None

    def forward(self, q, k, v, kp):
        kw = dict(self.kw, **({"sinks": self.sinks} if self.sinks is not None else {}))
        return torch.ops.kvt.attention(q, k, v, None, kp, 0.3, True, **kw)


@pytest.mark.parametrize("kw,sinks", [({"window": 3}, False), ({"window": 4, "softcap": 1.5}, True)],
                         ids=["window", "window+softcap+sinks"])
def test_attention_variants_translation_matches_op(tmp_path, kw, sinks):
    """window (a keep-mask term of Attention) and soft-cap + sinks (the explicit fp32 path; opset 23's Attention has
    no sinks) in onnxruntime against the op, at lengths past the window, with fully padded query rows."""
    gen = torch.Generator().manual_seed(0)

    def inputs(b, s):
        q = torch.randn(b, 4, s, 8, generator=gen)
        k, v = torch.randn(b, 2, s, 8, generator=gen), torch.randn(b, 2, s, 8, generator=gen)
        kp = torch.ones(b, s, dtype=torch.bool)
        kp[-1, : s - 1] = False
        return q, k, v, kp

    mod = _Variants(kw, sinks)
    b, s = torch.export.Dim("b", min=1, max=64), torch.export.Dim("s", min=2, max=512)
    ep = torch.export.export(mod, inputs(2, 5), dynamic_shapes=({0: b, 2: s}, {0: b, 2: s}, {0: b, 2: s}, {0: b, 1: s}))
    names = ("q", "k", "v", "kp")
    path = ox.export_onnx(ep, tmp_path / "v.onnx", names, output_names=("out",))
    sess = ort.InferenceSession(str(path))
    for shape in [(1, 3), (3, 13)]:
        args = inputs(*shape)
        with torch.no_grad():
            want = mod(*args)
        got = ox.run_onnx(path, dict(zip(names, args)), sess)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (shape, (got - want).abs().max())


def test_grouped_mm_translation_matches_op(tmp_path):
    """transformers.grouped_mm_fallback (the MoE experts matmul of Qwen3-MoE / gpt-oss captured on CPU) → Gather +
    MatMul, with an expert that gets no rows."""
    import transformers.integrations.moe  # noqa: F401  registers the op

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 8, 5))

        def forward(self, x, offs):
            return torch.ops.transformers.grouped_mm_fallback(x, self.w, offs)

    s = torch.export.Dim("s", min=2, max=256)
    ep = torch.export.export(M(), (torch.randn(6, 8), torch.tensor([2, 2, 6], dtype=torch.int32)),
                             dynamic_shapes=({0: s}, None))
    path = ox.export_onnx(ep, tmp_path / "g.onnx", ("x", "offs"), output_names=("y",))
    for rows, offs in [(6, [1, 1, 6]), (9, [4, 7, 9])]:
        x, offs = torch.randn(rows, 8), torch.tensor(offs, dtype=torch.int32)
        with torch.no_grad():
            want = ep.module()(x, offs)
        got = ox.run_onnx(path, {"x": x, "offs": offs})
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_dualkv_mask_in_graph_matches_op(tmp_path):
    """kvt.dualkv_attention → mask from cu_seqlens/segment_prefix in the graph + Attention; out and lse equal the op
    on layouts with other token and segment counts than the exported example."""
    class M(torch.nn.Module):
        def forward(self, q, k, v, cu, sp):
            out, lse = torch.ops.kvt.dualkv_attention(q, k, v, cu, sp, 0.4)
            return out, lse

    def inputs(groups, gen):
        lay = kvt.DualKVLayout.from_lengths(groups)
        t = lay.total_tokens
        return (torch.randn(t, 4, 8, generator=gen), torch.randn(t, 2, 8, generator=gen),
                torch.randn(t, 2, 8, generator=gen), lay.cu_seqlens, lay.segment_prefix)

    gen = torch.Generator().manual_seed(1)
    tok, seg = torch.export.Dim("t", min=2, max=4096), torch.export.Dim("seg", min=2, max=4096)
    ep = torch.export.export(M(), inputs([(3, [2, 2])], gen), dynamic_shapes=(
        {0: tok}, {0: tok}, {0: tok}, {0: seg + 1}, {0: seg}))
    path = ox.export_onnx(ep, tmp_path / "dkv.onnx", ("q", "k", "v", "cu_seqlens", "segment_prefix"),
                          output_names=("out", "lse"))
    sess = ort.InferenceSession(str(path))
    for groups in ([(5, [1, 4, 2])], [(2, [3]), (4, [1, 1, 5]), (1, [2])]):
        args = inputs(groups, gen)
        want_out, want_lse = torch.ops.kvt.dualkv_attention(*args, 0.4)
        got_out, got_lse = (torch.from_numpy(x) for x in sess.run(None, {
            n: a.numpy() for n, a in zip(("q", "k", "v", "cu_seqlens", "segment_prefix"), args)}))
        assert torch.allclose(got_out, want_out, atol=1e-5) and torch.allclose(got_lse, want_lse, atol=1e-5)


_TREE_NAMES = ("q", "k", "v", "cu_seqlens", "parent", "key_range_ptr", "key_ranges", "query_range_ptr",
               "query_ranges")


def _tree_inputs(lengths, parents, gen):
    lay = kvt.PrefixTreeLayout.from_parents(lengths, parents)
    t = lay.total_tokens
    return (torch.randn(t, 4, 8, generator=gen), torch.randn(t, 2, 8, generator=gen),
            torch.randn(t, 2, 8, generator=gen), *lay.kernel_tensors())


def test_prefix_tree_mask_in_graph_matches_op(tmp_path):
    """kvt.prefix_tree_attention → tree mask from cu_seqlens/key ranges in the graph + Attention; out and lse equal
    the op on trees of other depths, node, range and token counts than the exported example (several roots, a
    non-first child whose ancestor ranges are not contiguous)."""
    class M(torch.nn.Module):
        def forward(self, q, k, v, cu, par, kp, kr, qp, qr):
            return torch.ops.kvt.prefix_tree_attention(q, k, v, cu, par, kp, kr, qp, qr, 0.4)

    gen = torch.Generator().manual_seed(2)
    d = torch.export.Dim
    tok, nod, rk, rq = d("t", min=2, max=4096), d("n", min=2, max=4096), d("rk", min=1, max=4096), \
        d("rq", min=1, max=4096)
    ex = _tree_inputs([3, 2, 4, 1, 2], [-1, 0, 1, 0, -1], gen)
    assert ex[6].shape[0] != ex[8].shape[0] and ex[6].shape[0] != ex[3].shape[0]  # distinct example sizes
    ep = torch.export.export(M(), ex, dynamic_shapes=(
        {0: tok}, {0: tok}, {0: tok}, {0: nod + 1}, {0: nod}, {0: nod + 1}, {0: rk}, {0: nod + 1}, {0: rq}))
    path = ox.export_onnx(ep, tmp_path / "tree.onnx", _TREE_NAMES, output_names=("out", "lse"))
    sess = ort.InferenceSession(str(path))
    for lengths, parents in (([5, 1, 4, 2], [-1, 0, 1, 0]), ([2, 3, 1, 5, 2, 3, 1], [-1, 0, 1, 1, 0, -1, 5]),
                             ([4, 3], [-1, -1])):
        args = _tree_inputs(lengths, parents, gen)
        want_out, want_lse = torch.ops.kvt.prefix_tree_attention(*args, 0.4)
        got_out, got_lse = (torch.from_numpy(x) for x in sess.run(None, {
            n: a.numpy() for n, a in zip(_TREE_NAMES, args)}))
        assert torch.allclose(got_out, want_out, atol=1e-5) and torch.allclose(got_lse, want_lse, atol=1e-5)


class _PackedVariants(torch.nn.Module):
    """kvt.dualkv_attention (5 inputs) or kvt.prefix_tree_attention (9 inputs) with variant keywords."""

    def __init__(self, kw, sinks):
        super().__init__()
        self.kw = kw
        self.sinks = torch.nn.Parameter(torch.randn(4)) if sinks else None

    def forward(self, *args):
        kw = dict(self.kw, **({"sinks": self.sinks} if self.sinks is not None else {}))
        op = torch.ops.kvt.dualkv_attention if len(args) == 5 else torch.ops.kvt.prefix_tree_attention
        return op(*args, 0.4, **kw)


@pytest.mark.parametrize("layout,kw,sinks", [("dualkv", {"window": 3}, False),
                                             ("tree", {"window": 3, "softcap": 1.5}, True)])
def test_packed_variants_translation_matches_op(tmp_path, layout, kw, sinks):
    """The window over each sequence's own positions (a response token at P + r), soft-cap and sinks (in the lse
    too) of the DualKV / prefix-tree ops in onnxruntime against the ops, on other layouts than the example."""
    gen = torch.Generator().manual_seed(3)
    mod = _PackedVariants(kw, sinks)
    d = torch.export.Dim
    tok = d("t", min=2, max=4096)
    if layout == "dualkv":
        def inputs(groups):
            lay = kvt.DualKVLayout.from_lengths(groups)
            t = lay.total_tokens
            return (torch.randn(t, 4, 8, generator=gen), torch.randn(t, 2, 8, generator=gen),
                    torch.randn(t, 2, 8, generator=gen), lay.cu_seqlens, lay.segment_prefix)

        names, seg = ("q", "k", "v", "cu_seqlens", "segment_prefix"), d("seg", min=2, max=4096)
        ep = torch.export.export(mod, inputs([(3, [2, 2])]), dynamic_shapes=(
            ({0: tok}, {0: tok}, {0: tok}, {0: seg + 1}, {0: seg}),))
        cases = [inputs([(5, [1, 4, 2])]), inputs([(2, [3]), (4, [1, 1, 5]), (1, [2])])]
    else:
        nod, rk, rq = d("n", min=2, max=4096), d("rk", min=1, max=4096), d("rq", min=1, max=4096)
        names = _TREE_NAMES
        ep = torch.export.export(mod, _tree_inputs([3, 2, 4, 1, 2], [-1, 0, 1, 0, -1], gen), dynamic_shapes=(
            ({0: tok}, {0: tok}, {0: tok}, {0: nod + 1}, {0: nod}, {0: nod + 1}, {0: rk}, {0: nod + 1}, {0: rq}),))
        cases = [_tree_inputs([5, 1, 4, 2], [-1, 0, 1, 0], gen),
                 _tree_inputs([2, 3, 1, 5, 2, 3, 1], [-1, 0, 1, 1, 0, -1, 5], gen)]
    path = ox.export_onnx(ep, tmp_path / "p.onnx", names, output_names=("out", "lse"))
    sess = ort.InferenceSession(str(path))
    for args in cases:
        with torch.no_grad():
            want_out, want_lse = mod(*args)
        got_out, got_lse = (torch.from_numpy(x) for x in sess.run(None, {n: a.numpy() for n, a in zip(names, args)}))
        assert torch.allclose(got_out, want_out, atol=1e-5) and torch.allclose(got_lse, want_lse, atol=1e-5)


def _unverified(name):
    from kvtransform.config import config_from_dict

    return config_from_dict({"name": name, "verify": {"enabled": False}})


@pytest.fixture(scope="module")
def tiny():
    return kvt.tiny_model("llama")


def test_canonical_module_onnx_matches_module_and_model(tmp_path, tiny, capsys):
    opt = kvt.transform(tiny, _unverified("canonical"), progress=False)  # this test compares with the model itself
    capsys.readouterr()
    path = opt.export_onnx(tmp_path / "m.onnx", verify=False)
    err = capsys.readouterr().err  # the export says what runs (it can take minutes), as save() does
    assert "… exporting" in err and "✓ exporting" in err and "onnxruntime" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]  # no temp files left
    sess = ort.InferenceSession(str(path))
    gen = torch.Generator().manual_seed(0)
    for b, s in [(1, 4), (3, 19)]:
        ids = torch.randint(0, tiny.config.vocab_size, (b, s), generator=gen)
        am = torch.ones_like(ids)
        am[-1, :2] = 0  # left padding
        got = ox.run_onnx(path, {"input_ids": ids, "attention_mask": am}, sess)
        with torch.no_grad():
            want = tiny(input_ids=ids, attention_mask=am).logits
        keep = am.bool()
        assert ox.max_rel_error(got[keep], want[keep])[1] < 1e-5
        assert ox.max_rel_error(got, opt(ids, am))[1] < 1e-5


def test_dualkv_module_onnx_matches_module(tmp_path, tiny):
    opt = kvt.transform(tiny, _unverified("dualkv"), progress=False)
    path = opt.export_onnx(tmp_path / "d.onnx")  # with the onnxruntime check on the probe batch
    sess = ort.InferenceSession(str(path))
    assert [i.name for i in sess.get_inputs()] == ["input_ids", "position_ids", "cu_seqlens", "segment_prefix"]
    batch = kvt.pack_shared_prefix_groups([([1, 2, 3, 4, 5, 6], [[7, 8], [9, 10, 11]]), ([3, 4], [[5], [6, 7, 8]])])
    feeds = dict(zip(opt.core_input_names, opt.core_inputs(batch)))
    err = ox.compare_onnx(path, opt.core, feeds, session=sess)
    assert err[1] < 1e-5
    # per-response log-probs equal the original model on the replicated sequences
    from kvtransform.verify import replicated_logprobs

    lp = batch.response_logprobs(ox.run_onnx(path, feeds, sess))
    with torch.no_grad():
        ref = replicated_logprobs(tiny, batch)
    assert max(float((a - b).abs().max()) for a, b in zip(lp, ref)) < 1e-5


def test_dualkv_tree_program_onnx_matches_module(tmp_path, tiny):
    """``export_onnx(tree=True)``: the prefix-tree program with its mask built in the graph, checked in onnxruntime
    against the module on trees other than the exported example (depth 3 and 4, two roots, loss-masked log-probs
    against the original model run per trajectory)."""
    opt = kvt.transform(tiny, _unverified("dualkv"), progress=False)
    path = opt.export_onnx(tmp_path / "t.onnx", tree=True)  # with the onnxruntime check on a probe tree
    sess = ort.InferenceSession(str(path))
    assert [i.name for i in sess.get_inputs()] == list(opt.tree_input_names)
    gen = torch.Generator().manual_seed(3)
    base = torch.randint(0, tiny.config.vocab_size, (40,), generator=gen).tolist()
    for seqs in ([base[:9] + base[20:23], base[:9] + base[23:27] + base[30:33], base[:9] + base[23:27] + base[33:35],
                  base[10:14]],
                 [base[:5] + base[6:8], base[:5] + base[8:12] + base[1:4] + base[2:3], base[:5] + base[8:12]
                  + base[1:4] + base[12:15], base[:5] + base[8:12] + base[16:18]]):
        batch = kvt.pack_trajectories(seqs)
        assert batch.layout.depth >= 3
        feeds = dict(zip(opt.tree_input_names, (batch.input_ids, batch.position_ids, *batch.layout.kernel_tensors())))
        logits = ox.run_onnx(path, feeds, sess)
        with torch.no_grad():
            want = opt(batch)
            ref = [tiny(torch.tensor(s)[None]).logits[0].log_softmax(-1)[:-1]
                   .gather(-1, torch.tensor(s)[1:, None])[:, 0] for s in seqs]
        assert ox.max_rel_error(logits, want)[1] < 1e-5
        lp = batch.trajectory_logprobs(logits)
        assert max(float((a - b).abs().max()) for a, b in zip(lp, ref)) < 1e-5
    assert opt.export_onnx(tmp_path / "d.onnx").exists()  # the one-level program still the default


def test_untranslatable_op_refused_by_name_and_nothing_written(tmp_path):
    class Decode(torch.nn.Module):
        def forward(self, q, kc, vc, lens):
            return torch.ops.kvt.sparse_decode_attention(q, kc, vc, None, lens, None, None, 0.5)

    ep = torch.export.export(Decode(), (torch.randn(1, 2, 1, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8),
                                        torch.tensor([6], dtype=torch.int32)))
    with pytest.raises(ox.UnsupportedOpError, match="kvt.sparse_decode_attention"):
        ox.export_onnx(ep, tmp_path / "x.onnx", ("q", "k", "v", "lens"))
    assert list(tmp_path.iterdir()) == []


def test_failed_check_writes_nothing(tmp_path):
    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.ops.kvt.attention(q, k, v, None, None, 0.5, True)

    x = torch.randn(1, 2, 4, 8)
    ep = torch.export.export(M(), (x, x, x))
    target = tmp_path / "a.onnx"
    target.write_bytes(b"old")

    def check(p):
        assert p.is_file() and p != target
        raise RuntimeError("check failed")

    with pytest.raises(RuntimeError, match="check failed"):
        ox.export_onnx(ep, target, ("q", "k", "v"), check=check, overwrite=True)
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.onnx"]


def test_existing_file_is_replaced_only_with_overwrite(tmp_path, tiny, monkeypatch):
    """As ``opt.save``: an existing file is refused (before any export work) unless ``overwrite=True``; a directory
    is refused by name; a failed overwrite leaves the old file and no temporary file."""
    opt = kvt.transform(tiny, _unverified("canonical"), progress=False)
    target = tmp_path / "m.onnx"
    target.write_bytes(b"old")
    with pytest.raises(FileExistsError, match=r"m\.onnx' exists; .*overwrite=True"):
        opt.export_onnx(target, verify=False)
    with pytest.raises(FileExistsError, match="is a directory: give the ONNX file's path"):
        opt.export_onnx(tmp_path, verify=False, overwrite=True)
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    for kw, err, msg in ((dict(overwrite="false"), ValueError, "overwrite must be True or False"),  # ("false": truthy)
                         (dict(verify="no"), ValueError, "verify must be True or False"),
                         (dict(path=target / "x.onnx"), FileExistsError, "is a file: the ONNX file")):
        with pytest.raises(err, match=msg):
            opt.export_onnx(**{"path": target, "verify": False, **kw})
    import kvtransform.utils as utils

    monkeypatch.setattr(utils, "_unwritable", lambda path: (tmp_path, "read-only file system"))
    with pytest.raises(PermissionError, match="cannot write the ONNX file .* not writable"):  # before exporting
        opt.export_onnx(tmp_path / "sub" / "n.onnx", verify=False)
    monkeypatch.undo()
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]

    class Boom(RuntimeError):
        pass

    import kvtransform.onnx_export as oxm

    def bad_check(path, *a, **kw):
        raise Boom("onnxruntime differs")

    monkeypatch.setattr(oxm, "compare_onnx", bad_check)
    with pytest.raises(Boom):
        opt.export_onnx(target, overwrite=True)
    monkeypatch.undo()
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    path = opt.export_onnx(target, verify=False, overwrite=True)
    assert path == target and target.read_bytes() != b"old"
    sess = ort.InferenceSession(str(path))
    assert [i.name for i in sess.get_inputs()] == ["input_ids", "attention_mask"]
    # the low-level writer has the same rule
    x = torch.randn(1, 2, 4, 8)

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.ops.kvt.attention(q, k, v, None, None, 0.5, True)

    with pytest.raises(FileExistsError, match="overwrite=True"):
        ox.export_onnx(torch.export.export(M(), (x, x, x)), target, ("q", "k", "v"))


def test_special_files_trailing_separators_and_wrong_tokenizers_are_refused_first(tmp_path, tiny, monkeypatch):
    """A FIFO (or device) at the path is never replaced, not even with overwrite=True (it replaced /dev/null); a
    missing directory written as ``dir/`` is not made into a file; a tokenizer given as a path or with ids past the
    model's vocabulary is named before the export work (a raw TypeError / embedding IndexError after it)."""
    import kvtransform.capture as capture
    import kvtransform.transforms.base as base

    opt = kvt.transform(tiny, _unverified("canonical"), progress=False)
    dk = kvt.transform(tiny, _unverified("dualkv"), progress=False)
    for mod in (capture, base):
        monkeypatch.setattr(mod, "export_dynamic", lambda *a, **k: pytest.fail("exported before the check"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(FileExistsError, match="exists and is not a regular file"):
        opt.export_onnx(fifo, overwrite=True, verify=False)
    with pytest.raises(FileExistsError, match="names a directory: give the ONNX file's path"):
        opt.export_onnx(f"{tmp_path}/newdir/", verify=False)
    with pytest.raises(ValueError, match="tokenizer must be a tokenizer object"):
        opt.export_onnx(tmp_path / "a.onnx", tokenizer=str(tmp_path))

    def big_vocab(text, return_tensors=None, **kw):
        return {"input_ids": torch.tensor([[1, 2, 500, 3]])}

    for module, kw in ((opt, {}), (dk, {}), (dk, {"tree": True})):
        with pytest.raises(ValueError, match="token id 500, outside the model's vocabulary of 128"):
            module.export_onnx(tmp_path / "a.onnx", tokenizer=big_vocab, **kw)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]


def test_cli_emit_onnx(tmp_path, monkeypatch, capsys):
    from kvtransform.cli import main
    from kvtransform.models import tiny_model

    monkeypatch.chdir(tmp_path)
    tiny_model("qwen3").save_pretrained(tmp_path / "tiny")
    rc = main(["optimize", str(tmp_path / "tiny"), f"out={tmp_path / 'o'}", "emit=[onnx]",
               "transform.verify.lengths=[6]"])
    assert rc in (0, None), capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["meta.json", "model.onnx"]
    assert "onnxruntime matches" in " ".join(capsys.readouterr().out.split())
    rc = main(["optimize", str(tmp_path / "tiny"), f"out={tmp_path / 'o'}", "emit=[onnx]", "overwrite=true",
               "transform.verify.lengths=[6]"])  # meta.json marks the ONNX-only output as an artifact to replace
    assert rc in (0, None), capsys.readouterr().err
    capsys.readouterr()
    try:
        rc = main(["optimize", str(tmp_path / "tiny"), f"out={tmp_path / 'p'}", "emit=[pt2,tflite]"])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and "emit=['pt2', 'tflite']" in capsys.readouterr().err


def test_export_tree_flag_must_be_a_bool(tmp_path):
    opt = kvt.transform(kvt.tiny_model("llama"), kvt.DualKVConfig(verify=kvt.VerifyConfig(enabled=False)),
                        progress=False)
    with pytest.raises(ValueError, match="tree must be True or False"):
        opt.export_onnx(tmp_path / "m.onnx", tree="no")
    assert not (tmp_path / "m.onnx").exists()
