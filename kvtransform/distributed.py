"""DualKV training across GPUs with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Packed shared-prefix training (DualKV, arXiv 2605.15422) is data parallel over prompt groups: every rank packs its
own groups ``[P][R_1]...[R_N]`` (:func:`kvtransform.balance.balance_groups` chooses them so that packed token counts
match) and runs the transformed module on them; FSDP2 shards parameters, gradients and optimiser state::

    model = model.to(torch.bfloat16)                  # capture in the compute dtype (the graph bakes dtypes in)
    opt = kvt.transform(model, "dualkv"); del model
    opt.float()                                       # fp32 master weights; FSDP2 all-gathers them as bf16
    shard_dualkv(opt, mesh)                           # fully_shard per decoder layer + root, checkpoint per layer
    loss = token_level_loss(batch.response_logprobs(opt(batch)), adv, global_tokens)
    loss.backward(); optimizer.step()

Where ``fully_shard`` goes. FSDP2 all-gathers a module's parameters in a forward pre-hook and reduce-scatters their
gradients from hooks around that module's ``forward``. The transformed module is one ``torch.export`` graph in
which every decoder layer's weights are ``get_attr`` nodes of a flat ``GraphModule``: the submodules that hold them
(``gm.model.model.layers[i]``) are plain containers whose ``forward`` never runs, so ``fully_shard`` on them would
never unshard anything. Sharding the Hugging Face model *before* the transform does not work either: FSDP2 replaces
the module's parameters with new ``DTensor`` parameters (the captured graph would keep the old ones) and
``torch.export`` does not trace through FSDP hooks. :func:`split_decoder_layers` therefore cuts the rewritten graph at
decoder-layer boundaries (from ``torch.export``'s ``nn_module_stack`` metadata) into one ``GraphModule`` per layer
plus a prologue (embedding, rotary tables) and an epilogue (final norm, LM head), each holding its own parameters
(the same ``Parameter`` objects); ``fully_shard`` then goes on each layer (optionally inside PyTorch's
``checkpoint_wrapper``) and on the :class:`~kvtransform.transforms.dualkv.DualKVModule` as the root, which owns the
prologue and epilogue parameters (tied embeddings stay in one FSDP group). ``torch.fx.passes.split_module`` is not
used because it keeps every ``get_attr`` in the parent module and passes weights into partitions as arguments, which
would leave all parameters in the root.

Equal gradients. FSDP2 averages gradients over ranks; :func:`token_level_loss` scales each rank's sum by
``world_size / global_tokens`` so that the average is the gradient of the global batch's token-level loss, whatever
the per-rank token counts.
"""
from __future__ import annotations

import math
import numbers
import re
from typing import Optional, Sequence

import numpy as np
import torch
import torch.fx as fx

__all__ = [
    "split_decoder_layers",
    "shard_dualkv",
    "original_parameter_name",
    "token_level_loss",
    "group_advantages",
    "full_gradients",
    "micro_batch_loss",
    "all_reduce_int",
]

_COPY = -1  # partition marker: a node computed from graph inputs only, copied into every partition that uses it
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_PREFIX_RE = re.compile(r"^(?:.*?\.)?(?:pre|post|layers\.\d+)\.(?:_checkpoint_wrapped_module\.)?(?:_fsdp_wrapped_module\.)?")


def _stack_paths(node: fx.Node) -> list:
    stack = node.meta.get("nn_module_stack") or {}
    return [v[0] for v in stack.values() if isinstance(v, tuple) and v and isinstance(v[0], str)]


def _stack_layer(node: fx.Node) -> tuple[Optional[int], bool]:
    """(decoder-layer index from the node's module stack or ``None``, whether the stack names any module)."""
    paths = [p for p in _stack_paths(node) if p and not p.startswith("_")]
    for p in reversed(paths):
        m = _LAYER_RE.search(p)
        if m:
            return int(m.group(1)), True
    return None, bool(paths)


