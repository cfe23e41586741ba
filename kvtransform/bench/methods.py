"""Attention methods the DualKV suites compare, one adapter each, on the shared-prefix layout of one prompt
(``P`` tokens) and ``mb`` responses (DualKV, arXiv 2605.15422, App. F.4 and Table 1).

Every adapter takes ``q (T, H, D)``, ``k, v (T, H_kv, D)`` on its token axis and returns ``(T, H, D)``:

* packed ``[P][R_1]..[R_mb]`` (``T = P + sum R_i``): ``reference``, ``pg``, ``flex``, ``flex_rebuild``, ``dualkv``,
  ``dualkv_kernel``;
* replicated ``[P R_1][P R_2]..`` (``T_rep = sum (P + R_i)``, ``replicated = True``): ``fa2``.

``dualkv_compiled`` and ``flex_compiled`` (layer mode) run the whole decoder layer under ``torch.compile`` (static
shapes per T) around the same attention (``layer_forward``); the other methods run the layer eagerly.

``setup`` (untimed) gets the :class:`~kvtransform.layout.DualKVLayout` on the device; ``per_step`` runs inside each
timed step before the forward (what training must redo per micro-batch); ``attn_step`` is one timed forward
(``mark()``) backward.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Optional

import torch
import torch.nn.functional as F

from . import masks
from .config import Method

__all__ = ["Unavailable", "AttnMethod", "Reference", "FA2", "PrefixGrouper", "Flex", "FlexRebuild", "DualKV",
           "DualKVKernel", "DualKVCompiled", "FlexCompiled", "METHODS", "ORDER", "COMPILED", "methods_for"]


class Unavailable(RuntimeError):
    """The method cannot run here (missing op, unsupported device or mode); recorded as status ``unavailable``."""


class AttnMethod:
    """A pluggable attention: ``setup`` (untimed), ``per_step`` (timed, before the forward), ``__call__``."""

    name = "?"
    replicated = False  # runs on the replicated token axis
    impl = ""
    takes_variants = False  # the suite's window / softcap / sinks options

    def setup(self, layout, cfg, device) -> None:
        self.layout, self.cfg, self.device = layout, cfg, device
        self.variants = variant_kwargs(cfg, device)
        if self.variants and not self.takes_variants:
            raise Unavailable(f"{self.name} does not take window/softcap/sinks (only dualkv and dualkv_kernel do)")
        if hasattr(layout, "prefix_lens"):  # a DualKVLayout (the tree suites pass a PrefixTreeLayout)
            self.P, self.R = int(layout.prefix_lens[0]), [int(r) for r in layout.response_lens[0]]

    def per_step(self) -> None:
        pass

    def __call__(self, q, k, v):  # pragma: no cover - abstract
        raise NotImplementedError

    def layer_forward(self, layer, x):
        """The ``layer`` mode's forward with this attention: ``(out, attention output)``."""
        return layer(x, self, return_attn=True)

    def attn_step(self, q, k, v, do, mark) -> None:
        """One timed step of the ``attn`` mode: forward, ``mark()``, backward of ``do`` into q/k/v ``.grad``."""
        self.per_step()
        out = self(q, k, v)
        mark()
        out.backward(do)


def variant_kwargs(cfg, device) -> dict:
    """The suite's attention variants as keyword arguments of ``kvt.dualkv_attention`` / the kernels (empty when
    all are off): ``sinks`` are random fp32 logits ``(heads,)`` (seeded) that require grad."""
    out = {}
    if getattr(cfg, "window", 0):
        out["window"] = int(cfg.window)
    if getattr(cfg, "softcap", 0):
        out["softcap"] = float(cfg.softcap)
    if getattr(cfg, "sinks", False):
        g = torch.Generator(device="cpu").manual_seed(int(cfg.seed) + 7)
        out["sinks"] = torch.randn(int(cfg.heads), generator=g).to(device).requires_grad_(True)
    return out


def _repeat_kv(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    return x if n == 1 else x.repeat_interleave(n, dim=dim)


def _flash_ctx(device):
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


class Reference(AttnMethod):
    """Packed tokens, dense (T, T) bool mask, SDPA (math on CPU). For tiny shapes and checks only."""

    name = "reference"

    def setup(self, layout, cfg, device):
        super().setup(layout, cfg, device)
        self.mask = masks.shared_prefix_dense_mask(layout)
        self.impl = "sdpa+dense-mask"

    def __call__(self, q, k, v):
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=self.mask, enable_gqa=True)
        return o[0].transpose(0, 1)


