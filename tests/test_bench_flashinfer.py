"""The decode suite's ``flashinfer`` method (:mod:`kvtransform.bench.flashinfer_decode`) on the CPU: FlashInfer
itself needs CUDA, so a test double stands in for its ``BatchDecodeWithPagedKVCacheWrapper`` with the documented
semantics the method relies on (``HND`` pages of ``page_size`` tokens, lengths read from the caller's last-page-length
buffer at ``run``, base-2 log-sum-exp). What is tested is our side: the program rewrite, the buffer refresh, the
new-token merge, the first-call check, and the suite's wiring."""
import sys
import types

import pytest
import torch

import kvtransform as kvt
from kvtransform.bench import flashinfer_decode as F
from kvtransform.kernels.sparse_decode import sparse_decode_reference
from kvtransform.models import tiny_model


class _Wrapper:
    """FlashInfer's batch decode wrapper, CUDA-graph mode, in plain PyTorch (fp64)."""

    def __init__(self, ws, kv_layout, use_cuda_graph, use_tensor_cores, paged_kv_indptr_buffer,
                 paged_kv_indices_buffer, paged_kv_last_page_len_buffer, backend, lse_base=2.0):
        assert kv_layout == "HND" and use_cuda_graph and backend == "fa2"
        self.indptr, self.indices, self.last = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                                                paged_kv_last_page_len_buffer)
        self.lse_base = lse_base
        self.plans = 0

    def plan(self, indptr, indices, last_page_len, h, h_kv, d, page_size, *, pos_encoding_mode, q_data_type,
             kv_data_type, sm_scale):
        assert pos_encoding_mode == "NONE"
        self.h, self.h_kv, self.page_size, self.scale = h, h_kv, page_size, sm_scale
        self.plans += 1

    def run(self, q, kv, return_lse):
        k, v = kv
        b, h, d = q.shape
        g = h // self.h_kv
        out = torch.empty(b, h, d, dtype=q.dtype)
        lse = torch.empty(b, h, dtype=torch.float32)
        for r in range(b):
            pages = self.indices[int(self.indptr[r]):int(self.indptr[r + 1])].tolist()
            n = (len(pages) - 1) * self.page_size + int(self.last[r])
            kr = torch.cat([k[p] for p in pages], dim=1)[:, :n].double()   # (H_kv, n, D)
            vr = torch.cat([v[p] for p in pages], dim=1)[:, :n].double()
            s = torch.einsum("kgd,knd->kgn", q[r].double().view(self.h_kv, g, d), kr) * self.scale
            lse[r] = (torch.logsumexp(s, -1) / torch.log(torch.tensor(self.lse_base, dtype=torch.float64))).view(h).float()
            out[r] = torch.einsum("kgn,knd->kgd", s.softmax(-1), vr).reshape(h, d).to(q.dtype)
        return out, lse


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mod = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_Wrapper, __version__="test-double")
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    return mod


def _inputs(b=3, h=8, h_kv=2, s=37, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, d, generator=g, dtype=dtype)
    kc, vc = (torch.randn(b, h_kv, s, d, generator=g, dtype=dtype) for _ in range(2))
    kn, vn = (torch.randn(b, h_kv, d, generator=g, dtype=dtype) for _ in range(2))
    lens = torch.tensor([5, s, 0][:b], dtype=torch.int32)
    return q, kc, vc, lens, kn, vn


def test_merge_new_token_matches_attention_over_cache_plus_token():
    q, kc, vc, lens, kn, vn = _inputs(dtype=torch.float64)
    scale = 0.3
    b, h, d = q.shape
    g = h // kc.shape[1]
    s = torch.einsum("bkgd,bknd->bkgn", q.view(b, -1, g, d), kc) * scale
    s = s.masked_fill(torch.arange(kc.shape[2])[None, None, None] >= lens[:, None, None, None].long(), float("-inf"))
    lse = torch.logsumexp(s, -1).reshape(b, h)                      # -inf for the empty row
    out = torch.nan_to_num(torch.einsum("bkgn,bknd->bkgd", s.softmax(-1), vc).reshape(b, h, d))
    got = F.merge_new_token(out, lse, q, kn, vn, scale)
    ref = sparse_decode_reference(q, kc, vc, None, lens, kn, vn, scale)
    assert (got - ref).abs().max() < 1e-6   # fp32 merge
    assert torch.allclose(got[2], vn[2].repeat_interleave(g, 0).to(got.dtype), atol=1e-6)   # empty cache: v_new


def test_flashinfer_decode_refreshes_lengths_and_checks_its_first_call(fake_flashinfer):
    q, kc, vc, lens, kn, vn = _inputs()
    impl = F.FlashInferDecode()
    got = impl(q, kc, vc, lens, kn, vn, 0.25)
    assert (got - sparse_decode_reference(q, kc, vc, None, lens, kn, vn, 0.25)).abs().max() < 1e-5
    lens2 = torch.tensor([1, 20, 37], dtype=torch.int32)             # the same plan, new lengths
    got2 = impl(q, kc, vc, lens2, kn, vn, 0.25)
    assert (got2 - sparse_decode_reference(q, kc, vc, None, lens2, kn, vn, 0.25)).abs().max() < 1e-5
    (plan,) = impl._plans.values()
    assert plan["wrapper"].plans == 1 and torch.equal(plan["last"], lens2)
    # a kernel whose LSE is natural-log (not base 2) is caught at the first call of a plan, not used
    fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper = lambda *a, **k: _Wrapper(*a, **k, lse_base=torch.e)
    bad = F.FlashInferDecode()
    for _ in range(2):  # a plan that failed its check is dropped, so the next call is checked again
        with pytest.raises(RuntimeError, match="disagrees with the reference"):
            bad(q, kc, vc, lens, kn, vn, 0.25)


