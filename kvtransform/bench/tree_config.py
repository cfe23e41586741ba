"""Structured configs of the prefix-tree suites (``kvtransform bench tree-attn | tree-layer``), registered with the
other suites by :mod:`.config`. Runner: :mod:`.tree_runner`; shapes: :mod:`.tree_shapes`; methods:
:mod:`.tree_methods`; masks: :mod:`.masks`.

Shapes (``shape=``):

* ``agentic`` (default): ``trees`` trees, each a ``prompt``-token shared system+task prompt, then one level of turns
  per entry of ``fanout`` (``fanout=4x2x2``: 4 first turns, each branching 2 ways, each of those 2 ways: 16
  trajectories of 3 turns, 29 nodes), turn lengths ``random.Random(seed).randint(turn_min, turn_max)`` drawn in
  depth-first packing order (Tree Training, arXiv 2511.00413, for packing RL trajectories as a tree).
* ``one_level``: DualKV's shapes (arXiv 2605.15422, Table 1), a tree of one level: a prompt of ``P`` tokens and
  ``mb`` responses of lengths ``torch.randint(r_min, r_max + 1, (mb,))`` from a CPU generator seeded ``r_seed``
  (the ``dualkv-attn`` suite's lengths).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .config_common import DType, _at_least, _check_device, _check_gqa

__all__ = ["TreeMethod", "TreeMode", "TreeShapeKind", "TreeAttnBenchConfig", "TreeLayerBenchConfig",
           "parse_fanout", "validate_tree"]


class TreeMethod(Enum):
    """Prefix-tree attention implementations (``all`` = every one that applies to the device and the shape)."""

    all = "all"
    reference = "reference"  # packed tokens, dense (T, T) bool mask, SDPA (CPU / tiny shapes only)
    kvt_tree = "kvt_tree"  # ours: kvt.prefix_tree_attention on the packed tree
    flex_tree = "flex_tree"  # FlexAttention on the packed tree, tree block mask, compiled per shape
    flat = "flat"  # each trajectory its own causal sequence (shared tokens copied): varlen_attn or SDPA per trajectory
    dualkv = "dualkv"  # kvt.dualkv_attention, one-level trees only
    kvt_tree_compiled = "kvt_tree_compiled"  # layer mode: the layer under torch.compile, the tree op opaque
    flex_tree_compiled = "flex_tree_compiled"  # layer mode: the layer under torch.compile around flex_attention


class TreeMode(Enum):
    attn = "attn"  # the attention op alone: forward, backward, forward+backward rows
    layer = "layer"  # a Qwen3-8B-shaped decoder layer, forward+backward of out.sum()


class TreeShapeKind(Enum):
    agentic = "agentic"
    one_level = "one_level"


@dataclass
class TreeAttnBenchConfig:
    """One ``tree-attn`` job: one tree shape, every method (or one) timed in this process on the same inputs.

    Attributes:
        suite: suite name, recorded in the CSV and the reproduce command.
        mode: ``attn`` (the op alone: fwd, bwd and fwd+bwd rows) or ``layer`` (the ``tree-layer`` suite).
        method: one of :class:`TreeMethod`; ``all`` runs every method that applies to the device and shape.
        shape: ``agentic`` or ``one_level`` (see the module docstring).
        prompt: agentic: tokens of each tree's shared prompt (the root).
        fanout: agentic: children per node at each level below the root, ``x``-separated (``4x2x2``).
        turn_min, turn_max: agentic: turn (node) lengths are drawn uniformly from ``[turn_min, turn_max]``.
        trees: agentic: independent trees packed in one batch (each its own prompt and turns).
        seed: agentic: seed of the turn lengths; every shape: of the inputs / weights (``seed + 1``).
        P, mb, r_min, r_max, r_seed: one_level: the prompt, the number of responses, their length range and the
            seed of their lengths (42 = the DualKV paper's, as ``dualkv-attn``).
        hidden, heads, kv_heads, head_dim, mlp, qk_norm: the layer's shape (Qwen3-8B); the attention's heads.
        dtype: compute dtype.
        device: ``auto`` (cuda if available, else cpu), ``cuda`` or ``cpu``.
        warmup, iters: untimed, then timed steps (each step: forward, backward); p20/p50/p80 over the timed ones.
        time_budget_s, min_iters: fewer timed steps (never under ``min_iters``) when ``iters`` would exceed
            ``time_budget_s`` seconds (0 = no budget).
        check: compare each method's attention output with the first method's on the same inputs.
        kernel_check: first run the bf16/fp16 checks of the prefix-tree Triton kernels against float64 references
            (:func:`.checks_tree.check_prefix_tree_kernels`; once per process, a ``pass=check`` row; the run fails after
            writing its CSV when a check fails). CUDA (or TRITON_INTERPRET=1).
        matmul_tflops: the matmul rate of the FLOP floor (790 = measured on the H200).
        flat_impl: ``auto`` (``torch.nn.attention.varlen.varlen_attn`` when this torch has it with GQA and a causal
            window, on CUDA; else SDPA per trajectory), ``varlen`` or ``sdpa``; the row's ``impl`` says which ran.
        flex_compile: ``auto`` (torch.compile on CUDA, eager on CPU), ``true`` or ``false``.
        flex_mask: how the tree block mask is built: ``blocks`` (from the layout's node ranges, O(T * T/128) work),
            ``compiled`` (``torch.compile(create_block_mask)``) or ``eager`` (``create_block_mask`` on all T^2 pairs).
        flex_static: compile flex_attention with static shapes per token count (a full compile per shape).
        max_mem_gb: skip (status ``skip-mem``) a method whose estimated peak exceeds this (0 = the device's memory).
        out_dir, append, plot: as in the other suites.
    """

    suite: str = "tree-attn"
    mode: TreeMode = TreeMode.attn
    method: TreeMethod = TreeMethod.all
    shape: TreeShapeKind = TreeShapeKind.agentic
    prompt: int = 4096
    fanout: str = "4x2x2"
    turn_min: int = 256
    turn_max: int = 2048
    trees: int = 1
    seed: int = 0
    P: int = 8192
    mb: int = 16
    r_min: int = 131
    r_max: int = 2048
    r_seed: int = 42
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 14336
    qk_norm: bool = True
    dtype: DType = DType.bfloat16
    device: str = "auto"
    warmup: int = 3
    iters: int = 10
    time_budget_s: float = 0.0
    min_iters: int = 3
    check: bool = True
    kernel_check: bool = False
    matmul_tflops: float = 790.0
    flat_impl: str = "auto"
    flex_compile: str = "auto"
    flex_mask: str = "blocks"
    flex_static: bool = True
    max_mem_gb: float = 0.0
    out_dir: str = "out/bench/tree-attn"
    append: bool = False
    plot: bool = True


@dataclass
class TreeLayerBenchConfig(TreeAttnBenchConfig):
    """``tree-layer``: the same tree shapes through one Qwen3-8B-shaped decoder layer (the ``dualkv-layer`` suite's
    layer, :mod:`.layer`), forward+backward of ``out.sum()``; ``kvt_tree_compiled`` / ``flex_tree_compiled`` run the
    whole layer under torch.compile (static shapes) with the tree op / flex_attention inside."""

    suite: str = "tree-layer"
    mode: TreeMode = TreeMode.layer
    warmup: int = 2
    iters: int = 5
    out_dir: str = "out/bench/tree-layer"


def parse_fanout(text) -> tuple:
    """``"4x2x2"`` -> ``(4, 2, 2)``; ValueError (one line) unless one or more positive integers."""
    parts = str(text).replace("X", "x").split("x")
    try:
        out = tuple(int(p) for p in parts)
    except ValueError:
        out = ()
    if not out or any(f < 1 for f in out):
        raise ValueError(f"fanout={text}: fanout is the children per node at each level, positive integers joined "
                         f"by x (e.g. fanout=4x2x2)")
    return out


_CHOICES = {"flat_impl": ("auto", "varlen", "sdpa"), "flex_compile": ("auto", "true", "false", "1", "0", "yes", "no"),
            "flex_mask": ("blocks", "eager", "compiled")}


def validate_tree(cfg) -> None:
    """Check one composed tree job before anything runs.

    Raises:
        ValueError: one line naming the setting, its value and the fix: lengths, counts and the layer shape below
            1, ``turn_min > turn_max`` / ``r_min > r_max``, a bad ``fanout``, ``heads`` not divisible by
            ``kv_heads``, negative ``warmup``/``time_budget_s``/``max_mem_gb``, ``matmul_tflops <= 0``, an unknown
            ``flat_impl``/``flex_compile``/``flex_mask`` or an unparsable ``device``.
    """
    _at_least(cfg, {"prompt": "the shared prompt length in tokens", "turn_min": "the shortest turn in tokens",
                    "turn_max": "the longest turn in tokens", "trees": "the number of trees in the batch",
                    "P": "the one-level prompt length in tokens", "mb": "the number of one-level responses",
                    "r_min": "the shortest response length in tokens", "r_max": "the longest response length in tokens",
                    "iters": "the number of timed steps", "min_iters": "the floor of timed steps under time_budget_s",
                    "hidden": "the layer's hidden size", "heads": "the number of query heads",
                    "kv_heads": "the number of KV heads", "head_dim": "the head dimension", "mlp": "the MLP width"}, 1)
    for lo, hi, what in (("turn_min", "turn_max", "turn"), ("r_min", "r_max", "response")):
        if getattr(cfg, lo) > getattr(cfg, hi):
            raise ValueError(f"{lo}={getattr(cfg, lo)} > {hi}={getattr(cfg, hi)}: {what} lengths are drawn uniformly "
                             f"from [{lo}, {hi}]; set {lo} <= {hi}")
    parse_fanout(cfg.fanout)
    _check_gqa(cfg)
    for key in ("warmup", "time_budget_s", "max_mem_gb"):
        if getattr(cfg, key) < 0:
            raise ValueError(f"{key}={getattr(cfg, key)}: {key} must be >= 0")
    if not cfg.matmul_tflops > 0:
        raise ValueError(f"matmul_tflops={cfg.matmul_tflops}: the matmul rate of the FLOP floor must be > 0")
    for key, allowed in _CHOICES.items():
        val = str(getattr(cfg, key))
        if (val.lower() if key == "flex_compile" else val) not in allowed:
            raise ValueError(f"{key}={val}: {key} must be one of {', '.join(allowed)}")
    _check_device(cfg)
