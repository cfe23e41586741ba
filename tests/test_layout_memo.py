"""kernels/layout_memo.py: tables derived from a layout's tensors are reused only while those exact tensors live
unmodified; the prefix-tree kernels built from remembered tables follow a layout changed in place."""
import gc
import weakref

import torch

from kvtransform.kernels import layout_memo
from kvtransform.kernels import prefix_tree as K
from kvtransform.tree_layout import PrefixTreeLayout


def test_same_tensors_share_one_entry_until_changed_in_place():
    layout_memo.clear()
    a, b = torch.arange(5), torch.ones(3)
    first = layout_memo.memo(a, b, key="k")
    first["x"] = 1
    assert layout_memo.memo(a, b, key="k") is first
    assert layout_memo.memo(a, b, key="other") is not first  # another key, another entry
    b.add_(1)  # the version counter moves: the entry no longer applies
    assert "x" not in layout_memo.memo(a, b, key="k")


def test_dead_tensors_entry_is_not_served_to_a_new_tensor_with_the_same_id():
    layout_memo.clear()
    dead = torch.zeros(2)
    ref = weakref.ref(dead)
    del dead
    gc.collect()
    assert ref() is None
    b = torch.zeros(2)
    # the entry a freed tensor left behind under the id and version the new tensor has now
    layout_memo._ENTRIES[("k", (id(b), b._version))] = ((ref,), {"stale": True})
    assert "stale" not in layout_memo.memo(b, key="k")


def test_not_remembered_for_inference_tensors_or_subclasses():
    layout_memo.clear()
    with torch.inference_mode():
        t = torch.arange(3)
    assert layout_memo.memo(t) is not layout_memo.memo(t)
    p = torch.nn.Parameter(torch.zeros(2))
    assert layout_memo.memo(p) is not layout_memo.memo(p)


def test_entries_are_bounded():
    layout_memo.clear()
    keep = [torch.zeros(1) for _ in range(layout_memo.MAX_ENTRIES + 5)]
    for t in keep:
        layout_memo.memo(t)
    assert len(layout_memo._ENTRIES) == layout_memo.MAX_ENTRIES


def test_kernels_follow_a_layout_rewritten_in_place():
    """The same tensor objects, first one tree, then (copied in) another of the same sizes: the forward and
    backward follow the second (its plan is rebuilt, not read from the first's entry)."""
    layout_memo.clear()
    a = PrefixTreeLayout.from_parents([20, 9, 17], [-1, -1, 0])  # two roots, the third node under the first
    b = PrefixTreeLayout.from_parents([20, 9, 17], [-1, -1, 1])  # ... under the second
    names = ("cu_seqlens", "key_range_ptr", "key_ranges", "query_range_ptr", "query_ranges")
    assert all(getattr(a, n).shape == getattr(b, n).shape for n in names)
    assert any(not torch.equal(getattr(a, n), getattr(b, n)) for n in names)
    live = [getattr(a, n).clone() for n in names]
    t = a.total_tokens
    q, k, v = torch.randn(t, 4, 32), torch.randn(t, 2, 32), torch.randn(t, 2, 32)
    do = torch.randn_like(q)
    for lay in (a, b):
        for x, n in zip(live, names):
            x.copy_(getattr(lay, n))
        out, lse = K.prefix_tree_fwd(q, k, v, live[0], live[1], live[2], 0.2)
        grads = K.prefix_tree_bwd(do, q, k, v, out, lse, *live, 0.2)
        qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
        ref, _ = K.prefix_tree_attention_reference(qr, kr, vr, lay, 0.2)
        ref_grads = torch.autograd.grad(ref, (qr, kr, vr), do)
        assert (out - ref).abs().max() < 1e-5
        for g, r in zip(grads, ref_grads):
            assert (g - r).abs().max() < 5e-5
