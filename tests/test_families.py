"""The attention variants of Gemma 2, Gemma 3, gpt-oss, Qwen3-MoE and Phi-3 (sliding windows, logit soft-capping,
learned sinks, mixture-of-experts capture, fused QKV) through the canonical transform, on tiny random models (fp32
CPU); and ``kvt.attention``'s ``window`` / ``softcap`` / ``sinks`` against a loop-by-loop reference."""
import io

import pytest
import torch

import kvtransform as kvt
from kvtransform.models import TINY_WINDOW
from kvtransform.ops.attention import attention
from kvtransform.report import Report

NEW_FAMILIES = ["gemma2", "gemma3", "gpt_oss", "qwen3_moe", "phi3"]

#: per family, per layer: (window, softcap, has sinks) the matcher must find (layers alternate sliding / global)
EXPECTED = {
    "gemma2": [(TINY_WINDOW, 5.0, False), (None, 5.0, False)],
    "gemma3": [(TINY_WINDOW, None, False), (None, None, False)],
    "gpt_oss": [(TINY_WINDOW, None, True), (None, None, True)],
    "qwen3_moe": [(None, None, False), (None, None, False)],
    "phi3": [(None, None, False), (None, None, False)],
}


@pytest.fixture(scope="module", params=NEW_FAMILIES)
def transformed(request):
    """One capture per family: ``(family, model, canonical module)``. Qwen3-MoE runs transformers' data-dependent
    ``'eager'`` experts loop, which capture must go around (and leave set)."""
    fam = request.param
    model = kvt.tiny_model(fam, max_position_embeddings=64)  # the mask proof probes lengths up to 64
    if fam == "qwen3_moe":
        model.set_experts_implementation("eager")
    return fam, model, kvt.transform(model, "canonical", progress=False)


def _batch(s=21):
    """A left-padded batch longer than the window (so windows matter): row 1 padded by 6 tokens."""
    ids = torch.randint(3, 128, (2, s))
    am = torch.ones(2, s, dtype=torch.long)
    am[1, :6] = 0
    return ids, am


def _kvt_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.kvt.attention.default]


def test_canonical_verifies_with_variants_per_layer(transformed):
    fam, model, opt = transformed
    assert opt.report.verification.passed
    sites = sorted(opt.report.sites, key=lambda s: s.layer)
    assert [s.status for s in sites] == ["canonical"] * len(EXPECTED[fam])
    assert [(s.window, s.softcap, s.sinks is not None) for s in sites] == EXPECTED[fam]
    if fam == "gpt_oss":
        assert [s.sinks for s in sites] == [f"model.layers.{i}.self_attn.sinks" for i in range(2)]
    nodes = _kvt_nodes(opt.core.gm)
    assert len(nodes) == len(EXPECTED[fam])
    for n, (window, softcap, sinks) in zip(nodes, EXPECTED[fam]):
        assert n.args[3] is None and n.args[6] is True  # the proven mask is gone: causal (+ window), no tensor
        assert n.kwargs.get("window") == window and n.kwargs.get("softcap") == softcap
        assert (n.kwargs.get("sinks") is not None) == sinks
    # no eager-chain remnant (tanh soft-cap, sink concat, softmax of attention) is left
    targets = {n.target for n in opt.core.gm.graph.nodes}
    assert torch.ops.aten.tanh.default not in targets or fam == "gemma2"  # gemma2: the final-logit soft-cap only
    ids, am = _batch()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=am).logits
        got = opt(ids, am)
    keep = am.bool()
    torch.testing.assert_close(got[keep], ref[keep], rtol=1e-5, atol=2e-5)


def test_gradients_equal_including_sinks(transformed):
    """Soft-capped, windowed, sink and MoE (grouped_mm's autograd) models: every parameter gradient equals the
    original's (Gemma 3 / Phi-3 add nothing to the backward that the four older families' tests do not cover)."""
    fam, model, opt = transformed
    if fam in ("gemma3", "phi3"):
        pytest.skip("no backward variant beyond the window, which Gemma 2 and gpt-oss cover")
    ids, am = _batch(s=13)
    keep = am.bool()
    model.zero_grad()
    model(input_ids=ids, attention_mask=am).logits[keep].square().mean().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    opt(ids, am)[keep].square().mean().backward()  # the module holds the model's own Parameters
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    assert set(got) == set(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-6, msg=n)
    if fam == "gpt_oss":
        assert got["model.layers.0.self_attn.sinks"].abs().max() > 0


def test_moe_capture_goes_around_the_eager_experts_loop(transformed):
    fam, model, opt = transformed
    if fam not in ("qwen3_moe", "gpt_oss"):
        pytest.skip("not a mixture-of-experts model")
    assert model.config._experts_implementation == ("eager" if fam == "qwen3_moe" else "grouped_mm")
    assert any("grouped_mm" in str(n.target) for n in opt.core.gm.graph.nodes)


