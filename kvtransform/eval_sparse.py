"""Accuracy of sparse retrieval decode on real text (SpeContext, arXiv 2512.00722 §4.3, §6; ``kvtransform
eval-sparse``).

For each document (``prefix`` tokens of real text, then ``continuation`` more) and each (head, budget):

* **recall** -- the yardstick of every head: at each decode position ``t`` of the continuation the teacher is the
  model's own attention (dense, fp32 softmax of the post-RoPE queries over positions ``[0, t]``); for every layer
  and query head the share of its attention mass over the cached tokens ``[0, t)`` that the selection of its KV
  head captures (:func:`recall_per_layer`), averaged over query heads and positions. Reported: the mean over layers
  and the worst layer. (The group-max over the GQA group is what the heads rank by, as ``kvt::retrieval_topk``
  does; recall is counted per query head, which is what the sparse attention actually loses.)
* **NLL increase** -- the continuation's true next tokens, teacher-forced: mean ``-log p`` with every decode step
  attending only to the head's selection (plus the token itself) minus the dense value, nats/token;
* **greedy agreement** -- the dense model's greedy continuation (``generate`` tokens, the first one from the dense
  prefill), teacher-forced through the sparse model: the share of steps whose argmax equals dense's next token.

How the sparse decode is emulated (:mod:`kvtransform.attention_probe`): the prefix is run once (dense) into a
Hugging Face cache; the continuation is then one forward whose every query row is masked to its step's selection,
exactly teacher-forced sparse decoding (later tokens attend to K/V that were themselves computed sparsely). Heads
run through their real interface (:meth:`RetrievalHead.step` on a :class:`KVCache` holding the model's keys),
one step per position. Heads that score with the previous step's queries (``oracle``, ``quest``) get the dense
run's queries and keys (the teacher-forced emulation has no sparse-run queries before the forward); the others
(``recent``, ``self``, ``distilled``, ``eagle3``) depend only on token ids and are exact.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .attention_probe import cache_probs, probing
from .runtime.cache import KVCache
from .eval_results import markdown, read_results, summarize, write_results
from .utils import cache_kwarg, is_count, rename_keys

__all__ = ["Trace", "DocumentTeacher", "run_head", "keep_mask", "recall_per_layer", "nll",
           "evaluate_head", "EvalSparseConfig", "run_eval", "read_results", "write_results", "summarize",
           "markdown"]  # (the last four: the results table, kvtransform.eval_results)


@dataclass
class Trace:
    """A dense teacher-forced pass over ``ids[prefix:]`` after ``ids[:prefix]``.

    Attributes:
        ids: int64 ``(T,)``; prefix: P.
        q: fp32 ``(L, H, N + 1, D)`` post-RoPE queries at positions ``P-1 .. T-1`` (N = T - P).
        k: fp32 ``(L, H_kv, T, D)`` post-RoPE keys.
        scale: softmax scale per layer.
        logp: fp32 ``(N, vocab)`` dense log-probabilities at positions ``P .. T-1``.
    """

    ids: torch.Tensor
    prefix: int
    q: torch.Tensor
    k: torch.Tensor
    scale: list
    logp: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.ids.numel()) - self.prefix


class DocumentTeacher:
    """The dense prefix of one document in a Hugging Face cache, and the dense traces of continuations after it.

    Args:
        model: a Hugging Face causal LM (its attention goes through transformers' attention interface).
        prefix_ids: int64 ``(P,)``.
    """

    @torch.no_grad()
    def __init__(self, model, prefix_ids: torch.Tensor):
        from transformers import DynamicCache

        self.model = model
        self.prefix_ids = prefix_ids
        self.cache_kw = cache_kwarg(model)
        self.P = int(prefix_ids.numel())
        self.cache = DynamicCache(config=model.config)
        dev = next(model.parameters()).device
        with probing(model) as probe:
            probe.capture = True
            probe.q_positions = torch.tensor([self.P - 1], device=dev)
            out = model(input_ids=prefix_ids[None].to(dev), use_cache=True, **{self.cache_kw: self.cache})
        L = len(probe.k)
        self.q_last = torch.stack([probe.q[l][0] for l in range(L)])      # (L, H, 1, D)
        self.last_logits = out.logits[0, -1].float()

    def _forward(self, ids: torch.Tensor, keep: Optional[torch.Tensor], capture: bool):
        dev = next(self.model.parameters()).device
        with probing(self.model) as probe:
            probe.capture, probe.keep = capture, keep
            out = self.model(input_ids=ids[None].to(dev), use_cache=True, **{self.cache_kw: self.cache})
        self._crop()
        return out.logits[0].float().log_softmax(-1), probe

    def _crop(self):
        extra = self.cache.get_seq_length() - self.P
        if extra > 0:
            self.cache.crop(-extra)

    @torch.no_grad()
    def trace(self, cont: torch.Tensor) -> Trace:
        """The dense trace of ``cont`` (int64 ``(N,)``) after the prefix."""
        logp, probe = self._forward(cont, None, True)
        L = len(probe.k)
        q = torch.cat([self.q_last, torch.stack([probe.q[l][0] for l in range(L)])], dim=2)
        k = torch.stack([probe.k[l][0] for l in range(L)])
        return Trace(torch.cat([self.prefix_ids, cont.to(self.prefix_ids.device)]), self.P, q, k,
                     [probe.scale[l] for l in range(L)], logp)

    @torch.no_grad()
    def greedy(self, n: int) -> torch.Tensor:
        """The dense greedy continuation of ``n`` tokens (the first from the prefix's last logits), int64."""
        dev = next(self.model.parameters()).device
        toks = [int(self.last_logits.argmax())]
        with probing(self.model):
            for _ in range(n - 1):
                out = self.model(input_ids=torch.tensor([[toks[-1]]], device=dev), use_cache=True,
                                 **{self.cache_kw: self.cache})
                toks.append(int(out.logits[0, -1].argmax()))
        self._crop()
        return torch.tensor(toks, dtype=torch.long)

    @torch.no_grad()
    def sparse_logp(self, cont: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Log-probabilities ``(N, vocab)`` of ``cont`` decoded with every step attending only to ``keep``
        (bool ``(1, H_kv, N, P + N)``, :func:`keep_mask`)."""
        return self._forward(cont, keep, False)[0]


@torch.no_grad()
def run_head(head, trace: Trace, dtype=torch.float32) -> tuple[torch.Tensor, float]:
    """The head's selections for every decode position of ``trace``, through its real interface.

    Returns:
        ``(indices int32 (N, H_kv, W), ms per step)``.
    """
    L, h_kv, T, D = trace.k.shape
    k = trace.k[:, None].to(dtype)
    cache = KVCache(k, k, torch.tensor([trace.prefix], dtype=torch.int32), trace.ids[None].clone())
    head.prefill(cache)
    sels = []
    t0 = time.perf_counter()
    for i in range(trace.n):
        cache.cache_seqlens.fill_(trace.prefix + i)
        cache.set_current(trace.ids[trace.prefix + i:trace.prefix + i + 1])
        sels.append(head.step(cache, trace.q[:, None, :, i].to(dtype))[0])
    ms = 1000 * (time.perf_counter() - t0) / max(trace.n, 1)
    return torch.stack(sels), ms


def keep_mask(indices: torch.Tensor, prefix: int, total: int) -> torch.Tensor:
    """bool ``(1, H_kv, N, total)``: step ``i`` (position ``prefix + i``) attends the selected cache positions of
    ``indices`` ``(N, H_kv, W)`` (``-1`` ignored) and itself."""
    n, h_kv, _ = indices.shape
    keep = torch.zeros(n, h_kv, total + 1, dtype=torch.bool)
    keep.scatter_(2, (indices.long() + 1).clamp(min=0).permute(0, 1, 2), True)
    keep = keep[..., 1:]
    i = torch.arange(n)
    keep[i, :, prefix + i] = True
    return keep.permute(1, 0, 2)[None].contiguous()


@torch.no_grad()
def recall_per_layer(trace: Trace, keep: torch.Tensor) -> torch.Tensor:
    """Per layer, the share of the dense attention mass over the cache captured by the selection.

    Args:
        trace: the dense teacher; keep: :func:`keep_mask` of the selections (the token's own position is ignored:
            it is always attended and not part of the cache).

    Returns:
        fp64 ``(L,)``: mean over query heads and decode positions of ``Σ_{j∈sel} p_j / Σ_{j<t} p_j``.
    """
    L, h, _, _ = trace.q.shape
    h_kv = trace.k.shape[1]
    t = trace.prefix + torch.arange(trace.n)
    sel = keep[0].repeat_interleave(h // h_kv, dim=0).float()                # (H, N, T)
    out = torch.empty(L, dtype=torch.float64)
    for l in range(L):
        p = cache_probs(trace.q[l, :, 1:], trace.k[l], t, trace.scale[l])      # (H, N, T), 0 at/after t
        out[l] = ((p * sel).sum(-1) / p.sum(-1).clamp(min=1e-30)).double().mean()
    return out


def nll(logp: torch.Tensor, cont: torch.Tensor) -> torch.Tensor:
    """Per-step ``-log p(cont[i+1])`` fp64 ``(N-1,)`` from ``logp`` ``(N, vocab)``."""
    return -logp[:-1].gather(1, cont[1:, None].to(logp.device))[:, 0].double()


@torch.no_grad()
def evaluate_head(teacher: DocumentTeacher, head, trace: Trace, greedy_trace: Trace) -> dict:
    """Recall, NLL increase and greedy agreement of ``head`` on one document (the module docstring).

    Returns:
        ``recall_mean``, ``recall_worst``, ``worst_layer``, ``nll_dense``, ``nll_sparse``, ``nll_increase``
        (nats/token), ``agreement`` (share of the greedy steps), ``steps``, ``select_ms`` (ms per head step).
    """
    sel, ms = run_head(head, trace)
    keep = keep_mask(sel, trace.prefix, trace.ids.numel())
    rec = recall_per_layer(trace, keep)
    cont = trace.ids[trace.prefix:]
    d, s = nll(trace.logp, cont), nll(teacher.sparse_logp(cont, keep), cont)
    gsel, _ = run_head(head, greedy_trace)
    g = greedy_trace.ids[greedy_trace.prefix:]
    glogp = teacher.sparse_logp(g, keep_mask(gsel, greedy_trace.prefix, greedy_trace.ids.numel()))
    agree = float((glogp[:-1].argmax(-1).cpu() == g[1:]).double().mean())
    return {"recall_mean": float(rec.mean()), "recall_worst": float(rec.min()), "worst_layer": int(rec.argmin()),
            "nll_dense": float(d.mean()), "nll_sparse": float(s.mean()), "nll_increase": float((s - d).mean()),
            "agreement": agree, "steps": int(g.numel() - 1), "select_ms": ms,
            "recall_layers": [round(float(x), 4) for x in rec]}


# ---- the eval-sparse job -------------------------------------------------------------------------------------------

DEFAULT_HEADS = ("oracle", "quest", "recent", "self", "distilled")


@dataclass
class EvalSparseConfig:
    """``kvtransform eval-sparse`` settings (Hydra structured config; ``-m head=a,b budget=x,y`` sweeps).

    Attributes:
        head: a head name or a list of them; budget: tokens per KV head, an integer or a list.
        documents: evaluation files, relative to the standard library (never used for training:
            :data:`kvtransform.textdata.EVAL_FILES`).
        prefix: prompt tokens per document (the cache the heads choose from); continuation: teacher-forced true
            tokens after it (NLL); generate: dense greedy tokens (agreement).
        retrieval: ``SpeContextConfig.retrieval`` for trained heads (``self``: the packaged head).
        num_sink: ``SpeContextConfig.num_sink`` of every head (0, the runtime's default; ``self``, ``distilled``
            and ``eagle3`` keep 4 sink tokens on their own).
        out: directory of ``results.csv``, ``results.md``, ``results.png`` (rows of earlier runs with other
            heads/budgets are kept, the same (document, head, budget) replaced; a damaged ``results.csv`` is refused
            before the model loads, :func:`read_results`).
        threads: torch CPU threads (0: default).

    The defaults (2 documents, 4096 + 256 tokens, 128 greedy tokens, 5 heads × 2 budgets) fit in ≈ 15 minutes on
    2 shared CPU cores; the acceptance table (3 documents, continuation=512 generate=256) takes ≈ 40 minutes
    there (``oracle`` dominates: it scores all 30 layers every step).
    """

    model: Any = None
    head: Any = field(default_factory=lambda: list(DEFAULT_HEADS))
    budget: Any = field(default_factory=lambda: [1024, 2048])
    documents: list = field(default_factory=lambda: ["argparse.py", "idlelib/NEWS2x.txt"])
    prefix: int = 4096
    continuation: int = 256
    generate: int = 128
    retrieval: str = "self"
    num_sink: int = 0
    out: str = "outputs/eval-sparse"
    threads: int = 0


_TEACHERS: dict = {}  # (model id, document, prefix, continuation, generate) -> (teacher, trace, greedy trace)


def _as_list(v, kind, what) -> list:
    from omegaconf import ListConfig

    items = list(v) if isinstance(v, (list, tuple, ListConfig)) else [v]
    if not items or not all(isinstance(x, kind) and not isinstance(x, bool) for x in items):
        raise ValueError(f"{what} must be {'an integer' if kind is int else 'a name'} or a list of them; got {v!r}")
    return items


def _teacher(model, tok, doc: str, cfg) -> tuple:
    from .textdata import token_chunks

    key = (id(model), doc, cfg.prefix, cfg.continuation, cfg.generate)
    if key not in _TEACHERS:
        ids = token_chunks(tok, doc, cfg.prefix + cfg.continuation, 1)[0]
        teacher = DocumentTeacher(model, ids[:cfg.prefix])
        trace = teacher.trace(ids[cfg.prefix:])
        greedy = teacher.trace(teacher.greedy(cfg.generate))
        _TEACHERS[key] = (teacher, trace, greedy)
    return _TEACHERS[key]


def check_config(cfg) -> tuple:
    """The settings of ``cfg`` checked, without the model or ``out`` (also each job of a ``-m`` sweep, before the
    first runs): ``(heads, budgets, documents)``.

    Raises:
        ValueError: an unknown head, a bad budget, length, ``num_sink``, ``threads`` or ``model.dtype`` (the message
            names the key), a ``retrieval`` directory that no head reads (:func:`~kvtransform.config.check_retrieval`).
        FileNotFoundError: a document missing from this Python installation, a ``retrieval`` directory that does not
            exist.
    """
    from .runtime.heads import HEADS

    heads = list(dict.fromkeys(_as_list(cfg.head, str, "head")))  # a repeat runs once (it would be pooled twice)
    budgets = list(dict.fromkeys(_as_list(cfg.budget, int, "budget")))
    unknown = [h for h in heads if h not in HEADS]
    if unknown:
        raise ValueError(f"unknown retrieval head {unknown[0]!r}; choose from {sorted(HEADS)}")
    for key in ("prefix", "continuation", "generate"):
        v = getattr(cfg, key)
        if not is_count(v, 2):
            raise ValueError(f"{key} must be an integer >= 2 tokens; got {v!r}")
    if any(b < 1 for b in budgets):
        raise ValueError(f"budget must be >= 1 token per KV head; got {min(budgets)}")
    ns = cfg.num_sink
    if not is_count(ns, 0, min(budgets)):
        raise ValueError(f"num_sink must be an integer in [0, smallest budget {min(budgets)}]; got {ns!r}")
    if not is_count(cfg.threads, 0):
        raise ValueError(f"threads must be an integer >= 0 (0: torch's default); got {cfg.threads!r}")
    from .config import check_retrieval

    check_retrieval(heads, cfg.retrieval)
    docs = list(dict.fromkeys(_as_list(cfg.documents, str, "documents")))
    from .textdata import stdlib_path

    for d in docs:  # a missing document fails before the model loads and before any run
        stdlib_path(d)
    if hasattr(cfg.model, "dtype"):
        from .models import resolve_dtype

        resolve_dtype(cfg.model.dtype)
    return heads, budgets, docs


def run_eval(cfg, model=None, tokenizer=None, log=print):
    """Evaluate every (document, head, budget) of ``cfg``; write ``results.csv`` / ``.md`` / ``.png`` to
    ``cfg.out``. Returns the pandas DataFrame of this run's rows.

    Raises:
        ValueError: an unknown head, a bad budget or length, a document shorter than prefix + continuation, an
            ``out`` that cannot be written or whose ``results.csv`` cannot be merged (:func:`read_results`; both
            checked before the model loads).
        FileNotFoundError: a document missing from this Python installation.
    """
    import pandas as pd

    from .config import SpeContextConfig, retrieval_for
    from .runtime.heads import make_head

    heads, budgets, docs = check_config(cfg)
    from .utils import check_results_dir

    check_results_dir(cfg.out)  # as the output path: not after the run
    read_results(cfg.out)  # an earlier results.csv this run would merge into: refused now, not after the run
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    name = cfg.model.name if hasattr(cfg.model, "name") else str(cfg.model)
    if model is None:
        from .models import load_model

        model, tokenizer = load_model(name, dtype=getattr(cfg.model, "dtype", "float32"))
    model.eval()
    limit = getattr(model.config, "max_position_embeddings", None)
    longest = int(cfg.prefix) + max(int(cfg.continuation), int(cfg.generate))
    if isinstance(limit, int) and longest > limit:
        raise ValueError(f"prefix {cfg.prefix} + max(continuation {cfg.continuation}, generate {cfg.generate}) = "
                         f"{longest} tokens exceed the model's {limit} positions: shorten prefix, continuation or "
                         f"generate")
    from tqdm.auto import tqdm

    rows = []
    jobs = [(d, h, b) for d in docs for h in heads for b in budgets]
    bar = tqdm(jobs, desc="eval-sparse", unit="run")
    for doc, head_name, budget in bar:
        bar.set_postfix_str(f"{doc} {head_name} B={budget}")
        teacher, trace, greedy = _teacher(model, tokenizer, doc, cfg)
        hcfg = SpeContextConfig(head=head_name, budget=budget, retrieval=retrieval_for(head_name, cfg.retrieval),
                                num_sink=cfg.num_sink)
        head = make_head(head_name, hcfg, trace.scale[0])
        try:
            head.bind(model)
        except ValueError as e:  # the fix as this command's keys spell it (retrieval=, not transform.retrieval=)
            raise ValueError(rename_keys(str(e), {"retrieval": "retrieval"})) from None
        t0 = time.perf_counter()
        r = evaluate_head(teacher, head, trace, greedy)
        r.pop("recall_layers")
        rows.append({"model": name, "document": doc, "head": head_name, "budget": budget, "cached": trace.prefix,
                     "continuation": int(cfg.continuation), "generate": int(cfg.generate),
                     "num_sink": int(cfg.num_sink),
                     "retrieval": str(cfg.retrieval) if hasattr(head, "source") else "-",  # (heads with weights)
                     "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                     **r, "seconds": round(time.perf_counter() - t0, 1)})
    df = pd.DataFrame(rows)
    write_results(df, cfg.out)
    return df
