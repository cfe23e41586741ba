"""The mask proof of the canonical attention pass (:mod:`.attention`): what a materialised attention mask computes.

The mask subgraph (everything the mask node depends on) is extracted and evaluated over probe lengths (including
the two past the config's ``sliding_window``, where its band first shows) with random padding patterns (an unpadded
row, a left-padded row, random holes), and compared with the plain causal mask, with causal ∧ key-padding, and with
both restricted to the config's sliding window (HF semantics: query ``i`` sees keys ``i - window < j <= i``). A
verdict holds only if it holds at every probe.
"""
from __future__ import annotations

from typing import Optional

import torch

from .manager import PassContext


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


def config_window(config) -> Optional[int]:
    """The config's ``sliding_window`` (int >= 1) or None (no config, unset, 0)."""
    window = getattr(config, "sliding_window", None) if config is not None else None
    return int(window) if isinstance(window, int) and not isinstance(window, bool) and window >= 1 else None


def probe_lengths(ctx: PassContext) -> list[int]:
    lengths = {2, 3, 5, 17, 64}
    window = config_window(ctx.config)
    if window:  # (at window tokens a window mask is still causal: only longer probes see its band; O(s^2) each)
        lengths.update({int(window) + 1, int(window) + 2})
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
    window = config_window(ctx.config)
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
        if window:  # query i sees keys i - window < j <= i (a bool band: no (s, s) integer temporaries)
            band = causal.triu(-(int(window) - 1))
            win = (padded & band[None, None]) if reads_padding else band[None, None]
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


def reads_padding(gm: torch.fx.GraphModule, mask: torch.fx.Node, cache: dict) -> bool:
    """Whether the mask subgraph reads the ``attention_mask`` input."""
    key = ("reads_padding", mask)
    if key not in cache:
        cache[key] = "attention_mask" in extract_subgraph(gm, mask)[1]
    return cache[key]
