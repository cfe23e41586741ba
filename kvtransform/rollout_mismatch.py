"""The mismatch an RL trainer must absorb when rollouts are sampled with SpeContext sparse decode (arXiv 2512.00722)
and the policy is trained dense (``kvtransform rollout-mismatch``; docs/ROLLOUT_MISMATCH.md).

What is measured. For every prompt (the first ``prompt`` tokens of a real document, :mod:`kvtransform.textdata`),
retrieval head and budget, ``samples`` rollouts of ``max(lengths)`` tokens are **sampled from the sparse model** at
``temperature`` (1: the plain softmax). At every rollout token ``x_t``, with ``p_s`` / ``p_d`` the sparse / dense
next-token distributions given the same prefix ``prompt + x_<t`` (both at the same temperature):

* ``KL_t = KL(p_s ‖ p_d) = Σ_v p_s(v) (log p_s(v) − log p_d(v))``, exact over the whole vocabulary, in nats;
* ``w_t = p_d(x_t) / p_s(x_t)``, the per-token importance weight that makes sparse rollouts on-policy for the dense
  model in expectation (``E_{x~p_s}[w] = 1``); truncated importance sampling (TIS, as TRL applies to vLLM rollouts)
  uses ``min(w_t, C)``.

Statistics are per (head, budget, rollout length ``n``), pooled over prompts and samples, over the first ``n``
tokens of every rollout (a rollout of ``n`` tokens is distributed as the first ``n`` tokens of a longer one, so one
rollout of ``max(lengths)`` gives every length). Tokens after a rollout's first EOS are not counted (a trainer masks
them); the EOS itself is. The first token comes from the dense prefill, as in the runtime: ``KL_0 = 0``, ``w_0 = 1`` (up
to rounding), counted.

How the two distributions are obtained: an **emulation** of the SpeContext decode loop through
:mod:`kvtransform.attention_probe` (the probe of ``eval-sparse``), not the runtime's kernels.

* Sparse (:func:`decode_sparse`): one batched Hugging Face forward per decode step for every rollout of every
  (head, budget). Before the step, each head runs through its real interface (:meth:`RetrievalHead.step` on a
  :class:`KVCache` holding *this rollout's own* keys of every layer -- those the sparse decode itself computed, what
  the runtime's cache holds -- after ``set_current`` with the token being decoded; ``queries``: this rollout's own
  post-RoPE queries of the previous step, None at the first decode step, as in the runtime); every layer then
  attends only to the selection plus the token itself, and ``x_{t+1}`` is drawn from the resulting distribution
  (``torch.multinomial``; one generator per (head, budget) seeded with ``seed``: a head's rollouts do not depend on
  the others). Every head is thus emulated as the runtime runs it: unlike the
  teacher-forced ``eval-sparse`` emulation (:mod:`kvtransform.eval_sparse`), where ``quest`` and ``oracle`` score
  with the dense run's queries (teacher forcing has no sparse-run queries before its one forward), nothing here is
  borrowed from the dense run.
* Dense (:func:`score_dense`): each finished rollout teacher-forced through the dense model after its prompt
  (:class:`~kvtransform.eval_sparse.DocumentTeacher`), one forward per rollout.

Checks (tests/test_rollout_mismatch.py) and limits (attention in fp32 SDPA, ties at the budget's edge, the prompt
length used): docs/ROLLOUT_MISMATCH.md.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from .attention_probe import probing
from .eval_sparse import _as_list, markdown
from .runtime.cache import KVCache
from .utils import atomic_write, cache_kwarg, check_device, check_results_dir, is_count, rename_keys

__all__ = ["Rollouts", "token_kl_logw", "summarize_tokens", "sample_rollouts", "decode_sparse", "score_dense",
           "counted", "table", "RolloutMismatchConfig", "run_rollout_mismatch", "write_results", "TIS_CAP"]

TIS_CAP = 2.0  # the truncation level of the tis_* columns (TRL 1.16's default clip_max is 3: the w_gt3 column)


@dataclass
class Rollouts:
    """Per-token results of :func:`sample_rollouts` for ``n`` rollouts of ``N`` tokens.

    Attributes:
        rows: one dict per rollout (``head``, ``budget``, ``prompt`` index, ``sample`` index).
        tokens: int64 ``(n, N)`` the sampled ids; kl: fp64 ``(n, N)`` ``KL(p_s ‖ p_d)`` nats; logw: fp64 ``(n, N)``
            ``log w_t``. Only the first :attr:`steps` tokens are filled (a time limit may stop early).
        steps: tokens decoded per rollout (``<= N``).
        selections: with ``record``: per head config, per decode step, int32 ``(rows, H_kv, W)``; else None.
        sparse_logp: with ``record``: fp32 ``(n, N, vocab)`` the sparse log-probabilities; else None.
        seconds: wall time of the decode loop.
    """

    rows: list
    tokens: torch.Tensor
    kl: torch.Tensor
    logw: torch.Tensor
    steps: int
    selections: Optional[list] = None
    sparse_logp: Optional[torch.Tensor] = None
    seconds: float = 0.0


def token_kl_logw(logp_s: torch.Tensor, logp_d: torch.Tensor, tokens: torch.Tensor) -> tuple:
    """Per row ``KL(p_s ‖ p_d)`` and ``log w = log p_d(token) − log p_s(token)``.

    Args:
        logp_s, logp_d: ``(rows, vocab)`` log-probabilities (any float dtype; computed in fp64);
        tokens: int64 ``(rows,)``.

    Returns:
        ``(kl, logw)`` fp64 ``(rows,)``; ``kl`` is ``inf`` where ``p_d`` is 0 on a token ``p_s`` gives mass.
    """
    ls, ld = logp_s.double(), logp_d.double()
    p = ls.exp()
    kl = torch.where(p > 0, p * (ls - ld), torch.zeros_like(p)).sum(-1)
    idx = tokens.to(ls.device).long()[:, None]
    return kl, (ld.gather(1, idx) - ls.gather(1, idx))[:, 0]


def summarize_tokens(kl, logw, cap: float = TIS_CAP) -> dict:
    """The table's statistics over a set of tokens.

    Args:
        kl, logw: 1-D float arrays (tensors or numpy) of equal length ``>= 1``: ``KL_t`` (nats) and ``log w_t``.
        cap: the TIS truncation level ``C``.

    Returns:
        ``tokens``; ``kl_mean``, ``kl_p50``, ``kl_p90``, ``kl_p99``, ``kl_max`` (nats); ``w_p1``, ``w_p5``,
        ``w_p50``, ``w_p95``, ``w_p99``, ``w_mean`` (should be near 1); ``w_out`` (share of tokens with ``w``
        outside ``[0.5, 2]``); ``tis_clipped`` (share with ``w > cap``, the tokens TIS truncates) and ``tis_mass``
        (share of ``Σ w`` that truncation removes, ``Σ (w − min(w, cap)) / Σ w``); ``w_gt3`` (share with ``w > 3``,
        TRL's default ``vllm_importance_sampling_clip_max``).

    Raises:
        ValueError: empty or mismatched inputs.
    """
    kl = np.asarray(kl, dtype=np.float64).ravel()
    lw = np.asarray(logw, dtype=np.float64).ravel()
    if kl.size == 0 or kl.size != lw.size:
        raise ValueError(f"kl and logw must be non-empty and of equal length; got {kl.size} and {lw.size}")
    w = np.exp(lw)
    kq = np.quantile(kl, [0.5, 0.9, 0.99])
    wq = np.quantile(w, [0.01, 0.05, 0.5, 0.95, 0.99])
    clipped = w - np.minimum(w, cap)
    return {"tokens": int(kl.size), "kl_mean": float(kl.mean()), "kl_p50": float(kq[0]), "kl_p90": float(kq[1]),
            "kl_p99": float(kq[2]), "kl_max": float(kl.max()), "w_p1": float(wq[0]), "w_p5": float(wq[1]),
            "w_p50": float(wq[2]), "w_p95": float(wq[3]), "w_p99": float(wq[4]), "w_mean": float(w.mean()),
            "w_out": float(((w < 0.5) | (w > 2.0)).mean()), "tis_clipped": float((w > cap).mean()),
            "tis_mass": float(clipped.sum() / w.sum()), "w_gt3": float((w > 3.0).mean())}


def _check_model(model) -> None:
    types = getattr(model.config, "layer_types", None) or []
    if any(t != "full_attention" for t in types):
        raise ValueError("rollout-mismatch needs full-attention layers only (the sparse decode emulation has no "
                         f"sliding-window layers); this model has {sorted(set(types))}")


def _keep(sel: torch.Tensor, pos: int) -> torch.Tensor:
    """bool ``(rows, H_kv, pos + 1)``: the selected positions (``-1`` ignored) and the current one, ``pos``."""
    rows, h_kv, _ = sel.shape
    keep = torch.zeros(rows, h_kv, pos + 2, dtype=torch.bool, device=sel.device)
    keep.scatter_(2, (sel.long() + 1).clamp(min=0), True)
    keep = keep[..., 1:]
    keep[..., pos] = True
    return keep


@torch.no_grad()
def sample_rollouts(model, prompts: torch.Tensor, heads: Sequence[tuple], n_tokens: int, *, samples: int = 1,
                    temperature: float = 1.0, seed: int = 0, retrieval: str = "self", num_sink: int = 0,
                    deadline: Optional[float] = None, record: bool = False, progress: bool = False) -> Rollouts:
    """Sample sparse rollouts (:func:`decode_sparse`), then score every token against the dense model
    (:func:`score_dense`); the module docstring says how.

    Args:
        model: a Hugging Face causal LM with full attention through transformers' attention interface (fp32
            recommended), on the device to run on.
        prompts: int64 ``(prompts, P)`` (every prompt the same length ``P``).
        heads: ``(head name, budget)`` pairs; each gets ``prompts × samples`` rollouts, rows ordered by head pair,
            then prompt, then sample.
        n_tokens: tokens per rollout (``>= 1``).
        samples: rollouts per prompt and head; temperature: ``> 0``; seed: of the sampling generator.
        retrieval, num_sink: ``SpeContextConfig.retrieval`` / ``num_sink`` of every head.
        deadline: ``time.perf_counter()`` value after which decoding stops (:attr:`Rollouts.steps` says where).
        record: keep every step's selections and the sparse log-probabilities in the result (tests).

    Memory: fp32 ``rollouts × n_tokens × vocab`` sparse log-probabilities wait on the device until scored.

    Raises:
        ValueError: an unknown head, a bad setting, prompt + rollout beyond the model's positions (one line naming
            the fix).
    """
    _check_model(model)
    if prompts.dim() != 2 or prompts.shape[1] < 1:
        raise ValueError(f"prompts must be int64 (prompts, P) with P >= 1; got {tuple(prompts.shape)}")
    if n_tokens < 1 or samples < 1 or not temperature > 0:
        raise ValueError(f"need n_tokens >= 1, samples >= 1, temperature > 0; got {n_tokens}, {samples}, "
                         f"{temperature}")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and prompts.shape[1] + n_tokens > limit:
        raise ValueError(f"prompt {prompts.shape[1]} + rollout {n_tokens} tokens exceed the model's {limit} positions: "
                         f"use a shorter prompt or shorter lengths")
    t0 = time.perf_counter()
    r, lp = decode_sparse(model, prompts, heads, n_tokens, samples, temperature, seed, retrieval, num_sink,
                          deadline, record, progress)
    score_dense(model, prompts, r, lp, temperature)
    r.sparse_logp = lp.cpu() if record else None
    r.seconds = time.perf_counter() - t0
    return r


def decode_sparse(model, prompts, heads, n_tokens, samples, temperature, seed, retrieval, num_sink, deadline,
                  record, progress) -> tuple:
    """The sampling half of :func:`sample_rollouts` (same arguments): one batched sparse decode step per token.

    Returns:
        ``(Rollouts with tokens, rows, steps and (record) selections; kl/logw still 0, sparse log-probabilities
        fp32 (rollouts, n_tokens, vocab) on the model's device)``.
    """
    import inspect

    from transformers import DynamicCache

    from .config import SpeContextConfig, retrieval_for
    from .runtime.heads import make_head

    dev = next(model.parameters()).device
    n_p, P = prompts.shape
    B = n_p * samples                                                    # rollouts per head pair
    n = len(heads) * B
    rp = (torch.arange(B) // samples).to(dev)                            # prompt of each row of a head pair
    params = inspect.signature(model.forward).parameters
    kw = cache_kwarg(model)
    last = {"logits_to_keep": 1} if "logits_to_keep" in params else {}   # the prompt's last logits only
    cache = DynamicCache(config=model.config)
    with probing(model) as probe:
        probe.capture = True
        probe.q_positions = torch.tensor([P - 1], device=dev)
        out = model(input_ids=prompts.to(dev), use_cache=True, **{kw: cache}, **last)
        L = len(probe.k)
        keys = torch.stack([probe.k[l] for l in range(L)])                  # (L, n_p, H_kv, P, D)
        h_kv, scale = keys.shape[2], probe.scale[0]
    cache.batch_select_indices(rp.repeat(len(heads)))
    built = []
    for name, budget in heads:
        hcfg = SpeContextConfig(head=name, budget=int(budget), retrieval=retrieval_for(name, retrieval),
                                num_sink=num_sink)
        head = make_head(name, hcfg, scale)
        try:
            head.bind(model)
        except ValueError as e:  # the fix as this command's keys spell it (retrieval=, not transform.retrieval=)
            raise ValueError(rename_keys(str(e), {"retrieval": "retrieval"})) from None
        k = keys.new_zeros(L, B, h_kv, P + n_tokens, keys.shape[4])     # this pair's rollouts' own keys
        k[:, :, :, :P] = keys[:, rp]
        ids = torch.zeros(B, P + n_tokens, dtype=torch.long, device=dev)
        ids[:, :P] = prompts.to(dev)[rp]
        kv = KVCache(k, k, torch.full((B,), P, dtype=torch.int32, device=dev), ids)
        head.prefill(kv, n_tokens)
        built.append([head, kv, None])                                   # head, its cache, previous queries
    del keys
    # one generator per (head, budget) seeded with seed: every head draws the same random numbers (a paired comparison)
    gens = [torch.Generator(device=dev).manual_seed(int(seed)) for _ in heads]
    draw = lambda lp: torch.cat([torch.multinomial(b.exp(), 1, generator=g)[:, 0]  # noqa: E731
                                 for b, g in zip(lp.chunk(len(gens)), gens)])
    lp = (out.logits[:, -1].float() / temperature).log_softmax(-1)[rp.repeat(len(heads))]
    sparse_lp = torch.empty(n, n_tokens, lp.shape[-1], dtype=torch.float32, device=dev)
    sparse_lp[:, 0] = lp
    tok = draw(lp)
    tokens = torch.zeros(n, n_tokens, dtype=torch.long, device=dev)
    tokens[:, 0] = tok
    sels = [[] for _ in heads] if record else None
    steps = range(1, n_tokens)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc="rollout-mismatch", unit="tok")
    done = 1
    with probing(model) as probe:
        probe.capture = True
        for t in steps:
            if deadline is not None and time.perf_counter() > deadline:
                break
            pos = P + t - 1                                              # position of the token fed now
            keep = torch.empty(n, h_kv, 1, pos + 1, dtype=torch.bool, device=dev)
            for c, (head, kv, q) in enumerate(built):
                kv.cache_seqlens.fill_(pos)
                kv.set_current(tok[c * B:(c + 1) * B])
                sel = head.step(kv, q)
                keep[c * B:(c + 1) * B, :, 0] = _keep(sel, pos)
                if record:
                    sels[c].append(sel.cpu())
            probe.keep = keep
            out = model(input_ids=tok[:, None], use_cache=True, **{kw: cache})
            k_new = torch.stack([probe.k[l][:, :, -1] for l in range(L)])     # (L, n, H_kv, D)
            q_new = torch.stack([probe.q[l][:, :, 0] for l in range(L)])      # (L, n, H, D)
            for c, b in enumerate(built):
                b[1].append(k_new[:, c * B:(c + 1) * B], k_new[:, c * B:(c + 1) * B])
                b[2] = q_new[:, c * B:(c + 1) * B]
            lp = (out.logits[:, -1].float() / temperature).log_softmax(-1)
            sparse_lp[:, t] = lp
            tok = draw(lp)
            tokens[:, t] = tok
            done = t + 1
    for head, _, _ in built:
        head.release()
    del cache, built
    rows = [{"head": name, "budget": int(budget), "prompt": int(rp[i]), "sample": int(i % samples)}
            for name, budget in heads for i in range(B)]
    z = torch.zeros(n, n_tokens, dtype=torch.float64)
    return Rollouts(rows, tokens.cpu(), z, z.clone(), done, sels), sparse_lp


def score_dense(model, prompts: torch.Tensor, r: Rollouts, sparse_lp: torch.Tensor, temperature: float) -> None:
    """Fill ``r.kl`` and ``r.logw`` (first ``r.steps`` tokens): each rollout teacher-forced through the dense model
    after its prompt (:class:`~kvtransform.eval_sparse.DocumentTeacher`, one prompt prefill shared by its rows),
    against ``sparse_lp`` fp32 ``(rollouts, N, vocab)``. Both at ``temperature`` (a log-softmax is shift-invariant,
    so ``log_softmax(logp / T)`` is the tempered distribution)."""
    from .eval_sparse import DocumentTeacher

    dev = sparse_lp.device
    m = r.steps
    for p in sorted({row["prompt"] for row in r.rows}):
        teacher = DocumentTeacher(model, prompts[p].to(dev))
        first = (teacher.last_logits / temperature).log_softmax(-1)
        for i in [i for i, row in enumerate(r.rows) if row["prompt"] == p]:
            roll = r.tokens[i, :m].to(dev)
            dense = teacher.trace(roll[:-1]).logp if m > 1 else first[None][:0]
            dense = torch.cat([first[None], (dense / temperature).log_softmax(-1)])  # (m, vocab)
            for lo in range(0, m, 1024):                                   # fp64 temporaries of 1024 tokens
                hi = min(lo + 1024, m)  # a decode stopped by max_seconds: sparse_lp holds more steps than m
                kl, logw = token_kl_logw(sparse_lp[i, lo:hi], dense[lo:hi], roll[lo:hi])
                r.kl[i, lo:hi], r.logw[i, lo:hi] = kl.cpu(), logw.cpu()


# ---- the rollout-mismatch job --------------------------------------------------------------------------------------

@dataclass
class RolloutMismatchConfig:
    """``kvtransform rollout-mismatch`` settings (Hydra structured config).

    Attributes:
        head: a head name or a list; budget: tokens per KV head, an integer or a list (every pair is run).
        lengths: rollout lengths reported (tokens); rollouts are ``max(lengths)`` long, each length's statistics
            over their first ``n`` tokens.
        prompt: prompt tokens (the first ``prompt`` tokens of each document).
        documents: one prompt per document, paths relative to the standard library (default: ``argparse.py``,
            code and docstrings, and ``LICENSE.txt``, legal English; the distilled head never trained on either,
            :data:`kvtransform.textdata.TRAIN_FILES`, and both ship with every CPython build, where some Linux
            distributions' Python lacks ``idlelib/NEWS2x.txt``).
        samples: rollouts per prompt and (head, budget); temperature: of both distributions (1: plain softmax);
            seed: of the sampling generator.
        retrieval, num_sink: ``SpeContextConfig.retrieval`` (``self``: the packaged distilled head) / ``num_sink``.
        device: ``cpu`` or ``cuda``; max_seconds: stop decoding after this many seconds (0: never; the table's
            ``reached`` column says how far rollouts got); threads: torch CPU threads (0: default).
        out: directory of ``results.csv``, ``results.md`` and ``tokens.pt`` (per-token KL / log w / ids).
    """

    model: Any = None
    head: Any = field(default_factory=lambda: ["distilled", "quest", "self"])
    budget: Any = field(default_factory=lambda: [256, 512, 1024, 2048])
    lengths: Any = field(default_factory=lambda: [1024, 2048, 4096])
    prompt: int = 1024
    documents: list = field(default_factory=lambda: ["argparse.py", "LICENSE.txt"])
    samples: int = 1
    temperature: float = 1.0
    seed: int = 0
    retrieval: str = "self"
    num_sink: int = 0
    device: str = "cpu"
    max_seconds: float = 0.0
    threads: int = 0
    out: str = "outputs/rollout-mismatch"


def check_config(cfg) -> tuple:
    """The settings of ``cfg`` checked, without the model or ``out`` (also each job of a ``-m`` sweep, before the
    first runs): ``(heads, budgets, sorted lengths)``, each without repeats (a head or budget given twice would
    sample twice and pool both runs into one row).

    Raises:
        ValueError: one line naming the bad key (``retrieval``: :func:`~kvtransform.config.check_retrieval`,
            FileNotFoundError for a missing directory).
    """
    from .config import check_retrieval
    from .runtime.heads import HEADS

    heads = list(dict.fromkeys(_as_list(cfg.head, str, "head")))
    budgets = list(dict.fromkeys(_as_list(cfg.budget, int, "budget")))
    lengths = _as_list(cfg.lengths, int, "lengths")
    unknown = [h for h in heads if h not in HEADS]
    if unknown:
        raise ValueError(f"unknown retrieval head {unknown[0]!r}; choose from {sorted(HEADS)}")
    if min(budgets) < 1 or min(lengths) < 1:
        raise ValueError(f"budget and lengths must be integers >= 1; got budget={budgets} lengths={lengths}")
    for key in ("prompt", "samples", "threads", "seed"):
        v, lo = getattr(cfg, key), 1 if key in ("prompt", "samples") else 0
        if not is_count(v, lo) or (key == "seed" and v >= 2 ** 63):
            raise ValueError(f"{key} must be an integer >= {lo}{' and < 2**63' if key == 'seed' else ''}; got {v!r}")
    if not 0 < float(cfg.temperature) < math.inf or not float(cfg.max_seconds) >= 0:
        raise ValueError(f"temperature must be a finite number > 0 (inf makes both distributions uniform) and "
                         f"max_seconds one >= 0; got {cfg.temperature}, {cfg.max_seconds}")
    ns = cfg.num_sink
    if not is_count(ns, 0, min(budgets)):
        raise ValueError(f"num_sink must be an integer in [0, smallest budget {min(budgets)}]; got {ns!r}")
    check_device(cfg.device)
    check_retrieval(heads, cfg.retrieval)
    return heads, budgets, sorted(set(lengths))


#: decoded tokens above which a CPU run is told it is GPU-sized (the CPU example of docs/ROLLOUT_MISMATCH.md decodes
#: 4 x 256 tokens in ~2 minutes on 2 cores; the default grid decodes 24 x 4096)
CPU_TOKENS_HINT = 16384


def run_rollout_mismatch(cfg, model=None, tokenizer=None, log=print):
    """Run every (head, budget) of ``cfg`` on one prompt per document; write ``results.csv``, ``results.md`` and
    ``tokens.pt`` to ``cfg.out``. Returns the pandas DataFrame of the table.

    Raises:
        ValueError: a bad setting, an ``out`` that cannot be written, a document shorter than ``prompt`` tokens.
        FileNotFoundError: a document missing from this Python installation.
    """
    from .textdata import stdlib_path, token_chunks

    heads, budgets, lengths = check_config(cfg)
    check_results_dir(cfg.out)
    docs = _as_list(cfg.documents, str, "documents")
    for d in docs:  # fail before the model loads
        stdlib_path(d)
    check_device(cfg.device, available=True)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    name = cfg.model.name if hasattr(cfg.model, "name") else str(cfg.model)
    dtype = str(getattr(cfg.model, "dtype", "float32"))
    if model is None:
        from .models import load_model

        model, tokenizer = load_model(name, dtype=dtype)
    model = model.to(cfg.device).eval()
    prompts = torch.stack([token_chunks(tokenizer, d, int(cfg.prompt), 1)[0] for d in docs])
    t0 = time.perf_counter()
    deadline = t0 + float(cfg.max_seconds) if cfg.max_seconds else None
    pairs = [(h, b) for h in heads for b in budgets]
    log(f"rollout-mismatch: {len(pairs)} (head, budget) x {len(docs)} prompts x {cfg.samples} samples, "
        f"{lengths[-1]} tokens each, prompt {cfg.prompt}, {cfg.device}")
    decoded = len(pairs) * len(docs) * int(cfg.samples) * lengths[-1]
    if str(cfg.device) == "cpu" and decoded > CPU_TOKENS_HINT and not cfg.max_seconds:
        log(f"rollout-mismatch: {decoded} decoded tokens is a GPU-sized grid (hours on a CPU); a CPU-sized one: "
            f"'budget=[64,128]' 'lengths=[128,256]' prompt=512, or max_seconds=N (docs/ROLLOUT_MISMATCH.md)")
    r = sample_rollouts(model, prompts, pairs, lengths[-1], samples=int(cfg.samples),
                        temperature=float(cfg.temperature), seed=int(cfg.seed), retrieval=str(cfg.retrieval),
                        num_sink=int(cfg.num_sink), deadline=deadline, progress=True)
    eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
    df = table(r, lengths, eos, model=name, prompt=int(cfg.prompt), dtype=dtype, device=str(cfg.device),
               temperature=float(cfg.temperature))
    meta = {"command": "kvtransform rollout-mismatch", "seconds": round(time.perf_counter() - t0, 1),
            "documents": docs}
    write_results(df, r, cfg.out, meta)
    return df


def counted(r: Rollouts, eos) -> torch.Tensor:
    """bool ``(n, N)``: the tokens a trainer scores: decoded (``< steps``) and not after the rollout's first EOS."""
    n, N = r.tokens.shape
    mask = (torch.arange(N)[None, :] < r.steps).expand(n, N).clone()
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if eos:
        hit = torch.isin(r.tokens, torch.tensor(eos)) & mask
        first = torch.where(hit.any(1), hit.float().argmax(1), torch.full((n,), N))
        mask &= torch.arange(N)[None, :] <= first[:, None]
    return mask


def table(r: Rollouts, lengths: Sequence[int], eos=None, **settings):
    """One row per (head, budget, length) of :func:`summarize_tokens` over every rollout's counted tokens among its
    first ``length``; ``reached``: tokens decoded per rollout, ``ended``: rollouts that hit EOS before ``length``;
    ``seq_logw``: mean over rollouts of ``Σ_t log w_t`` (the log of a sequence-level weight)."""
    import pandas as pd

    mask = counted(r, eos)
    out = []
    keys = list(dict.fromkeys((row["head"], row["budget"]) for row in r.rows))
    for head, budget in keys:
        idx = [i for i, row in enumerate(r.rows) if (row["head"], row["budget"]) == (head, budget)]
        for n in lengths:
            m = mask[idx, :n]
            s = summarize_tokens(r.kl[idx, :n][m], r.logw[idx, :n][m])
            ended = int((m.sum(1) < min(n, r.steps)).sum())
            seq = float((r.logw[idx, :n] * m).sum(1).mean())
            out.append({**settings, "head": head, "budget": budget, "length": n, "reached": min(n, r.steps),
                        "rollouts": len(idx), "ended": ended, **s, "seq_logw": seq})
    return pd.DataFrame(out)


def write_results(df, r: Rollouts, out, meta: dict) -> None:
    """``results.csv`` (the table), ``results.md`` (the same as markdown, with the run's settings) and
    ``tokens.pt`` (``tokens``, ``kl``, ``logw``, ``rows``, ``steps``) into ``out`` (replaced), each atomically
    (:func:`kvtransform.utils.atomic_write`: a run killed meanwhile leaves the earlier file, never a part)."""
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    with atomic_write(out / "results.csv") as tmp:
        df.to_csv(tmp, index=False)
    cols = ["head", "budget", "length", "reached", "tokens", "kl_mean", "kl_p50", "kl_p90", "kl_p99", "kl_max",
            "w_p1", "w_p5", "w_p50", "w_p95", "w_p99", "w_out", "tis_clipped", "tis_mass", "w_gt3", "w_mean",
            "seq_logw", "ended"]
    first = df.iloc[0]
    head = (f"model {first['model']} ({first['dtype']}, {first['device']}), prompt {first['prompt']} tokens, "
            f"temperature {first['temperature']}, {int(first['rollouts'])} rollouts per (head, budget); "
            f"{meta.get('seconds', '?')} s; documents {', '.join(meta.get('documents', []))}\n\n")
    with atomic_write(out / "results.md") as tmp:
        tmp.write_text(head + markdown(df[[c for c in cols if c in df.columns]]) + "\n")
    with atomic_write(out / "tokens.pt") as tmp:
        torch.save({"tokens": r.tokens, "kl": r.kl, "logw": r.logw, "rows": r.rows, "steps": r.steps, **meta}, tmp)