def test_flashinfer_program_needs_slot_mode_and_decodes_like_dense(fake_flashinfer):
    """The dense runtime with its slot-mode program's attention through the FlashInfer op produces the same greedy
    tokens as the dense runtime itself."""
    from kvtransform.bench.decode_ours import use_flashinfer

    model = tiny_model("llama")
    sp = kvt.transform(model, kvt.SpeContextConfig(budget=16, head="dense"), progress=False)
    with pytest.raises(ValueError, match="slot-mode decode program"):
        F.flashinfer_program(sp.runtime.decode_fn, F.register(lambda *a: None))
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in (19, 33)]
    cache, logits = sp.runtime.prefill(rows, 33 + 10, torch.device("cpu"))
    ref = sp.runtime.decode_from(cache, logits.argmax(-1), 9)
    cache2, logits2 = sp.runtime.prefill(rows, 33 + 10, torch.device("cpu"))
    note = use_flashinfer(sp.runtime, tensor_cores=False)
    assert "test-double" in note and "one page per request" in note
    def calls():
        prog = sp.runtime._decode_program(torch.device("cpu"), slot=True)
        return [n for n in prog.graph.nodes if n.op == "call_function" and n.target is F.OP]

    assert len(calls()) == model.config.num_hidden_layers
    out = sp.runtime.decode_from(cache2, logits2.argmax(-1), 9)
    assert torch.equal(out.sequences, ref.sequences)
    sp.runtime.fuse_projections = "qkv"  # the derived programs are rebuilt, FlashInfer's kernel with them
    assert len(calls()) == model.config.num_hidden_layers
    with pytest.raises(ValueError, match="slot_rewrite must be a callable"):
        sp.runtime.slot_rewrite = "flashinfer"
    sp.runtime.slot_rewrite = None
    assert calls() == []


def test_suite_runs_the_flashinfer_method_when_it_imports(tmp_path, fake_flashinfer, monkeypatch):
    from kvtransform.bench import decode as D
    from kvtransform.bench import run

    monkeypatch.setattr(D, "_KEEP", {})
    rows = run("decode", ["-m", "model=tiny", "input=32", "output=12", "samples=2", "steps=2", "n0=2", "requests=2",
                          "method=flashinfer", f"out_dir={tmp_path}", "plot=false"])
    (r,) = [r for r in rows if r["pass"] == "run"]
    assert r["status"] == "ok" and r["tokens_per_s"] > 0 and "FlashInfer test-double" in r["note"]


def test_suite_skips_flashinfer_where_it_does_not_import(tmp_path, monkeypatch):
    from kvtransform.bench import run

    monkeypatch.setitem(sys.modules, "flashinfer", None)     # import fails
    rows = run("decode", ["-m", "model=tiny", "input=32", "output=12", "samples=2", "steps=2", "n0=2", "requests=2",
                          "method=flashinfer", f"out_dir={tmp_path}", "plot=false"])
    (r,) = [r for r in rows if r["pass"] == "run"]
    assert r["status"].startswith("skip: flashinfer is not installed")


def test_suite_reports_a_broken_flashinfer_install_as_such(tmp_path, monkeypatch):
    """An installed FlashInfer that fails at import is not reported as missing: the row says why it failed."""
    from kvtransform.bench.decode import flashinfer_missing

    pkg = tmp_path / "site" / "flashinfer"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise OSError('libcudart.so.13: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    why = flashinfer_missing()
    assert why.startswith("flashinfer does not import (OSError") and "libcudart" in why
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert flashinfer_missing() == "flashinfer is not installed on this machine"


def test_plans_are_bounded_least_recently_used_first(fake_flashinfer):
    impl = F.FlashInferDecode(max_plans=2)
    for b in (3, 2, 3, 1):  # batch 2 is the least recently used when batch 1 arrives
        q, kc, vc, lens, kn, vn = _inputs(b=b)
        got = impl(q, kc, vc, lens, kn, vn, 0.25)
        assert (got - sparse_decode_reference(q, kc, vc, None, lens, kn, vn, 0.25)).abs().max() < 1e-5
    assert [k[0] for k in impl._plans] == [3, 1]


def test_tensor_cores_setting_only_touches_flashinfer_rows(tmp_path, fake_flashinfer, monkeypatch):
    """flashinfer_tensor_cores=false is part of the flashinfer rows' params only, and needs no second transform."""
    from kvtransform.bench import decode as D
    from kvtransform.bench import run

    monkeypatch.setattr(D, "_KEEP", {})
    rows = run("decode", ["-m", "model=tiny", "input=32", "output=12", "samples=2", "steps=2", "n0=2", "requests=2",
                          "method=dense,flashinfer", "flashinfer_tensor_cores=true,false", f"out_dir={tmp_path}",
                          "plot=false"])
    runs = [r for r in rows if r["pass"] == "run"]
    assert all(r["status"] == "ok" for r in runs) and len(runs) == 4
    assert all("flashinfer_tensor_cores" not in r["params"] for r in runs if r["method"] == "dense")
    assert sum("flashinfer_tensor_cores=false" in r["params"] for r in runs if r["method"] == "flashinfer") == 1
    assert len(D._KEEP["ours"]) == 1
    (ours,) = D._KEEP["ours"].values()
    assert {k for k in ours.modules if isinstance(k, tuple)} == {("flashinfer", True), ("flashinfer", False)}
