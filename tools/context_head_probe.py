"""Probe (docs/specontext_heads.md, "A head that reads its context"): a distilled head with a causal self-attention
sublayer, trained on the distill teacher cache, evaluated against the shipped head on one document; and ensembles.

    python3 -P tools/context_head_probe.py train OUT.pt STEPS SEED ctx window=8 dim=256 ctx_heads=4 teacher=DIR/teacher.pt
    python3 -P tools/context_head_probe.py eval LICENSE.txt shipped OUT.pt ens:mean+shipped+OUT.pt ens:max+shipped+OUT.pt
    python3 -P tools/context_head_probe.py group-teacher DIR/teacher.pt deep.pt 15 30     # layers 15..29 alone
    python3 -P tools/context_head_probe.py train DEEP.pt 4000 0 base window=8 dim=256 teacher=deep.pt
    python3 -P tools/context_head_probe.py eval-groups LICENSE.txt 15 shipped:shipped shipped:DEEP.pt
"""
import torch, torch.nn.functional as F
from torch import nn
from kvtransform.runtime.distilled import DistilledBlock, DistilledHead
from kvtransform.runtime.embedding_heads import rms_norm, rope, yarn_rows, current_tokens, _forced_windows, copy_sources
from kvtransform.runtime.heads import _scores
from kvtransform.kernels.retrieval import select_topk


class ContextBlock(DistilledBlock):
    def __init__(self, *a, ctx_heads=8, ctx_mlp=True, **kw):
        super().__init__(*a, **kw)
        dim = self.arch["dim"]
        self.arch.update(ctx_heads=ctx_heads, ctx_mlp=ctx_mlp)
        self.attn_norm = nn.Parameter(torch.ones(dim))
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        nn.init.zeros_(self.wo.weight)
        if ctx_mlp:
            self.mlp2_norm = nn.Parameter(torch.ones(dim))
            self.up2 = nn.Linear(dim, 4 * dim, bias=False)
            self.down2 = nn.Linear(4 * dim, dim, bias=False)
            nn.init.zeros_(self.down2.weight)

    def forward(self, emb, positions, max_length=None, tables=None):
        a = self.arch
        single = positions.dim() == 1
        if single:
            emb, positions = emb[None], positions[None]
        x = self.w_in(rms_norm(emb, None, a["eps"]).flatten(-2))
        x = x + self.down(F.silu(self.up(rms_norm(x, self.mlp_norm, a["eps"]))))
        if tables is None:
            tables = yarn_rows(a["rope_theta"], a["head_dim"], int(max_length or 0), a["train_length"])
        inv, mscale = tables[0].to(emb.device), tables[1]
        nh = a["ctx_heads"]
        qkv = self.wqkv(rms_norm(x, self.attn_norm, a["eps"])).unflatten(-1, (3, nh, -1))
        qa, ka, va = qkv.unbind(-3)                      # (b, S, nh, dh)
        dh = qa.shape[-1]
        ti, tm = (inv, mscale)
        if dh != a["head_dim"]:
            ti, tm = yarn_rows(a["rope_theta"], dh, int(max_length or 0), a["train_length"])
        qa, ka = rope(qa, positions, ti, tm), rope(ka, positions, ti, tm)
        o = F.scaled_dot_product_attention(qa.transpose(1, 2), ka.transpose(1, 2), va.transpose(1, 2), is_causal=True)
        x = x + self.wo(o.transpose(1, 2).flatten(-2))
        if a["ctx_mlp"]:
            x = x + self.down2(F.silu(self.up2(rms_norm(x, self.mlp2_norm, a["eps"]))))
        h = rms_norm(x, self.out_norm, a["eps"])
        q = self.w_q(h).unflatten(-1, (a["heads"], a["head_dim"]))
        k = self.w_k(h).unflatten(-1, (a["kv_heads"], a["head_dim"]))
        q, k = rope(q, positions, inv, mscale), rope(k, positions, inv, mscale)
        if single:
            q, k = q[0], k[0]
        return q, k


