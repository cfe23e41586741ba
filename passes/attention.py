"""Canonical attention pass: every standard attention in a captured causal LM becomes one ``kvt.attention`` node.

Recognised sites (``docs/ARCHITECTURE.md``):

* ``aten.scaled_dot_product_attention`` (transformers' ``sdpa`` implementation);
* the eager chain ``matmul(q, kᵀ) → ·scale → + mask → softmax(fp32) → to(dtype) → dropout(p=0) → matmul(·, v)``.

For each site the pass walks K and V back through ``repeat_kv`` (``unsqueeze → expand → reshape``) to the real
``(B, H_kv, S, D)`` tensors, so GQA is visible to the op, and classifies the materialised mask by *proving* what it
computes: the mask subgraph is extracted and evaluated over probe lengths (including every structural threshold the
config declares, such as a sliding window) with random padding patterns, and compared with the plain causal mask and
with causal ∧ key-padding. Only a mask proven equal to one of those is dropped, and it is replaced by ``causal=True``
plus the ``attention_mask`` input itself as ``key_padding`` (so padding is kept, compactly). Any other mask
(sliding window, custom) stays an input of the op. Sites that do not fit are left untouched and reported.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

from kvtransform.report import Site

from .manager import KVPass, PassContext

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
    # downstream: softmax -> (to/dropout)* -> matmul(p, v)
    cur, dropout_p = softmax, 0.0
    while True:
        users = _value_users(cur)
        if len(users) != 1:
            return None
        (user,) = users
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
    # upstream: softmax(x) with x = scores [+ mask]; scores = matmul(q, kᵀ) [* scale | / c]
    x = softmax.args[0]
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
    mm, scale = found
    q, kt = mm.args[0], mm.args[1]
    if not (isinstance(kt, torch.fx.Node) and kt.target is aten.transpose.int
            and sorted(int(d) % 4 for d in kt.args[1:3]) == [2, 3]):
        return None
    m = AttentionMatch("eager", out, q, kt.args[0], v, mask, scale, False, dropout_p)
    if dropout_p != 0.0:
        m.problem = f"dropout p={dropout_p} in training mode"
    if scale is None:
        m.problem = "non-constant attention scale"
    return m


def _find_scores(node) -> Optional[tuple[torch.fx.Node, Optional[float]]]:
    """``node`` = matmul(q, kᵀ) [* c | / c] → (matmul node, scale)."""
    node = _skip_passthrough_up(node)
    if not isinstance(node, torch.fx.Node):
        return None
    if node.target in _MATMUL:
        return node, 1.0
    if node.target in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
        a, c = node.args[0], node.args[1]
        if isinstance(a, torch.fx.Node) and isinstance(c, (int, float)):
            a = _skip_passthrough_up(a)
            if isinstance(a, torch.fx.Node) and a.target in _MATMUL:
                return a, (float(c) if node.target in (aten.mul.Tensor, aten.mul.Scalar) else 1.0 / float(c))
    return None


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
# mask proof
# ---------------------------------------------------------------------------------------------------------------------
def extract_subgraph(gm: torch.fx.GraphModule, target: torch.fx.Node) -> tuple[torch.fx.GraphModule, list[str]]:
    """A GraphModule computing ``target`` from the placeholders it depends on; returns it and those names."""
    needed, stack = set(), [target]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        stack.extend(n.all_input_nodes)
    graph, env, names = torch.fx.Graph(), {}, []
    for n in gm.graph.nodes:
        if n in needed:
            env[n] = graph.node_copy(n, lambda x: env[x])
            if n.op == "placeholder":
                names.append(n.target)
    graph.output(env[target])
    return torch.fx.GraphModule(gm, graph), names


def _keep_mask(value: torch.Tensor) -> Optional[torch.Tensor]:
    """Bool keep-mask from a bool or additive float mask; None for a float mask with other values (a bias)."""
    if value.dtype == torch.bool:
        return value
    finite_min = torch.finfo(value.dtype).min
    keep = value == 0
    blocked = (value <= finite_min / 2) | torch.isneginf(value)
    if not bool((keep | blocked).all()):
        return None
    return keep


def probe_lengths(ctx: PassContext) -> list[int]:
    lengths = {2, 3, 5, 17, 64}
    window = getattr(ctx.config, "sliding_window", None) if ctx.config is not None else None
    if window:
        lengths.update({int(window), int(window) + 1, int(window) + 2})
    if ctx.max_seq_len <= 1024:
        lengths.add(ctx.max_seq_len)
    return sorted(s for s in lengths if 2 <= s <= ctx.max_seq_len)


def classify_mask(gm: torch.fx.GraphModule, mask: Optional[torch.fx.Node], is_causal: bool, ctx: PassContext,
                  cache: dict) -> str:
    """Prove what a mask node computes. Returns ``"none"``, ``"causal"``, ``"causal+padding"``,
    ``"sliding_window"`` or ``"custom"`` (see module docstring)."""
    if mask is None:
        return "causal" if is_causal else "none"
    if mask in cache:
        return cache[mask]
    kind = "custom"
    if not is_causal:
        try:
            kind = _probe(gm, mask, ctx)
        except Exception:
            kind = "custom"
    cache[mask] = kind
    return kind


def _probe(gm, mask, ctx) -> str:
    sub, names = extract_subgraph(gm, mask)
    if any(n not in ("input_ids", "attention_mask") for n in names):
        return "custom"
    reads_padding = "attention_mask" in names
    vocab = getattr(ctx.config, "vocab_size", 2) or 2
    window = getattr(ctx.config, "sliding_window", None) if ctx.config is not None else None
    gen = torch.Generator().manual_seed(1234)
    verdicts = set()
    for s in probe_lengths(ctx):
        b = 3 if s <= 256 else 1
        am = (torch.rand(b, s, generator=gen) > 0.3).long()
        am[0] = 1  # one unpadded row
        if b > 1:
            am[1, : s // 2] = 0  # one left-padded row
        am[:, -1] = 1
        inputs = {"input_ids": torch.randint(0, vocab, (b, s), generator=gen), "attention_mask": am}
        dev = _device_of(gm)
        with torch.no_grad():
            value = sub(*[inputs[n].to(dev) for n in names]).cpu()
        keep = _keep_mask(value)
        if keep is None:
            return "custom"
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        padded = causal[None, None] & am.bool()[:, None, None, :]
        keep = keep.expand(b, keep.shape[1], s, s)
        if torch.equal(keep, padded.expand_as(keep)):
            verdicts.add("causal+padding" if reads_padding else "causal")
            continue
        if not reads_padding and torch.equal(keep, causal[None, None].expand_as(keep)):
            verdicts.add("causal")
            continue
        if window:
            i = torch.arange(s)[:, None]
            j = torch.arange(s)[None, :]
            win = padded & ((i - j) < int(window))[None, None]
            if torch.equal(keep, win.expand_as(keep)):
                verdicts.add("sliding_window")
                continue
        return "custom"
    if verdicts == {"causal"}:
        return "causal"
    if verdicts <= {"causal", "causal+padding"} and reads_padding:
        return "causal+padding"
    if verdicts and verdicts <= {"causal", "causal+padding", "sliding_window"}:
        return "sliding_window"
    return "custom"


def _device_of(gm) -> torch.device:
    for p in gm.parameters():
        return p.device
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------------------------------
# the pass
# ---------------------------------------------------------------------------------------------------------------------
def describe(m: AttentionMatch, index: int, mask_kind: str, status: str) -> Site:
    qs = _shape(m.q)
    k0, _ = unrepeat_kv(m.k)
    ks = _shape(k0)
    return Site(index=index, layer=layer_of(m.out), kind=m.kind, q_heads=_int(qs[1]) if qs else None,
                kv_heads=_int(ks[1]) if ks else None, head_dim=_int(qs[-1]) if qs else None,
                mask_kind=mask_kind, status=status, node=m.out.name)


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
            if m.problem:
                ctx.report.sites.append(describe(m, i, mask_kind, f"skipped: {m.problem}"))
                rec.skip(i, m.problem)
                continue
            k0, rep_k = unrepeat_kv(m.k)
            v0, rep_v = unrepeat_kv(m.v)
            if rep_k != rep_v:
                rec.skip(i, "K and V repeated differently")
                ctx.report.sites.append(describe(m, i, mask_kind, "skipped: K and V repeated differently"))
                continue
            if not rewrite:
                ctx.report.sites.append(describe(m, i, mask_kind, "found"))
                continue
            causal = mask_kind in ("causal", "causal+padding")
            with graph.inserting_before(m.out):
                kp = None
                if mask_kind == "causal+padding":
                    if key_padding is None:
                        am = _attention_mask_placeholder(gm)
                        key_padding = graph.call_function(aten.ne.Scalar, (am, 0))
                        key_padding.meta["val"] = None
                    kp = key_padding
                attn_mask = m.mask if mask_kind in ("sliding_window", "custom") else None
                scale = float(m.scale) if m.scale is not None else float(_shape(m.q)[-1]) ** -0.5
                new = graph.call_function(KVT_ATTENTION, (m.q, k0, v0, attn_mask, kp, scale, causal))
            new.meta.update({k: v for k, v in m.out.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
            m.out.replace_all_uses_with(new)
            rec.rewritten += 1
            ctx.report.sites.append(describe(m, i, mask_kind, "canonical"))
        kinds = sorted({s.mask_kind for s in ctx.report.sites})
        rec.notes.append("mask kinds: " + ", ".join(kinds) if kinds else "no attention found")
        return rec.rewritten > 0
