"""The ``distilled`` retrieval head: a small block trained to capture the target's attention (SpeContext, arXiv
2512.00722 §9 future work: a head trained directly on the LLM's attention; selection as §4.3).

Architecture (:class:`DistilledBlock`), per token ``j`` with the target's frozen embedding ``E`` (shared, not
copied)::

    x_j = W_in · concat(RMSNorm(E[t_{j-w+1}]), ..., RMSNorm(E[t_j]))      window w tokens (zeros before 0)
    h_j = x_j + MLP(RMSNorm(x_j))                                         SiLU MLP, 4× width
    q_j = RoPE(W_q · RMSNorm(h_j))   (H query heads, the target's GQA layout)
    k_j = RoPE(W_k · RMSNorm(h_j))   (H_kv key heads)

The window lets a key carry its predecessors (so "the token after an earlier occurrence of the current token",
the induction pattern, is expressible) while every key still depends only on ids and positions: the head's key
cache is built once at prefill and grows by one key per step. RoPE uses the target's base; beyond the training
length ``train_length`` YaRN (:func:`~.embedding_heads.yarn_inv_freq`) stretches the low frequencies by
``length / train_length`` for the whole generation, ``length`` being the row's own final length (prompt plus
``max_new_tokens``; :func:`~.embedding_heads.row_lengths`): static per request, independent of the other rows.

A trained head is a directory with ``head.safetensors`` (the block's weights, fp16) and ``head.json`` (architecture,
training settings, the target's :func:`fingerprint` and the weights file's SHA-256); :func:`load_head_dir` refuses a
head whose fingerprint differs from the model's, and a damaged one. Heads shipped with the package live in
``kvtransform/data/heads/<name>/`` (:func:`shipped_head_for`).
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ..utils import is_count
from .embedding_heads import EmbeddingKeyHead, _model_config, find_param, rms_norm, rope, yarn_rows
from .heads import register_head

__all__ = ["DistilledBlock", "DistilledHead", "fingerprint", "check_fingerprint", "save_head_dir", "load_head_dir",
           "shipped_head_for", "auto_head", "SHIPPED_DIR", "FORMAT"]

FORMAT = "kvtransform-distilled-head"
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "heads"


class DistilledBlock(nn.Module):
    """The trained block (see the module docstring). fp32.

    Args:
        hidden: the target's embedding width; heads/kv_heads/head_dim: the target's GQA layout (the selection is
            per target KV head); window: tokens per input window; dim: the block's width; rope_theta: RoPE base;
            train_length: longest position seen in training (YaRN beyond it); eps: RMSNorm epsilon.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, window: int = 4, dim: int = 256,
                 rope_theta: float = 10000.0, train_length: int = 2048, eps: float = 1e-5):
        super().__init__()
        self.arch = dict(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, window=window, dim=dim,
                         rope_theta=float(rope_theta), train_length=int(train_length), eps=float(eps))
        self.w_in = nn.Linear(window * hidden, dim, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(dim))
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)
        self.out_norm = nn.Parameter(torch.ones(dim))
        self.w_q = nn.Linear(dim, heads * head_dim, bias=False)
        self.w_k = nn.Linear(dim, kv_heads * head_dim, bias=False)
        nn.init.zeros_(self.down.weight)

    def forward(self, emb: torch.Tensor, positions: torch.Tensor, max_length: Optional[int] = None,
                tables: Optional[tuple] = None):
        """``emb`` ``(..., window, hidden)``, ``positions`` int64 ``emb.shape[:-2]`` → ``(q (..., H, D),
        k (..., H_kv, D))`` fp32 post-RoPE. RoPE: ``tables`` (``(inv_freq, mscale)`` from :meth:`rope_tables`,
        per row of ``positions``' first dim), else one ``max_length`` for every position (> ``train_length``
        switches on YaRN; training uses this)."""
        a = self.arch
        x = self.w_in(rms_norm(emb, None, a["eps"]).flatten(-2))
        x = x + self.down(nn.functional.silu(self.up(rms_norm(x, self.mlp_norm, a["eps"]))))
        h = rms_norm(x, self.out_norm, a["eps"])
        q = self.w_q(h).unflatten(-1, (a["heads"], a["head_dim"]))
        k = self.w_k(h).unflatten(-1, (a["kv_heads"], a["head_dim"]))
        if tables is None:
            tables = yarn_rows(a["rope_theta"], a["head_dim"], int(max_length or 0), a["train_length"])
        inv, mscale = tables[0].to(emb.device), tables[1]     # on the device already for a head's tables
        return rope(q, positions, inv, mscale), rope(k, positions, inv, mscale)

    def rope_tables(self, lengths: tuple, device) -> tuple:
        """Per-row RoPE for rows of final lengths ``lengths`` (:func:`~.embedding_heads.yarn_rows`, YaRN past
        ``train_length``): ``(inv_freq fp32 (batch, D/2), mscale fp32 (batch,))`` on ``device``."""
        a = self.arch
        inv, mscale = yarn_rows(a["rope_theta"], a["head_dim"], tuple(lengths), a["train_length"])
        return inv.to(device), mscale.to(device)