class PrecomputedHead(DistilledHead):
    """Eval-only: q and k of every position of cache.token_ids computed at prefill in one causal pass (the block is
    causal, so position j's q/k depend only on ids <= j)."""

    def __init__(self, config, block, scale=None, copy_bonus=20.0):
        super().__init__(config, scale)
        self._blk, self.COPY_BONUS = block, copy_bonus

    def bind(self, model):
        from kvtransform.runtime.embedding_heads import find_param
        self.embed = find_param(model, "embed_tokens.weight")
        self.block = self._blk
        self.window = int(self.block.arch["window"])

    @torch.no_grad()
    def prefill(self, cache, max_new_tokens=None):
        b, s_max = cache.token_ids.shape
        lengths = tuple([s_max] * b)
        tables = self.block.rope_tables(lengths, cache.k.device)
        pos = torch.arange(s_max).expand(b, -1)
        blk = self.block
        # the whole row at once (causal)
        if isinstance(blk, ContextBlock):
            self._q, k = blk(self._window(cache.token_ids, pos), pos, tables=tables)
        else:
            self._q, k = blk(self._window(cache.token_ids, pos), pos, tables=tables)
        self.keys = k.transpose(1, 2).contiguous()

    def select(self, cache, queries):
        tok, pos = current_tokens(cache)
        rows = torch.arange(cache.batch)
        q = self._q[rows, pos]                                # (b, H, D)
        scale = q.shape[-1] ** -0.5
        s = _scores(q, self.keys, cache.cache_seqlens, scale,
                    *_forced_windows(self.budget, max(self.num_sink, self.SINK), max(self.num_recent, self.RECENT)))
        if self.COPY_BONUS:
            src = copy_sources(cache.token_ids, tok, cache.cache_seqlens, self.COPY_MAX_OCCURRENCES)
            s = s + self.COPY_BONUS * src[:, None, :].to(s.dtype)
        return select_topk(s, self.budget, ordered=False)


class EnsembleHead(PrecomputedHead):
    """Eval-only: the mean (or max) of several precomputed heads' group-max log-probabilities."""

    def __init__(self, config, blocks, scale=None, how="mean", copy_bonus=20.0):
        super().__init__(config, blocks[0], scale, copy_bonus)
        self.heads = [PrecomputedHead(config, b, scale, copy_bonus) for b in blocks]
        self.how = how

    def bind(self, model):
        super().bind(model)
        for h in self.heads:
            h.bind(model)

    def prefill(self, cache, max_new_tokens=None):
        for h in self.heads:
            h.prefill(cache, max_new_tokens)

    def select(self, cache, queries):
        tok, pos = current_tokens(cache)
        rows = torch.arange(cache.batch)
        acc = []
        for h in self.heads:
            q = h._q[rows, pos]
            acc.append(_scores(q, h.keys, cache.cache_seqlens, q.shape[-1] ** -0.5,
                               *_forced_windows(self.budget, max(self.num_sink, self.SINK), max(self.num_recent, self.RECENT))))
        st = torch.stack(acc)
        s = st.mean(0) if self.how == "mean" else st.max(0).values
        if self.COPY_BONUS:
            src = copy_sources(cache.token_ids, tok, cache.cache_seqlens, self.COPY_MAX_OCCURRENCES)
            s = s + self.COPY_BONUS * src[:, None, :].to(s.dtype)
        return select_topk(s, self.budget, ordered=False)


