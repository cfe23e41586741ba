"""Canonical attention pass: every standard attention in a captured causal LM becomes one ``kvt.attention`` node.

Recognised sites (``docs/ARCHITECTURE.md``):

* ``aten.scaled_dot_product_attention`` (transformers' ``sdpa`` implementation);
* the eager chain ``matmul(q, kᵀ) → ·scale → + mask → softmax(fp32) → to(dtype) → dropout(p=0) → matmul(·, v)``,
  with two variants transformers' eager code adds:

  - logit soft-capping (Gemma 2): ``·scale → / c → tanh → · c`` before the mask → ``softcap=c``;
  - learned sinks (gpt-oss): ``cat([scores + mask, sinks.reshape(1, H, 1, 1).expand(B, H, S_q, 1)], -1)``, an
    optional ``- max(·, -1)`` shift (softmax is shift-invariant), ``softmax``, then ``[..., :-1]`` drops the sink
    column → ``sinks=<the (H,) parameter node>``.

For each site the pass walks K and V back through ``repeat_kv`` (``unsqueeze → expand → reshape``) to the real
``(B, H_kv, S, D)`` tensors, so GQA is visible to the op, and classifies the materialised mask by *proving* what it
computes (:mod:`.mask_proof`): the mask subgraph is extracted and evaluated over probe lengths (including every
structural threshold the config declares, such as a sliding window) with random padding patterns, and compared with
the plain causal mask, with causal ∧ key-padding, and with both restricted to the config's ``sliding_window`` (HF
semantics: query ``i`` sees keys ``i - window < j <= i``). Only a mask proven equal to one of those is dropped, and it
is replaced by ``causal=True`` (plus ``window=W`` for a proven sliding window) and the ``attention_mask`` input itself
as ``key_padding`` when the mask reads it (so padding is kept, compactly). Any other mask (custom) stays an input of
the op. Sites that do not fit are left untouched and reported.

The variants become keyword arguments of the ``kvt.attention`` node, set only when on: ``window`` (int),
``softcap`` (float), ``sinks`` (the ``(H,)`` sink-logit node); passes that rewrite the canonical node further
(``passes/dualkv.py``, ``passes/sparse_decode.py``) must carry them on or refuse the site.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Optional

import torch

from kvtransform.report import Site

from .manager import KVPass, PassContext
from .mask_proof import _keep_mask, classify_mask, config_window, extract_subgraph, probe_lengths, \
    reads_padding  # noqa: F401  (re-exported: passes/sparse_decode.py and tests import them from here)

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
KVT_ATTENTION = torch.ops.kvt.attention.default
_SOFTMAX = {aten.softmax.int, aten._softmax.default}
_MATMUL = {aten.matmul.default, aten.bmm.default}
_PASSTHROUGH = {aten.to.dtype, aten._to_copy.default, aten.alias.default, aten.clone.default,
                aten.contiguous.default, aten.type_as.default}
_DROPOUT = {aten.dropout.default}


@dataclass
class AttentionMatch:
    """One recognised attention site before rewriting."""

    kind: str                      # "sdpa" | "eager"
    out: torch.fx.Node             # node whose value is the attention output (B, H, S_q, D)
    q: torch.fx.Node
    k: torch.fx.Node               # after repeat_kv (as consumed)
    v: torch.fx.Node
    mask: Optional[torch.fx.Node]
    scale: Optional[float]
    is_causal: bool
    dropout_p: float = 0.0
    problem: Optional[str] = None  # why it cannot be rewritten
    softcap: Optional[float] = None          # Gemma 2 logit soft-cap c (s = c * tanh(s / c)), before the mask
    sinks: Optional[torch.fx.Node] = None    # gpt-oss learned sink logits, the (H,) parameter node


def _shape(node) -> Optional[tuple]:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _int(x) -> Optional[int]:
    try:
        return int(x)
    except Exception:
        return None


def layer_of(node: torch.fx.Node) -> Optional[int]:
    """Decoder layer index from the node's ``nn_module_stack`` (``model.layers.<i>.self_attn``), if present."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        m = re.search(r"layers\.(\d+)", str(path))
        if m:
            return int(m.group(1))
    return None


