"""Probe: where a selection from the current step's real queries would have to come from (SpeContext arXiv
2512.00722 selects once per step, before the layers run). On one document (SmolLM2-135M, budget 1024, 512-token true
continuation), NLL increase when layers < k use the shipped distilled head's selection and layers >= k one made from
the dense run's current-step queries (attention probabilities, group-max per KV head, max over layers): of layer k
alone, or of layers k..L-1; and the exact current-step oracle (all layers).
Usage: python3 -P tools/two_stage_selection_probe.py LICENSE.txt 3072 4,16"""
import sys, time, torch
torch.set_num_threads(2)
import kvtransform.attention_probe as ap
from kvtransform.eval_sparse import DocumentTeacher, run_head, keep_mask, nll
from kvtransform.models import load_model
from kvtransform.config import SpeContextConfig
from kvtransform.runtime.heads import make_head
from kvtransform.textdata import token_chunks
orig = ap.Probe.__call__
def call(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    if isinstance(self.keep, dict):
        saved = self.keep
        self.keep = saved[int(getattr(module, "layer_idx", 0))]
        try:
            return orig(self, module, query, key, value, attention_mask, scaling, dropout, **kw)
        finally:
            self.keep = saved
    return orig(self, module, query, key, value, attention_mask, scaling, dropout, **kw)
ap.Probe.__call__ = call
model, tok = load_model("smollm2-135m"); model.eval()
doc = sys.argv[1]; P = int(sys.argv[2]); N = 512; B = 1024
ids = token_chunks(tok, doc, P + N, 1)[0]
t0 = time.time()
teacher = DocumentTeacher(model, ids[:P]); trace = teacher.trace(ids[P:])
print("teacher", round(time.time() - t0), "s", flush=True)
L, H, _, D = trace.q.shape; h_kv = trace.k.shape[1]; g = H // h_kv
cont = trace.ids[P:]; T = trace.ids.numel()
d = nll(trace.logp, cont)
head = make_head("distilled", SpeContextConfig(head="distilled", budget=B), trace.scale[0]); head.bind(model)
sel, _ = run_head(head, trace)
keep_d = keep_mask(sel, P, T)
def cur_sel(layers):
    # current-step queries of `layers` (dense trace), group-max per KV head, max over the layers, top-B of [0, t)
    n = trace.n; out = torch.empty(n, h_kv, B, dtype=torch.long)
    for i in range(n):
        t = P + i
        best = None
        for l in layers:
            q = trace.q[l, :, i + 1]                      # (H, D) current step
            s = torch.einsum("hd,htd->ht", q, trace.k[l, :, :t].repeat_interleave(g, 0))
            s = (s * trace.scale[l]).softmax(-1).view(h_kv, g, t).amax(1)  # attention probabilities
            best = s if best is None else torch.maximum(best, s)
        k = min(B, t)
        idx = best.topk(k, -1).indices
        if k < B: idx = torch.cat([idx, torch.full((h_kv, B - k), -1)], -1)
        out[i] = idx
    return out
res = {"distilled": float((nll(teacher.sparse_logp(cont, keep_d), cont) - d).mean())}
print("distilled", res["distilled"], flush=True)
for k in [int(x) for x in sys.argv[3].split(",") if x]:
    ks = keep_mask(cur_sel([k]), P, T)
    keep = {l: (keep_d if l < k else ks) for l in range(L)}
    inc = float((nll(teacher.sparse_logp(cont, keep), cont) - d).mean())
    print(f"layers <{k}: distilled; layers >={k}: layer {k}'s current query: {inc:+.4f}", flush=True)
ks = keep_mask(cur_sel(list(range(L))), P, T)
print("exact current-step oracle (all layers):", float((nll(teacher.sparse_logp(cont, ks), cont) - d).mean()), flush=True)
for k in (12, 20):
    ks = keep_mask(cur_sel(list(range(k, L))), P, T)
    keep = {l: (keep_d if l < k else ks) for l in range(L)}
    print(f"layers <{k}: distilled; >= {k}: current queries of layers {k}..{L-1}:", float((nll(teacher.sparse_logp(cont, keep), cont) - d).mean()), flush=True)
