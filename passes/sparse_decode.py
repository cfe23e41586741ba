"""Sparse-decode pass: every attention of a captured decode step that is *proved* to be causal attention over the
KV cache becomes ``kvt::sparse_decode_attention`` over the step's selected tokens (SpeContext, arXiv 2512.00722
§4.3: one selection per decode step, shared by every layer).

Input: a graph captured by :func:`kvtransform.capture.capture_decode_step` (placeholders ``input_ids (B, 1)``,
``cache_seqlens (B,)`` int32, ``indices (B, H_kv, Bud)`` int32, ``k_cache``/``v_cache (L, B, H_kv, S_max, D)``).
A site is rewritten only when all of this is proved:

* its K (after walking back through ``repeat_kv``) is ``cat([k_cache[l], k_new], dim=-2)`` and its V is
  ``cat([v_cache[l], v_new], dim=-2)`` of the same layer ``l``: attention over this layer's cache plus the new
  token (anything else -- cross-attention, a cache the capture did not provide -- is refused);
* its mask keeps exactly the valid cache positions ``j < cache_seqlens[b]`` and the new token, or those limited to
  the config's ``sliding_window`` W: the mask subgraph is extracted and evaluated on probe inputs (several ``S_max``,
  including every threshold around W, random ``cache_seqlens`` including 0 and ``S_max``) and compared with those
  patterns. A window is accepted over the row's own positions (``cache_seqlens[b] - j < W``) or over the static
  cache index (``S_max - j < W``: transformers numbers the new token by the cache's size); either way the site
  becomes ``window=W``, which the op applies over the row's own positions (the new token is at position
  ``cache_seqlens[b]``: HF's semantics, where the distance between two real tokens is their position difference;
  the gate, :func:`kvtransform.verify.verify_decode`, checks it against the original model). A mask
  reading other inputs, or a bias, is refused;
* one query token (``(B, H, 1, D)``) and no attention dropout.

Each site becomes::

    out = kvt.sparse_decode_attention(q[:, :, 0], k_cache[l], v_cache[l], indices, cache_seqlens,
                                      k_new[:, :, 0], v_new[:, :, 0], scale,
                                      window=W, softcap=c, sinks=s)               # (B, H, D); each only when on
    out.unsqueeze(2)                                                             # what the layer consumes

with the site's soft-cap (Gemma 2) and learned sinks (gpt-oss) from the matcher (:mod:`.attention`). A window layer
never attends outside its window at any budget; within the budget it attends densely to its window
(:func:`kvtransform.ops.sparse_decode.sparse_decode_attention`), so the step's selection serves the global layers.

and the step's queries ``(L, B, H, D)`` (post-RoPE, one per layer) are appended to the graph's outputs, for
retrieval heads that score with the model's own queries. Any refused site is a ``ValueError`` naming the site and
the reason (the whole model must be rewritten: one dense site would read the full cache). The dead
``cat(k_cache, k_new)`` copies and the mask construction are removed by the cleanup pass that follows.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils._pytree import tree_structure

from .attention import _PASSTHROUGH, _keep_mask, _shape, config_window, describe, extract_subgraph, \
    find_attention, noop_slice, probe_lengths, unrepeat_kv
from .manager import KVPass, PassContext, derived_program

aten = torch.ops.aten
KVT_SPARSE_DECODE = torch.ops.kvt.sparse_decode_attention.default
_CAT = {aten.cat.default}


def _placeholder(gm: torch.fx.GraphModule, name: str) -> Optional[torch.fx.Node]:
    return next((n for n in gm.graph.nodes if n.op == "placeholder" and n.target == name), None)


def _skip_up(node):
    """Walk up through dtype/alias passthroughs and no-op slices."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and (node.target in _PASSTHROUGH
                                                                               or noop_slice(node)):
        node = node.args[0]
    return node


def unrepeat(node: torch.fx.Node) -> torch.fx.Node:
    """The un-repeated ``(B, H_kv, S, D)`` K/V behind transformers' ``repeat_kv`` (:func:`.attention.unrepeat_kv`),
    after dtype/alias passthroughs; ``node`` itself (after them) when the pattern is absent."""
    return unrepeat_kv(_skip_up(node))[0]


def cache_concat(node: torch.fx.Node, cache: torch.fx.Node) -> Optional[tuple[int, torch.fx.Node, torch.fx.Node]]:
    """``node`` = ``cat([select(cache, 0, l), new], dim=-2)`` (through dtype/alias passthroughs) →
    ``(l, select node, new node)``; None otherwise."""
    node = _skip_up(node)
    if not (isinstance(node, torch.fx.Node) and node.target in _CAT and len(node.args[0]) == 2):
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if dim not in (2, -2):
        return None
    past, new = node.args[0]
    past = _skip_up(past)
    if not (isinstance(past, torch.fx.Node) and past.target is aten.select.int and past.args[0] is cache
            and past.args[1] == 0 and isinstance(past.args[2], int)):
        return None
    ns = _shape(new)
    if ns is None or len(ns) != 4 or str(ns[2]) != "1":
        return None
    return int(past.args[2]), past, new


