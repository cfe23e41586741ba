"""KV offload with elastic loading (SpeContext, arXiv 2512.00722 §5–6) on the CPU stand-in of the copy engine:
the offloaded path gives exactly the tokens of the resident path, copies fewer bytes than reloading the budget, and
the elastic copy kernel and slot map do what they say."""
import pytest
import torch

import kvtransform as kvt
from kvtransform.kernels.elastic import elastic_copy_reference, elastic_copy_triton
from kvtransform.models import tiny_model
from kvtransform.runtime.offload import LayerReady, SlotMap


def _weights(rt):
    """The weights the memory plan counts: the decode program's parameters plus the fused projection copies the
    resident run built (fuse_projections)."""
    params = {id(p): p for p in rt.decode_fn.parameters()}.values()
    return sum(p.numel() * p.element_size() for p in params) + rt.programs.fused_bytes()


@pytest.mark.parametrize("head,layers,tokens,budget", [("recent", 2, 21, 8), ("self", 4, 26, 8), ("self", 4, 26, 4)])
def test_offloaded_tokens_equal_resident(head, layers, tokens, budget):
    """Offloaded decode gives the resident run's tokens and selections; budget 4 is below the self head's own
    sink + recent windows (clamped to the budget, so no tie among forced positions decides the set)."""
    model = tiny_model("llama", num_hidden_layers=layers)
    sp = kvt.transform(model, kvt.SpeContextConfig(budget=budget, head=head, num_sink=2 if head == "recent" else 0),
                       progress=False)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in (20, 13, 17)]
    ids = torch.zeros(3, 20, dtype=torch.long)
    am = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, 20 - len(r):], am[b, 20 - len(r):] = r, 1
    kw = dict(max_new_tokens=16, eos_token_id=None, return_dict_in_generate=True)
    ref = sp.generate(ids, am, **kw)
    rt = sp.runtime
    rt.offload, rt.offload_chunk = True, 4
    c = 2 * model.config.num_key_value_heads * 16 * 4  # K+V bytes per token, layer and row (fp32, head_dim 16)
    rt.gpu_memory_bytes = _weights(rt) + 3 * layers * c * tokens  # every layer resident up to `tokens` tokens
    try:
        out = sp.generate(ids, am, **kw)
    finally:
        rt.offload = False
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.selection_checksums == ref.stats.selection_checksums
    st = out.stats
    assert st.offload and st.offload_moves, "the plan moved no layer: the test does not exercise offload"
    assert [m[2] for m in st.offload_moves] == sorted((m[2] for m in st.offload_moves), reverse=True)  # last first
    assert max(st.offload_layers_per_step) >= (2 if layers > 2 else 1)
    moved, full = st.offload_bytes_per_step, st.offload_full_bytes_per_step
    assert len(moved) >= 5 and moved[0] == full[0]  # the first offloaded step loads every selected token
    # after it only the entries that entered the selection move
    assert all(m < f for m, f in zip(moved[1:], full[1:])) and sum(moved[1:]) < 0.5 * sum(full[1:])
    # the split program runs on the decode program's very weights: one copy, and in-place updates reach it
    split = [rt.programs.layer_split(LayerReady)]  # built once by the offloaded run
    assert split[0] is rt.programs.layer_split(LayerReady)
    dec = {id(p) for p in rt.decode_fn.parameters()}
    assert split and all(id(p) in dec for m in split for p in m.parameters())
    # it runs the fused projections, as resident steps do (same GEMMs: the same bits on CUDA too)
    assert rt.fuse_projections == "all" and any(n.startswith("_kvt_fused_proj") for n, _ in split[0].named_buffers())
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(-2)
    ref2 = sp.generate(ids, am, **kw)
    rt.offload = True
    try:
        out2 = sp.generate(ids, am, **kw)
    finally:
        rt.offload = False
    assert not torch.equal(ref2.sequences, ref.sequences) and torch.equal(out2.sequences, ref2.sequences)


