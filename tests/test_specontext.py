"""SpeContext transform (arXiv 2512.00722 §4–5): exactness against HF generate, the recent-head plumbing against a
plain-PyTorch reference, save/load in a fresh process, sampling, per-row EOS, bad input."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvtransform as kvt
from kvtransform.models import tiny_model
from kvtransform.runtime.heads import HEADS


def _transform(model, **cfg):
    return kvt.transform(model, kvt.SpeContextConfig(**cfg), progress=False)


def _hf_greedy(model, row, n, eos=None):
    with torch.no_grad():
        out = model.generate(row[None], attention_mask=torch.ones(1, len(row), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(row):]


def _with_config(sp, cfg, model):
    """A SpeContext module on ``sp``'s programs (captured from ``model``) with settings ``cfg`` (head, budget, sink,
    ...): what a transform of ``model`` with ``cfg`` builds after its capture (the captured decode step takes any
    budget), without capturing again."""
    return type(sp)(sp.core["prefill"], sp.core["decode"], cfg, sp.report, sp.info, sp.head.scale, model=model)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def sp_llama(llama):
    return _transform(llama, budget=64, head="quest")


@pytest.fixture(scope="module")
def _sp_llama_saved(sp_llama, tmp_path_factory):
    return sp_llama.save(tmp_path_factory.mktemp("sp_llama") / "sp")


@pytest.fixture
def sp_llama_artifact(_sp_llama_saved, tmp_path):
    """A private copy of ``sp_llama``'s saved artifact (a test may damage its files)."""
    import shutil

    return Path(shutil.copytree(_sp_llama_saved, tmp_path / "sp"))


@pytest.mark.parametrize("family,head", [("llama", "quest"), ("qwen2", "dense"), ("qwen3", "oracle"),
                                         ("mistral", "recent")])
def test_exact_when_budget_covers_context(family, head, left_padded):
    model = tiny_model(family)
    sp = _transform(model, budget=256, head=head)
    assert sp.report.count("sparse_decode") == model.config.num_hidden_layers
    assert sp.report.verification.passed
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in (5, 47, 20)]
    ids, am = left_padded(rows)
    out = sp.generate(ids, am, max_new_tokens=16, eos_token_id=None, return_dict_in_generate=True)
    assert out.sequences.shape == (3, ids.shape[1] + 16)
    assert torch.equal(out.sequences[:, :ids.shape[1]], ids)
    for b, r in enumerate(rows):
        assert torch.equal(out.sequences[b, ids.shape[1]:], _hf_greedy(model, r, 16)), (family, head, b)
    st = out.stats
    assert st.decode_steps == 15 and st.new_tokens == 48 and st.prompt_tokens == 72
    assert st.cache_max_length == 47 + 16
    assert st.kv_bytes == 2 * 2 * 3 * 2 * (47 + 16) * 16 * 4  # 2 (K,V) * L * B * H_kv * max_len * D * fp32
    assert st.decode_tokens_per_s > 0 and 0 < st.selection_overlap <= 1


def _recent_reference(model, prompt, n_new, budget, sink):
    """Greedy decoding where token i (i >= len(prompt)) attends to exactly the recent head's choice over the
    i cached tokens (the first ``sink`` and the last ``budget - sink``, all when i <= budget) plus itself: full
    recomputation with an explicit 4-D mask every step."""
    seq = prompt.clone()
    p = len(prompt)
    for _ in range(n_new):
        t = len(seq)
        keep = torch.ones(t, t, dtype=torch.bool).tril()
        for i in range(p, t):
            allowed = torch.zeros(t, dtype=torch.bool)
            if i <= budget:
                allowed[:i] = True
            else:
                allowed[:sink] = True
                allowed[i - (budget - sink):i] = True
            allowed[i] = True
            keep[i] = allowed
        with torch.no_grad():
            logits = model(input_ids=seq[None], attention_mask=keep[None, None], use_cache=False).logits
        seq = torch.cat([seq, logits[0, -1].argmax()[None]])
    return seq[p:]


def test_recent_head_attends_exactly_the_chosen_positions(llama, sp_llama, left_padded):
    budget, sink = 12, 3
    sp = _with_config(sp_llama, kvt.SpeContextConfig(budget=budget, num_sink=sink, head="recent"), llama)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in (30, 9)]
    ids, am = left_padded(rows)
    out = sp.generate(ids, am, max_new_tokens=10, eos_token_id=None)
    for b, r in enumerate(rows):
        assert torch.equal(out[b, ids.shape[1]:], _recent_reference(llama, r, 10, budget, sink)), b