def fingerprint(model) -> dict:
    """What identifies the target a head was trained for: its layout (model type, vocabulary, hidden size, layers,
    heads, KV heads, head_dim) and its embedding matrix (shape, fp64 sum and sum of absolute values)."""
    e = find_param(model, "embed_tokens.weight").double()
    fp = {"embed_shape": list(e.shape), "embed_sum": float(e.sum()), "embed_abs_sum": float(e.abs().sum())}
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "num_attention_heads"):
        h = cfg.num_attention_heads
        fp.update(model_type=str(cfg.model_type), vocab_size=int(cfg.vocab_size), hidden_size=int(cfg.hidden_size),
                  num_hidden_layers=int(cfg.num_hidden_layers), num_attention_heads=int(h),
                  num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or h),
                  head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // h))
    return fp


def fingerprint_mismatch(stored: dict, live: dict) -> list:
    """The keys present in both fingerprints that differ (floats: relative 1e-3, so a bf16 copy of the same
    weights matches)."""
    bad = []
    for key in sorted(set(stored) & set(live)):
        a, b = stored[key], live[key]
        if isinstance(a, float) or isinstance(b, float):
            if abs(float(a) - float(b)) > 1e-3 * max(abs(float(a)), abs(float(b)), 1.0):
                bad.append(key)
        elif a != b:
            bad.append(key)
    return bad


def check_fingerprint(stored: dict, model, where: str) -> None:
    """Raise ``ValueError`` when the head at ``where`` was trained for another model (names what differs)."""
    bad = fingerprint_mismatch(stored, fingerprint(model))
    if bad:
        live = fingerprint(model)
        diffs = ", ".join(f"{k}: head {stored[k]!r} vs model {live[k]!r}" for k in bad[:3])
        raise ValueError(f"the retrieval head {where} was trained for another model ({diffs}); train one for this "
                         f"model with `kvtransform distill-retrieval-head MODEL` or use head=self")


def save_head_dir(directory, block: DistilledBlock, fp: dict, extra: Optional[dict] = None) -> Path:
    """Write ``head.safetensors`` (fp16 weights) and ``head.json`` (format, architecture, fingerprint, the weights
    file's SHA-256, ``extra``).

    Both files are written under temporary names first (:func:`~kvtransform.utils.atomic_write`; the metadata
    serialised before anything is written) and then renamed into place, the weights first: a failure while writing
    leaves the previous head as it was and never a half-written file. A crash between the two renames pairs new
    weights with the old ``head.json``, which :func:`load_head_dir` refuses (the checksum differs).

    Raises:
        TypeError: ``extra`` not JSON-serialisable (nothing written). IsADirectoryError: a target is a directory.
    """
    from safetensors.torch import save

    from ..utils import atomic_write

    d = Path(directory)
    weights = save({k: v.detach().to(torch.float16).contiguous() for k, v in block.state_dict().items()})
    meta = json.dumps({"format": FORMAT, "version": 1, "arch": block.arch, "fingerprint": fp,
                       "weights_sha256": hashlib.sha256(weights).hexdigest(), **(extra or {})}, indent=1)
    for name in ("head.safetensors", "head.json"):
        if (d / name).is_dir():
            raise IsADirectoryError(f"{d / name} is a directory: remove it or choose another head directory")
    d.mkdir(parents=True, exist_ok=True)
    with atomic_write(d / "head.json") as meta_tmp, atomic_write(d / "head.safetensors") as weights_tmp:
        weights_tmp.write_bytes(weights)
        meta_tmp.write_text(meta)
    return d


def _damaged(file: Path, why: str) -> ValueError:
    """The one-line error for a damaged file of a head directory: what is wrong and how to get a good head."""
    d = file.parent
    fix = ("reinstall kvtransform" if d.parent == SHIPPED_DIR else
           f"write the head again with `kvtransform distill-retrieval-head MODEL out={d}`, or pass another head")
    why = " ".join(why.split())
    return ValueError(f"{file} is damaged ({why[:200]}): {fix}")