def prove_cache_mask(gm: torch.fx.GraphModule, mask: Optional[torch.fx.Node], is_causal: bool, ctx: PassContext,
                     memo: dict) -> str:
    """What a decode-step mask computes over the ``S_max + 1`` keys ``[cache..., new]``: ``"cache"`` (exactly the
    valid cache positions ``j < cache_seqlens[b]`` plus the new token, proved on probe inputs),
    ``"sliding_window"`` (that, limited to the config's window), or ``"custom"``."""
    if mask is None:
        return "custom"  # no mask: the padding past cache_seqlens would be attended (or is_causal: only key 0)
    if mask not in memo:
        memo[mask] = _probe_or_custom(gm, mask, ctx)
    return memo[mask]


def _probe_or_custom(gm, mask, ctx) -> str:
    """:func:`_probe_cache_mask`; a mask subgraph that cannot be evaluated on the probes is ``"custom"``."""
    try:
        return _probe_cache_mask(gm, mask, ctx)
    except Exception:
        return "custom"


def _probe_cache_mask(gm, mask, ctx) -> str:
    sub, names = extract_subgraph(gm, mask)
    allowed = {"input_ids", "cache_seqlens", "k_cache", "v_cache", "indices"}
    if any(n not in allowed for n in names):
        return "custom"
    cfg = ctx.config
    window = getattr(cfg, "sliding_window", None) if cfg is not None else None
    vals = {n: _val(_placeholder(gm, n)) for n in names}
    dev = next((v.device for v in vals.values() if v is not None), torch.device("cpu"))
    gen = torch.Generator().manual_seed(4321)
    verdicts = set()
    for s in sorted(set(probe_lengths(ctx)) | {4, 9}):
        b = 3
        lens = torch.randint(0, s + 1, (b,), generator=gen)
        lens[0], lens[1] = s, 0
        inputs = {"input_ids": torch.zeros(b, 1, dtype=torch.long), "cache_seqlens": lens.to(torch.int32),
                  "indices": torch.zeros(b, 1, 1, dtype=torch.int32)}
        for n in ("k_cache", "v_cache"):
            if n in names:
                v = vals[n]
                inputs[n] = torch.zeros(int(v.shape[0]), b, int(v.shape[2]), s, int(v.shape[4]), dtype=v.dtype)
        with torch.no_grad():
            value = sub(*[inputs[n].to(dev) for n in names]).cpu()
        keep = _keep_mask(value)
        if keep is None or keep.dim() != 4 or keep.shape[-1] != s + 1 or keep.shape[-2] != 1:
            return "custom"
        j = torch.arange(s + 1)
        cached = j[None, :] < lens[:, None]
        want = cached | (j == s)[None, :]
        keep = keep.expand(b, keep.shape[1], 1, s + 1)
        if torch.equal(keep, want[:, None, None, :].expand_as(keep)):
            verdicts.add("cache")
            continue
        if window:  # the window over the row's own positions, or over the static cache index (module docstring)
            if any(torch.equal(keep, win[:, None, None, :].expand_as(keep)) for win in (
                    (cached & ((lens[:, None] - j[None, :]) < int(window))) | (j == s)[None, :],
                    (cached & ((s - j) < int(window))[None, :]) | (j == s)[None, :])):
                verdicts.add("sliding_window")
                continue
        return "custom"
    if verdicts == {"cache"}:
        return "cache"
    return "sliding_window" if verdicts else "custom"


