"""Train the ``distilled`` retrieval head on the target's own attention (SpeContext, arXiv 2512.00722 §9:
"train the retrieval head directly to capture the LLM's attention"; ``kvtransform distill-retrieval-head``).

**Teacher** (:func:`teacher_targets`): on real text (:data:`kvtransform.textdata.TRAIN_FILES`: code, English
technical prose and a changelog; legal English is the kind held out for evaluation; chunks of ``length`` tokens), at
``positions`` query positions per chunk drawn from its second half, the model's dense attention over the cached
tokens ``[0, t)`` of every layer, group-max over each GQA group (per KV head, as the selection ranks), aggregated
over layers (``teacher``: **max**, the default, or mean), renormalised to sum 1 per (KV head, position): the
aggregate a single per-step selection shared by all layers must serve (§4.3). The max keeps the few tokens one deep
layer concentrates on (the copy source of an induction head) as heavy as the attention sink; the mean divides them
by the number of layers. Measured on SmolLM2-135M (budget 1024, 3 unseen documents, 128-token continuations): NLL
increase +0.113 (max) vs +0.147 (mean) nats/token at equal recall (0.91 vs 0.92). Stored fp16 in ``teacher.pt``
beside the checkpoint (computed once; a resumed run reuses it).

**Loss** (:func:`loss_fn`), on the head's group-max log-probabilities ``s`` ``(H_kv, P, T)`` (softmax per query
head over ``[0, t)``, max over the group: exactly what ``kvt::retrieval_topk`` ranks):

* ``attn`` (§9 ``L_attn``): ``1 - Σ_j a_j · σ((s_j - θ)/τ)``, the teacher mass captured by a soft top-``k``
  selection, ``θ`` the ``k``-th largest ``s`` (no gradient), ``k = budget_fraction · t`` (the eval's budget 1024
  over ≈4.5K cached tokens is ≈ 0.25), ``τ = temperature`` × the row's standard deviation of ``s`` (no
  gradient: the soft selection does not harden just because the scores spread out);
* ``kl``: ``KL(a ‖ softmax(s))`` over ``[0, t)``, a dense surrogate.

Checkpoints (``checkpoint.pt``: block, optimizer, step, RNG) every ``checkpoint_every`` steps; a run with the same
``out`` resumes from it. Both files are written atomically (a run killed while writing leaves the previous file); a
damaged ``teacher.pt`` (a cache of what the model computes again) is recomputed with a note, a damaged
``checkpoint.pt`` (the training done so far) is an error (:func:`distill`). The result is a head directory
(``head.safetensors`` + ``head.json`` with the target's fingerprint),
:func:`kvtransform.runtime.distilled.save_head_dir`.
"""
from __future__ import annotations

import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from .attention_probe import cache_probs, probing
from .runtime.distilled import DistilledBlock, fingerprint, fingerprint_mismatch, save_head_dir
from .runtime.embedding_heads import find_param
from .textdata import TRAIN_FILES
from .transforms.artifact_files import load_artifact_file
from .utils import atomic_write, check_device, check_free_space, is_count

__all__ = ["DistillConfig", "TEACHERS", "teacher_targets", "loss_fn", "head_scores", "distill"]


