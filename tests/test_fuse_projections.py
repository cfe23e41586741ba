"""Projection fusion of the decode program (passes/fuse_projections.py): which groups fuse, the fused program equals
the unfused one, the fused copies follow in-place parameter updates, bad input."""
import pytest
import torch

import kvtransform as kvt
from kvtransform.models import tiny_model
from kvtransform.passes.fuse_projections import FusedProjections, fused_program


def _sp(family, fuse="qkv"):
    torch.manual_seed(0)
    model = tiny_model(family)
    return model, kvt.transform(model, kvt.SpeContextConfig(budget=256, head="dense", fuse_projections=fuse),
                                progress=False)


def _step(rt, program_fn, seed=0):
    """One decode step of ``program_fn`` over a random cache: the program's outputs."""
    info = rt.info
    g = torch.Generator().manual_seed(seed)
    layers, h_kv, d = info.num_layers, info.num_kv_heads, info.head_dim
    k = torch.randn(layers, 3, h_kv, 40, d, generator=g)
    v = torch.randn(layers, 3, h_kv, 40, d, generator=g)
    seqlens = torch.tensor([5, 39, 17], dtype=torch.int32)
    idx = torch.arange(40, dtype=torch.int32).expand(3, h_kv, 40).contiguous()
    ids = torch.randint(3, 100, (3, 1), generator=g)
    with torch.no_grad():
        return program_fn(ids, seqlens, idx, k, v)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_qkv_groups_fused_and_equal(family):
    model, sp = _sp(family)
    dec = sp.runtime.decode_fn
    layers = model.config.num_hidden_layers
    f = fused_program(dec, "qkv")
    assert len(f.groups) == layers
    for _, wts, bts in f.groups:
        assert [t.rsplit(".", 2)[-2] for t in wts] == ["q_proj", "k_proj", "v_proj"]
        assert (bts is not None) == (family == "qwen2")  # Qwen2's q/k/v have biases: fused too
    code = f.program.code
    assert code.count("aten.split_with_sizes.default(") == layers and "k_proj" not in code
    assert len(fused_program(dec, "all").groups) == 2 * layers  # + gate/up
    assert fused_program(dec, "none") is None
    assert fused_program(dec, "qkv") is f  # built once per program
    want, got = _step(sp.runtime, dec), _step(sp.runtime, f.program)
    assert len(want) == len(got)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # the model's parameters took the fused weights' place: views of them, no extra memory
    assert f.shared == [True] * layers and f.extra_bytes == 0
    for name, wts, bts in f.groups:
        buf = getattr(f.program, name + "_w")
        for t in wts:
            p = dec.get_parameter(t)
            assert buf.data_ptr() <= p.data_ptr() < buf.data_ptr() + buf.numel() * 4
    copy = fused_program(dec, "qkv", share=False)  # the copy rule: its own buffers, counted
    assert copy is not f and copy.shared == [False] * layers
    assert copy.extra_bytes == sum(_.numel() * 4 for _ in (getattr(copy.program, n + "_w") for n, _, _ in f.groups)) \
        + sum(getattr(copy.program, n + "_b").numel() * 4 for n, _, b in f.groups if b)
    for a, b in zip(want, _step(sp.runtime, copy.program)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_shared_fusion_follows_every_update():
    model, sp = _sp("llama", fuse="all")
    rt = sp.runtime
    attn = model.model.layers[0].self_attn
    before = _step(rt, rt.decode_fn)
    f = rt._fused()
    assert all(f.shared) and len(f.groups) == 2 * model.config.num_hidden_layers and f.extra_bytes == 0
    # the model's weights live once: its parameters' storages hold exactly their bytes (no copy anywhere)
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert sum(storages.values()) == sum(p.numel() * p.element_size() for p in model.parameters())
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.v_proj.weight.untyped_storage().data_ptr()
    assert f.program.code.count("aten.split_with_sizes.default(") == len(f.groups)
    for a, b in zip(before, _step(rt, f.program)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # every way of updating a parameter in place reaches the fused program without a copy
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(-2.0)
    attn.q_proj.weight.data.copy_(attn.q_proj.weight.data * 3.0)
    model.load_state_dict({k: v * 0.5 if k.endswith("v_proj.weight") else v for k, v in model.state_dict().items()})
    assert f.refresh(force=True) == 0
    for a, b in zip(_step(rt, rt.decode_fn), _step(rt, f.program)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    ids = torch.randint(3, 100, (2, 9))
    res = sp.generate(ids, max_new_tokens=6, eos_token_id=None, return_dict_in_generate=True)
    assert res.stats.fused_weight_bytes == 0
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert torch.equal(res.sequences, ref)
    # a parameter replaced under the program (new storage): that group falls back to the copy rule
    k0 = rt.decode_fn.get_parameter("model.model.layers.0.self_attn.k_proj.weight")
    k0.data = k0.data.clone() * 7.0
    assert f.refresh() == 1 and f.shared.count(False) == 1 and f.extra_bytes > 0
    assert f.refresh() == 0
    for a, b in zip(_step(rt, rt.decode_fn), _step(rt, f.program)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_a_second_fusion_reuses_the_buffers_and_ties_are_copied():
    model, sp = _sp("llama", fuse="none")
    dec = sp.runtime.decode_fn
    qkv = fused_program(dec, "qkv")
    assert all(qkv.shared)
    full = fused_program(dec, "all")  # q/k/v already are one buffer's consecutive rows: that buffer is reused
    assert all(full.shared) and full.extra_bytes == 0
    assert getattr(full.program, full.groups[0][0] + "_w").data_ptr() == \
        getattr(qkv.program, qkv.groups[0][0] + "_w").data_ptr()
    for a, b in zip(_step(sp.runtime, qkv.program), _step(sp.runtime, full.program)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)

    class Tied(torch.nn.Module):  # two parameters on one storage (a tie the module does not declare)
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 6, bias=False)
            self.c = torch.nn.Linear(8, 4, bias=False)
            self.c.weight = torch.nn.Parameter(self.a.weight.data)  # same storage, another Parameter

        def forward(self, x):
            return self.a(x), self.b(x), self.c(x * 2)

    gm = torch.export.export(Tied(), (torch.randn(3, 8),)).module()
    f = FusedProjections(gm, "all")
    assert f.shared == [False] and f.extra_bytes > 0
    x = torch.randn(3, 8)
    for a, b in zip(gm(x), f.program(x)):
        torch.testing.assert_close(b, a)


def test_fused_weights_follow_in_place_updates():
    model, sp = _sp("llama")
    rt = sp.runtime
    rt.share_fused_weights = False
    f = rt._fused()
    assert not any(f.shared)
    assert f.refresh() == 0  # nothing changed since the copy
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight.mul_(-2.0)
    assert f.refresh() == 1 and f.refresh() == 0  # the changed layer's group only, once
    for a, b in zip(_step(rt, rt.decode_fn), _step(rt, f.program)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # generate reads the new weights, also after an update through .data (which bumps no version counter)
    w = model.model.layers[0].self_attn.q_proj.weight
    v0 = w._version
    w.data.copy_(w.data * 3.0)
    assert w._version == v0 and f.refresh() == 0 and f.refresh(force=True) == model.config.num_hidden_layers
    w.data.mul_(0.5)
    ids = torch.randint(3, 100, (2, 9))
    res = sp.generate(ids, max_new_tokens=6, eos_token_id=None, return_dict_in_generate=True)
    out = res.sequences
    assert res.stats.fused_weight_bytes == f.extra_bytes > 0
    from kvtransform.passes.fuse_projections import fused_bytes
    assert fused_bytes(rt.decode_fn) == f.extra_bytes  # what the offload memory plan adds to the weights
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, ref)


def test_shape_change_is_refused():
    _, sp = _sp("llama")
    f = sp.runtime._fused()
    k_proj = sp.runtime.decode_fn.get_submodule("model.model.layers.0.self_attn.k_proj")  # what the program reads
    k_proj.weight = torch.nn.Parameter(k_proj.weight[:-1].clone())
    with pytest.raises(ValueError, match="changed shape"):
        f.refresh()


def test_bad_choice():
    with pytest.raises(ValueError, match="fuse_projections must be one of"):
        kvt.SpeContextConfig(fuse_projections="qk").validate()
    _, sp = _sp("llama", fuse="none")
    rt = sp.runtime
    assert rt._fused() is None
    rt._decode_program("cpu", slot=True)
    assert rt.programs._slot is not None
    rt.fuse_projections = "qkv"  # switching drops the derived programs: the slot variant is rebuilt from the fused one
    assert rt.programs._slot is None and rt._fused() is not None
    assert "aten.split_with_sizes.default(" in rt._decode_program("cpu", slot=True).code
    with pytest.raises(ValueError, match="fuse_projections must be one of"):
        rt.fuse_projections = "yes"
    with pytest.raises(ValueError, match="fuse_projections must be one of"):
        FusedProjections(sp.runtime.decode_fn, "gate")


def test_program_without_attention_fuses_nothing_for_qkv():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 6, bias=False)

        def forward(self, x):
            return self.a(x) * 2, self.b(x)

    gm = torch.export.export(Two(), (torch.randn(3, 8),)).module()
    assert FusedProjections(gm, "qkv").program is gm  # no attention site: nothing is q/k/v
    f = FusedProjections(gm, "all")
    assert len(f.groups) == 1
    x = torch.randn(3, 8)
    for a, b in zip(gm(x), f.program(x)):
        torch.testing.assert_close(b, a)



def test_fused_copies_are_freed_with_the_program():
    """The fused weights live on the source program: one garbage collection frees them with the model."""
    import gc
    import weakref

    model, sp = _sp("llama")
    sp.generate(torch.randint(3, 100, (2, 7)), max_new_tokens=3, eos_token_id=None)
    gone = [weakref.ref(sp.runtime._fused().program), weakref.ref(model.model.embed_tokens.weight)]
    del model, sp
    gc.collect()
    assert all(r() is None for r in gone)


def test_share_setting_from_the_config_and_switching_it_later():
    """share_fused_weights=False in the config leaves the model's storage alone (copies, counted); switching the
    runtime's setting drops the derived programs, so the decode reads the fused weights it refreshes."""
    torch.manual_seed(0)
    model = tiny_model("llama")
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    sp = kvt.transform(model, kvt.SpeContextConfig(budget=256, head="dense", share_fused_weights=False),
                       progress=False)
    rt = sp.runtime
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs  # untouched
    assert not any(rt._fused().shared) and rt._fused().extra_bytes > 0
    ids = torch.randint(3, 100, (2, 9))

    def same_as_hf():
        out = sp.generate(ids, max_new_tokens=5, eos_token_id=None)
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        return torch.equal(out, ref)

    assert same_as_hf()
    rt.share_fused_weights = True  # the slot-mode program is rebuilt from the shared fusion
    assert rt.programs._slot is None and same_as_hf() and all(rt._fused().shared)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    assert same_as_hf()
    with pytest.raises(ValueError, match="share_fused_weights must be true or false"):
        rt.share_fused_weights = "yes"


def test_a_failing_slot_rewrite_fails_every_time():
    _, sp = _sp("llama")
    rt, ids = sp.runtime, torch.randint(3, 100, (2, 9))
    calls = []

    def broken(program):
        calls.append(1)
        raise RuntimeError("kernel registration failed")

    rt.slot_rewrite = broken
    for _ in range(2):  # never decodes without the rewrite while the hook is set
        with pytest.raises(RuntimeError, match="kernel registration failed"):
            sp.generate(ids, max_new_tokens=3, eos_token_id=None)
    assert len(calls) == 2
    rt.slot_rewrite = lambda program: None
    with pytest.raises(ValueError, match="slot_rewrite returned NoneType"):
        sp.generate(ids, max_new_tokens=3, eos_token_id=None)
    rt.slot_rewrite = None
    sp.generate(ids, max_new_tokens=3, eos_token_id=None)