def _val(node):
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def append_outputs(gm: torch.fx.GraphModule, nodes: list) -> None:
    """Append ``nodes`` to the flat outputs of an unlifted ``ep.module()`` graph whose output is a tuple, updating
    its pytree output spec so the module returns the longer tuple."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = out.args[0]
    flat = list(flat) if isinstance(flat, (tuple, list)) else [flat]
    out.args = (tuple(flat + list(nodes)),)
    spec = tree_structure(tuple(range(len(flat) + len(nodes))))
    codegen = gm.graph._codegen
    if hasattr(codegen, "pytree_info") and codegen.pytree_info is not None:
        codegen.pytree_info = codegen.pytree_info._replace(out_spec=spec)
    if hasattr(gm, "_out_spec"):
        gm._out_spec = spec


def _refusal(m, mask_kind: str, kc, vc, ctx) -> Optional[str]:
    if m.problem:
        return m.problem
    if kc is None or vc is None:
        return ("keys/values are not this layer's KV cache plus the new token (cat(k_cache[l], k_new)): "
                "cross-attention or a cache the capture did not provide")
    if kc[0] != vc[0]:
        return f"keys read layer {kc[0]}'s cache but values layer {vc[0]}'s"
    qs = _shape(m.q)
    if qs is None or len(qs) != 4 or str(qs[2]) != "1":
        return f"query of shape {qs}: a decode step has one query token"
    if mask_kind not in ("cache", "sliding_window"):
        return "the mask is not provably causal attention over the cache (unknown or custom mask)"
    return None


class SparseDecodePass(KVPass):
    """Rewrite every proved decode attention into ``kvt::sparse_decode_attention`` (see the module docstring).

    Records a pass named ``sparse_decode`` and one :class:`~kvtransform.report.Site` per attention (status
    ``sparse_decode``, mask kind ``cache``), and appends the queries ``(L, B, H, D)`` to the graph outputs.

    Raises:
        ValueError: the graph was not captured by ``capture_decode_step`` (missing placeholders), has no attention,
            or has a site the pass cannot prove (the message names each refused site, its reason and the fix).
    """

    name = "sparse_decode"

    def run(self, gm: torch.fx.GraphModule, rec) -> bool:
        ctx = self.ctx
        ph = {n: _placeholder(gm, n) for n in ("cache_seqlens", "indices", "k_cache", "v_cache")}
        missing = [n for n, p in ph.items() if p is None]
        if missing:
            raise ValueError(f"the sparse_decode pass needs a decode-step graph with inputs {list(ph)} (missing "
                             f"{missing}); capture it with kvtransform.capture.capture_decode_step")
        matches = find_attention(gm)
        rec.matched = len(matches)
        if not matches:
            raise ValueError("no attention found in the decode step: nothing for SpeContext to rewrite")
        memo: dict = {}
        plans, refused = [], []
        for i, m in enumerate(matches):
            kind = prove_cache_mask(gm, m.mask, m.is_causal, ctx, memo)
            kc, vc = cache_concat(unrepeat(m.k), ph["k_cache"]), cache_concat(unrepeat(m.v), ph["v_cache"])
            why = _refusal(m, kind, kc, vc, ctx)
            window = config_window(ctx.config) if kind == "sliding_window" else None
            site = describe(m, i, kind, "sparse_decode" if why is None else f"skipped: {why}", window=window)
            ctx.report.sites.append(site)
            if why is not None:
                rec.skip(i, why)
                refused.append(f"site {i} (layer {site.layer}): {why}")
            else:
                plans.append((m, kc, vc, window))
        if refused:
            raise ValueError(
                f"the specontext transform cannot rewrite this model's decode step: {refused[0]}"
                + (f" (and {len(refused) - 1} more sites)" if len(refused) > 1 else "")
                + ". SpeContext needs causal self-attention over the KV cache (within a sliding window or not) in "
                  "every layer: use transform=canonical for this model")
        graph = gm.graph
        queries = {}
        for m, (layer, kc, kn), (_, vc, vn), window in plans:
            scale = float(m.scale) if m.scale is not None else float(_shape(m.q)[-1]) ** -0.5
            variants = {name: val for name, val in (("window", window), ("softcap", m.softcap), ("sinks", m.sinks))
                        if val is not None}
            with graph.inserting_before(m.out):
                q3 = graph.call_function(aten.select.int, (m.q, 2, 0))
                k3 = graph.call_function(aten.select.int, (kn, 2, 0))
                v3 = graph.call_function(aten.select.int, (vn, 2, 0))
                call = graph.call_function(KVT_SPARSE_DECODE, (q3, kc, vc, ph["indices"], ph["cache_seqlens"],
                                                               k3, v3, scale), variants)
                new = graph.call_function(aten.unsqueeze.default, (call, 2))
            new.meta.update({k: v for k, v in m.out.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
            call.meta["nn_module_stack"] = m.out.meta.get("nn_module_stack", {})
            m.out.replace_all_uses_with(new)
            queries[layer] = q3
            rec.rewritten += 1
        layers = sorted(queries)
        if layers != list(range(len(layers))):
            raise ValueError(f"decode-step attention found for layers {layers}: expected one per layer 0..L-1")
        out = next(n for n in graph.nodes if n.op == "output")
        with graph.inserting_before(out):
            stacked = graph.call_function(aten.stack.default, ([queries[i] for i in layers],))
        append_outputs(gm, [stacked])
        rec.notes.append(f"{rec.rewritten} sites read {len(layers)} layers' caches through indices; queries "
                         f"(L, B, H, D) exposed as an output")
        return True


def selection_layers(gm: torch.fx.GraphModule, budget: int) -> Optional[tuple]:
    """The layers of a rewritten decode program whose attention reads the step's selection: every layer without a
    window, and a window layer whose window's cache part (``window - 1`` tokens) exceeds ``budget`` (a smaller
    window is attended densely, :func:`kvtransform.ops.sparse_decode.sparse_decode_attention`). None when that is
    every layer (or none): a retrieval head then scores with all of them."""
    windows = {}
    for i, n in enumerate(x for x in gm.graph.nodes if x.op == "call_function" and x.target is KVT_SPARSE_DECODE):
        src = _skip_up(n.args[1])
        layer = int(src.args[2]) if isinstance(src, torch.fx.Node) and src.target is aten.select.int else i
        windows[layer] = n.kwargs.get("window")
    reads = tuple(sorted(l for l, w in windows.items() if w is None or int(w) - 1 > int(budget)))
    return reads if reads and len(reads) < len(windows) else None


def count_cache_copies(gm: torch.fx.GraphModule) -> int:
    """``cat`` nodes left that read a ``k_cache``/``v_cache`` slice (each would copy a layer's whole cache)."""
    caches = {_placeholder(gm, "k_cache"), _placeholder(gm, "v_cache")} - {None}
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _CAT:
            for a in node.args[0]:
                a = _skip_up(a)
                if isinstance(a, torch.fx.Node) and a.target is aten.select.int and a.args[0] in caches:
                    n += 1
    return n



def slot_mode_program(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The decode program a pass run produced, with every ``kvt::sparse_decode_attention`` in slot mode
    (``indices=None``): each layer attends to its whole cache up to ``cache_seqlens[b]`` (plus the new token), the
    kernel's loop bounded by the row's length. Full attention without an index per cached token: what the
    ``dense`` head selects, at the cost of the tokens actually cached rather than of ``S_max`` (gather mode walks
    every index, ``-1`` padding included).

    The result shares ``gm``'s parameters (no weight copy) and keeps its signature; the ``indices`` input is
    unused, so the captured input guards (``_guards_fn``) are dropped with it: callers pass any tensor there.

    Raises:
        ValueError: ``gm`` holds no ``kvt::sparse_decode_attention`` (not a program of this pass).
    """
    def slot(n):
        args = list(n.args)
        args[3] = None
        n.args = tuple(args)

    return rewrite_sites(gm, slot, "slot_mode_program needs a decode program rewritten by the sparse-decode pass "
                                   "(no kvt::sparse_decode_attention in it)")


def drop_input_guards(graph: torch.fx.Graph) -> None:
    """Erase, in place, the ``_guards_fn`` call ``torch.export`` leaves at the top of a program (it checks the
    export's ``Dim`` ranges, not what the program needs) where nothing reads its output."""
    for n in list(graph.nodes):
        if n.op == "call_module" and n.target == "_guards_fn" and not n.users:
            graph.erase_node(n)


def rewrite_sites(gm: torch.fx.GraphModule, edit: Callable[[torch.fx.Node], None], missing: str
                  ) -> torch.fx.GraphModule:
    """A copy of ``gm`` (sharing its parameters, same signature) in which ``edit(node)`` has changed every
    ``kvt::sparse_decode_attention`` node in place (its ``args`` / ``target``); the captured input guards
    (``_guards_fn``) are dropped once nothing reads them. What :func:`slot_mode_program` and the benchmark's
    FlashInfer program derive from a decode program.

    Raises:
        ValueError: ``missing``, when ``gm`` holds no such node; an ``edit`` that swaps the op for another and drops a
            site's ``window``/``softcap``/``sinks``.
    """
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    sites = [n for n in graph.nodes if n.op == "call_function" and n.target is KVT_SPARSE_DECODE]
    if not sites:
        raise ValueError(missing)
    for n in sites:
        variants = {k: v for k, v in n.kwargs.items() if v is not None}
        edit(n)
        if variants and n.target is not KVT_SPARSE_DECODE and any(n.kwargs.get(k) is not v
                                                                   for k, v in variants.items()):
            raise ValueError(f"the rewrite of {n.name} replaces kvt::sparse_decode_attention but drops its "
                             f"{', '.join(sorted(variants))} argument(s): this decode program needs them")
    drop_input_guards(graph)
    graph.lint()
    return derived_program(gm, graph)


__all__ = ["SparseDecodePass", "prove_cache_mask", "cache_concat", "append_outputs", "count_cache_copies",
           "slot_mode_program", "rewrite_sites", "drop_input_guards", "selection_layers"]