def test_recent_differs_from_dense_below_context(llama, sp_llama):
    """The budget really limits attention: a 4-token window changes the greedy continuation of a long prompt."""
    sp = _with_config(sp_llama, kvt.SpeContextConfig(budget=4, head="recent"), llama)
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(2))
    dense = sp_llama.generate(ids, max_new_tokens=12, eos_token_id=None)
    assert not torch.equal(sp.generate(ids, max_new_tokens=12, eos_token_id=None), dense)


@pytest.mark.parametrize("head", ["quest", "recent", "oracle"])
def test_a_budget_beyond_the_cache_selects_what_the_cache_holds(llama, sp_llama, head):
    """A budget above prompt + new tokens is used as that length for the call (a budget of 10**9 once allocated
    tens of GB of -1 padding): the same tokens as a budget covering the context; the configured budget stays."""
    cfg = kvt.SpeContextConfig(budget=10 ** 9, head=head)
    sp = _with_config(sp_llama, cfg, llama) if head != "quest" else kvt.transform(llama, cfg, progress=False)
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(5))
    out = sp.generate(ids, max_new_tokens=5, eos_token_id=None, return_dict_in_generate=True)
    assert torch.equal(out.sequences, sp_llama.generate(ids, max_new_tokens=5, eos_token_id=None))
    assert out.stats.budget == 15 and sp.head.budget == 10 ** 9


def test_quest_and_oracle_select_within_budget(llama, sp_llama):
    for head in ("quest", "oracle"):
        sp = _with_config(sp_llama, kvt.SpeContextConfig(budget=32, head=head), llama)
        ids = torch.randint(3, 128, (2, 100), generator=torch.Generator().manual_seed(3))
        st = sp.generate(ids, max_new_tokens=6, eos_token_id=None, return_dict_in_generate=True).stats
        assert st.decode_steps == 5 and st.selection_overlap is not None and 0 < st.selection_overlap <= 1
        cache, _ = sp.runtime.prefill([ids[0], ids[1]], 110, torch.device("cpu"))
        sp.head.prefill(cache)
        q = torch.randn(2, 2, 4, 16)
        sel = sp.head.step(cache, q)
        valid = sel[sel >= 0]
        assert sel.shape[:2] == (2, 2) and (sel >= 0).sum(-1).max() <= 32 and int(valid.max()) < 100
        assert all(len(set(s.tolist()) - {-1}) == int((s >= 0).sum()) for s in sel.flatten(0, 1))  # no repeats


@pytest.mark.parametrize("budget,sink,recent,want", [
    (16, 4, 12, {6}),         # one page: the newest (96..99), not the sink's or the recent window's older page
    (16, 4, 0, {6}),          # the newest page before the sink's
    (32, 4, 20, {6, 5}),      # newest, then the recent window's other page (80..95), not the sink's
    (48, 4, 20, {6, 5, 0}),   # all three forced pages fit
    (64, 4, 20, {6, 5, 0, None}),  # and one page by score
])
def test_quest_keeps_forced_pages_by_priority(llama, sp_llama, budget, sink, recent, want):
    """More forced pages than the budget's: the newest page first, then the recent pages, then the sink (the
    newest page was dropped for the sink's before). Rows of 100 tokens, pages of 16. (The programs of one transform
    with each setting: the captured decode step takes any budget.)"""
    sp = _with_config(sp_llama, kvt.SpeContextConfig(budget=budget, head="quest", num_sink=sink, num_recent=recent),
                      llama)
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(3))
    cache, _ = sp.runtime.prefill([ids[0]], 110, torch.device("cpu"))
    sp.head.prefill(cache)
    sel = sp.head.step(cache, torch.randn(2, 1, 4, 16))
    for row in sel[0]:
        pages = {int(t) // 16 for t in row if t >= 0}
        assert {p for p in want if p is not None} <= pages and len(pages) == budget // 16, pages
        if None not in want:
            assert pages == want


def test_sampling_is_seeded_and_top_k_1_is_greedy(sp_llama):
    ids = torch.randint(3, 128, (2, 15), generator=torch.Generator().manual_seed(4))
    a = sp_llama.generate(ids, max_new_tokens=8, do_sample=True, temperature=0.8, top_p=0.9, seed=7,
                          eos_token_id=None)
    b = sp_llama.generate(ids, max_new_tokens=8, do_sample=True, temperature=0.8, top_p=0.9, seed=7,
                          eos_token_id=None)
    assert torch.equal(a, b)
    greedy = sp_llama.generate(ids, max_new_tokens=8, eos_token_id=None)
    assert torch.equal(sp_llama.generate(ids, max_new_tokens=8, do_sample=True, top_k=1, seed=1,
                                         eos_token_id=None), greedy)


def test_temperature_that_overflows_the_logits_samples_greedily(sp_llama):
    """logits / 1e-38 overflows float32: the draw used to fail in torch.multinomial (probability tensor contains
    inf/nan); such a temperature is the greedy limit of sampling."""
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    greedy = sp_llama.generate(ids, max_new_tokens=6, eos_token_id=None)
    for temperature in (1e-38, 1e-300):
        got = sp_llama.generate(ids, max_new_tokens=6, do_sample=True, temperature=temperature, seed=0,
                                eos_token_id=None)
        assert torch.equal(got, greedy)
    from kvtransform.runtime.generate import _sampler

    logits = torch.tensor([[10.0, 30.0, 20.0], [-5.0, -4.0, -6.0], [0.1, 0.3, 0.2]])  # overflows up, down, not
    draw = _sampler(True, 1e-38, None, None, 0, "cpu")
    assert draw(logits).tolist() == [1, 1, 1]
    assert _sampler(True, 1e-38, 2, 0.5, 0, "cpu")(logits).tolist() == [1, 1, 1]  # with top-k / top-p too


def test_per_row_eos_stop_matches_hf(llama, sp_llama, left_padded):
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in (11, 6)]
    free = _hf_greedy(llama, rows[0], 10)
    eos = int(free[3])  # row 0 emits it at step 3 (or earlier)
    ids, am = left_padded(rows)
    out = sp_llama.generate(ids, am, max_new_tokens=10, eos_token_id=eos, pad_token_id=0)
    for b, r in enumerate(rows):
        ref = _hf_greedy(llama, r, 10, eos=eos)
        new = out[b, ids.shape[1]:]
        assert torch.equal(new[:len(ref)], ref) and bool((new[len(ref):] == 0).all()), b
    assert out.shape[1] <= ids.shape[1] + 10