@dataclass
class DistillConfig:
    """``kvtransform distill-retrieval-head`` settings (Hydra structured config).

    Attributes:
        model: registry name / local HF directory of the target (on the command line: the model group).
        out: the head directory (also holds ``checkpoint.pt`` and ``teacher.pt`` while training).
        files: training files (relative to the standard library; split from the evaluation files by file);
            ``stdlib`` stands for :func:`~kvtransform.textdata.stdlib_corpus` (≈100 files, ≈200 chunks: the broad
            mix the packaged head was trained on; docs/specontext_heads.md gives its command).
        length: tokens per training chunk; chunks_per_file: chunks taken from each file (``pydoc_data/topics.py``
            gives ``topics_chunks``); positions: teacher query positions per chunk (second half).
        teacher: the aggregate over layers of the teacher attention, ``mean`` or ``max`` (:data:`TEACHERS`).
        loss: ``attn`` (captured mass of a soft top-k, §9) or ``kl``.
        budget_fraction: k / t of the soft top-k; temperature: its sigmoid temperature (in standard deviations of the scores).
        steps, lr, weight_decay: AdamW, cosine decay; checkpoint_every: steps between checkpoints.
        window, dim: the block's input window (tokens) and width.
        seed: data order and initialisation; threads: torch CPU threads (0: torch's default).
        overwrite: train again into an ``out`` that holds a trained head which this run cannot resume (its
            checkpoint is gone or from other settings); without it that is refused before training.
        device: where the teacher and the training run: ``auto`` (a given model's device; else ``cuda`` when torch
            sees one, else ``cpu``), ``cpu`` or ``cuda[:N]`` (the model is moved there). Checkpoints and the head
            directory load on any device.
    """

    model: Any = "smollm2-135m"
    out: str = "outputs/heads/smollm2-135m"
    files: list = field(default_factory=lambda: list(TRAIN_FILES))
    length: int = 2048
    chunks_per_file: int = 1
    topics_chunks: int = 5
    positions: int = 192
    teacher: str = "max"
    loss: str = "kl"
    budget_fraction: float = 0.25
    temperature: float = 0.25
    steps: int = 400
    lr: float = 3e-3
    weight_decay: float = 0.01
    checkpoint_every: int = 50
    window: int = 4
    dim: int = 256
    seed: int = 0
    threads: int = 0
    device: str = "auto"
    progress: bool = True
    overwrite: bool = False


TEACHERS = {"mean": "mean over layers of per-KV-head group-max attention",
            "max": "max over layers of per-KV-head group-max attention"}


@torch.no_grad()
def teacher_targets(model, ids: torch.Tensor, positions: torch.Tensor, aggregate: str = "max") -> torch.Tensor:
    """The per-KV-head group-max attention over ``[0, t)`` aggregated over layers (``aggregate``: ``mean`` or
    ``max``, :data:`TEACHERS`), renormalised.

    Args:
        ids: int64 ``(T,)``; positions: int64 ``(P,)`` query positions (``>= 1``).

    Returns:
        fp32 ``(H_kv, P, T)``, each ``(h, p)`` row summing to 1 over ``j < positions[p]``.

    Raises:
        ValueError: an unknown ``aggregate``.
    """
    if aggregate not in TEACHERS:
        raise ValueError(f"teacher must be one of {sorted(TEACHERS)}; got {aggregate!r}")
    dev = next(model.parameters()).device
    with probing(model) as probe:
        probe.capture, probe.q_positions = True, positions.to(dev)
        model(input_ids=ids[None].to(dev), use_cache=False)
    acc = None
    for l in range(len(probe.k)):
        p = cache_probs(probe.q[l][0], probe.k[l][0], positions.to(dev), probe.scale[l])   # (H, P, T)
        h_kv = probe.k[l].shape[1]
        gm = p.unflatten(0, (h_kv, -1)).amax(dim=1)                                          # (H_kv, P, T)
        acc = gm if acc is None else (acc + gm if aggregate == "mean" else torch.maximum(acc, gm))
    return (acc / acc.sum(-1, keepdim=True).clamp(min=1e-30)).cpu()


