"""DualKV pass: every canonical causal ``kvt.attention`` of a packed capture becomes ``kvt.dualkv_attention``.

Input: a graph captured by :func:`kvtransform.capture.capture_packed` (placeholders ``input_ids (1, T)``,
``position_ids (1, T)``, ``cu_seqlens (S+1,)``, ``segment_prefix (S,)``) after :func:`~.attention.canonicalize_attention`.
Each ``kvt.attention(q (1, H, T, D), k (1, H_kv, T, D), v, attn_mask=None, key_padding=None, scale, causal=True)``
is replaced by::

    q3 = q.transpose(1, 2).squeeze(0)            # (T, H, D)      (same for k, v: (T, H_kv, D); GQA by index)
    out = kvt.dualkv_attention(q3, k3, v3, cu_seqlens, segment_prefix, scale)[0]
    out.unsqueeze(0).transpose(1, 2)             # (1, H, T, D), what the rest of the layer consumes

so a prompt token attends causally within its prompt and a response token to its group's whole prompt plus its own
response so far (DualKV, arXiv 2605.15422, §2–3). The canonical node's variant keywords (``window``: causal within a
sliding window of each sequence's own positions; ``softcap``; ``sinks``: learned per-head sink logits) are passed on
to ``kvt.dualkv_attention`` unchanged. The causal mask the canonical pass proved (and already dropped)
stays gone; this pass removes the dead canonical nodes and checks that no ``(T, T)`` tensor is left in the graph.

Sites the layout cannot express are *refused*, never silently kept: a custom mask, key padding, a batch dimension
other than 1, a variant keyword the installed op does not take, or a site the canonical pass skipped. Each refusal is a ``skipped`` entry of the
``dualkv`` pass record and a ``skipped: ...`` site status; the dualkv transform raises on any refusal, because one
plain attention left over a packed token axis would let responses attend to each other.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch

from .manager import KVPass

aten = torch.ops.aten
KVT_ATTENTION = torch.ops.kvt.attention.default
KVT_DUALKV = torch.ops.kvt.dualkv_attention.default


def _placeholder(gm: torch.fx.GraphModule, name: str) -> Optional[torch.fx.Node]:
    return next((n for n in gm.graph.nodes if n.op == "placeholder" and n.target == name), None)


def _val(node):
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


#: the attention-variant keyword arguments of canonical ``kvt.attention`` nodes (window, soft-cap, learned sinks)
VARIANTS = ("window", "softcap", "sinks")


def variant_kwargs(node: torch.fx.Node) -> dict:
    """The variant keyword arguments a canonical ``kvt.attention`` node sets (not None): ``window`` (int),
    ``softcap`` (float), ``sinks`` (the ``(H,)`` sink-logit node); ``{}`` for plain causal attention."""
    return {name: node.kwargs[name] for name in VARIANTS if node.kwargs.get(name) is not None}


def unsupported_variants(op, kwargs: dict) -> Optional[str]:
    """None when the registered op ``op`` (an ``OpOverload``) takes every keyword of ``kwargs``; else the one-line
    reason naming the ones it does not take yet."""
    takes = {a.name for a in op._schema.arguments}
    missing = [f"{name}={kwargs[name] if not isinstance(kwargs[name], torch.fx.Node) else kwargs[name].name}"
               for name in kwargs if name not in takes]
    if not missing:
        return None
    return f"{', '.join(missing)}: {op._schema.name} does not take {'it' if len(missing) == 1 else 'them'} yet"


def _refusal(node: torch.fx.Node) -> Optional[str]:
    """Why a ``kvt.attention`` node cannot become DualKV attention (None when it can)."""
    args = list(node.args) + [None] * (7 - len(node.args))
    q, k, v, attn_mask, key_padding, scale, causal = args[:7]
    if attn_mask is not None:
        return "mask is not causal or causal within a window (a custom mask): the packed layout cannot express it"
    why = unsupported_variants(KVT_DUALKV, variant_kwargs(node))
    if why is not None:
        return why
    if key_padding is not None:
        return "key padding: packed batches have no padding (capture with capture_packed)"
    if not causal:
        return "not causal: DualKV attention is causal within prompt and response"
    qv = _val(q)
    if qv is not None and qv.dim() == 4:
        b = qv.shape[0]
        if not (isinstance(b, int) and b == 1) and str(b) != "1":
            return f"batch dimension {b}: a packed batch has batch size 1"
    return None


def _tokens_symbol(gm) -> Optional[object]:
    ph = _placeholder(gm, "input_ids")
    v = _val(ph)
    return v.shape[1] if v is not None and v.dim() == 2 else None


def count_square_tensors(gm: torch.fx.GraphModule) -> int:
    """Nodes whose value has two trailing dims both equal to the packed length ``T`` (e.g. a ``(T, T)`` mask)."""
    t = _tokens_symbol(gm)
    if t is None:
        return 0
    n = 0
    for node in gm.graph.nodes:
        v = _val(node)
        if v is not None and v.dim() >= 2 and str(v.shape[-1]) == str(t) and str(v.shape[-2]) == str(t):
            n += 1
    return n


class DualKVPass(KVPass):
    """Rewrite canonical causal attention into ``kvt.dualkv_attention`` over the graph's layout placeholders.

    Records a pass named ``dualkv`` (matched = canonical attention nodes, rewritten, skipped with reasons) and sets
    each rewritten site's status to ``"dualkv"``. Run the cleanup pass after it; then
    :func:`count_square_tensors` checks that no ``(T, T)`` tensor is left.

    Raises:
        ValueError: the graph has no ``cu_seqlens``/``segment_prefix`` placeholders (it was not captured with
            :func:`kvtransform.capture.capture_packed`).
    """

    name = "dualkv"

    def run(self, gm: torch.fx.GraphModule, rec) -> bool:
        ctx = self.ctx
        cu = _placeholder(gm, "cu_seqlens")
        sp = _placeholder(gm, "segment_prefix")
        if cu is None or sp is None:
            raise ValueError("the dualkv pass needs a graph with cu_seqlens and segment_prefix inputs; capture the model "
                             "with kvtransform.capture.capture_packed")
        graph = gm.graph
        nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is KVT_ATTENTION]
        rec.matched = len(nodes)
        canonical_sites = [s for s in ctx.report.sites if s.status == "canonical"]
        site_of = dict(zip(nodes, canonical_sites)) if len(canonical_sites) == len(nodes) else {}
        for s in ctx.report.sites:
            if s.status.startswith("skipped"):
                rec.skip(s.index, f"not canonicalised ({s.status})")
        for i, node in enumerate(nodes):
            site = site_of.get(node)
            why = _refusal(node)
            if why is not None:
                rec.skip(site.index if site else i, why)
                if site is not None:
                    site.status = f"skipped: {why}"
                continue
            q, k, v = node.args[:3]
            scale = float(node.args[5])
            d_qk, d_v = (_val(x).shape[-1] if _val(x) is not None else None for x in (k, v))
            width = max(d_qk, d_v) if isinstance(d_qk, int) and isinstance(d_v, int) and d_qk != d_v else None
            with graph.inserting_before(node):
                packed = []
                for x in (q, k, v):
                    tr = graph.call_function(aten.transpose.int, (x, 1, 2))
                    x3 = graph.call_function(aten.squeeze.dim, (tr, 0))
                    if width is not None:  # MLA (DeepSeek-V2/V3): value heads of another size than query/key ones;
                        # zero columns change neither q·k nor the kept output columns (exact; the HF integration
                        # and transformers' FlashAttention path pad the same way), the scale stays the model's
                        x3 = graph.call_function(aten.constant_pad_nd.default, (x3, [0, width - _val(x).shape[-1]]))
                    packed.append(x3)
                call = graph.call_function(KVT_DUALKV, (*packed, cu, sp, scale), variant_kwargs(node))
                out = graph.call_function(operator.getitem, (call, 0))
                if width is not None:
                    out = graph.call_function(aten.slice.Tensor, (out, -1, 0, d_v))
                uns = graph.call_function(aten.unsqueeze.default, (out, 0))
                new = graph.call_function(aten.transpose.int, (uns, 1, 2))
            new.meta.update({key: val for key, val in node.meta.items() if key in ("val", "nn_module_stack",
                                                                                   "stack_trace")})
            call.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
            node.replace_all_uses_with(new)
            rec.rewritten += 1
            if site is not None:
                site.status = "dualkv"
        return rec.rewritten > 0