def test_save_load_in_fresh_process(sp_llama, tmp_path):
    ids = torch.randint(3, 128, (2, 13), generator=torch.Generator().manual_seed(6))
    want = sp_llama.generate(ids, max_new_tokens=8, eos_token_id=None)
    assert sp_llama.runtime._fused().extra_bytes == 0  # the fused projections are the parameters (shared)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = sp_llama.save(tmp_path / "sp")
    assert not [w for w in caught if "No complete tensor" in str(w.message)]
    assert {"prefill_shared.pt2", "decode.pt2", "head.pt", "config.yaml", "report.json", "meta.json"} <= \
        {p.name for p in path.iterdir()}
    # the weights are on disk once: the prefill program's are placeholders bound to decode.pt2's on load
    import zipfile

    def weight_bytes(f):  # the weight payloads of a .pt2 archive (a zip), not their json index
        return sum(i.file_size for i in zipfile.ZipFile(path / f).infolist()
                   if "/data/weights/" in i.filename and not i.filename.endswith(".json"))
    assert weight_bytes("prefill_shared.pt2") < 0.01 * weight_bytes("decode.pt2")
    assert not (path / "prefill.pt2").exists()
    # the reloaded decode program's q/k/v and gate/up rows are still one storage per group: fused without a copy
    # and the reloaded prefill program holds the decode program's weights, not a second copy
    code = ("import json, sys, torch, kvtransform as kvt; ids = torch.tensor(json.loads(sys.argv[2])); "
            "sp = kvt.load(sys.argv[1]); out = sp.generate(ids, max_new_tokens=8, eos_token_id=None, "
            "return_dict_in_generate=True); "
            "pre, dec = (dict(sp.core[k].named_parameters(remove_duplicate=False)) for k in ('prefill', 'decode')); "
            "shared = [n for n in pre if n in dec and pre[n] is dec[n]]; "
            "print(json.dumps([out.sequences.tolist(), out.stats.fused_weight_bytes, len(shared), len(pre)]))")
    res = subprocess.run([sys.executable, "-c", code, str(path), json.dumps(ids.tolist())], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    seqs, fused_bytes, shared, n_params = json.loads(res.stdout.strip().splitlines()[-1])
    assert seqs == want.tolist() and fused_bytes == 0
    assert shared == n_params > 0


def test_sizes_outside_the_capture_ranges_decode(tmp_path):
    """The export's Dim ranges are not limits of the programs: a budget past the model's positions (the default
    2048 with 1024 positions), a 1-token prompt (cache of 3 < the captured minimum of 4), also after a reload, give
    HF's greedy tokens (an MHA model: it raised "Guard failed: indices.size()[2] <= 1024")."""
    m = tiny_model("llama", num_key_value_heads=4, max_position_embeddings=1024)
    sp = kvt.transform(m, "specontext", progress=False)
    again = kvt.load(sp.save(tmp_path / "mha"))
    g = torch.Generator().manual_seed(3)
    for n, new in ((10, 4), (1, 2)):
        row = torch.randint(3, 128, (n,), generator=g)
        ref = _hf_greedy(m, row, new)
        for model in (sp, again):
            out = model.generate(row[None], max_new_tokens=new, eos_token_id=None)
            assert torch.equal(out[0, n:], ref), (n, model is sp)


def test_artifact_with_damaged_weight_list_is_refused(sp_llama, sp_llama_artifact):
    path = sp_llama_artifact
    meta = json.loads((path / "meta.json").read_text())
    assert meta["prefill_weights_from_decode"] and meta["retrieval_head"] == sp_llama.runtime.head.name
    for names, match in ((None, "needs meta.json's 'prefill_weights_from_decode' list"),
                         (meta["prefill_weights_from_decode"][1:], "are placeholders that meta.json's"),
                         (meta["prefill_weights_from_decode"] + ["core.not_a_weight"], "'core.not_a_weight' should "
                                                                                       "come from decode.pt2")):
        bad = dict(meta)
        if names is None:
            bad.pop("prefill_weights_from_decode")
        else:
            bad["prefill_weights_from_decode"] = names
        (path / "meta.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            kvt.load(path)


def test_artifact_with_damaged_model_info_or_head_file_is_named_in_one_line(sp_llama, sp_llama_artifact):
    """meta.json's model_info and head.pt, damaged: one ValueError line naming the file (before: a TypeError from
    ModelInfo(**...), an AttributeError from a gutted head.pt)."""
    path = sp_llama_artifact
    meta = json.loads((path / "meta.json").read_text())
    info = meta["model_info"]
    for bad, why in (([1, 2], "a JSON list, not an object"), ({**info, "extra": 1}, r"unknown \['extra'\]"),
                     ({k: v for k, v in info.items() if k != "head_dim"}, r"missing \['head_dim'\]"),
                     ({**info, "num_layers": "2"}, "num_layers is '2', not a positive int"),
                     ({**info, "dtype": "float99"}, "dtype is 'float99', not a torch dtype's name"),
                     ({**info, "eos_token_id": 2}, "eos_token_id is 2, not a list of ints"),
                     # facts the saved decode step contradicts (an edited meta.json, or another artifact's)
                     ({**info, "num_layers": 3}, r"num_layers 3 \(the program's: 2\) does not match decode.pt2"),
                     ({**info, "max_positions": 10 ** 7}, r"max_positions 10000000 \(the program takes at most "
                                                          r"\d+\) does not match decode.pt2")):
        (path / "meta.json").write_text(json.dumps({**meta, "model_info": bad}))
        with pytest.raises(ValueError, match=rf"^{path / 'meta.json'} is damaged \(model_info: {why}\): save the "
                                             rf"artifact again$"):
            kvt.load(path)
    for scale in ("x", -1.0, True, float("inf")):  # (loaded, then a TypeError inside the first generate)
        (path / "meta.json").write_text(json.dumps({**meta, "softmax_scale": scale}))
        with pytest.raises(ValueError, match=r"meta.json is damaged \(softmax_scale .* is not a positive number\)"):
            kvt.load(path)
    (path / "meta.json").write_text(json.dumps(meta))
    for gutted in ([1, 2], {"state": {}}, {"name": "quest"}):
        torch.save(gutted, path / "head.pt")
        with pytest.raises(ValueError, match=r"head.pt is damaged \(not a retrieval head's name and state\)"):
            kvt.load(path)
    for name in ("", "bogus"):  # (an empty name used to fall back to the config's head)
        torch.save({"name": name, "state": {}}, path / "head.pt")
        with pytest.raises(ValueError, match=rf"head.pt is damaged \(head name {name!r} is not a retrieval head: "):
            kvt.load(path)


def test_a_self_head_state_that_does_not_fit_is_refused_at_load(llama, sp_llama):
    """head.pt of a self head over a saved program, emptied or holding other tensors: refused where the artifact is
    built (before: a KeyError 'layers' at the first generate). A good state builds."""
    def build(state):
        return type(sp_llama)(sp_llama.core["prefill"], sp_llama.core["decode"], kvt.SpeContextConfig(budget=8),
                              sp_llama.report, sp_llama.info, sp_llama.head.scale, head_name="self", head_state=state)

    state = _with_config(sp_llama, kvt.SpeContextConfig(budget=8, head="self"), llama).head.state_dict()
    build(state)
    with pytest.raises(ValueError, match=r"^head='self' over a saved program needs .* head.pt holds none: save the"):
        build({})
    with pytest.raises(ValueError, match=r"^head='distilled' over a saved program needs .* head.pt holds none: save"):
        type(sp_llama)(sp_llama.core["prefill"], sp_llama.core["decode"], kvt.SpeContextConfig(budget=8),
                       sp_llama.report, sp_llama.info, sp_llama.head.scale, head_name="distilled", head_state={})
    for bad, lacks in (({"x": torch.zeros(3)}, "layers"), ({k: v for k, v in state.items() if k != "q0"}, "q0")):
        with pytest.raises(ValueError, match=rf"^the saved state of the 'self' retrieval head does not load "
                                             rf"\(ValueError: the self head's state lacks {lacks}.*save the artifact"):
            build(bad)


def test_artifact_missing_its_shared_prefill_program_names_that_file(sp_llama, tmp_path):
    path = sp_llama.save(tmp_path / "sp")
    (path / "prefill_shared.pt2").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing \['prefill_shared.pt2'\]"):
        kvt.load(path)


def test_artifact_with_a_full_prefill_program_still_loads(sp_llama, tmp_path, monkeypatch):
    """Artifacts written before prefill_shared.pt2 hold prefill.pt2 with its own weights: they load, sharing the
    weights that are equal."""
    from kvtransform.transforms import specontext as sp_mod

    monkeypatch.setattr(sp_mod, "_strip_shared_weights", lambda pre, dec: [])
    path = sp_llama.save(tmp_path / "old")
    assert (path / "prefill.pt2").is_file() and not (path / "prefill_shared.pt2").exists()
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    again = kvt.load(path)
    pre, dec = (dict(again.core[k].named_parameters(remove_duplicate=False)) for k in ("prefill", "decode"))
    assert all(pre[n] is dec[n] for n in pre if n in dec) and pre
    assert torch.equal(again.generate(ids, max_new_tokens=5, eos_token_id=None),
                       sp_llama.generate(ids, max_new_tokens=5, eos_token_id=None))


# ---- bad input ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg,match", [
    (dict(budget=0), "budget must be >= 1"),
    (dict(budget=-3), "budget must be >= 1"),
    (dict(head="nope"), r"unknown retrieval head 'nope'; choose one of \['auto', "),
])
def test_bad_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        kvt.SpeContextConfig(**cfg).validate()