def _layer_count(gm: fx.GraphModule) -> int:
    idx = [int(m.group(1)) for n in gm.graph.nodes if n.op == "get_attr"
           for m in [_LAYER_RE.search(str(n.target))] if m]
    if not idx:
        raise ValueError("split_decoder_layers: the graph has no decoder-layer weights (no get_attr target with "
                         "'layers.<i>'): not a captured Hugging Face decoder-only model")
    return max(idx) + 1


def _assign_partitions(gm: fx.GraphModule, num_layers: int) -> dict:
    """node -> partition (0 prologue, 1..L decoder layers, L+1 epilogue) for every computing node."""
    part: dict = {}
    pending: list = []
    seen_layer = False
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        layer, named = _stack_layer(n)
        if layer is not None:
            part[n] = layer + 1
            seen_layer = True
        elif named:
            part[n] = num_layers + 1 if seen_layer else 0
        else:  # nodes the passes inserted (no module stack), guards, symbolic sizes
            ins = [part[a] for a in n.all_input_nodes if part.get(a) is not None]
            part[n] = max(ins) if ins else None
            if part[n] is None:
                pending.append(n)
    for n in pending:  # reads graph inputs only (sym_size of input_ids, guards): copied where used
        part[n] = _COPY if n.op == "call_function" and n.users else 0
    for n, p in part.items():
        for a in n.all_input_nodes:
            if p != _COPY and part.get(a, _COPY) != _COPY and part[a] > p:
                raise ValueError(f"split_decoder_layers: node {n.name} (partition {p}) uses {a.name} from a later "
                                 f"partition {part[a]}: the graph is not a sequence of decoder layers")
    return part


def split_decoder_layers(gm: fx.GraphModule) -> fx.GraphModule:
    """Cut a captured (and rewritten) decoder-only graph into one ``GraphModule`` per decoder layer.

    Args:
        gm: an unlifted ``GraphModule`` from ``torch.export`` of a Hugging Face causal LM (e.g. ``opt.core.gm`` of a
            :class:`~kvtransform.transforms.dualkv.DualKVModule`); nodes carry ``nn_module_stack`` metadata, nodes
            inserted by kvtransform's passes inherit the layer of their inputs.

    Returns:
        a ``GraphModule`` with the same signature and outputs whose children are ``pre`` (embedding, rotary
        tables), ``layers`` (``nn.ModuleList``, one ``GraphModule`` per decoder layer, holding that layer's
        parameters) and ``post`` (final norm, LM head); parameters are the same ``Parameter`` objects as ``gm``'s,
        named as in the Hugging Face model (``layers[3]`` holds ``model.layers.3.mlp.up_proj.weight``). The result
        computes exactly what ``gm`` computes (same ops in the same order).

    Raises:
        ValueError: no decoder-layer weights in the graph, or a node that uses a value of a later layer.
    """
    num_layers = _layer_count(gm)
    part = _assign_partitions(gm, num_layers)
    nparts = num_layers + 2
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "get_attr"]
    strip = "model." if targets and all(t.startswith("model.") for t in targets) else ""
    # a tied weight (embedding = LM head) is one object under several names, and the graph may read it under
    # either: each partition names it by its first name in the model (Hugging Face's: model.embed_tokens.weight)
    first_name: dict = {}
    for t, obj in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        first_name.setdefault(id(obj), t)

    graphs = [fx.Graph() for _ in range(nparts)]
    envs: list[dict] = [{} for _ in range(nparts)]
    inputs: list[list] = [[] for _ in range(nparts)]       # external values each partition reads, in order
    attrs: list[dict] = [{} for _ in range(nparts)]        # target -> attribute object
    outputs: list[list] = [[] for _ in range(nparts)]      # values each partition hands on

    def fetch(p: int, a: fx.Node) -> fx.Node:
        env = envs[p]
        if a in env:
            return env[a]
        if part.get(a) == _COPY:
            env[a] = graphs[p].node_copy(a, lambda x: fetch(p, x))
        elif a.op == "get_attr":
            t = str(a.target)
            obj = gm.get_submodule(t) if isinstance(_getattr(gm, t), torch.nn.Module) else _getattr(gm, t)
            t = first_name.get(id(obj), t)
            name = t[len(strip):] if t.startswith(strip) else t
            attrs[p][name] = obj
            env[a] = graphs[p].get_attr(name)
        else:
            ph = graphs[p].placeholder(a.name)
            ph.meta = dict(a.meta)
            inputs[p].append(a)
            env[a] = ph
            if a.op != "placeholder" and a not in outputs[part[a]]:
                outputs[part[a]].append(a)
        env[a].meta = dict(a.meta)
        return env[a]

    out_node = None
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            out_node = n
            for a in n.all_input_nodes:
                if a.op not in ("placeholder", "get_attr") and part[a] != _COPY and a not in outputs[part[a]]:
                    outputs[part[a]].append(a)
            continue
        if n.op == "get_attr" or part[n] == _COPY:
            continue
        p = part[n]
        for a in n.all_input_nodes:
            if a not in envs[p]:
                fetch(p, a)
        if n.op == "call_module":
            attrs[p][str(n.target)] = gm.get_submodule(str(n.target))
        envs[p][n] = graphs[p].node_copy(n, lambda a: envs[p][a])

    root = torch.nn.Module()
    modules = []
    for p in range(nparts):
        g = graphs[p]
        g.output(tuple(envs[p][a] for a in outputs[p]))
        mod = fx.GraphModule(attrs[p], g, class_name="DecoderLayer" if 0 < p <= num_layers else "Stage")
        modules.append(mod)
    root.pre = modules[0]
    root.layers = torch.nn.ModuleList(modules[1:num_layers + 1])
    root.post = modules[num_layers + 1]
    names = ["pre"] + [f"layers.{i}" for i in range(num_layers)] + ["post"]

    top = fx.Graph()
    top._codegen = gm.graph._codegen
    env: dict = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = top.node_copy(n, lambda a: env[a])
    for p in range(nparts):
        call = top.call_module(names[p], tuple(env[a] for a in inputs[p]))
        for k, a in enumerate(outputs[p]):
            env[a] = top.call_function(_getitem, (call, k))
            env[a].meta = dict(a.meta)
    top.node_copy(out_node, lambda a: env[a])
    new = fx.GraphModule(root, top, class_name="LayerSplitGraph")
    new.layers = root.layers  # a ModuleList (GraphModule copied the call targets into a plain Module)
    new.meta.update(gm.meta)
    return new