def test_report_and_inspect_table_show_variants(transformed):
    fam, _, opt = transformed
    d = opt.report.to_dict()
    assert {"window", "softcap", "sinks"} <= set(d["sites"][0])
    back = Report.from_dict(d)
    assert [(s.window, s.softcap, s.sinks) for s in back.sites] == [(s.window, s.softcap, s.sinks)
                                                                   for s in opt.report.sites]
    from rich.console import Console

    out = io.StringIO()
    opt.report.print(console=Console(file=out, width=200))
    header = out.getvalue()
    has_variant = any(any(v[:2]) or v[2] for v in EXPECTED[fam])
    assert ("window" in header and "softcap" in header and "sinks" in header) == has_variant


# ---- kvt.attention's variants --------------------------------------------------------------------------------------


def _loop_reference(q, k, v, kp, scale, window, softcap, sinks):
    """Row by row, key by key (float64): the contract's definition."""
    b_, h_, s_q, _ = q.shape
    s_k, grp = k.shape[2], h_ // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(b_):
        for h in range(h_):
            for i in range(s_q):
                pos = i + s_k - s_q
                js = [j for j in range(s_k) if j <= pos and (window is None or j > pos - window) and kp[b, j]]
                if not js:
                    continue
                s = torch.stack([q[b, h, i] @ k[b, h // grp, j] * scale for j in js])
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                e = torch.exp(s)
                den = e.sum() + (torch.exp(sinks[h]) if sinks is not None else 0.0)
                out[b, h, i] = sum(e[t] / den * v[b, h // grp, j] for t, j in enumerate(js))
    return out


@pytest.mark.parametrize("window,softcap,use_sinks", [(3, None, False), (None, 2.0, False), (None, None, True),
                                                      (2, 1.5, True)])
def test_attention_variants_match_loop_reference_forward_and_backward(window, softcap, use_sinks):
    b, h, h_kv, s_q, s_k, d = 2, 4, 2, 4, 6, 4  # S_q < S_k: bottom-right aligned
    leaves = [torch.randn(b, h, s_q, d, dtype=torch.float64), torch.randn(b, h_kv, s_k, d, dtype=torch.float64),
              torch.randn(b, h_kv, s_k, d, dtype=torch.float64)] + ([torch.randn(h, dtype=torch.float64)]
                                                                   if use_sinks else [])
    for t in leaves:
        t.requires_grad_(True)
    q, k, v = leaves[:3]
    sinks = leaves[3] if use_sinks else None
    kp = torch.ones(b, s_k, dtype=torch.bool)
    kp[1, :4] = False  # row 1: its first query sees no key (zeros; with sinks too)
    out = attention(q, k, v, None, kp, 0.3, True, window=window, softcap=softcap, sinks=sinks)
    ref = _loop_reference(q, k, v, kp, 0.3, window, softcap, sinks)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    plain = attention(q, k, v, None, kp, 0.3, True)
    assert (out - plain).abs().max() > 1e-3  # the variant changes the answer at these lengths
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dout)  # the op's registered backward (dq, dk, dv, dsinks)
    want = torch.autograd.grad(ref, leaves, dout)
    for name, g, w in zip("q k v sinks".split(), got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("kwargs,match", [
    (dict(window=0), r"window must be a positive int"),
    (dict(window=-3), r"window must be a positive int"),
    (dict(softcap=0.0), r"softcap must be a finite float > 0"),
    (dict(softcap=float("inf")), r"softcap must be a finite float > 0"),
    (dict(sinks=torch.zeros(3)), r"sinks must be \(H,\) = \(4,\)"),
    (dict(sinks=torch.zeros(1, 4)), r"sinks must be \(H,\) = \(4,\)"),
])
def test_bad_variant_arguments_are_one_line_errors(kwargs, match):
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    for call in (lambda: attention(q, k, k, causal=True, **kwargs),  # the wrapper
                 lambda: torch.ops.kvt.attention(q, k, k, None, None, 0.3, True, **kwargs)):  # the registered op
        with pytest.raises(ValueError, match=match) as e:
            call()
        assert "\n" not in str(e.value)
    # a float window: the wrapper's one-line error (the registered op's schema itself takes ints only)
    with pytest.raises(ValueError, match=r"window must be a positive int"):
        attention(q, k, k, causal=True, window=2.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [dict(window=64), dict(softcap=30.0), dict(sinks=True), dict(window=64, sinks=True)],
                         ids=["window", "softcap", "sinks", "window+sinks"])
def test_cuda_paths_match_float64(dtype, kw):
    """CUDA: a window runs PyTorch's SDPA with a boolean band, soft-cap / sinks the reference math; each within 2x
    PyTorch's own error in ``dtype`` (the plain-PyTorch reference in that dtype) of the float64 reference."""
    from kvtransform.ops.attention import attention_reference

    b, h, h_kv, s, d = 2, 8, 2, 333, 64
    q, k, v = (torch.randn(b, n, s, d, device="cuda") for n in (h, h_kv, h_kv))
    kw = dict(kw)
    if kw.get("sinks"):
        kw["sinks"] = torch.randn(h, device="cuda")
    want = attention_reference(q.double(), k.double(), v.double(), None, None, 0.125, True,
                               **{n: (x.double() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()})
    x = [t.to(dtype) for t in (q, k, v)]
    got = attention(*x, softmax_scale=0.125, causal=True, **kw)
    own = attention_reference(*x, None, None, 0.125, True, **kw)
    assert (got.double() - want).abs().max() <= 2 * (own.double() - want).abs().max() + 1e-5