def train(argv):
    import time
    from kvtransform.distill import head_scores, loss_fn
    from kvtransform.models import load_model
    from kvtransform.runtime.embedding_heads import find_param
    out, steps, seed, kind = argv[0], int(argv[1]), int(argv[2]), argv[3]
    extra = dict(a.split("=") for a in argv[4:])
    torch.set_num_threads(int(extra.pop("threads", 2)))
    m, tok = load_model("smollm2-135m"); m.eval()
    embed = find_param(m, "embed_tokens.weight").float()
    data = torch.load(extra.pop("teacher"), weights_only=False)
    items = data["items"]
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    mc = m.config
    kw = dict(window=int(extra.get("window", 8)), dim=int(extra.get("dim", 512)), rope_theta=100000.0, train_length=2048, eps=mc.rms_norm_eps)
    if kind == "ctx":
        block = ContextBlock(mc.hidden_size, 9, 3, 64, ctx_heads=int(extra.get("ctx_heads", 8)), ctx_mlp=extra.get("ctx_mlp", "1") == "1", **kw)
    else:
        block = DistilledBlock(mc.hidden_size, 9, 3, 64, **kw)
    lr = float(extra.get("lr", 3e-3))
    opt = torch.optim.AdamW(block.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * s / steps)).item()))
    hist = []; t0 = time.time()
    for step in range(steps):
        it = items[int(torch.randint(len(items), (1,), generator=gen))]
        s = head_scores(block, embed, it["ids"], it["positions"])
        loss, cap = loss_fn(s, it["target"].float(), it["positions"], "kl")
        opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(block.parameters(), 1.0); opt.step(); sched.step()
        hist.append((loss.item(), cap.item()))
        if (step + 1) % 250 == 0:
            l = hist[-250:]
            print(f"step {step+1} loss {sum(a for a,_ in l)/len(l):.4f} cap {sum(c for _,c in l)/len(l):.4f} {time.time()-t0:.0f}s", flush=True)
    torch.save({"kind": kind, "arch": block.arch, "state": block.state_dict()}, out)
    print("saved", out, time.time() - t0)



def evaluate(argv):
    import json, time
    from types import SimpleNamespace
    from kvtransform.runtime.distilled import load_head_dir, shipped_head_for
    from kvtransform.models import load_model
    from kvtransform.config import SpeContextConfig
    from kvtransform.eval_sparse import _teacher, evaluate_head
    torch.set_num_threads(int(__import__("os").environ.get("THREADS", "2")))
    docs = argv[0].split(",")
    heads = argv[1:]
    m, tok = load_model("smollm2-135m"); m.eval()
    def block_of(h):
        if h == "shipped":
            return load_head_dir(shipped_head_for(m), m)[0]
        if h.endswith(".pt"):
            d = torch.load(h, weights_only=False)
            arch = dict(d["arch"])
            if d["kind"] == "ctx":
                ch, cm = arch.pop("ctx_heads"), arch.pop("ctx_mlp")
                b = ContextBlock(**arch, ctx_heads=ch, ctx_mlp=cm)
            else:
                b = DistilledBlock(**arch)
            b.load_state_dict(d["state"]); return b.eval()
        return load_head_dir(h, m)[0]
    for doc in docs:
        prefix = 3072 if doc == "LICENSE.txt" else 4096
        cfg = SimpleNamespace(prefix=prefix, continuation=512, generate=256)
        t0 = time.time(); teacher, trace, greedy = _teacher(m, tok, doc, cfg); print("teacher", doc, round(time.time()-t0), flush=True)
        for h in heads:
            t0 = time.time()
            cfgh = SpeContextConfig(head="distilled", budget=1024)
            if h.startswith("ens:"):
                how, *parts = h[4:].split("+")
                head = EnsembleHead(cfgh, [block_of(x).float() for x in parts], trace.scale[0], how=how)
            else:
                head = PrecomputedHead(cfgh, block_of(h).float(), trace.scale[0])
            head.bind(m)
            r = evaluate_head(teacher, head, trace, greedy)
            print(json.dumps({"doc": doc, "head": h, "nll_increase": round(r["nll_increase"], 4), "agreement": round(r["agreement"], 4),
                              "recall": round(r["recall_mean"], 4), "s": round(time.time()-t0)}), flush=True)