def _read_meta(d: Path) -> dict:
    """``head.json`` of head directory ``d``: a JSON object of :data:`FORMAT` with an ``arch`` and a fingerprint.

    Raises:
        ValueError: anything else (one line naming the file and the fix).
    """
    f = d / "head.json"
    try:
        meta = json.loads(f.read_text())
    except (UnicodeDecodeError, ValueError) as e:  # (JSONDecodeError; an integer of over 4300 digits)
        raise _damaged(f, f"not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise _damaged(f, f"a JSON {type(meta).__name__}, not an object")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{f} is not a {FORMAT} (format {meta.get('format')!r}): pass a head directory written by "
                         f"`kvtransform distill-retrieval-head`")
    bad = [k for k in ("arch", "fingerprint") if not isinstance(meta.get(k), dict)]
    if bad:
        raise _damaged(f, f"{' and '.join(bad)} missing or not a JSON object")
    lacks = [k for k in ("embed_shape", "embed_sum", "embed_abs_sum") if k not in meta["fingerprint"]]
    if lacks:  # what every fingerprint has: without them any model would match
        raise _damaged(f, f"the fingerprint lacks {', '.join(lacks)}")
    fp = meta["fingerprint"]
    for key in ("embed_sum", "embed_abs_sum"):  # NaN compares unequal to nothing in fingerprint_mismatch's test
        if not _finite_number(fp[key]):
            raise _damaged(f, f"fingerprint {key} is {_short(fp[key])}, not a finite number")
    shape = fp["embed_shape"]
    if not (isinstance(shape, list) and len(shape) == 2 and all(is_count(n, 1, 1 << 62) for n in shape)):
        raise _damaged(f, f"fingerprint embed_shape is {_short(shape)}, not [vocab, hidden]")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim"):  # the model layout (fingerprint()): positive ints where present
        if key in fp and not is_count(fp[key], 1, 1 << 62):
            raise _damaged(f, f"fingerprint {key} is {_short(fp[key])}, not a positive integer")
    if "model_type" in fp and not isinstance(fp["model_type"], str):
        raise _damaged(f, f"fingerprint model_type is {_short(fp['model_type'])}, not a string")
    return meta


def _finite_number(x) -> bool:
    """An int or float of JSON that is finite as a float (an int too large for a float is not)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _short(x) -> str:
    """``repr(x)`` cut to 60 characters (for a one-line message about a damaged value)."""
    try:
        r = repr(x)
    except ValueError:  # an int past the digit limit of int -> str conversion
        return "a number of over 4300 digits"
    return r if len(r) <= 60 else r[:57] + "..."


def load_head_dir(directory, model=None) -> tuple[DistilledBlock, dict]:
    """Load a head directory; with ``model``, refuse a head trained for another model.

    Raises:
        FileNotFoundError: no ``head.json`` / ``head.safetensors`` there.
        ValueError: not a distilled head; a damaged file (``head.json`` not a JSON object with the format, ``arch``
            and fingerprint of a head; ``head.safetensors`` truncated, not matching the checksum ``head.json``
            records, unreadable, holding non-finite weights or not the weights ``arch`` describes): one line naming
            the file and the fix; or (with ``model``) a fingerprint mismatch.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    d = Path(directory)
    if not (d / "head.json").is_file() or not (d / "head.safetensors").is_file():
        raise FileNotFoundError(f"{d} is not a distilled retrieval head (needs head.json and head.safetensors): "
                                f"train one with `kvtransform distill-retrieval-head MODEL out={d}`, or use "
                                f"retrieval=self (the packaged head)")
    meta = _read_meta(d)
    if model is not None:
        check_fingerprint(meta["fingerprint"], model, str(d))
    try:
        block = DistilledBlock(**meta["arch"])
    except (TypeError, ValueError, RuntimeError) as e:  # keys or values no DistilledBlock takes
        raise _damaged(d / "head.json", f"arch: {e}") from None
    w = d / "head.safetensors"
    data = w.read_bytes()
    digest = meta.get("weights_sha256")  # heads written before the checksum have none
    if digest is not None and hashlib.sha256(data).hexdigest() != digest:
        raise _damaged(w, "its SHA-256 differs from the one head.json records")
    try:
        state = {k: v.float() for k, v in load(data).items()}
        block.load_state_dict(state)
    except (SafetensorError, RuntimeError) as e:  # truncated or garbled; or not the weights arch describes
        raise _damaged(w, str(e)) from None
    bad = [k for k, v in state.items() if not v.isfinite().all()]
    if bad:
        raise _damaged(w, f"non-finite weights in {bad[0]}")
    return block.eval(), meta


def shipped_head_for(model) -> Optional[Path]:
    """The packaged head directory whose fingerprint matches ``model`` (None when there is none)."""
    if not SHIPPED_DIR.is_dir():
        return None
    try:
        live = fingerprint(model)
    except ValueError:  # no Llama-style embed_tokens (GPT-2's wte): no packaged head was trained on such a model
        return None
    for meta_file in sorted(SHIPPED_DIR.glob("*/head.json")):
        try:
            stored = _read_meta(meta_file.parent)["fingerprint"]
        except (OSError, ValueError):
            continue
        if not fingerprint_mismatch(stored, live):
            return meta_file.parent
    return None


