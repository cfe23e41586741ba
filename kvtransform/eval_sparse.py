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
from pathlib import Path
from typing import Any, Optional

import torch

from .attention_probe import cache_probs, probing
from .runtime.cache import KVCache
from .utils import atomic_write, cache_kwarg

__all__ = ["Trace", "DocumentTeacher", "run_head", "keep_mask", "recall_per_layer", "nll",
           "evaluate_head", "EvalSparseConfig", "run_eval", "read_results", "write_results", "summarize",
           "markdown"]


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

    from .config import SpeContextConfig
    from .runtime.heads import HEADS, make_head

    heads = _as_list(cfg.head, str, "head")
    budgets = _as_list(cfg.budget, int, "budget")
    unknown = [h for h in heads if h not in HEADS]
    if unknown:
        raise ValueError(f"unknown retrieval head {unknown[0]!r}; choose from {sorted(HEADS)}")
    for key in ("prefix", "continuation", "generate"):
        v = getattr(cfg, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 2:
            raise ValueError(f"{key} must be an integer >= 2 tokens; got {v!r}")
    if any(b < 1 for b in budgets):
        raise ValueError(f"budget must be >= 1 token per KV head; got {budgets}")
    ns = cfg.num_sink
    if isinstance(ns, bool) or not isinstance(ns, int) or not 0 <= ns <= min(budgets):
        raise ValueError(f"num_sink must be an integer in [0, smallest budget {min(budgets)}]; got {ns!r}")
    if isinstance(cfg.threads, bool) or not isinstance(cfg.threads, int) or cfg.threads < 0:
        raise ValueError(f"threads must be an integer >= 0 (0: torch's default); got {cfg.threads!r}")
    docs = _as_list(cfg.documents, str, "documents")
    from .textdata import stdlib_path

    for d in docs:  # a missing document fails before the model loads and before any run
        stdlib_path(d)
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
    from tqdm.auto import tqdm

    rows = []
    jobs = [(d, h, b) for d in docs for h in heads for b in budgets]
    bar = tqdm(jobs, desc="eval-sparse", unit="run")
    for doc, head_name, budget in bar:
        bar.set_postfix_str(f"{doc} {head_name} B={budget}")
        teacher, trace, greedy = _teacher(model, tokenizer, doc, cfg)
        head = make_head(head_name, SpeContextConfig(head=head_name, budget=budget, retrieval=cfg.retrieval,
                                                     num_sink=cfg.num_sink),
                         trace.scale[0])
        head.bind(model)
        t0 = time.perf_counter()
        r = evaluate_head(teacher, head, trace, greedy)
        r.pop("recall_layers")
        rows.append({"model": name, "document": doc, "head": head_name, "budget": budget, "cached": trace.prefix,
                     "continuation": int(cfg.continuation), "generate": int(cfg.generate),
                     **r, "seconds": round(time.perf_counter() - t0, 1)})
    df = pd.DataFrame(rows)
    write_results(df, cfg.out)
    return df


#: the columns every kvtransform's results.csv has held: the merge's key and the summary's measurements
RESULT_COLUMNS = ("model", "document", "head", "budget", "recall_mean", "recall_worst", "nll_increase", "agreement",
                  "select_ms")


def read_results(out):
    """The rows of ``out/results.csv`` (a pandas DataFrame) that :func:`write_results` merges with, None where there
    is no such file. The whole file is checked, so that a damaged one is refused before an evaluation, never merged.

    Raises:
        ValueError: one line naming the file and the fix (move it away, or choose another ``out=``): not a regular
            file; not UTF-8 CSV; empty; its last line without a newline or a row with fewer or more fields than the
            header (cut short, as by a run killed while writing it); a column of :data:`RESULT_COLUMNS` missing;
            a row without a value there, or a non-number where a number belongs (a setting of :data:`SETTINGS`:
            a non-integer).
    """
    import csv
    import io

    import pandas as pd

    path = Path(str(out)).expanduser() / "results.csv"
    if not path.exists():
        return None

    def bad(why: str) -> ValueError:
        return ValueError(f"{path} cannot be merged with this run's rows ({why}): move it away or choose another "
                          f"out=<directory>")

    if not path.is_file():
        raise bad("not a regular file")
    try:
        text = path.read_text(encoding="utf-8")
        rows = list(csv.reader(io.StringIO(text, newline="")))
        if not text.strip() or not text.endswith("\n"):
            raise bad(f"{'empty' if not text.strip() else 'its last line has no newline'}: cut short, as by a run "
                      f"killed while writing it")
        missing = [c for c in RESULT_COLUMNS if c not in rows[0]]
        if missing:
            raise bad(f"no {', '.join(missing)} column: not eval-sparse results, or cut short")
        for line, row in enumerate(rows[1:], start=2):
            if row and len(row) != len(rows[0]):
                raise bad(f"line {line} has {len(row)} fields, the header {len(rows[0])}: cut short or edited")
            empty = [c for c in RESULT_COLUMNS if row and not row[rows[0].index(c)].strip()]
            if empty:
                raise bad(f"line {line} has no {empty[0]}")
        old = pd.read_csv(io.StringIO(text))
    except (UnicodeDecodeError, csv.Error, pd.errors.ParserError) as e:
        raise bad(f"not a UTF-8 CSV file: {str(e).strip().splitlines()[0]}") from None
    for c in RESULT_COLUMNS[3:]:
        if len(old) and not pd.api.types.is_numeric_dtype(old[c]):
            raise bad(f"column {c} holds a value that is not a number")
    for c in (c for c in SETTINGS if c in old.columns):  # integers, or empty for a run that did not record them
        v = old[c].dropna()
        if len(v) and (not pd.api.types.is_numeric_dtype(v) or bool((v != v.round()).any())):
            raise bad(f"column {c} holds a value that is not an integer")
    return old


def write_results(df, out) -> None:
    """Merge ``df`` into ``out/results.csv`` (replacing rows of equal model, document, head, budget and settings:
    ``cached`` prompt tokens, ``continuation``, ``generate``; a row without settings, from an older kvtransform, by a
    new row of its model, document, head and budget), then write ``results.md`` (mean over documents per
    head, budget and settings, plus the per-document rows) and ``results.png``. ``seconds``: the head's evaluation
    on one document (the dense teacher pass, shared by every head of a document, is not in it). Each file is
    written atomically (:func:`kvtransform.utils.atomic_write`): a run killed meanwhile leaves the earlier one.

    Raises:
        ValueError: an existing ``results.csv`` that cannot be merged (:func:`read_results`; nothing written).
    """
    import pandas as pd

    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    csv = out / "results.csv"
    old = read_results(out)
    settings = [c for c in SETTINGS if c in df.columns or (old is not None and c in old.columns)]
    key = ["model", "document", "head", "budget"] + settings
    if old is not None:
        # a row written without its settings (an older kvtransform) is superseded by a new row of the same model,
        # document, head and budget: its settings are unknown, so no other row can ever be its duplicate
        unset = old[[c for c in settings if c in old.columns]].isna().all(axis=1) if settings else old["model"].isna()
        ours = old[["model", "document", "head", "budget"]].apply(tuple, axis=1).isin(
            set(df[["model", "document", "head", "budget"]].apply(tuple, axis=1)))
        df = pd.concat([old[~(unset & ours)], df])
    for c in settings:   # integers; rows written without a setting (older runs) keep it empty, never 1024.0000
        df[c] = df[c].astype("Int64") if c in df.columns else pd.array([pd.NA] * len(df), dtype="Int64")
    df = df.drop_duplicates(subset=key, keep="last").sort_values(key).reset_index(drop=True)
    with atomic_write(csv) as tmp:
        df.to_csv(tmp, index=False)
    summary = summarize(df)
    with atomic_write(out / "results.md") as tmp:
        tmp.write_text("## Mean over documents\n\n" + markdown(summary) + "\n\n## Per document\n\n"
                       + markdown(df) + "\n")
    with atomic_write(out / "results.png") as tmp:
        _plot(summary, tmp)


def markdown(df) -> str:
    """A pandas DataFrame as a GitHub markdown table (floats with 4 decimals; no ``tabulate`` dependency)."""
    def cell(v):
        if type(v).__name__ == "NAType" or (isinstance(v, float) and v != v):
            return ""                                     # a setting an older run did not record
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


SETTINGS = ("cached", "continuation", "generate")  # rows measured with other settings are never averaged together


def summarize(df):
    """Mean over documents per (model, head, budget, settings): recall mean/worst layer, NLL increase, agreement.
    Rows of earlier runs with other settings (``cached`` prompt tokens, ``continuation``, ``generate``) stay
    separate rows."""
    cols = ["recall_mean", "recall_worst", "nll_increase", "agreement", "select_ms"]
    by = ["model", "head", "budget"] + [c for c in SETTINGS if c in df.columns]
    g = df.groupby(by, as_index=False, dropna=False)
    s = g[cols].mean()
    s.insert(len(by), "documents", g.size()["size"].values)
    return s


def _plot(summary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    settings = [c for c in SETTINGS if c in summary.columns]
    several = len(summary.drop_duplicates(settings)) > 1 if settings else False
    for key, g in summary.groupby(["head"] + settings, dropna=False):
        label = key[0] if not several else f"{key[0]} ({'/'.join(str(v) for v in key[1:])})"  # prefix/cont./gen.
        g = g.sort_values("budget")
        axes[0].plot(g.budget, g.recall_mean, marker="o", label=label)
        axes[1].plot(g.budget, g.nll_increase, marker="o", label=label)
        axes[2].plot(g.budget, g.agreement, marker="o", label=label)
    for ax, title in zip(axes, ["recall (mean over layers)", "NLL increase (nats/token)", "greedy agreement"]):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tokens per KV head)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