def head_scores(block: DistilledBlock, embed: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                max_length: Optional[int] = None) -> torch.Tensor:
    """The head's group-max log-probabilities ``(H_kv, P, T)`` fp32 of the queries at ``positions`` over the keys
    ``[0, t)`` of ``ids`` ``(T,)`` (-inf elsewhere), as the selection ranks them."""
    T, w, dev = ids.numel(), block.arch["window"], ids.device
    pos = torch.arange(T, device=dev)
    off = torch.arange(w - 1, -1, -1, device=dev)
    p = pos[:, None] - off
    emb = torch.where((p >= 0)[..., None], embed[ids[p.clamp(min=0)]].float(), torch.zeros((), device=dev))
    q, k = block(emb, pos, max_length)                                # (T, H, D), (T, H_kv, D)
    q = q[positions]                                                   # (P, H, D)
    h, h_kv, d = q.shape[1], k.shape[1], q.shape[2]
    logits = torch.einsum("phd,shd->hps", q, k.repeat_interleave(h // h_kv, dim=1)) * d ** -0.5
    valid = pos[None, None, :] < positions[None, :, None]
    logp = logits.masked_fill(~valid, float("-inf")).log_softmax(-1)
    return logp.unflatten(0, (h_kv, -1)).amax(dim=1)


def loss_fn(scores: torch.Tensor, target: torch.Tensor, positions: torch.Tensor, kind: str,
            budget_fraction: float = 0.25, temperature: float = 0.25) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, captured)``: the training loss (module docstring) and the teacher mass a hard top-k selection
    captures (mean over KV heads and positions; no gradient).

    Raises:
        ValueError: an unknown ``kind``.
    """
    t = positions.float()
    k = (budget_fraction * t).long().clamp(min=1)                      # (P,)
    srt = scores.detach().sort(dim=-1, descending=True).values
    thr = srt.gather(-1, (k - 1)[None, :, None].expand(scores.shape[0], -1, 1))   # (H_kv, P, 1)
    with torch.no_grad():
        captured = (target * (scores >= thr)).sum(-1).mean()
    if kind == "attn":
        valid = torch.isfinite(scores)
        z = torch.where(valid, scores, torch.zeros_like(scores)).detach()
        n = valid.sum(-1, keepdim=True).clamp(min=1)
        mean = z.sum(-1, keepdim=True) / n
        std = (((z - mean) ** 2 * valid).sum(-1, keepdim=True) / n).sqrt().clamp(min=1e-3)
        soft = torch.sigmoid((scores - thr) / (temperature * std))
        loss = 1 - (target * soft).sum(-1).mean()
    elif kind == "kl":
        valid = torch.isfinite(scores)
        logq = torch.where(valid, scores, torch.full_like(scores, -1e9)).log_softmax(-1)
        loss = (target * (target.clamp(min=1e-30).log() - logq)).masked_fill(~valid, 0).sum(-1).mean()
    else:
        raise ValueError(f"loss must be 'attn' or 'kl'; got {kind!r}")
    return loss, captured


def _chunks_of(cfg: DistillConfig, f: str) -> int:
    """Training chunks asked of file ``f``: ``topics_chunks`` for pydoc's topics, ``chunks_per_file`` otherwise."""
    return cfg.topics_chunks if f == "pydoc_data/topics.py" else cfg.chunks_per_file


def _training_files(cfg: DistillConfig) -> tuple[list, set]:
    """``cfg.files`` with ``stdlib`` expanded to :func:`~kvtransform.textdata.stdlib_corpus` (duplicates once), and
    the set of files that came from the corpus (skipped when shorter than one chunk; a named file is not)."""
    from .textdata import STDLIB_CORPUS, stdlib_corpus

    files, corpus = [], set()
    for f in cfg.files:
        more = stdlib_corpus() if f == STDLIB_CORPUS else [f]
        if f == STDLIB_CORPUS:
            corpus.update(more)
        files += [g for g in more if g not in files]
    return files, corpus


def _chunks(tok, cfg: DistillConfig, files: list, corpus: set) -> list:
    from .textdata import token_chunks

    out = []
    for f in files:
        try:
            out += [(f, c) for c in token_chunks(tok, f, cfg.length, _chunks_of(cfg, f))]
        except ValueError:
            if f not in corpus or tok is None:
                raise
    return out


def _refuse_replacing_head(out: Path, cfg, why: str) -> None:
    """ValueError (one line) when ``out`` holds a trained head (``head.json``) that this run would train again from
    scratch and replace (``why``), unless ``cfg.overwrite``."""
    if (out / "head.json").is_file() and not cfg.overwrite:
        raise ValueError(f"out={out} holds a trained head and {why}: training would replace it; choose another "
                         f"out=<directory> or pass overwrite=true")


def _load_pt(file: Path, fix: str):
    """``torch.load`` of one of our own files (``teacher.pt``, ``checkpoint.pt``) that must hold a dict.

    Raises:
        ValueError: the file is damaged (:func:`~kvtransform.transforms.artifact_files.load_artifact_file`: truncated, a
            failed CRC, not a pickle) or holds no dict: one line naming it and ``fix``.
    """
    data = load_artifact_file(file, lambda f: torch.load(f, map_location="cpu", weights_only=False), fix)
    if not isinstance(data, dict):
        raise ValueError(f"{file} is damaged (a {type(data).__name__}, not a dict): {fix}")
    return data


def _cached_teacher(file: Path, log) -> Optional[dict]:
    """The teacher cache ``file``; None when there is none, or when it is damaged (said through ``log``): the cache
    is the model's attention on the training text, computed again as when the settings or the model change."""
    if not file.is_file():
        return None
    try:
        return _load_pt(file, "computing the teacher targets again")
    except ValueError as e:
        log(str(e))
        return None


def check_config(cfg: DistillConfig) -> None:
    """The settings of ``cfg`` checked, without the model or ``out`` (also each job of a ``-m`` sweep, before the
    first runs).

    Raises:
        ValueError: one line naming the bad key.
        FileNotFoundError: a training file missing from this Python installation.
    """
    from .textdata import STDLIB_CORPUS, stdlib_path

    for key in ("length", "positions", "steps", "checkpoint_every", "window", "dim"):
        v = getattr(cfg, key)
        if not is_count(v, 1):
            raise ValueError(f"{key} must be an integer >= 1; got {v!r}")
    queries = cfg.length - cfg.length // 2  # the teacher's query positions: a chunk's second half
    if cfg.length < 2 or cfg.positions > queries:  # (length=1 trained on nothing; more positions were dropped)
        raise ValueError(f"positions={cfg.positions} with length={cfg.length}: the teacher's queries are drawn from a "
                         f"chunk's second half ({queries} positions) and attend to the tokens before them: set "
                         f"length >= 2 and positions <= length - length // 2")
    if cfg.teacher not in TEACHERS:
        raise ValueError(f"teacher must be one of {sorted(TEACHERS)}; got {cfg.teacher!r}")
    if cfg.loss not in ("attn", "kl"):
        raise ValueError(f"loss must be 'attn' or 'kl'; got {cfg.loss!r}")
    if not 0 < cfg.budget_fraction <= 1:
        raise ValueError(f"budget_fraction must be in (0, 1]; got {cfg.budget_fraction}")
    for key, low in (("lr", 0.0), ("temperature", 0.0), ("weight_decay", None)):
        v = getattr(cfg, key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
                (v <= low if low is not None else v < 0):
            raise ValueError(f"{key} must be a finite number {'> 0' if low is not None else '>= 0'}; got {v!r}")
    if not is_count(cfg.threads, 0):
        raise ValueError(f"threads must be an integer >= 0 (0: torch's default); got {cfg.threads!r}")
    check_device(cfg.device, auto=True)
    for key, low in (("chunks_per_file", 1), ("topics_chunks", 0)):
        v = getattr(cfg, key)
        if not is_count(v, low):
            raise ValueError(f"{key} must be an integer >= {low}; got {v!r}")
    if not any(_chunks_of(cfg, f) for f in cfg.files):
        raise ValueError(f"files={list(cfg.files)} with topics_chunks={cfg.topics_chunks} gives no training chunk: "
                         f"name at least one file (e.g. files=[argparse.py])")
    for f in cfg.files:  # before the model loads, as the output directory
        if f != STDLIB_CORPUS:
            stdlib_path(f, "files")


def distill(cfg: DistillConfig, model=None, tokenizer=None, log=print) -> dict:
    """Train (or resume) the head of ``cfg``; write the head directory ``cfg.out``.

    Returns:
        ``{"out", "steps", "device" (where it trained), "captured" (hard top-k teacher mass, last 20 steps), "loss",
        "seconds"}``.

    Raises:
        ValueError: bad settings (the message names the key), an ``out`` that cannot be written (before the model
            loads).
        FileNotFoundError: a training file missing from this Python installation (before the model loads).
        ValueError: ``out`` holds a trained head that this run cannot resume and ``overwrite`` is off (before
            training; before the model loads when there is no checkpoint).
        ValueError: a damaged ``checkpoint.pt`` in ``out`` (truncated, a failed CRC, entries missing or not this
            block's): one line saying to delete it. It holds the training done so far, so it is not replaced
            silently: the user may have a good copy, and a checkpoint written atomically that is damaged points at
            the disk or a copy. A damaged ``teacher.pt`` is only a cache: it is computed again, with a note.
        OSError: the disk holding ``out`` has no room for the teacher targets or the checkpoint
            (:func:`kvtransform.utils.check_free_space`, checked before each write: ``torch.save`` aborts the process
            on a full disk); a refusal before the first write leaves no new directory.
    """
    check_config(cfg)
    from .utils import check_results_dir

    check_results_dir(cfg.out)
    if not (Path(cfg.out).expanduser() / "checkpoint.pt").is_file():  # nothing to resume: a head there is finished
        _refuse_replacing_head(Path(cfg.out).expanduser(), cfg, "it has no checkpoint to resume")
    check_device(cfg.device, available=True, auto=True)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    if cfg.device != "auto":
        dev = torch.device(cfg.device)
    elif model is not None:
        dev = next(model.parameters()).device
    else:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if model is None:
        from .models import load_model

        model, tokenizer = load_model(getattr(cfg.model, "name", cfg.model))
    model.to(dev).eval()
    out = Path(cfg.out).expanduser()  # made at its first file: a run that fails before leaves nothing
    mc = model.config
    h = mc.num_attention_heads
    h_kv = getattr(mc, "num_key_value_heads", None) or h
    hd = getattr(mc, "head_dim", None) or mc.hidden_size // h
    theta = float((getattr(mc, "rope_parameters", None) or {}).get("rope_theta", getattr(mc, "rope_theta", 1e4)))
    embed = find_param(model, "embed_tokens.weight").float()   # on dev

    teacher_file = out / "teacher.pt"
    gen = torch.Generator().manual_seed(cfg.seed)
    files, corpus = _training_files(cfg)
    key = {"length": cfg.length, "positions": cfg.positions, "files": files,
           "chunks_per_file": cfg.chunks_per_file, "topics_chunks": cfg.topics_chunks, "teacher": cfg.teacher}
    fp = fingerprint(model)
    data = _cached_teacher(teacher_file, log)
    # the teacher targets are this model's attention on these chunks: another model (fingerprint beyond the bf16
    # tolerance of fingerprint_mismatch) or other data recomputes them
    if data is None or data.get("key") != key or "fingerprint" not in data or \
            fingerprint_mismatch(data["fingerprint"], fp):
        data = {"key": key, "fingerprint": fp, "items": []}
        chunks = _chunks(tokenizer, cfg, files, corpus)
        if not chunks:  # every file shorter than one chunk
            raise ValueError(f"files={list(cfg.files)} hold no chunk of length={cfg.length} tokens: add longer files "
                             f"or lower length")
        for f, ids in tqdm(chunks, desc="teacher attention", unit="chunk", disable=not cfg.progress):
            lo = cfg.length // 2
            pos = torch.randperm(cfg.length - lo, generator=gen)[:cfg.positions].sort().values + lo
            tgt = teacher_targets(model, ids, pos, cfg.teacher)
            data["items"].append({"file": f, "ids": ids, "positions": pos, "target": tgt.half()})
        check_free_space(out, sum(t.nbytes for it in data["items"] for t in it.values() if torch.is_tensor(t)),
                         what="the teacher targets")  # (before mkdir: a refusal leaves no new directory)
        out.mkdir(parents=True, exist_ok=True)
        with atomic_write(teacher_file) as tmp:
            torch.save(data, tmp)
    # on the training device once, not per step (the targets: 192 x 2048 fp16 per chunk)
    items = [{**it, "ids": it["ids"].to(dev), "positions": it["positions"].to(dev), "target": it["target"].to(dev)}
             for it in data["items"]]

    torch.manual_seed(cfg.seed)
    block = DistilledBlock(mc.hidden_size, h, h_kv, hd, window=cfg.window, dim=cfg.dim, rope_theta=theta,
                           train_length=cfg.length, eps=float(getattr(mc, "rms_norm_eps", 1e-5))).to(dev)
    opt = torch.optim.AdamW(block.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * s / cfg.steps)).item()))
    step, hist = 0, []
    ckpt = out / "checkpoint.pt"
    train_key = {k: getattr(cfg, k) for k in ("loss", "budget_fraction", "temperature", "steps", "lr",
                                                "weight_decay", "window", "dim", "seed", "teacher")}
    # the checkpoint resumes only the same training: same settings (steps too: the cosine schedule depends on it),
    # same data (files, chunks, positions) and the same target model (fingerprint within fingerprint_mismatch's
    # tolerance: a bf16 copy is the same model); anything else trains from scratch, so head.json never describes
    # training the weights did not get
    resume_key = {**key, **train_key}
    fix = "delete it to train from scratch"
    if ckpt.is_file():
        st = _load_pt(ckpt, fix)
        old = st.get("key") or {}
        changed = sorted(k for k in set(old) & set(resume_key) if old[k] != resume_key[k])
        missing = sorted(set(resume_key) - set(old)) + ([] if "fingerprint" in st else ["fingerprint"])
        if "fingerprint" in st and fingerprint_mismatch(st["fingerprint"], fp):
            changed.append("target model")
        if changed or missing:
            why = (f"{', '.join(changed)} differ" if changed else
                   f"it was written by an older kvtransform (no {', '.join(missing)})")
            _refuse_replacing_head(out, cfg, f"its checkpoint is from other settings ({why})")
            log(f"{ckpt} is from other settings ({why}): training from scratch")
        else:
            try:
                block.load_state_dict(st["block"])
                opt.load_state_dict(st["opt"])
                sched.load_state_dict(st["sched"])
                step, hist = int(st["step"]), list(st["hist"])
                gen.set_state(st["gen"])
            except (KeyError, TypeError, ValueError, RuntimeError) as e:  # entries missing or not this block's
                why = " ".join(str(e).split())[:160]
                raise ValueError(f"{ckpt} is damaged ({type(e).__name__}: {why}): {fix}") from None
            log(f"resumed from {ckpt} at step {step}")
    # the checkpoint holds the block's weights and AdamW's two moments of each (torch.save aborts on a full disk):
    # checked before training starts and before each write
    ckpt_bytes = 3 * sum(p.numel() * p.element_size() for p in block.parameters())
    check_free_space(out, ckpt_bytes, what="the checkpoint")
    bar = tqdm(total=cfg.steps, initial=step, desc=f"distill ({cfg.loss})", unit="step", disable=not cfg.progress)
    while step < cfg.steps:
        it = items[int(torch.randint(len(items), (1,), generator=gen))]
        ids, positions = it["ids"], it["positions"]
        s = head_scores(block, embed, ids, positions)
        loss, cap = loss_fn(s, it["target"].float(), positions, cfg.loss, cfg.budget_fraction,
                            cfg.temperature)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(block.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        hist.append((loss.item(), cap.item()))
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.4f}", captured=f"{sum(c for _, c in hist[-20:]) / len(hist[-20:]):.3f}")
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            check_free_space(out, ckpt_bytes, what="the checkpoint")
            with atomic_write(ckpt) as tmp:
                torch.save({"key": resume_key, "fingerprint": fp, "block": block.state_dict(),
                            "opt": opt.state_dict(), "sched": sched.state_dict(), "step": step, "hist": hist,
                            "gen": gen.get_state()}, tmp)
    bar.close()
    last = hist[-20:]
    res = {"out": str(out), "steps": step, "device": str(dev), "loss": sum(l for l, _ in last) / len(last),
           "captured": sum(c for _, c in last) / len(last), "seconds": time.perf_counter() - t_start}
    save_head_dir(out, block.cpu(), fp, {
        "training": {**key, **train_key, "python": platform.python_version(), "teacher": cfg.teacher,
                     "teacher_aggregate": TEACHERS[cfg.teacher], "train_captured_top_k": round(res["captured"], 4)}})
    return res
