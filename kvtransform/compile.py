"""A ``torch.compile`` backend that applies the canonical attention rewrite to the graphs torch.compile captures.

::

    model = torch.compile(model, backend=kvt.compile_backend("canonical"))   # model keeps its class, save_pretrained,
    loss = model(**batch).loss; loss.backward()                               # PEFT adapters, gradient checkpointing

Dynamo hands the backend torch-level FX graphs (before AOT autograd), so the backend matches torch-level
``scaled_dot_product_attention`` calls (transformers' ``sdpa`` attention; ``docs/ARCHITECTURE.md``, floor "passes")
rather than the aten-level patterns of ``kvtransform.passes.attention``, and rewrites each into
``kvt.attention(q, k, v, attn_mask, None, softmax_scale, causal)``: ``is_causal`` maps to ``causal`` when the query
and key lengths are provably equal (SDPA's causal mask is top-left aligned, ``kvt.attention``'s bottom-right: equal
only then), GQA (``enable_gqa``) maps to the op's own head mapping, ``attn_mask`` is passed on unchanged, and
``scale=None`` becomes ``head_dim ** -0.5``. A call it cannot prove equivalent (attention dropout, a traced scale,
causal with possibly different lengths) is left as SDPA and listed in :attr:`KVCompileBackend.skipped`.
Subgraphs of higher-order ops (activation checkpointing) are rewritten too; with transformers 5.25 or later, whose
checkpointed layers set an output collector, only if dynamo's config
``skip_fwd_side_effects_in_bwd_under_checkpoint`` is set (else dynamo runs those layers eagerly and there is nothing
to rewrite; README). The graph rewrite is a pass,
:func:`kvtransform.passes.torch_sdpa.rewrite_sdpa`; this module is the backend around it. The rewritten graph goes
to the inner backend (Inductor by default), which treats ``kvt.attention`` as an opaque op with its registered
autograd formula and fuses everything around it.
"""
from __future__ import annotations

from typing import Union

import torch

from kvtransform.config import CanonicalConfig, TransformConfig
from kvtransform.passes.torch_sdpa import rewrite_sdpa  # re-exported: the rewrite itself is a pass

__all__ = ["KVCompileBackend", "compile_backend", "rewrite_sdpa"]


class KVCompileBackend:
    """The callable ``torch.compile`` receives: rewrite, then hand over to ``inner``.

    Attributes:
        config: the resolved :class:`~kvtransform.config.CanonicalConfig`.
        inner: the backend the rewritten graph goes to (a name for ``torch._dynamo.lookup_backend`` or a callable).
        rewritten: attention calls rewritten so far, over every graph this backend compiled.
        skipped: ``(graph module, node, reason)`` for every SDPA call left alone.
        graphs: graphs compiled.
    """

    def __init__(self, config: CanonicalConfig, inner="inductor"):
        self.config, self.inner = config, inner
        self.rewritten, self.skipped, self.graphs = 0, [], 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        n, skipped = rewrite_sdpa(gm)
        self.rewritten += n
        self.skipped += skipped
        self.graphs += 1
        inner = torch._dynamo.lookup_backend(self.inner) if isinstance(self.inner, str) else self.inner
        return inner(gm, example_inputs)


def compile_backend(config: Union[str, TransformConfig] = "canonical", inner="inductor") -> KVCompileBackend:
    """A ``torch.compile`` backend applying the canonical transform's attention rewrite (module docstring).

    Args:
        config: ``"canonical"`` or a :class:`~kvtransform.config.CanonicalConfig`.
        inner: backend for the rewritten graphs: ``"inductor"`` (default), ``"aot_eager"``, ``"eager"`` or a
            callable ``(gm, example_inputs) -> callable``.

    Returns:
        a :class:`KVCompileBackend`.

    Raises:
        ValueError: another transform. ``dualkv`` needs the packed layout, which is not an input of the graphs
            torch.compile captures: use ``kvt.integrations.transformers.enable(model, "dualkv")`` (its attention
            calls ``kvt.dualkv_attention``, opaque under any torch.compile backend); ``specontext`` is a decode
            runtime, not a graph rewrite.
    """
    from kvtransform.config import resolve_config

    cfg = resolve_config(config)
    if not isinstance(cfg, CanonicalConfig):
        hint = {"dualkv": "the packed layout (cu_seqlens, segment_prefix) is not an input of the graphs "
                          "torch.compile captures: use kvt.integrations.transformers.enable(model, 'dualkv') and "
                          "torch.compile(model) (kvt.dualkv_attention is opaque to every backend)",
                "specontext": "SpeContext is a decode runtime, not a graph rewrite"}.get(cfg.name, "")
        raise ValueError(f"compile_backend supports the canonical transform only; got {cfg.name!r}: {hint}")
    return KVCompileBackend(cfg, inner)