def test_unknown_head_lists_valid_ones(llama):
    with pytest.raises(ValueError) as e:
        kvt.transform(llama, {"name": "specontext", "head": "eagle9"}, progress=False)
    assert all(h in str(e.value) for h in HEADS)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(max_new_tokens=250), "exceeds the model's 256 positions"),
    (dict(eos_token_id=128), "eos_token_id 128 is outside the vocabulary"),
    (dict(eos_token_id=[2, -1]), "outside the vocabulary"),
    (dict(eos_token_id=2.0), "eos_token_id 2.0 is outside the vocabulary .* or not an integer id"),  # was TypeError
    (dict(eos_token_id=torch.tensor(2.0)), "not an integer id"),
    (dict(eos_token_id=torch.tensor([2.0])), "not an integer id"),
    (dict(eos_token_id=True), "not an integer id"),
    (dict(output_logprobs=True), "pass return_dict_in_generate=True too"),  # the ids alone would drop them
    (dict(do_sample=True, temperature=0.0), "temperature must be a finite number > 0"),
    (dict(do_sample=True, temperature=float("inf")), "temperature must be a finite number > 0"),  # was uniform
    (dict(do_sample=True, temperature=float("nan")), "temperature must be a finite number > 0"),
    (dict(do_sample=True, temperature=True), "temperature must be a finite number > 0"),
    (dict(temperature=True), r"temperature must be a number \(ignored when do_sample=False\)"),
    (dict(do_sample="yes"), "do_sample must be True or False; got 'yes'"),
    (dict(do_sample=1), "do_sample must be True or False"),
    (dict(do_sample=True, seed=1.5), r"seed must be an integer in \[0, 2\*\*64\)"),
    (dict(eos_token_id="none"), "eos_token_id must be an id, a list of ids, None .* or 'default'"),  # was the default
    (dict(do_sample=True, top_p=True), r"top_p must be in \(0, 1\]"),
    (dict(do_sample=True, seed=-1), r"seed must be an integer"),
    (dict(attention_mask=[[1] * 10] * 2), "attention_mask must be a 0/1 tensor"),  # was AttributeError
    (dict(pad_token_id=128), r"pad_token_id must be an id in \[0, 128\)"),  # was IndexError at a row's EOS
    (dict(pad_token_id=-1), "pad_token_id must be an id"),
    (dict(return_dict_in_generate="no"), "return_dict_in_generate must be True or False"),  # was a GenerateOutput
    (dict(progress="yes"), "progress must be True, False or None"),
])
def test_bad_generate_arguments(sp_llama, kwargs, match):
    ids = torch.randint(3, 128, (2, 10))
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        sp_llama.generate(ids, **kwargs)