def noop_slice(node) -> bool:
    """``x[..., 0:MAX]`` (what ``x[:, :, None]`` and friends can export as): a view equal to ``x``."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is aten.slice.Tensor):
        return False
    a = list(node.args) + [None] * (5 - len(node.args))
    start, end, step = a[2], a[3], a[4]
    return start in (0, None) and (end is None or (isinstance(end, int) and end >= 1 << 62)) and step in (1, None)


def _skip_noop_slices(node):
    while noop_slice(node):
        node = node.args[0]
    return node


def unrepeat_kv(node: torch.fx.Node) -> tuple[torch.fx.Node, int]:
    """Walk back through transformers' ``repeat_kv`` (``x[:, :, None].expand(B, H_kv, n, S, D).reshape(B, H_kv*n,
    S, D)``), through the no-op slices torch.export can leave between those steps. Returns ``(kv_node, n_rep)``;
    ``(node, 1)`` when the pattern is absent."""
    node = _skip_noop_slices(node)
    if node.op != "call_function" or node.target not in (aten.reshape.default, aten.view.default,
                                                           aten._unsafe_view.default):
        return node, 1
    exp = _skip_noop_slices(node.args[0])
    if not isinstance(exp, torch.fx.Node) or exp.target is not aten.expand.default:
        return node, 1
    uns = _skip_noop_slices(exp.args[0])
    if not isinstance(uns, torch.fx.Node) or uns.target is not aten.unsqueeze.default or uns.args[1] != 2:
        return node, 1
    base = _skip_noop_slices(uns.args[0])
    bs, es, rs = _shape(base), _shape(exp), _shape(node)
    if bs is None or es is None or rs is None or len(bs) != 4 or len(es) != 5 or len(rs) != 4:
        return node, 1
    n_rep = _int(es[2])
    h_kv = _int(bs[1])
    if n_rep is None or h_kv is None or _int(rs[1]) != h_kv * n_rep or _int(bs[3]) != _int(rs[3]):
        return node, 1
    return base, n_rep


def _value_users(node: torch.fx.Node) -> list:
    """Users of ``node`` other than metadata asserts."""
    return [u for u in node.users if u.target is not aten._assert_tensor_metadata.default]


def _skip_passthrough_up(node):
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _PASSTHROUGH:
        node = node.args[0]
    return node


def match_sdpa(node: torch.fx.Node) -> AttentionMatch:
    args = list(node.args) + [None] * (8 - len(node.args))
    q, k, v = args[0], args[1], args[2]
    mask = node.kwargs.get("attn_mask", args[3])
    dropout_p = node.kwargs.get("dropout_p", args[4] if args[4] is not None else 0.0)
    is_causal = node.kwargs.get("is_causal", args[5] if args[5] is not None else False)
    scale = node.kwargs.get("scale", args[6])
    m = AttentionMatch("sdpa", node, q, k, v, mask, scale, bool(is_causal), float(dropout_p or 0.0))
    if m.dropout_p != 0.0:
        m.problem = f"dropout_p={m.dropout_p} (training dropout inside attention is not supported)"
    return m


def match_eager(softmax: torch.fx.Node) -> Optional[AttentionMatch]:
    """Match the eager chain around a softmax node; None when it is not an attention softmax."""
    dim = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim")
    if dim not in (-1, 3):
        return None
    # downstream: softmax -> [[..., :-1] (drop the sink column)] -> (to/dropout)* -> matmul(p, v)
    cur, dropout_p, dropped_last = softmax, 0.0, False
    while True:
        users = _value_users(cur)
        if len(users) != 1:
            return None
        (user,) = users
        if cur is softmax and _drops_last_column(user):
            dropped_last = True
            cur = user
            continue
        if user.target in _PASSTHROUGH:
            cur = user
            continue
        if user.target in _DROPOUT:
            p = user.args[1] if len(user.args) > 1 else user.kwargs.get("p", 0.0)
            train = user.args[2] if len(user.args) > 2 else user.kwargs.get("train", False)
            dropout_p = float(p) if train else 0.0
            cur = user
            continue
        if user.target in _MATMUL and user.args[0] is cur:
            out, v = user, user.args[1]
            break
        return None
    # upstream: softmax(x) with x = [cat([scores [+ mask], sink column]) [- max]]; scores = matmul(q, kᵀ) [* scale]
    # [softcap]
    x = _skip_max_shift(softmax.args[0])
    sinks = None
    if dropped_last:
        x, sinks = _split_sink_column(x)
        if sinks is None:
            return None
    mask = None
    if isinstance(x, torch.fx.Node) and x.target is aten.add.Tensor:
        a, b = x.args[0], x.args[1]
        a_mm = _find_scores(a)
        b_mm = _find_scores(b)
        if a_mm is not None:
            scores, mask = a, b
        elif b_mm is not None:
            scores, mask = b, a
        else:
            return None
        if not isinstance(mask, torch.fx.Node):
            return None
    else:
        scores = x
    found = _find_scores(scores)
    if found is None:
        return None
    mm, scale, softcap = found
    q, kt = mm.args[0], mm.args[1]
    if not (isinstance(kt, torch.fx.Node) and kt.target is aten.transpose.int
            and sorted(int(d) % 4 for d in kt.args[1:3]) == [2, 3]):
        return None
    if sinks is not None and _int((_shape(sinks) or (None,))[0]) != _int((_shape(q) or (None, None))[1]):
        return None
    m = AttentionMatch("eager", out, q, kt.args[0], v, mask, scale, False, dropout_p, softcap=softcap, sinks=sinks)
    if dropout_p != 0.0:
        m.problem = f"dropout p={dropout_p} in training mode"
    if scale is None:
        m.problem = "non-constant attention scale"
    return m


_MUL = (aten.mul.Tensor, aten.mul.Scalar)
_DIV = (aten.div.Tensor, aten.div.Scalar)


def _const_factor(node) -> Optional[tuple[torch.fx.Node, float]]:
    """``node`` = x * c or x / c with a python constant ``c`` → ``(x, multiplier)``; None otherwise."""
    if not (isinstance(node, torch.fx.Node) and node.target in _MUL + _DIV):
        return None
    a, c = node.args[0], node.args[1]
    if node.target in _MUL and isinstance(a, (int, float)) and isinstance(c, torch.fx.Node):
        a, c = c, a
    if not isinstance(a, torch.fx.Node) or isinstance(c, bool) or not isinstance(c, (int, float)) or c == 0:
        return None
    return a, (float(c) if node.target in _MUL else 1.0 / float(c))


def _peel_softcap(node) -> tuple[object, Optional[float]]:
    """``c * tanh(x / c)`` (Gemma 2's attention soft-capping; ``x * (1/c)`` inside too) → ``(x, c)``; else
    ``(node, None)``; a negative ``c`` (the same function: tanh is odd) gives ``|c|``."""
    outer = _const_factor(_skip_passthrough_up(node))
    if outer is None:
        return node, None
    t, c = outer
    t = _skip_passthrough_up(t)
    if not (isinstance(t, torch.fx.Node) and t.target is aten.tanh.default):
        return node, None
    inner = _const_factor(_skip_passthrough_up(t.args[0]))
    if inner is None or abs(inner[1] * c - 1.0) > 1e-6:
        return node, None
    return inner[0], abs(c)  # tanh is odd: c · tanh(x / c) with c < 0 is the cap |c|


def _find_scores(node) -> Optional[tuple[torch.fx.Node, float, Optional[float]]]:
    """``node`` = matmul(q, kᵀ) [* c | / c] [soft-capped] → (matmul node, scale, softcap or None)."""
    node, softcap = _peel_softcap(node)
    node = _skip_passthrough_up(node)
    if not isinstance(node, torch.fx.Node):
        return None
    if node.target in _MATMUL:
        return node, 1.0, softcap
    found = _const_factor(node)
    if found is not None:
        a = _skip_passthrough_up(found[0])
        if isinstance(a, torch.fx.Node) and a.target in _MATMUL:
            return a, found[1], softcap
    return None


def _last_dim(node, dim) -> bool:
    rank = len(_shape(node) or ())
    return isinstance(dim, int) and rank > 0 and dim % rank == rank - 1


def _drops_last_column(node) -> bool:
    """``x[..., :-1]``: ``aten.slice(x, -1 | rank-1, 0 | None, -1)``."""
    if not (isinstance(node, torch.fx.Node) and node.target is aten.slice.Tensor):
        return False
    a = list(node.args) + [None] * (5 - len(node.args))
    return _last_dim(a[0], a[1]) and a[2] in (0, None) and a[3] == -1 and a[4] in (1, None)


def _skip_max_shift(node):
    """``x - max(x, -1, keepdim=True)`` (gpt-oss's overflow guard; softmax is shift-invariant) → ``x``."""
    if not (isinstance(node, torch.fx.Node) and node.target is aten.sub.Tensor):
        return node
    x, m = node.args[0], node.args[1]
    if isinstance(m, torch.fx.Node) and m.target is operator.getitem and m.args[1] == 0:
        m = m.args[0]
    if isinstance(m, torch.fx.Node) and m.target in (aten.max.dim, aten.amax.default) and m.args[0] is x:
        dim = m.args[1] if len(m.args) > 1 else None
        dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
        keep = m.args[2] if len(m.args) > 2 else m.kwargs.get("keepdim", False)
        if _last_dim(x, dim) and keep:
            return x
    return node


_SINK_VIEWS = {aten.reshape.default, aten.view.default, aten.expand.default, aten.unsqueeze.default,
               aten._unsafe_view.default}


def _split_sink_column(node) -> tuple[object, Optional[torch.fx.Node]]:
    """``cat([scores, s], -1)`` where ``s`` = a ``(H,)`` tensor viewed as ``(B, H, S_q, 1)`` (gpt-oss's sinks) →
    ``(scores, the (H,) node)``; ``(node, None)`` otherwise."""
    if not (isinstance(node, torch.fx.Node) and node.target is aten.cat.default):
        return node, None
    parts = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and _last_dim(node, dim)):
        return node, None
    scores, col = parts
    cs = _shape(col)
    if cs is None or len(cs) != 4 or _int(cs[-1]) != 1:
        return node, None
    base = col
    while isinstance(base, torch.fx.Node) and base.op == "call_function" and (
            base.target in _SINK_VIEWS or base.target in _PASSTHROUGH):
        base = base.args[0]
    bs = _shape(base)
    if not isinstance(base, torch.fx.Node) or bs is None or len(bs) != 1 or _int(bs[0]) != _int(cs[1]):
        return node, None
    return scores, base


def find_attention(gm: torch.fx.GraphModule) -> list[AttentionMatch]:
    """All attention sites in graph order (SDPA nodes and eager chains)."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is SDPA:
            found.append(match_sdpa(node))
        elif node.target in _SOFTMAX:
            m = match_eager(node)
            if m is not None:
                found.append(m)
    return found


# ---------------------------------------------------------------------------------------------------------------------
# the pass
# ---------------------------------------------------------------------------------------------------------------------
def describe(m: AttentionMatch, index: int, mask_kind: str, status: str, window: Optional[int] = None) -> Site:
    """The report record of one site; ``window``: the proven sliding window (None: none)."""
    qs = _shape(m.q)
    k0, _ = unrepeat_kv(m.k)
    ks = _shape(k0)
    sinks = None if m.sinks is None else str(m.sinks.target if m.sinks.op in ("get_attr", "placeholder")
                                              else m.sinks.name)
    return Site(index=index, layer=layer_of(m.out), kind=m.kind, q_heads=_int(qs[1]) if qs else None,
                kv_heads=_int(ks[1]) if ks else None, head_dim=_int(qs[-1]) if qs else None,
                mask_kind=mask_kind, status=status, node=m.out.name, window=window, softcap=m.softcap, sinks=sinks)


def _attention_mask_placeholder(gm) -> Optional[torch.fx.Node]:
    return next((n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "attention_mask"), None)


class AttentionPass(KVPass):
    """Rewrite every recognised attention into ``kvt.attention`` (or, with ``rewrite=False``, only report them).

    Records a pass named ``attention`` and one :class:`~kvtransform.report.Site` per attention in ``ctx.report``.
    The nodes the rewrite leaves dead (mask construction, ``repeat_kv``) are removed by the cleanup pass.
    """

    name = "attention"

    def __init__(self, ctx: PassContext, rewrite: bool = True):
        super().__init__(ctx)
        self.rewrite = rewrite

    def run(self, gm: torch.fx.GraphModule, rec) -> bool:
        ctx, rewrite = self.ctx, self.rewrite
        matches = find_attention(gm)
        rec.matched = len(matches)
        cache: dict = {}
        key_padding = None
        graph = gm.graph
        for i, m in enumerate(matches):
            mask_kind = classify_mask(gm, m.mask, m.is_causal, ctx, cache)
            window = config_window(ctx.config) if mask_kind == "sliding_window" else None
            if m.problem:
                ctx.report.sites.append(describe(m, i, mask_kind, f"skipped: {m.problem}", window))
                rec.skip(i, m.problem)
                continue
            k0, rep_k = unrepeat_kv(m.k)
            v0, rep_v = unrepeat_kv(m.v)
            if rep_k != rep_v:
                rec.skip(i, "K and V repeated differently")
                ctx.report.sites.append(describe(m, i, mask_kind, "skipped: K and V repeated differently",
                                                 window))
                continue
            if not rewrite:
                ctx.report.sites.append(describe(m, i, mask_kind, "found", window))
                continue
            causal = mask_kind in ("causal", "causal+padding", "sliding_window")
            with graph.inserting_before(m.out):
                kp = None
                if mask_kind == "causal+padding" or (mask_kind == "sliding_window"
                                                     and reads_padding(gm, m.mask, cache)):
                    if key_padding is None:
                        am = _attention_mask_placeholder(gm)
                        key_padding = graph.call_function(aten.ne.Scalar, (am, 0))
                        key_padding.meta["val"] = None
                    kp = key_padding
                attn_mask = m.mask if mask_kind == "custom" else None
                scale = float(m.scale) if m.scale is not None else float(_shape(m.q)[-1]) ** -0.5
                variants = {n: x for n, x in (("window", window), ("softcap", m.softcap), ("sinks", m.sinks))
                            if x is not None}
                new = graph.call_function(KVT_ATTENTION, (m.q, k0, v0, attn_mask, kp, scale, causal), variants)
            new.meta.update({k: v for k, v in m.out.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
            m.out.replace_all_uses_with(new)
            rec.rewritten += 1
            ctx.report.sites.append(describe(m, i, mask_kind, "canonical", window))
        kinds = sorted({s.mask_kind for s in ctx.report.sites})
        rec.notes.append("mask kinds: " + ", ".join(kinds) if kinds else "no attention found")
        variants = [f"{n} x{c}" for n, c in (
            ("window", sum(s.window is not None for s in ctx.report.sites)),
            ("softcap", sum(s.softcap is not None for s in ctx.report.sites)),
            ("sinks", sum(s.sinks is not None for s in ctx.report.sites))) if c]
        if variants:
            rec.notes.append("variants: " + ", ".join(variants))
        return rec.rewritten > 0