def group_teacher(argv):
    """Teacher targets of the layers [lo, hi) alone (max over them) on the chunks and positions of a teacher.pt."""
    import time
    from kvtransform.models import load_model
    from kvtransform.attention_probe import cache_probs, probing
    src, out, lo, hi = argv[0], argv[1], int(argv[2]), int(argv[3])
    torch.set_num_threads(2)
    m, tok = load_model("smollm2-135m"); m.eval()
    data = torch.load(src, weights_only=False)
    items = []
    t0 = time.time()
    for n, it in enumerate(data["items"]):
        ids, positions = it["ids"], it["positions"]
        with torch.no_grad(), probing(m) as probe:
            probe.capture, probe.q_positions = True, positions
            m(input_ids=ids[None], use_cache=False)
            acc = None
            for l in range(lo, hi):
                p = cache_probs(probe.q[l][0], probe.k[l][0], positions, probe.scale[l])
                gm = p.unflatten(0, (probe.k[l].shape[1], -1)).amax(dim=1)
                acc = gm if acc is None else torch.maximum(acc, gm)
        tgt = acc / acc.sum(-1, keepdim=True).clamp(min=1e-30)
        items.append({"file": it["file"], "ids": ids, "positions": positions, "target": tgt.half()})
        if n % 20 == 0:
            print(n, round(time.time() - t0), flush=True)
    torch.save({"items": items, "layers": [lo, hi]}, out)
    print("saved", out, time.time() - t0)


def eval_groups(argv):
    """Per-group selection: layers [0, split) attend the first head's selection, [split, L) the second's
    (pairs "shallow:deep", each "shipped" or a .pt of train)."""
    import json
    from types import SimpleNamespace
    from kvtransform.attention_probe import Probe
    from kvtransform.runtime.distilled import load_head_dir, shipped_head_for
    from kvtransform.models import load_model
    from kvtransform.config import SpeContextConfig
    from kvtransform.eval_sparse import _teacher, run_head, keep_mask, nll
    torch.set_num_threads(2)
    orig = Probe.__call__

    def call(self, module, *a, **k):  # a dict of keep masks: one per layer
        kb = self.keep
        if isinstance(kb, dict):
            self.keep = kb[int(getattr(module, "layer_idx", 0))]
            try:
                return orig(self, module, *a, **k)
            finally:
                self.keep = kb
        return orig(self, module, *a, **k)
    Probe.__call__ = call
    doc, split = argv[0], int(argv[1])
    m, tok = load_model("smollm2-135m"); m.eval()
    L = m.config.num_hidden_layers

    def block_of(h):
        if h == "shipped":
            return load_head_dir(shipped_head_for(m), m)[0].float()
        d = torch.load(h, weights_only=False)
        b = DistilledBlock(**d["arch"]); b.load_state_dict(d["state"]); return b.eval()
    prefix = 3072 if doc == "LICENSE.txt" else 4096
    teacher, trace, greedy = _teacher(m, tok, doc, SimpleNamespace(prefix=prefix, continuation=512, generate=256))
    for pair in argv[2:]:
        a, b = pair.split(":")

        def keeps(tr):
            ks = []
            for h in (a, b):
                head = PrecomputedHead(SpeContextConfig(head="distilled", budget=1024), block_of(h), trace.scale[0])
                head.bind(m)
                sel, _ = run_head(head, tr)
                ks.append(keep_mask(sel, tr.prefix, tr.ids.numel()))
            return {l: ks[0] if l < split else ks[1] for l in range(L)}
        cont = trace.ids[trace.prefix:]
        d, s = nll(trace.logp, cont), nll(teacher.sparse_logp(cont, keeps(trace)), cont)
        g = greedy.ids[greedy.prefix:]
        glogp = teacher.sparse_logp(g, keeps(greedy))
        agree = float((glogp[:-1].argmax(-1).cpu() == g[1:]).double().mean())
        print(json.dumps({"doc": doc, "split": split, "pair": pair, "nll_increase": round(float((s - d).mean()), 4),
                          "agreement": round(agree, 4)}), flush=True)


if __name__ == "__main__":
    import sys
    {"train": train, "eval": evaluate, "group-teacher": group_teacher, "eval-groups": eval_groups}[sys.argv[1]](
        sys.argv[2:])