def test_a_bad_pad_id_from_the_generation_config_names_its_source():
    """A pad id the caller never passed (the model's generation_config default) outside the vocabulary is named as
    the config's, with the argument that overrides it (the message told the user to fix an argument they did not
    pass, and that None, the default that failed, was allowed)."""
    model = kvt.tiny_model("llama")
    model.generation_config.pad_token_id = -1
    sp = kvt.transform(model, kvt.SpeContextConfig(budget=16), progress=False)
    ids = torch.randint(3, 128, (1, 6))
    with pytest.raises(ValueError, match=r"generation_config.pad_token_id=-1 is not an id .* pass pad_token_id="):
        sp.generate(ids, max_new_tokens=2)
    assert sp.generate(ids, max_new_tokens=2, pad_token_id=2).shape == (1, 8)


def test_a_prompt_with_no_room_to_generate_says_how_much_to_shorten(sp_llama):
    with pytest.raises(ValueError, match=r"prompt of 300 tokens leaves no room .* at most 255 tokens \(45 fewer\)"):
        sp_llama.generate(torch.randint(3, 128, (1, 300)), max_new_tokens=3)


@pytest.mark.parametrize("temperature", [0, 0.0, -1.0, None, float("inf")])
def test_greedy_ignores_temperature_like_hf(sp_llama, temperature):
    """do_sample=False decodes greedily whatever the temperature (HF ignores it there)."""
    ids = torch.randint(3, 128, (2, 10))
    got = sp_llama.generate(ids, max_new_tokens=3, do_sample=False, temperature=temperature, eos_token_id=None)
    want = sp_llama.generate(ids, max_new_tokens=3, eos_token_id=None)
    assert torch.equal(got, want)