def _varlen_kwargs() -> Optional[dict]:
    """Keyword arguments that make torch's varlen_attn causal with GQA, or None if this torch cannot."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "enable_gqa" not in params:
        return None
    kw = {"enable_gqa": True}
    if "is_causal" in params:
        kw["is_causal"] = True
    elif "window_size" in params:
        kw["window_size"] = (-1, 0)
    else:
        return None
    return kw


class FA2(AttnMethod):
    """Flash attention on the replicated layout: each response its own causal sequence ``[P R_i]``, no padding.

    ``fa2_impl``: ``varlen`` = ``torch.nn.attention.varlen.varlen_attn`` (one launch, GQA by index); ``sdpa`` =
    ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` per sequence under the flash backend;
    ``auto`` = varlen on CUDA when this torch's varlen_attn takes GQA and a causal flag, else sdpa.
    """

    name = "fa2"
    replicated = True

    def setup(self, layout, cfg, device):
        super().setup(layout, cfg, device)
        self.init_sequences(layout.replicated_cu_seqlens(), cfg.fa2_impl)
        self.impl = self.kind

    def init_sequences(self, cu: torch.Tensor, impl: str) -> None:
        """The causal sequences (int32 offsets ``cu`` on the device) and the implementation (``auto``, ``varlen``,
        ``sdpa``) that runs them; sets ``kind`` to ``varlen`` or ``sdpa``. Raises :class:`Unavailable`."""
        self.cu = cu
        self.bounds = [int(x) for x in self.cu.tolist()]
        self.max_len = max(b - a for a, b in zip(self.bounds[:-1], self.bounds[1:]))
        kw = _varlen_kwargs() if self.device.type == "cuda" else None
        if impl == "auto":
            impl = "varlen" if kw is not None else "sdpa"
        if impl == "varlen" and kw is None:
            raise Unavailable("varlen_attn with enable_gqa and a causal flag is not in this torch / device")
        if impl not in ("varlen", "sdpa"):
            raise ValueError(f"fa2_impl must be auto, varlen or sdpa, not {impl!r}")
        self.kind, self.kw, self.gqa_ok = impl, kw, True

    def __call__(self, q, k, v):
        if self.kind == "varlen":
            from torch.nn.attention.varlen import varlen_attn

            return varlen_attn(q, k, v, self.cu, self.cu, self.max_len, self.max_len, **self.kw)
        outs = []
        g = q.shape[1] // k.shape[1]
        with _flash_ctx(self.device):
            for s, e in zip(self.bounds[:-1], self.bounds[1:]):
                qs, ks, vs = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))
                if self.gqa_ok:
                    try:
                        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                    except RuntimeError:  # this torch's flash kernel without GQA: repeat K/V heads instead
                        self.gqa_ok = False
                        self.impl += " (kv heads repeated)"
                if not self.gqa_ok:
                    o = F.scaled_dot_product_attention(qs, _repeat_kv(ks, g, 1), _repeat_kv(vs, g, 1), is_causal=True)
                outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)


class PrefixGrouper(AttnMethod):
    """Prefix Grouper style (as the DualKV paper reimplements it): the prompt attends causally to itself once
    (flash SDPA); the responses are padded to ``[mb, R_max]`` queries against ``[mb, P + R_max]`` keys made of the
    prompt's K/V expanded per response and the response's own K/V (KV heads repeated HF-style), with a bool mask
    (prompt visible, causal within the response, padding hidden), SDPA picking its kernel."""

    name = "pg"

    def setup(self, layout, cfg, device):
        super().setup(layout, cfg, device)
        P, R = self.P, self.R
        mb, rmax = len(R), max(R)
        Rt = torch.tensor(R, device=device)
        rows = torch.repeat_interleave(torch.arange(mb, device=device), Rt)
        starts = torch.cumsum(Rt, 0) - Rt
        cols = torch.arange(int(sum(R)), device=device) - torch.repeat_interleave(starts, Rt)
        self.pad_idx = rows * rmax + cols
        r = torch.arange(rmax, device=device)
        resp_keep = (r[None, :] <= r[:, None])[None] & (r[None, None, :] < Rt[:, None, None])  # (mb, rmax, rmax)
        pre = torch.ones(mb, rmax, P, dtype=torch.bool, device=device)
        self.mask = torch.cat([pre, resp_keep], dim=2)[:, None]  # (mb, 1, rmax, P + rmax)
        self.mb, self.rmax = mb, rmax
        self.impl = "sdpa(prefix causal)+sdpa(padded, mask)"

    def __call__(self, q, k, v):
        P, mb, rmax = self.P, self.mb, self.rmax
        H, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
        g = H // Hkv
        with _flash_ctx(self.device):
            po = F.scaled_dot_product_attention(q[:P].transpose(0, 1)[None], _repeat_kv(k[:P], g, 1).transpose(0, 1)[None],
                                                _repeat_kv(v[:P], g, 1).transpose(0, 1)[None], is_causal=True)
        po = po[0].transpose(0, 1)

        def pad(x):
            z = x.new_zeros(mb * rmax, x.shape[1], D)
            return z.index_copy(0, self.pad_idx, x[P:]).view(mb, rmax, x.shape[1], D)

        qr, kr, vr = pad(q), pad(k), pad(v)
        K = torch.cat([k[:P][None].expand(mb, P, Hkv, D), kr], dim=1)
        V = torch.cat([v[:P][None].expand(mb, P, Hkv, D), vr], dim=1)
        K, V = _repeat_kv(K, g, 2), _repeat_kv(V, g, 2)
        ro = F.scaled_dot_product_attention(qr.transpose(1, 2), K.transpose(1, 2), V.transpose(1, 2), attn_mask=self.mask)
        ro = ro.transpose(1, 2).reshape(mb * rmax, H, D)[self.pad_idx]
        return torch.cat([po, ro])


_FLEX_FN: dict = {}


def _static_compiled(key: str, fn, T: int, backend: str = "inductor"):
    """``torch.compile(fn, dynamic=False)`` for token count ``T``, shared by the static-shape methods of a job: when
    ``T`` changes, dynamo is reset and every cached compile dropped (a full compile per shape, no recompile limit)."""
    if _FLEX_FN.get("static_T") != T:
        torch._dynamo.reset()
        _FLEX_FN.clear()
        _FLEX_FN["static_T"] = T
    if key not in _FLEX_FN:
        _FLEX_FN[key] = torch.compile(fn, dynamic=False, backend=backend)
    return _FLEX_FN[key]


def _flex_fn(compile_: bool, static_T: int = 0):
    """flex_attention, compiled once for the sweep, or (``static_T``) compiled with static shapes for one length T
    (dynamo reset when T changes: a full compile per shape, the fastest kernels)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not compile_:
        return flex_attention
    if static_T:
        return _static_compiled("static", flex_attention, static_T)
    if "compiled" not in _FLEX_FN:
        # one compiled flex for every shape of a sweep: the second shape makes dynamo mark the lengths dynamic; a
        # higher recompile limit keeps it from silently falling back to eager flex (which materialises T^2 scores)
        import torch._dynamo.config as dcfg

        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(dcfg, name):
                setattr(dcfg, name, max(getattr(dcfg, name), 64 if "accumulated" not in name else 512))
        _FLEX_FN["compiled"] = torch.compile(flex_attention)
    return _FLEX_FN["compiled"]


class Flex(AttnMethod):
    """FlexAttention on the packed tokens with the shared-prefix block mask (:mod:`.masks`), GQA by
    ``enable_gqa``. ``rebuild``: the block mask is rebuilt inside every timed step, as training must when the
    layout changes each micro-batch. ``flex_mask`` picks how the mask is built (see the suite config). A subclass
    for another mask sets ``mask_mod_of`` and ``block_mask_of`` (factories of :mod:`.masks`)."""

    name = "flex"
    rebuild = False
    takes_variants = True  # soft-capping only, as a score_mod (FlexAttention's own soft-cap example)
    mask_mod_of = staticmethod(masks.shared_prefix_mask_mod)
    block_mask_of = staticmethod(masks.shared_prefix_block_mask)

    def setup(self, layout, cfg, device):
        super().setup(layout, cfg, device)
        try:
            from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401
        except Exception as e:  # pragma: no cover
            raise Unavailable(f"flex_attention not in this torch: {e}")
        if device.type == "cpu":
            raise Unavailable("FlexAttention runs on CUDA only here (no CPU backward; the suite times fwd and bwd)")
        if set(self.variants) - {"softcap"}:
            raise Unavailable(f"{self.name} takes softcap as a score_mod; window and sinks only dualkv does")
        cap = self.variants.get("softcap")
        self.score_mod = None if cap is None else (lambda s, b, h, q_idx, kv_idx: cap * torch.tanh(s / cap))
        comp = cfg.flex_compile
        comp = (device.type == "cuda") if comp == "auto" else str(comp).lower() in ("1", "true", "yes")
        self.T = int(layout.total_tokens)
        self.mask_mod = self.mask_mod_of(layout)
        self.fn = _flex_fn(comp, self.T if cfg.flex_static else 0)
        kind = ("compiled" + (" static" if cfg.flex_static else "")) if comp else "eager"
        self.impl = f"{kind} {cfg.flex_mask}-mask" + ("/step" if self.rebuild else " once")
        self.block_mask = None if self.rebuild else self._build()

    def _build(self):
        how = self.cfg.flex_mask
        if how == "blocks":
            try:
                return self.block_mask_of(self.layout, mask_mod=self.mask_mod)
            except TypeError:  # an older BlockMask.from_kv_blocks (no seq_lengths): let create_block_mask build it
                how = "eager"
                self.impl = self.impl.replace("blocks-mask", "eager-mask")
        from torch.nn.attention.flex_attention import create_block_mask

        if how == "compiled":
            if "cbm" not in _FLEX_FN:
                _FLEX_FN["cbm"] = torch.compile(create_block_mask)
            return _FLEX_FN["cbm"](self.mask_mod, None, None, self.T, self.T, device=self.device)
        if how != "eager":
            raise ValueError(f"flex_mask must be blocks, eager or compiled, not {how!r}")
        return create_block_mask(self.mask_mod, None, None, self.T, self.T, device=self.device)

    def per_step(self):
        if self.rebuild:
            self.block_mask = self._build()

    def __call__(self, q, k, v):
        o = self.fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                    block_mask=self.block_mask, score_mod=self.score_mod, enable_gqa=True)
        return o[0].transpose(0, 1)


class FlexRebuild(Flex):
    name = "flex_rebuild"
    rebuild = True


class DualKV(AttnMethod):
    """Ours: ``kvtransform.ops.dualkv.dualkv_attention`` on the packed tokens with a ``DualKVLayout``
    (built inside every timed step when ``dualkv_layout_per_step``)."""

    name = "dualkv"
    takes_variants = True

    def setup(self, layout, cfg, device):
        super().setup(layout, cfg, device)
        try:
            from kvtransform.layout import DualKVLayout
            from kvtransform.ops.dualkv import dualkv_attention
        except Exception as e:
            raise Unavailable(f"DualKV op not importable: {type(e).__name__}: {e}")
        self.op, self.Layout = dualkv_attention, DualKVLayout
        self.per_step_layout = bool(cfg.dualkv_layout_per_step)
        self.impl = "kvt.dualkv_attention" + (" layout/step" if self.per_step_layout else "") + _variant_str(self)

    def per_step(self):
        if self.per_step_layout:
            self.layout = self.Layout.from_lengths([(self.P, list(self.R))], device=self.device)

    def __call__(self, q, k, v):
        out = self.op(q, k, v, self.layout, **self.variants)
        return out[0] if isinstance(out, (tuple, list)) else out


def _variant_str(meth) -> str:
    """`` window=.. softcap=.. sinks`` of the method's variants for the ``impl`` column."""
    return "".join(f" {k}" if k == "sinks" else f" {k}={v}" for k, v in meth.variants.items())


class DualKVKernel(AttnMethod):
    """The DualKV Triton kernels called directly (``kvtransform.kernels.dualkv.dualkv_fwd`` / ``dualkv_bwd``, no
    autograd, no op dispatch), ``attn`` mode only; ``launch_config`` = the defaults or the ``tune`` sweep's best.
    On CPU only under ``TRITON_INTERPRET=1``."""

    name = "dualkv_kernel"
    launch_config: Optional[dict] = None
    takes_variants = True

    def setup(self, layout, cfg, device):
        super().setup(layout, cfg, device)
        from kvtransform.kernels import dualkv as K
        from kvtransform.kernels._common import interpreting

        mode = cfg.mode.value if hasattr(cfg.mode, "value") else str(cfg.mode)
        if mode != "attn":
            raise Unavailable("dualkv_kernel runs in the attn mode only (no autograd)")
        if device.type != "cuda" and not interpreting():
            raise Unavailable("Triton needs CUDA (or TRITON_INTERPRET=1 on CPU)")
        self.K = K
        self.impl = "triton " + (_config_str(self.launch_config) if self.launch_config else "default config") + \
            _variant_str(self)

    def _fwd(self, q, k, v):
        d = q.shape[-1]
        return self.K.dualkv_fwd(q, k, v, self.layout.cu_seqlens, self.layout.segment_prefix, d ** -0.5,
                                 config=self.launch_config, **self.variants)

    def __call__(self, q, k, v):
        return self._fwd(q.detach(), k.detach(), v.detach())[0]

    def attn_step(self, q, k, v, do, mark):
        q, k, v = q.detach(), k.detach(), v.detach()
        out, lse = self._fwd(q, k, v)
        mark()
        self.K.dualkv_bwd(do, q, k, v, out, lse, self.layout.cu_seqlens, self.layout.segment_prefix,
                          q.shape[-1] ** -0.5, config=self.launch_config, **self.variants)


def _dualkv_layer(layer, x, cu_seqlens, segment_prefix):
    """The layer with ``kvt::dualkv_attention`` (an opaque custom op for torch.compile) as its attention."""
    def attn(q, k, v):
        return torch.ops.kvt.dualkv_attention(q, k, v, cu_seqlens, segment_prefix, q.shape[-1] ** -0.5)[0]

    return layer(x, attn, return_attn=True)


def _flex_layer(layer, x, block_mask):
    """The layer with flex_attention (GQA, the shared-prefix block mask) as its attention."""
    from torch.nn.attention.flex_attention import flex_attention

    def attn(q, k, v):
        o = flex_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                           block_mask=block_mask, enable_gqa=True)
        return o[0].transpose(0, 1)

    return layer(x, attn, return_attn=True)


def _compiled_setup(meth, kind: str, fn):
    """Common setup of the whole-layer compiled methods (layer mode only): static shapes per T; Inductor on CUDA,
    ``aot_eager`` on CPU (tests: same graph capture, no C++ build)."""
    mode = meth.cfg.mode.value if hasattr(meth.cfg.mode, "value") else str(meth.cfg.mode)
    if mode != "layer":
        raise Unavailable(f"{meth.name} compiles the whole decoder layer (layer mode only)")
    backend = "inductor" if meth.device.type == "cuda" else "aot_eager"
    meth.layer_fn = _static_compiled(kind, fn, int(meth.layout.total_tokens), backend)
    meth.impl = f"torch.compile(layer, {backend}, static) + {meth.impl}"


class DualKVCompiled(DualKV):
    """The whole decoder layer under ``torch.compile`` (Inductor fuses the norms, SwiGLU and residuals) with
    ``kvt::dualkv_attention`` opaque inside; the layout tensors are graph inputs (rebuilt per step as ``dualkv``)."""

    name = "dualkv_compiled"
    takes_variants = False

    def setup(self, layout, cfg, device):
        super().setup(layout, cfg, device)
        _compiled_setup(self, "dualkv_layer", _dualkv_layer)

    def layer_forward(self, layer, x):
        return self.layer_fn(layer, x, self.layout.cu_seqlens, self.layout.segment_prefix)


class FlexCompiled(Flex):
    """The whole decoder layer under ``torch.compile`` around flex_attention (block mask built once, a graph input)."""

    name = "flex_compiled"
    takes_variants = False  # the compiled layer calls flex_attention without a score_mod

    def setup(self, layout, cfg, device):
        super().setup(layout, cfg, device)
        _compiled_setup(self, "flex_layer", _flex_layer)

    def layer_forward(self, layer, x):
        return self.layer_fn(layer, x, self.block_mask)


def _config_str(config: dict) -> str:
    return " ".join(f"{kind}:{c['BLOCK_M']}/{c['BLOCK_N']}/{c['num_warps']}/{c['num_stages']}"
                    + ("/pack" if c.get("PACK") else "") + ("/tma" if c.get("TMA") else "")
                    for kind, c in sorted(config.items()))


METHODS = {m.name: m for m in (Reference, FA2, PrefixGrouper, Flex, FlexRebuild, DualKV, DualKVKernel, DualKVCompiled,
                                FlexCompiled)}
ORDER = ["reference", "fa2", "pg", "flex", "flex_rebuild", "dualkv", "dualkv_kernel", "flex_compiled",
         "dualkv_compiled"]
COMPILED = ("flex_compiled", "dualkv_compiled")


def methods_for(cfg, device, T: int) -> list:
    """Method names a job runs: the one asked for, or with ``all`` every method that applies (``reference`` only on
    CPU or at small T, since it materialises a (T, T) mask; ``dualkv_kernel`` only in the attn mode; the whole-layer
    compiled methods only in the layer mode on CUDA)."""
    m = cfg.method.value if isinstance(cfg.method, Method) else str(cfg.method)
    if m != "all":
        return [m]
    mode = cfg.mode.value if hasattr(cfg.mode, "value") else str(cfg.mode)
    return [n for n in ORDER if (n != "reference" or device.type == "cpu" or T <= 4096)
            and (n != "dualkv_kernel" or mode == "attn")
            and (n not in COMPILED or (mode == "layer" and device.type == "cuda"))]