@register_head("distilled")
class DistilledHead(EmbeddingKeyHead):
    """The trained head (module docstring). Where its weights come from: ``SpeContextConfig.retrieval`` =
    ``"self"`` → the packaged head for this model (:func:`shipped_head_for`), or a head directory written by
    ``kvtransform distill-retrieval-head``. The artifact stores the block's weights (``head.pt``), never the
    embedding.

    Copy rule (:attr:`COPY_BONUS`): the earlier occurrences of the current token and the token after each
    (:func:`~.embedding_heads.copy_sources`, what the target's induction heads read when it continues a repeated
    span) get ``COPY_BONUS`` added to their scores. The block alone ranks them poorly: on SmolLM2-135M the NLL
    increase of the head concentrates on copied tokens (the 10 worst of 128 steps make 97 % of it), whose source
    the deep layers 20-24 attend to and the trained block misses. Measured (budget 1024, 3 unseen documents,
    128-token continuations): NLL increase +0.113 → +0.020 nats/token, recall unchanged (0.912 → 0.913). Where
    the previous token repeats too (a bigram), the next two tokens after the successor are kept as well: on held-out
    legal text +0.128 → +0.100 nats/token (budget 1024, 512-token continuations; docs/specontext_heads.md, "The copy
    rule's bigram continuation").

    Raises (at ``bind``):
        ValueError: no packaged head for this model, or a head trained for another model.
    """

    COPY_BONUS = 20.0
    # the line being written is always kept: copy positions (+20) would otherwise push it out when the current token
    # is frequent and the budget small ("x = 1\n" * 30 at budget 64: 60 copy positions + 4 sinks filled it)
    RECENT = 16

    def __init__(self, config, scale=None):
        super().__init__(config, scale)
        self.source = str(getattr(config, "retrieval", "self") or "self")
        self.block: Optional[DistilledBlock] = None
        self.meta: dict = {}

    def bind(self, model) -> None:
        self.embed = find_param(model, "embed_tokens.weight")
        if self.block is not None:  # restored from an artifact
            check_fingerprint({k: v for k, v in self.meta["fingerprint"].items() if k.startswith("embed")}, model,
                              "in this artifact")
            return
        if _model_config(model) is None:  # a reloaded program: the block comes from load_state_dict
            raise ValueError("head='distilled' over a saved program needs the block its artifact's head.pt stores, "
                             "and head.pt holds none: save the artifact again")
        if self.source == "self":
            where = shipped_head_for(model)
            if where is None:
                raise ValueError("no packaged distilled retrieval head fits this model: train one with `kvtransform "
                                 "distill-retrieval-head MODEL` and pass transform.retrieval=<its directory>, or "
                                 "use head=self")
        else:
            where = Path(self.source).expanduser()
        self.block, self.meta = load_head_dir(where, model)
        self.block.to(self.embed.device)
        self.window = int(self.block.arch["window"])

    def prefill(self, cache, max_new_tokens=None) -> None:
        self.block.to(cache.k.device)  # a head restored from an artifact or a state dict starts on the CPU
        super().prefill(cache, max_new_tokens)

    def rope_tables(self, lengths, device):
        return self.block.rope_tables(lengths, device)

    def qk(self, emb, positions, tables):
        return self.block(emb, positions, tables=tables)

    def state_dict(self) -> dict:
        st = {f"block.{k}": v for k, v in self.block.state_dict().items()} if self.block is not None else {}
        return {**st, "meta": json.dumps(self.meta)} if st else {}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self.meta = json.loads(state["meta"])
        self.block = DistilledBlock(**self.meta["arch"])
        self.block.load_state_dict({k[len("block."):]: v for k, v in state.items() if k.startswith("block.")})
        self.block.eval()
        self.window = int(self.block.arch["window"])


def auto_head(model, retrieval="self") -> str:
    """The default head of ``SpeContextConfig(head="auto")``. With ``retrieval`` a directory, the head it holds:
    ``eagle3`` for an EAGLE-3 draft (a ``config.json`` and no ``head.json``), else ``distilled`` (whose loader names
    what the directory lacks). Otherwise ``distilled`` when a packaged head fits ``model`` (SmolLM2-135M), else the
    training-free ``self`` where it can borrow the model's layer-0 query (else ``quest``, which reads only the KV
    cache: Phi-3's fused ``qkv_proj``, Gemma 3's two RoPE tables, Phi-2's LayerNorm)."""
    if str(retrieval) != "self":
        d = Path(str(retrieval)).expanduser()
        return "eagle3" if (d / "config.json").is_file() and not (d / "head.json").is_file() else "distilled"
    if shipped_head_for(model) is not None:
        return "distilled"
    from .embedding_heads import SelfHead

    return "quest" if _model_config(model) is not None and SelfHead.unavailable(model) is not None else "self"