def test_one_prompt_without_a_batch_dimension_names_the_fix(sp_llama):
    with pytest.raises(ValueError, match=r"got torch.int64 \(10,\): one prompt needs a batch dimension, pass "
                                         r"input_ids\[None\]"):
        sp_llama.generate(torch.randint(3, 128, (10,)), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"got a list: pass torch.tensor\(\[ids\]\)"):
        sp_llama.generate([1, 2, 3], max_new_tokens=2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(topk=5), r"'topk' \(did you mean top_k\?\)"),
    (dict(max_length=30), r"'max_length' \(did you mean max_new_tokens"),
    (dict(num_beams=4, streamer=None), r"'num_beams', 'streamer'.*It takes attention_mask, max_new_tokens"),
])
def test_unsupported_generate_keywords_name_the_fix(sp_llama, kwargs, match):
    with pytest.raises(TypeError, match=match):
        sp_llama.generate(torch.randint(3, 128, (1, 6)), **kwargs)


def test_empty_prompt_row(sp_llama):
    ids = torch.randint(3, 128, (2, 6))
    am = torch.ones_like(ids)
    am[1] = 0
    with pytest.raises(ValueError, match="prompt row 1 is empty"):
        sp_llama.generate(ids, am, max_new_tokens=2)


def test_sliding_window_model_decodes_within_its_window():
    """Mistral with a window of 8: every decode site carries ``window=8`` (the gate, on, compares prefill and decode
    logits with the original model on prompts longer than the window); KV offload, whose slots are not cache
    positions, refuses the window in one line."""
    sp = _transform(tiny_model("mistral", sliding_window=8), budget=64, head="dense")
    assert sp.report.verification.passed and [s.window for s in sp.report.sites] == [8, 8]
    for slot in (False, True):
        calls = [n for n in sp.runtime.programs.program(slot).graph.nodes
                 if n.target is torch.ops.kvt.sparse_decode_attention.default]
        assert [n.kwargs.get("window") for n in calls] == [8, 8]
    with pytest.raises(ValueError, match=r"^KV offload does not support sliding-window layers yet \(window 8\)"):
        sp.runtime.programs.layer_split()