def test_engine_resumed_at_a_length_decodes_like_the_resident_cache():
    """``OffloadEngine.resume_at`` + ``decode_from(engine=)`` (what the decode suite times at sampled lengths): the
    plan's layers start on CPU without ever being on the GPU, the decode crosses a growth and a further move, and
    the tokens and selections equal ``decode_from`` on a resident cache holding the same K/V."""
    import dataclasses

    from kvtransform.runtime.cache import KVCache
    from kvtransform.runtime.offload import OffloadedKVCache, OffloadEngine, make_plan

    model = tiny_model("llama", num_hidden_layers=4)
    sp = kvt.transform(model, kvt.SpeContextConfig(budget=8, head="self"), progress=False)
    rt, info = sp.runtime, sp.runtime.info
    b, max_len, ctx = 3, 64, 37
    shape = (info.num_layers, b, info.num_kv_heads, max_len, info.head_dim)
    g = torch.Generator().manual_seed(0)
    resident = KVCache.allocate(*shape[:3], max_len, info.head_dim, torch.float32, "cpu")
    resident.k.normal_(generator=g)
    resident.v.normal_(generator=g)
    resident.token_ids.random_(3, info.vocab_size, generator=g)
    resident.cache_seqlens.fill_(ctx)
    tok = torch.randint(3, info.vocab_size, (b,), generator=g)
    plan = dataclasses.replace(make_plan(rt, b, ctx, max_len - ctx, 10 ** 9), thresholds=[None, 55, 30, 20])
    cache = OffloadedKVCache(*shape[:3], max_len, info.head_dim, torch.float32, "cpu", capacity=1)
    engine = OffloadEngine(cache, plan, 8, 16, rt.programs.layer_split(LayerReady))
    engine.resume_at(ctx)
    assert cache.offloaded == [2, 3] and cache.capacity == 48 and int(cache.cache_seqlens.max()) == ctx
    for w, full in ((0, resident.k), (1, resident.v)):
        for l in range(info.num_layers):
            (cache.gpu[w][l] if cache.gpu[w][l] is not None else cache.host[w][l])[:, :, :ctx] = full[l][:, :, :ctx]
    cache.token_ids.copy_(resident.token_ids)
    want = rt.decode_from(resident, tok, 16)
    got = rt.decode_from(cache, tok, 16, engine=engine)
    assert torch.equal(got.sequences, want.sequences)
    assert got.stats.selection_checksums == want.stats.selection_checksums
    assert [m[2] for m in engine.moves] == [1] and cache.capacity == 64  # layer 1 moved when growing past 48
    with pytest.raises(ValueError, match="fresh engine"):
        engine.resume_at(ctx)
    with pytest.raises(ValueError, match="engine must be the OffloadEngine of this cache"):
        rt.decode_from(resident, tok, 2, engine=engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_offloaded_cuda_graph_steps_equal_resident():
    """CUDA: offloaded steps are CUDA-graph replays (recaptured after each layer move and growth, the elastic
    copies on the capturing stream) and give the resident run's tokens and selections."""
    layers = 4
    model = tiny_model("llama", num_hidden_layers=layers).cuda()
    sp = kvt.transform(model, kvt.SpeContextConfig(budget=8, head="self", fuse_projections="none"), progress=False)
    ids = torch.randint(3, 128, (3, 20), generator=torch.Generator().manual_seed(1)).cuda()
    kw = dict(max_new_tokens=24, eos_token_id=None, return_dict_in_generate=True)
    ref = sp.generate(ids, **kw)
    rt = sp.runtime
    rt.offload, rt.offload_chunk = True, 4
    c = 2 * model.config.num_key_value_heads * 16 * 4
    rt.gpu_memory_bytes = _weights(rt) + 3 * layers * c * 26
    try:
        out = sp.generate(ids, **kw)
    finally:
        rt.offload = False
    assert ref.stats.cuda_graph and out.stats.cuda_graph and out.stats.offload_moves
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.selection_checksums == ref.stats.selection_checksums


def test_offload_refuses_heads_that_read_every_layer():
    sp = kvt.transform(tiny_model("llama"), kvt.SpeContextConfig(budget=8, head="quest"), progress=False)
    sp.runtime.offload, sp.runtime.gpu_memory_bytes = True, 10 ** 6
    with pytest.raises(ValueError, match="use head= one of recent, self"):
        sp.generate(torch.randint(3, 100, (1, 12)), max_new_tokens=2)


@pytest.fixture(scope="module")
def sp_recent():
    """One SpeContext transform of a tiny Llama (head=recent) for the settings checks below (each sets its settings
    with monkeypatch, undone after the test)."""
    return kvt.transform(tiny_model("llama"), kvt.SpeContextConfig(budget=8, head="recent"), progress=False)


@pytest.mark.parametrize("key,value,msg", [("gpu_memory_bytes", float("nan"), r"gpu_memory_bytes=nan must be an "),
                                           ("gpu_memory_bytes", True, r"gpu_memory_bytes=True must be an integer"),
                                           ("gpu_memory_bytes", "1e9", r"gpu_memory_bytes='1e9' must be an integer"),
                                           ("offload_chunk", 0, r"offload_chunk=0 must be an integer >= 1")])
def test_offload_settings_are_checked(sp_recent, monkeypatch, key, value, msg):
    """The runtime's offload settings from Python: one line naming the attribute (they were int() errors)."""
    sp = sp_recent
    monkeypatch.setattr(sp.runtime, "offload", True)  # monkeypatch: the module's transform is shared, settings not
    monkeypatch.setattr(sp.runtime, "gpu_memory_bytes", 10 ** 9)
    monkeypatch.setattr(sp.runtime, key, value)
    with pytest.raises(ValueError, match="runtime." + msg):
        sp.generate(torch.randint(3, 100, (1, 12)), max_new_tokens=2)


def test_slot_map_moves_only_entering_entries():
    sm = SlotMap(1, 1, 4, 16, "cpu")
    slot_of, pos, slot, enter = sm.update(torch.tensor([[[3, 5, -1, -1]]], dtype=torch.int32))
    assert enter.tolist() == [[[True, True, False, False]]] and slot_of.tolist() == [[[0, 1, -1, -1]]]
    slot_of, pos, slot, enter = sm.update(torch.tensor([[[9, 3, 7, 5]]], dtype=torch.int32))
    assert enter.tolist() == [[[True, False, True, False]]]
    assert slot_of.tolist() == [[[2, 0, 3, 1]]] and sm.slot_pos.tolist() == [[[3, 5, 9, 7]]]
    slot_of, pos, slot, enter = sm.update(torch.tensor([[[11, 9, 3, 7]]], dtype=torch.int32))  # 5 left, 11 enters
    assert enter.tolist() == [[[True, False, False, False]]] and slot_of.tolist() == [[[1, 2, 0, 3]]]


def test_elastic_copy_kernel_matches_reference():
    g = torch.Generator().manual_seed(0)
    src_k, src_v = torch.randn(2, 3, 40, 24, generator=g), torch.randn(2, 3, 40, 24, generator=g)
    pos = torch.randint(0, 40, (2, 3, 19), generator=g)
    slot = torch.stack([torch.stack([torch.randperm(19, generator=g) for _ in range(3)]) for _ in range(2)])
    enter = torch.rand(2, 3, 19, generator=g) < 0.4
    outs = []
    for fn in (elastic_copy_reference, elastic_copy_triton):
        dk, dv = torch.full((2, 3, 19, 24), 7.0), torch.full((2, 3, 19, 24), 7.0)
        fn(src_k, src_v, dk, dv, pos, slot, enter)
        outs.append((dk, dv))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    b, h, j = enter.nonzero(as_tuple=True)
    assert torch.equal(outs[0][0][b, h, slot[b, h, j]], src_k[b, h, pos[b, h, j]])
    untouched = torch.ones(2, 3, 19, dtype=torch.bool)
    untouched[b, h, slot[b, h, j]] = False
    assert bool((outs[1][1][untouched] == 7.0).all())


def test_a_dropped_offloaded_cache_is_freed_without_the_garbage_collector():
    """An offloaded generation's cache and engine hold no reference cycle: dropping them frees the GPU layers at
    once (the decode suite and repeated ``generate`` calls allocate the next cache right after), not when Python's
    cyclic collector happens to run."""
    import gc
    import weakref

    from kvtransform.runtime.offload import OffloadedKVCache, OffloadEngine, make_plan

    model = tiny_model("llama", num_hidden_layers=3)
    sp = kvt.transform(model, kvt.SpeContextConfig(budget=8, head="self"), progress=False)
    rt, info = sp.runtime, sp.runtime.info
    b, max_len, ctx = 2, 48, 20
    plan = make_plan(rt, b, ctx, max_len - ctx, 10 ** 9)
    plan.thresholds = [None, 30, 25]
    cache = OffloadedKVCache(info.num_layers, b, info.num_kv_heads, max_len, info.head_dim, torch.float32, "cpu",
                             capacity=1)
    engine = OffloadEngine(cache, plan, 8, 8, rt.programs.layer_split(LayerReady))
    engine.resume_at(ctx)
    cache.token_ids.random_(3, info.vocab_size)
    out = rt.decode_from(cache, torch.randint(3, info.vocab_size, (b,)), 12, engine=engine)
    assert engine.moves  # layers moved: the engine ran its full path
    layer0, dead = cache.gpu[0][0], []
    weakref.finalize(layer0, dead.append, True)
    was = gc.isenabled()
    gc.disable()
    try:
        del cache, engine, layer0, out
        assert dead == [True], "the offloaded cache outlived its last reference (a reference cycle)"
    finally:
        if was:
            gc.enable()