def _getitem(t, k):
    return t[k]


def _getattr(mod, target: str):
    for a in target.split("."):
        mod = getattr(mod, a)
    return mod


def original_parameter_name(name: str) -> str:
    """The Hugging Face name of a parameter of a (split, checkpoint-wrapped, sharded) DualKV module: strips
    ``core.gm.layers.3._checkpoint_wrapped_module.`` (or ``core.gm.pre.``/``post.``) or ``core.gm.model.``, so
    ``core.gm.layers.3._checkpoint_wrapped_module.model.layers.3.mlp.up_proj.weight`` ->
    ``model.layers.3.mlp.up_proj.weight``."""
    if ".gm.model." in name or name.startswith("gm.model."):
        return name.split("gm.model.", 1)[1]
    m = _PREFIX_RE.match(name)
    return name[m.end():] if m else name


def shard_dualkv(opt: torch.nn.Module, mesh=None, *, param_dtype: Optional[torch.dtype] = None,
                 reduce_dtype: Optional[torch.dtype] = None, master_dtype: Optional[torch.dtype] = None,
                 checkpoint: bool = True,
                 reshard_after_forward: bool = True) -> torch.nn.Module:
    """Shard a DualKV-transformed module with FSDP2: ``fully_shard`` per decoder layer and at the root.

    Splits ``opt.core.gm`` per decoder layer (:func:`split_decoder_layers`), wraps each layer in PyTorch's
    ``checkpoint_wrapper`` (non-reentrant activation checkpointing: the layer's forward, ``kvt.dualkv_attention``
    included, is recomputed in backward) when ``checkpoint``, applies ``fully_shard`` to each layer and then to
    ``opt`` itself (embedding, final norm and LM head); prefix-tree batches (``opt(tree_batch)``) then run the
    tree program over the same sharded layers (:func:`kvtransform.passes.prefix_tree.prefix_tree_layers`). Modifies
    ``opt`` in place (its class becomes FSDP's
    subclass of it) and returns it. Build the optimiser on ``opt.parameters()`` *after* this call: the parameters
    are new ``DTensor`` parameters (``Shard(0)`` over ``mesh``); the original model's tensors are no longer used, so
    drop the model to free them.

    Args:
        opt: a :class:`~kvtransform.transforms.dualkv.DualKVModule` (``kvt.transform(model, "dualkv")``), not yet
            sharded, parameters on the mesh's device type (or CPU: FSDP2 moves them).
        mesh: a 1-D ``DeviceMesh`` (default: all ranks of the default process group on the current device type).
        param_dtype: dtype of the all-gathered parameters used in compute, e.g. ``torch.bfloat16`` (with fp32
            ``opt`` parameters as master weights). Must equal the dtype the graph was captured in (the graph
            bakes dtype casts in): capture a bf16 model, then ``opt.float()``. ``None``: the parameters' dtype.
        reduce_dtype: dtype of the gradient reduce-scatter (e.g. ``torch.float32``); ``None``: ``param_dtype``.
        master_dtype: convert the parameters (not the buffers: the graph checks their captured dtypes) to this
            dtype before sharding, e.g. ``torch.float32`` master weights for a graph captured in bf16 with
            ``param_dtype=torch.bfloat16``; the sharded parameters, their gradients and the optimiser state then
            live in it. ``None``: keep the parameters' dtype.
        checkpoint: activation checkpointing per decoder layer.
        reshard_after_forward: free the all-gathered layer parameters after forward (ZeRO-3); ``False`` keeps them
            until backward (ZeRO-2-like, more memory, one all-gather less per layer).

    Returns:
        ``opt`` (now also an ``FSDPModule``).

    Raises:
        ValueError: ``opt`` is not a DualKV module, is already sharded, or ``param_dtype`` differs from the dtype
            the graph was captured in (the message says how to capture in that dtype).
        RuntimeError: no default process group and no ``mesh``.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    core = getattr(opt, "core", None)
    gm = getattr(core, "gm", None)
    if not isinstance(gm, fx.GraphModule):
        raise ValueError(f"shard_dualkv needs the module returned by kvt.transform(model, 'dualkv'); got "
                         f"{type(opt).__name__}")
    if isinstance(opt, FSDPModule):
        raise ValueError("shard_dualkv: this module is already sharded (fully_shard was applied before)")
    if mesh is None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("shard_dualkv needs torch.distributed initialised (torchrun + "
                               "dist.init_process_group) or a DeviceMesh passed as mesh=")
        dev = "cuda" if torch.cuda.is_available() and dist.get_backend() != "gloo" else "cpu"
        mesh = init_device_mesh(dev, (dist.get_world_size(),))
    captured = _captured_dtype(gm)
    compute = param_dtype or master_dtype or next(opt.parameters()).dtype
    if captured is not None and compute != captured:
        raise ValueError(f"shard_dualkv: the layers would compute in {compute} but the graph was captured in "
                         f"{captured} (it casts to {captured} internally). Capture in the compute dtype: "
                         f"model.to({compute}) before kvt.transform, and pass param_dtype={compute} (with "
                         f"master_dtype=torch.float32 for fp32 master weights)")
    if master_dtype is not None:
        with torch.no_grad():
            for p in opt.parameters():
                p.data = p.data.to(master_dtype)
    if not hasattr(gm, "layers"):
        gm = split_decoder_layers(gm)
        core.gm = gm
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i in range(len(gm.layers)):
            gm.layers[i] = checkpoint_wrapper(gm.layers[i])
    for layer in gm.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(opt, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if "_tree_core" in opt.__dict__:  # prefix-tree batches: the tree program over the same sharded layer modules
        from kvtransform.passes.manager import PassContext
        from kvtransform.passes.prefix_tree import prefix_tree_layers
        from kvtransform.report import Report

        opt.__dict__["_tree_core"] = prefix_tree_layers(gm, PassContext(Report()))
    return opt


def _captured_dtype(gm: fx.GraphModule) -> Optional[torch.dtype]:
    for n in gm.graph.nodes:
        if n.op == "get_attr" and "embed_tokens" in str(n.target):
            val = n.meta.get("val")
            return getattr(val, "dtype", None)
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.meta.get("val") is not None and n.meta["val"].dtype.is_floating_point:
            return n.meta["val"].dtype
    return None


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's group-normalised advantages ``(r_i − mean(r)) / (std(r) + eps)`` over one prompt's responses.

    Args:
        rewards: ``(N,)`` float rewards of the N responses of one prompt.
        eps: added to the (unbiased, 0 for N = 1) standard deviation.

    Returns:
        ``(N,)`` float32 advantages (zeros when all rewards are equal).

    Raises:
        ValueError: ``rewards`` is not a non-empty 1-D tensor of finite rewards, ``eps`` is not a finite number
            >= 0.
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or rewards.numel() == 0 or \
            rewards.is_complex() or rewards.dtype == torch.bool:
        raise ValueError(f"rewards must be a non-empty 1-D real tensor (one reward per response); got {rewards!r}")
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real) or not 0 <= float(eps) < math.inf:
        raise ValueError(f"eps must be a finite number >= 0; got {eps!r}")
    eps = float(eps)
    r = rewards.double()  # (float32 first would round rewards near 1e9 to equal values: all advantages 0)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite: a NaN or inf reward would make every advantage of the group NaN")
    std = r.std() if r.numel() > 1 else r.new_zeros(())
    centred = r - r.mean()
    return torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred)).float()  # equal rewards: 0


def token_level_loss(logprobs: Sequence[torch.Tensor], advantages: torch.Tensor, global_tokens: int,
                     world_size: int = 1) -> torch.Tensor:
    """The token-level policy-gradient loss of this rank's responses, scaled for data-parallel averaging.

    ``loss = −world_size / global_tokens · Σ_i advantage_i · Σ_j logprob_ij`` (DAPO's token-level normalisation:
    every response token of the global batch weighs the same). FSDP2/DDP average gradients over ranks, so the
    averaged gradient is that of ``−1/global_tokens · Σ`` over the global batch, however tokens are split.

    Args:
        logprobs: this rank's per-response log-probs, ``[(R_i,) ...]`` (:meth:`PackedBatch.response_logprobs`).
        advantages: ``(N,)`` one advantage per response, same order.
        global_tokens: the number of response tokens on all ranks together (``all_reduce`` of the local count).
        world_size: number of data-parallel ranks that average the gradients.

    Returns:
        0-d tensor in the log-probs' dtype.

    Raises:
        ValueError: lengths that do not match, advantages that are not ``(N,)`` or not finite, log-probs that are
            not 1-D, ``global_tokens``/``world_size``
            not integers >= 1, or fewer ``global_tokens`` than this rank's own response tokens.
    """
    if not isinstance(advantages, torch.Tensor) or advantages.dim() != 1:
        raise ValueError(f"advantages must be a 1-D tensor, one per response; got "
                         f"{tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages)}")
    if len(logprobs) != advantages.numel():
        raise ValueError(f"{len(logprobs)} responses but {advantages.numel()} advantages")
    if not bool(torch.isfinite(advantages).all()):
        raise ValueError("advantages must be finite: a NaN or inf advantage makes the loss and every gradient NaN")
    bad = next((i for i, lp in enumerate(logprobs) if not isinstance(lp, torch.Tensor) or lp.dim() != 1), None)
    if bad is not None:
        lp = logprobs[bad]
        raise ValueError(f"logprobs[{bad}] must be a 1-D tensor of one response's token log-probs; got "
                         f"{tuple(lp.shape) if isinstance(lp, torch.Tensor) else type(lp).__name__}")
    for key, v in (("global_tokens", global_tokens), ("world_size", world_size)):
        if isinstance(v, bool) or not hasattr(v, "__index__") or int(v) < 1:
            raise ValueError(f"{key} must be an integer >= 1; got {v!r}")
    if not logprobs:
        raise ValueError("token_level_loss needs at least one response")
    local = sum(int(lp.numel()) for lp in logprobs)
    if local > int(global_tokens):
        raise ValueError(f"global_tokens={global_tokens} is below this rank's own {local} response tokens: pass the "
                         f"all-reduced sum of every rank's response tokens")
    adv = advantages.to(logprobs[0].device, logprobs[0].dtype)
    total = torch.stack([adv[i] * lp.sum() for i, lp in enumerate(logprobs)]).sum()
    return -total * (world_size / global_tokens)


def micro_batch_loss(opt: torch.nn.Module, groups: Sequence[tuple], advantages: Sequence[torch.Tensor],
                     global_tokens: int, world_size: int = 1, *, trees: bool = False) -> torch.Tensor:
    """Forward one micro-batch of prompt groups (or prefix trees) through the (sharded) DualKV module and return
    its :func:`token_level_loss` (call ``.backward()`` on it; gradients accumulate over micro-batches).

    Args:
        opt: the DualKV module (sharded with :func:`shard_dualkv` or not).
        groups: this rank's groups of the micro-batch, ``[(prompt_ids, [response_ids, ...]), ...]``; with
            ``trees=True`` its prefix trees, ``[[trajectory_ids, ...], ...]`` (as ``kvt.balance_groups(...,
            trees=True)`` assigns them; packed together by ``kvt.pack_trajectories``, every token after a
            trajectory's first trained). May be empty (a rank without groups in this micro-batch): a 2-token filler
            batch then runs with loss weight 0, so that every rank issues the same FSDP collectives.
        advantages: per group a ``(N_g,)`` tensor, one advantage per response (per trajectory for trees).
        global_tokens: trained tokens of the whole step on all ranks and micro-batches.
        world_size: data-parallel ranks averaging the gradients.

    Returns:
        0-d float32 loss.

    Raises:
        ValueError: groups and advantages that do not match, in number or per group (or what
            ``pack_shared_prefix_groups`` / ``pack_trajectories`` raises).
    """
    from kvtransform.packing import pack_shared_prefix, pack_shared_prefix_groups
    from kvtransform.tree_packing import pack_trajectories

    if len(groups) != len(advantages):
        raise ValueError(f"{len(groups)} groups but {len(advantages)} advantage vectors")
    for i, (item, adv) in enumerate(zip(groups, advantages)):
        n = len(item) if trees else len(item[1])
        if not isinstance(adv, torch.Tensor) or adv.dim() != 1 or adv.numel() != n:
            shape = tuple(adv.shape) if isinstance(adv, torch.Tensor) else type(adv).__name__
            raise ValueError(f"{'tree' if trees else 'group'} {i} has {n} {'trajectories' if trees else 'responses'} "
                             f"but its advantages are {shape}: pass a 1-D tensor of {n} values")
    if not groups:
        batch = pack_shared_prefix([1], [[2]])
        return opt(batch).float().sum() * 0.0
    if trees:
        batch = pack_trajectories([t for tree in groups for t in tree])
        logprobs = batch.trajectory_logprobs(opt(batch))
    else:
        batch = pack_shared_prefix_groups(list(groups))
        logprobs = batch.response_logprobs(opt(batch))
    return token_level_loss(logprobs, torch.cat(list(advantages)), global_tokens, world_size)


def full_gradients(module: torch.nn.Module) -> dict:
    """``{Hugging Face parameter name: full gradient}`` of a (possibly FSDP-sharded) module: ``DTensor``
    gradients are all-gathered (a collective: call on every rank). Parameters without a gradient are skipped."""
    out = {}
    for name, p in module.named_parameters():
        g = p.grad
        if g is None:
            continue
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[original_parameter_name(name)] = g.detach()
    return out


def all_reduce_int(value: int, group=None) -> int:
    """Sum of an integer over the ranks of ``group`` (the identity without torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return int(value)
    dev = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([int(value)], dtype=torch.int64, device=dev)
    dist.all_reduce(t, group=group)
    return int(t.item())