def test_dense_head_runs_the_slot_mode_program_with_gather_mode_logits(llama):
    """The dense head decodes through the slot-mode variant of the program (each layer reads its cache up to
    cache_seqlens); its logits equal the gather-mode program's over all_positions, step by step on a ragged batch."""
    from kvtransform.passes.sparse_decode import slot_mode_program
    from kvtransform.runtime.heads import all_positions

    sp = _transform(llama, budget=64, head="dense")
    rt = sp.runtime
    assert rt.head.slot_mode
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in (3, 30, 11)]
    assert any(p.requires_grad for p in llama.parameters())
    cache, logits = rt.prefill(rows, 40, torch.device("cpu"))
    assert not logits.requires_grad and not cache.k.requires_grad  # inference only: no activations kept
    tok = logits.argmax(-1)
    rt.head.prefill(cache)
    for _ in range(4):
        cache.set_current(tok)
        idx = all_positions(cache)
        ref = rt.decode_fn(tok[:, None], cache.cache_seqlens, idx, cache.k, cache.v)
        got, _ = rt.decode(cache, tok, rt.head.step(cache, None))
        assert rt.programs._slot is not None
        torch.testing.assert_close(got, ref[0], rtol=1e-5, atol=1e-5)
        tok = got.argmax(-1)
    with pytest.raises(ValueError, match="sparse-decode pass"):
        slot_mode_program(sp.core["prefill"])
    # a runtime around a plain callable keeps gather mode: the head's indices are honoured
    from kvtransform.runtime.generate import SpeContextRuntime

    plain = SpeContextRuntime(rt.prefill_fn, lambda *a: rt.decode_fn(*a), rt.head, rt.info)
    assert not plain._slot_mode()
    cache.set_current(tok)
    few = all_positions(cache).clone()
    few[:, :, 3:] = -1  # only the first 3 positions
    ref = rt.decode_fn(tok[:, None], cache.cache_seqlens, few, cache.k, cache.v)[0]
    got, _ = plain.decode(cache, tok, few)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_replaced_parameter_is_an_error_not_stale_weights():
    """load_state_dict(assign=True) swaps the model's Parameter objects: the captured programs would decode with
    the old weights, so generate refuses; in-place updates are followed."""
    model = tiny_model("llama")
    sp = _transform(model, budget=64, head="quest")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(0.5)  # in place: followed
    out = sp.generate(ids, max_new_tokens=4, eos_token_id=None)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, ref)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    for call in (lambda: sp.generate(ids, max_new_tokens=4), lambda: sp(ids)):
        with pytest.raises(ValueError, match=r"was replaced after the transform \(load_state_dict\(assign=True\)"):
            call()


def test_parameter_check_sees_untied_weights_and_spares_deep_copies():
    import copy

    model = tiny_model("llama")
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    sp = _transform(model, budget=64, head="quest")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    twin = copy.deepcopy(sp)  # its programs hold their own copies: nothing of the model to check
    assert torch.equal(twin.generate(ids, max_new_tokens=4, eos_token_id=None),
                       sp.generate(ids, max_new_tokens=4, eos_token_id=None))
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))  # untied after the transform
    with pytest.raises(ValueError, match="'lm_head.weight' was replaced after the transform"):
        sp(ids)
    twin(ids)


