"""TRL's padded GRPO batch ↔ packed shared-prefix batches (DualKV, arXiv 2605.15422, §2), for the per-token log-prob
passes of :class:`kvtransform.integrations.trl.GRPOTrainer`.

TRL hands its log-prob passes ``input_ids`` / ``attention_mask`` ``(B, P + C)``: left-padded prompts then
right-padded completions, the last ``C = logits_to_keep`` columns being the completions. Rows whose prompts are equal
(TRL repeats each prompt ``num_generations`` times; the rows of a micro-batch are shuffled, so equal prompts need not
be adjacent) form one group. A group packs as ``[p_0 .. p_{P-2}] [p_{P-1} c_0 .. c_{n-2}] [p_{P-1} c'_0 ..] ..``: the
prompt without its last token is the shared prefix, and every completion segment starts with that last prompt token,
so each position of a segment predicts exactly one completion token (``c_0`` from ``p_{P-1}``, ...). The segment
continues the prompt's positions and attends to the prefix and to itself, so every log-prob is the one of the
unpacked row: a per-position label (TRL's fused LM head's ``shift_labels``) is all the head needs, and the scores go
back to TRL's ``(B, C)`` layout (0 at masked completion positions, as TRL's own pass returns them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["PackPlan", "plan_packing", "pack_chunk", "pack_chunk_tree", "scatter_back"]


@dataclass
class PackPlan:
    """How one padded batch packs.

    Attributes:
        chunks: lists of groups, each group ``(prompt (P_g,) int64 CPU, [row indices])``; a chunk is one forward.
        completions: per row, its unpadded completion ``(n_r,)`` int64 CPU (``n_r`` may be 0: a fully masked row).
        batch, width: ``B`` and ``C``.
    """

    chunks: list
    completions: list
    batch: int
    width: int


def plan_packing(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                 batch_size: Optional[int] = None, trees: bool = False, left_padding: bool = True
                 ) -> tuple[Optional[PackPlan], str]:
    """Group the rows of a TRL batch by prompt.

    Args:
        input_ids: int ``(B, P + C)``; attention_mask: 0/1 ``(B, P + C)``; logits_to_keep: ``C``.
        batch_size: at most this many rows per forward (TRL's chunking of its log-prob passes; groups are never
            split, a larger group is a chunk of its own); None: one forward.
        trees: the chunks are packed as prefix trees (:func:`pack_chunk_tree`), which share whatever prefix rows
            have in common and need neither equal prompts nor two-token prompts.
        left_padding: whether a left-padded prompt packs; False for a model whose positions count the padding as
            TRL runs it (learned absolute positions numbered by column, GPT-2): packed prompts start at position 0.

    Returns:
        ``(plan, "")``, or ``(None, reason)`` when the batch does not pack: a prompt mask that is not left padding (or
        left padding without ``left_padding``), a
        completion mask that is not a prefix of ones, no completion token at all, and without ``trees`` no two rows
        sharing a prompt or a one-token prompt.
    """
    b, total = input_ids.shape
    c = int(logits_to_keep)
    p = total - c
    ids, mask = input_ids.detach().cpu(), attention_mask.detach().cpu().bool()
    pm, cm = mask[:, :p], mask[:, p:]
    n_p, n_c = pm.sum(1), cm.sum(1)
    if not torch.equal(pm, torch.arange(p)[None] >= (p - n_p)[:, None]):
        return None, "the prompt mask is not left padding"
    if not left_padding and int(n_p.min()) < p:
        return None, ("left padding moves this model's learned absolute positions as TRL numbers them (packed "
                      "prompts start at position 0)")
    if not torch.equal(cm, torch.arange(c)[None] < n_c[:, None]):
        return None, "a completion mask is not a prefix of ones (tokens masked inside a completion)"
    if int(n_c.sum()) == 0:
        return None, "no completion token to score"
    if int(n_p.min()) < (1 if trees else 2):
        return None, "a prompt of one token (the packed layout needs two)" if n_p.min() > 0 else "an empty prompt"
    groups: dict = {}
    for r in range(b):
        groups.setdefault(tuple(ids[r, p - int(n_p[r]):p].tolist()), []).append(r)
    if not trees and max(len(rows) for rows in groups.values()) < 2:
        return None, ("no two rows share a prompt (a micro-batch holds at most one completion of each: raise "
                      "per_device_train_batch_size to num_generations or more, or use shared_prefix='tree')")
    chunks, cur, rows_in = [], [], 0
    for prompt, rows in groups.items():
        if cur and batch_size is not None and rows_in + len(rows) > batch_size:
            chunks.append(cur)
            cur, rows_in = [], 0
        cur.append((torch.tensor(prompt, dtype=torch.long), rows))
        rows_in += len(rows)
    chunks.append(cur)
    completions = [ids[r, p:p + int(n_c[r])] for r in range(b)]
    return PackPlan(chunks, completions, b, c), ""


def pack_chunk(plan: PackPlan, chunk: list, device) -> Optional[tuple]:
    """The packed batch of one chunk.

    Returns:
        ``(batch, shift_labels (1, T) int64, rows, cols, src)`` -- a :class:`~kvtransform.packing.PackedBatch` on
        ``device``, the label of every packed position (-100 on the shared prefixes), and the int64 index vectors
        that put packed position ``src[i]`` at ``(rows[i], cols[i])`` of the ``(B, C)`` layout -- or None when no
        row of the chunk has a completion token.
    """
    from kvtransform.packing import pack_shared_prefix_groups

    spec, labels, rows, cols, src = [], [], [], [], []
    at = 0
    for prompt, members in chunk:
        segs = [(r, plan.completions[r]) for r in members if plan.completions[r].numel() > 0]
        if not segs:
            continue
        spec.append((prompt[:-1], [torch.cat([prompt[-1:], comp[:-1]]) for _, comp in segs]))
        labels.append(torch.full((prompt.numel() - 1,), -100, dtype=torch.long))
        at += prompt.numel() - 1
        for r, comp in segs:
            n = comp.numel()
            labels.append(comp)
            rows.append(torch.full((n,), r, dtype=torch.long))
            cols.append(torch.arange(n))
            src.append(torch.arange(at, at + n))
            at += n
    if not spec:
        return None
    batch = pack_shared_prefix_groups(spec, device=device)
    return (batch, torch.cat(labels)[None].to(device), torch.cat(rows).to(device), torch.cat(cols).to(device),
            torch.cat(src).to(device))


def pack_chunk_tree(plan: PackPlan, chunk: list, device) -> Optional[tuple]:
    """The rows of one chunk as one prefix tree (:func:`kvtransform.pack_trajectories`): every prefix rows share is
    stored once, across prompts too (a system prompt or few-shot examples common to several prompts, turns two
    rows have in common), not only a group's prompt. Same return as :func:`pack_chunk`.

    So that each packed position predicts one token (TRL's fused LM head takes one label per position), the trie is
    built over (token, next token) pairs: row ``s`` becomes ``s[t] * V + s[t + 1]`` for ``t < len(s) - 1`` (``V`` one
    more than the chunk's largest id). Two rows share position ``t`` only where they also agree on ``s[t + 1]``,
    so a branch point's token is repeated at the start of each branch, as :func:`pack_chunk` repeats a prompt's
    last token in each completion segment; inputs are the pairs' first tokens, labels their second.
    """
    import dataclasses

    from kvtransform.tree_packing import pack_trajectories

    members = [(prompt, r) for prompt, rows in chunk for r in rows if plan.completions[r].numel() > 0]
    if not members:
        return None
    seqs = [torch.cat([prompt, plan.completions[r]]) for prompt, r in members]
    v = max(int(s.max()) for s in seqs) + 1
    tree = pack_trajectories([s[:-1] * v + s[1:] for s in seqs])
    inputs, targets = tree.input_ids // v, tree.input_ids % v
    labels = torch.full_like(targets, -100)
    rows, cols, src = [], [], []
    for i, (prompt, r) in enumerate(members):
        n = plan.completions[r].numel()
        at = tree.token_index(i)[prompt.numel() - 1:prompt.numel() - 1 + n]  # the pairs predicting the completion
        labels[0, at] = targets[0, at]
        rows.append(torch.full((n,), r, dtype=torch.long))
        cols.append(torch.arange(n))
        src.append(at)
    batch = dataclasses.replace(tree, input_ids=inputs, _index={}).to(device)
    return batch, labels.to(device), torch.cat(rows).to(device), torch.cat(cols).to(device), torch.cat(src).to(device)


def scatter_back(values: list, plan: PackPlan, dtype, device) -> torch.Tensor:
    """``(B, C)`` from ``values``: per chunk ``(per-position scores (1, T), rows, cols, src)`` or None; zeros where
    no completion token is (differentiable through the packed scores)."""
    out = torch.zeros(plan.batch, plan.width, dtype=dtype, device=device)
    for item in values:
        if item is None:
            continue
        scores, rows, cols, src = item
        out = out.index_put((rows, cols), scores[0].index_select(0, src).to(dtype))
    return out