def test_self_head_follows_in_place_updates():
    """The training-free ``self`` head reads the model's own layer-0 q projection at every generate (not a copy
    taken at transform time): after an in-place update it selects what a fresh transform of the updated model
    selects."""
    model = tiny_model("llama")
    sp = _transform(model, budget=16, head="self")
    ids = torch.randint(3, 128, (2, 60), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for p in model.model.layers[0].self_attn.q_proj.parameters():
            p.mul_(-3.0)
    got = sp.generate(ids, max_new_tokens=8, eos_token_id=None, return_dict_in_generate=True)
    fresh = _transform(model, budget=16, head="self").generate(ids, max_new_tokens=8, eos_token_id=None,
                                                              return_dict_in_generate=True)
    assert torch.equal(got.sequences, fresh.sequences)
    assert got.stats.selection_checksums == fresh.stats.selection_checksums


def test_selection_checksum_is_of_the_set():
    """Heads may return their selection in any order (the embedding heads' top-k is unordered): the step checksum
    compares sets per KV head, so an eager run and a graph replay agree whatever order each returned."""
    from kvtransform.runtime.generate import _checksum

    sel = torch.randint(-1, 5000, (3, 4, 64), dtype=torch.int32)
    shuffled = sel[..., torch.randperm(64)]
    assert torch.equal(_checksum(sel), _checksum(shuffled))
    assert not torch.equal(_checksum(sel), _checksum(sel[:, [1, 0, 2, 3]]))       # another head's set
    swap = torch.tensor([[[0, 3], [1, 2]], [[1, 2], [0, 3]]], dtype=torch.int32)  # equal sums, exchanged
    assert _checksum(swap)[0] != _checksum(swap)[1]
    other = sel.clone()
    other[0, 0, 0] = int(other[0, 0, 0]) + 1 if int(other[0, 0, 0]) < 4999 else 0  # one position differs
    assert _checksum(other)[0] != _checksum(sel)[0] and torch.equal(_checksum(other)[1:], _checksum(sel)[1:])


def test_compiled_cache_length_buckets():
    """With compile on CUDA, ``generate``'s cache length is rounded up to one of 8 buckets per power of two (at
    least 256 tokens), so a GRPO run's rollouts of nearby prompt lengths reuse one compiled program; eager, on the
    CPU or with offload it is the needed length itself."""
    from kvtransform.runtime.generate import SpeContextRuntime

    rt = SpeContextRuntime.__new__(SpeContextRuntime)  # cache_length reads only these settings
    rt.compile, rt.offload = True, False
    got = {n: rt.cache_length(n, "cuda") for n in (1, 100, 256, 257, 2048, 2049, 9000, 17000, 17408)}
    assert got == {1: 256, 100: 256, 256: 256, 257: 512, 2048: 2048, 2049: 2304, 9000: 9216, 17000: 18432,
                   17408: 18432}
    for n in range(2048, 40000, 97):
        c = rt.cache_length(n, torch.device("cuda", 0))
        assert n <= c <= n * 9 // 8 + 1
    # a run's rollouts: prompts of 1,000-2,000 tokens + 16,384 new tokens share one bucket (not 1,001 lengths)
    assert {rt.cache_length(p + 16384, "cuda") for p in range(1000, 2001)} == {18432}
    assert rt.cache_length(9000, "cpu") == 9000
    rt.offload = True
    assert rt.cache_length(9000, "cuda") == 9000
    rt.offload, rt.compile = False, False
    assert rt.cache_length(9000, "cuda") == 9000
    for bad in (0, -300, True, 2.5):
        with pytest.raises(ValueError, match="an integer >= 1"):
            rt.cache_length(bad, "cuda")


@pytest.mark.parametrize("head", ["quest", "self", "recent", "oracle"])
def test_a_longer_cache_changes_no_token_or_selection(llama, sp_llama, head):
    """The cache-length bucket (``cache_length`` with compile on CUDA) leaves tokens and selections as they are:
    here forced on the CPU (a cache of 256 for 32 needed tokens), with more forced quest pages (sink + newest) than
    the budget holds, where top-k's tie order once depended on the page table's width."""
    extra = dict(page_size=4, num_sink=8) if head == "quest" else {}
    sp = _with_config(sp_llama, kvt.SpeContextConfig(head=head, budget=8, **extra), llama)
    ids = torch.randint(3, 128, (3, 20), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[1, :7] = 0
    am[2, :13] = 0
    kw = dict(max_new_tokens=12, eos_token_id=None, return_dict_in_generate=True)
    ref = sp.generate(ids, am, **kw)
    sp.runtime.cache_length = lambda needed, device: 256
    out = sp.generate(ids, am, **kw)
    assert out.stats.cache_max_length == 256 and ref.stats.cache_max_length == 32
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.selection_checksums == ref.stats.selection_checksums


def test_onnx_export_is_refused_before_any_work(sp_llama, tmp_path):
    """The decode step's top-k and sparse attention run in the SpeContext runtime: export_onnx names them at once and
    writes nothing."""
    from kvtransform.onnx_export import UnsupportedOpError

    with pytest.raises(UnsupportedOpError, match=r"kvt.retrieval_topk: .*kvt.sparse_decode_attention"):
        sp_llama.export_onnx(tmp_path / "m.onnx", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_numpy_and_0d_tensor_arguments_are_their_numbers(sp_llama):
    """Settings computed with NumPy or torch (np.int64(4), torch.tensor(0.9), np.True_) are the numbers they hold,
    as in HF generate: the same tokens as the Python numbers, not an error calling 4 'not an integer'."""
    np = pytest.importorskip("numpy")
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    plain = sp_llama.generate(ids, max_new_tokens=4, do_sample=True, temperature=0.7, top_k=5, top_p=0.9, seed=3,
                              eos_token_id=[2], pad_token_id=0, progress=False)
    wrapped = sp_llama.generate(ids, max_new_tokens=np.int64(4), do_sample=np.True_, temperature=np.float32(0.7),
                                top_k=torch.tensor(5), top_p=torch.tensor(0.9, dtype=torch.float64),
                                seed=np.int64(3), eos_token_id=[np.int64(2)], pad_token_id=torch.tensor(0),
                                progress=False)
    assert torch.equal(plain, wrapped)
    array_eos = sp_llama.generate(ids, max_new_tokens=4, do_sample=True, temperature=0.7, top_k=5, top_p=0.9, seed=3,
                                  eos_token_id=np.array([2]), pad_token_id=0, progress=False)
    assert torch.equal(plain, array_eos)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1; got 2.5"):
        sp_llama.generate(ids, max_new_tokens=torch.tensor(2.5), progress=False)
