"""Rollout/training mismatch of sparse rollouts (kvtransform.rollout_mismatch): the KL / importance-weight math on
hand-made distributions, and the sampled rollouts on a tiny random model checked against an independent dense
forward and against eval-sparse's teacher-forced emulation of the same selections."""
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import kvtransform as kvt
from kvtransform.eval_sparse import DocumentTeacher, keep_mask
from kvtransform.models import tiny_model
from kvtransform.rollout_mismatch import (Rollouts, counted, sample_rollouts, summarize_tokens, table,
                                          token_kl_logw)
from kvtransform.runtime.distilled import DistilledBlock, fingerprint, save_head_dir


def test_kl_and_weights_on_hand_made_distributions():
    p = torch.tensor([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]]).log()
    kl, lw = token_kl_logw(p, p, torch.tensor([0, 2]))
    assert kl.dtype == torch.float64 and torch.equal(kl, torch.zeros(2)) and torch.equal(lw, torch.zeros(2))
    # Bernoulli pair: KL(s || d) = a log(a/b) + (1-a) log((1-a)/(1-b)); w = p_d(x) / p_s(x)
    a, b = 0.9, 0.6
    s, d = torch.tensor([[a, 1 - a]]).log(), torch.tensor([[b, 1 - b]]).log()
    kl, lw = token_kl_logw(s, d, torch.tensor([1]))
    assert kl.item() == pytest.approx(a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b)), rel=1e-6)
    assert math.exp(lw.item()) == pytest.approx((1 - b) / (1 - a), rel=1e-6)
    # a token the sparse model never samples (p_s = 0) adds nothing; p_d = 0 where p_s > 0 is an infinite KL
    kl, _ = token_kl_logw(torch.tensor([[0.0, -math.inf]]), torch.tensor([[-0.1, -2.4]]), torch.tensor([0]))
    assert kl.item() == pytest.approx(0.1)
    kl, _ = token_kl_logw(torch.tensor([[-0.1, -2.4]]), torch.tensor([[0.0, -math.inf]]), torch.tensor([0]))
    assert kl.item() == math.inf


def test_summary_statistics():
    w = np.array([0.25, 0.5, 1.0, 1.0, 2.0, 4.0, 8.0, 1.0])
    s = summarize_tokens(np.arange(8) / 10, np.log(w), cap=2.0)
    assert s["tokens"] == 8 and s["kl_max"] == pytest.approx(0.7) and s["kl_mean"] == pytest.approx(0.35)
    assert s["w_out"] == pytest.approx(3 / 8)            # 0.25, 4 and 8 are outside [0.5, 2]; 0.5 and 2 are not
    assert s["tis_clipped"] == pytest.approx(2 / 8)      # 4 and 8 are above the cap
    assert s["tis_mass"] == pytest.approx((2 + 6) / w.sum())
    assert s["w_p50"] == pytest.approx(1.0) and s["w_mean"] == pytest.approx(w.mean())
    with pytest.raises(ValueError, match="non-empty"):
        summarize_tokens([], [])


def test_tokens_after_the_first_eos_are_not_counted():
    tokens = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8]])
    r = Rollouts([{"head": "h", "budget": 1}] * 2, tokens, torch.ones(2, 4), torch.zeros(2, 4), steps=3)
    assert counted(r, [2]).tolist() == [[True, True, False, False], [True, True, True, False]]
    df = table(r, [2, 4], eos=2)
    assert df.tokens.tolist() == [4, 5] and df.ended.tolist() == [0, 1] and df.reached.tolist() == [2, 3]


def test_rollouts_match_a_dense_forward_and_the_teacher_forced_emulation(tmp_path):
    torch.set_num_threads(1)
    model = tiny_model("llama")
    save_head_dir(tmp_path / "h", DistilledBlock(64, 4, 2, 16, rope_theta=10000.0, train_length=64), fingerprint(model))
    prompts = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    heads = [("quest", 16), ("distilled", 8), ("dense", 8)]
    n = 12
    r = sample_rollouts(model, prompts, heads, n, samples=2, seed=3, retrieval=str(tmp_path / "h"), record=True)
    assert r.steps == n and r.tokens.shape == (12, n) and r.rows[4] == {"head": "distilled", "budget": 8,
                                                                           "prompt": 0, "sample": 0}
    again = sample_rollouts(model, prompts, heads, n, samples=2, seed=3, retrieval=str(tmp_path / "h"))
    assert torch.equal(again.tokens, r.tokens) and torch.equal(again.kl, r.kl)     # seeded
    assert (r.kl[:, 0].abs() < 1e-6).all() and (r.logw[:, 0].abs() < 1e-5).all()   # the first token is dense's
    assert (r.kl[8:].abs() < 1e-6).all() and (r.logw[8:].abs() < 1e-5).all()       # dense head: the rounding floor
    assert (r.kl[:8, 2:] > 0).all()                                                # budgets below the context
    for row in (0, 3, 5, 10):
        c, i = divmod(row, 4)
        p, roll = prompts[i // 2], r.tokens[row]
        with torch.no_grad():
            dense = model(torch.cat([p, roll])[None]).logits[0, 23:-1].float().log_softmax(-1)
        kl, lw = token_kl_logw(r.sparse_logp[row], dense, roll)
        assert torch.allclose(kl, r.kl[row], atol=1e-5) and torch.allclose(lw, r.logw[row], atol=1e-5)
        width = max(s.shape[-1] for s in r.selections[c])
        sel = torch.stack([torch.nn.functional.pad(s[i], (0, width - s.shape[-1]), value=-1)
                           for s in r.selections[c]])                               # (n - 1, H_kv, W)
        forced = DocumentTeacher(model, p).sparse_logp(roll[:-1], keep_mask(sel, 24, 24 + n - 1))
        assert torch.allclose(forced, r.sparse_logp[row, 1:], atol=1e-5)


def test_the_job_writes_the_table(tmp_path):
    from omegaconf import OmegaConf

    from kvtransform.rollout_mismatch import RolloutMismatchConfig, run_rollout_mismatch

    class Tok:
        def __call__(self, text, **kw):
            return {"input_ids": torch.tensor([[3 + ord(ch) % 120 for ch in text]])}

    cfg = OmegaConf.structured(RolloutMismatchConfig(head=["self", "quest"], budget=[4], lengths=[3, 6], prompt=20,
                                                     documents=["argparse.py"], out=str(tmp_path / "o")))
    cfg.model = "tiny"
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None     # random ids: an EOS would end a rollout early (tested above)
    df = run_rollout_mismatch(cfg, model=model, tokenizer=Tok(), log=lambda *a: None)
    assert len(df) == 4 and set(df["head"]) == {"self", "quest"} and df.tokens.tolist() == [3, 6, 3, 6]
    assert "| self | 4 | 6 | 6 | 6 |" in (tmp_path / "o" / "results.md").read_text()
    assert len(__import__("pandas").read_csv(tmp_path / "o" / "results.csv")) == 4
    assert torch.load(tmp_path / "o" / "tokens.pt")["kl"].shape == (2, 6)
    import time

    r = sample_rollouts(model, torch.randint(3, 128, (1, 20)), [("self", 4)], 6, deadline=time.perf_counter())
    assert r.steps == 1 and table(r, [6]).reached.tolist() == [1]       # the time limit stops decoding
    assert not r.kl[:, 1:].any() and not r.logw[:, 1:].any()  # only the decoded steps are scored
    cfg.out = str(tmp_path / "o2")
    with pytest.raises(ValueError, match="has no tokenizer"):  # a saved tiny model directory has none
        run_rollout_mismatch(cfg, model=model, tokenizer=None, log=lambda *a: None)
    said = []
    cfg.lengths, cfg.budget = [8192], [4, 8]  # the size warning comes before any decoding
    with pytest.raises(ValueError, match="exceed the model's 256 positions"):
        run_rollout_mismatch(cfg, model=model, tokenizer=Tok(), log=said.append)
    assert any("GPU-sized grid" in m for m in said)
    cfg.budget = [0]
    with pytest.raises(ValueError, match="budget and lengths must be integers >= 1"):
        run_rollout_mismatch(cfg, model=tiny_model("llama"), tokenizer=Tok())
    with pytest.raises(ValueError, match="exceed the model's 256 positions"):
        sample_rollouts(model, torch.zeros(1, 200, dtype=torch.long), [("self", 4)], 100)
    with pytest.raises(ValueError, match="sliding-window"):
        sample_rollouts(tiny_model("gemma3"), torch.zeros(1, 4, dtype=torch.long), [("self", 4)], 2)


def test_cli_help_and_bad_input(tmp_path, capsys):
    from kvtransform.cli import main

    with pytest.raises(SystemExit) as e:
        main(["rollout-mismatch", "--help"])
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith("kvtransform rollout-mismatch [MODEL]") and "lengths=[n,...]" in out and "Examples:" in out
    for args, msg in [(["hed=self"], "unknown config key 'hed'"), (["lengths=[0]"], "lengths must be integers >= 1"),
                      (["device=tpu"], "device must be cpu or cuda"), (["head=nope"], "unknown retrieval head 'nope'"),
                      (["temperature=inf"], "temperature must be a finite number > 0"),  # was a uniform, 0-KL table
                      (["seed=100000000000000000000000"], "seed must be an integer >= 0 and < 2**63")]:
        with pytest.raises(SystemExit) as e:
            main(["rollout-mismatch", *args, f"out={tmp_path / 'o'}"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err and err.count("error:") == 1 and "Traceback" not in err
    assert not (tmp_path / "o").exists()   # refused before anything is written


def test_a_heads_rollouts_do_not_depend_on_the_other_heads():
    """Each (head, budget) samples from its own generator seeded with seed: quest's rollouts are the same alone, after
    another head and before one (one shared generator gave each a different kl_mean: 0.0035 / 0.0025 / 0.0066)."""
    torch.set_num_threads(1)
    model = tiny_model("llama")
    prompts = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    runs = [sample_rollouts(model, prompts, heads, 8, samples=2, seed=3)
            for heads in ([("quest", 8)], [("recent", 8), ("quest", 8)], [("quest", 8), ("recent", 8)])]
    quest = [r.tokens[[i for i, row in enumerate(r.rows) if row["head"] == "quest"]] for r in runs]
    assert torch.equal(quest[0], quest[1]) and torch.equal(quest[0], quest[2])


def test_repeated_heads_and_budgets_are_run_once():
    """head=[quest,quest] or budget=[8,8] ran each pair twice and pooled both into one row (its token count
    doubled); repeats are dropped, as lengths' are, keeping the order given."""
    from omegaconf import OmegaConf

    from kvtransform.rollout_mismatch import RolloutMismatchConfig, check_config

    cfg = OmegaConf.structured(RolloutMismatchConfig(head=["quest", "self", "quest"], budget=[8, 4, 8],
                                                     lengths=[6, 3, 6], prompt=20))
    assert check_config(cfg) == (["quest", "self"], [8, 4], [3, 6])


def test_results_killed_while_writing_keep_the_earlier_files(tmp_path, monkeypatch):
    """results.csv and tokens.pt are written to a temporary file renamed into place: a run killed while writing one
    leaves the earlier file whole and loadable, and no temporary file behind."""
    import pandas as pd

    from kvtransform.rollout_mismatch import write_results

    def result(kl):
        r = Rollouts([{"head": "h", "budget": 1, "prompt": 0, "sample": 0}], torch.tensor([[5, 6, 7]]),
                     torch.full((1, 3), kl, dtype=torch.float64), torch.zeros(1, 3, dtype=torch.float64), steps=3)
        return r, table(r, [3], model="m", dtype="float32", device="cpu", prompt=8, temperature=1.0)

    r1, df1 = result(0.5)
    write_results(df1, r1, tmp_path, {"seconds": 1.0, "documents": ["a"]})
    real_csv, real_save = pd.DataFrame.to_csv, torch.save

    def killed_csv(self, path, **kw):
        Path(path).write_text(real_csv(self, None, **kw)[:20])
        raise KeyboardInterrupt

    def killed_save(obj, path, **kw):
        real_save(obj, path, **kw)
        Path(path).write_bytes(Path(path).read_bytes()[:100])
        raise KeyboardInterrupt

    r2, df2 = result(0.25)
    for cls, name, fake in ((pd.DataFrame, "to_csv", killed_csv), (torch, "save", killed_save)):
        with monkeypatch.context() as m:
            m.setattr(cls, name, fake)
            with pytest.raises(KeyboardInterrupt):
                write_results(df2, r2, tmp_path, {"seconds": 2.0, "documents": ["a"]})
        assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv", "results.md", "tokens.pt"]
        if name == "to_csv":
            assert pd.read_csv(tmp_path / "results.csv").kl_mean.tolist() == [0.5]   # the earlier table
    assert pd.read_csv(tmp_path / "results.csv").kl_mean.tolist() == [0.25]          # the second attempt's, whole
    assert torch.load(tmp_path / "tokens.pt")["kl"][0, 0].item() == 0.5               # the earlier tokens.pt


def test_eval_sparse_names_its_own_keys_refuses_positions_past_the_model_and_runs_a_repeat_once(tmp_path):
    """eval-sparse (and rollout-mismatch) passed on the heads' advice to set transform.retrieval=, a key these
    commands do not have (theirs is retrieval=); eval-sparse evaluated past the model's positions without a word
    (rollout-mismatch and generate refuse); a head listed twice ran twice and printed a table that disagreed with
    results.md."""
    from omegaconf import OmegaConf

    from kvtransform.eval_sparse import EvalSparseConfig, run_eval
    from kvtransform.rollout_mismatch import RolloutMismatchConfig, run_rollout_mismatch

    class Tok:
        def __call__(self, text, **kw):
            return {"input_ids": torch.tensor([[3 + ord(ch) % 120 for ch in text]])}

    model = tiny_model("llama")
    limit = model.config.max_position_embeddings
    quiet = dict(model=model, tokenizer=Tok(), log=lambda *a: None)

    def eval_cfg(**kw):
        cfg = OmegaConf.structured(EvalSparseConfig(**{"documents": ["argparse.py"], "budget": [8], "prefix": 24,
                                                        "continuation": 4, "generate": 3,
                                                        "out": str(tmp_path / "e"), **kw}))
        cfg.model = "tiny"
        return cfg

    with pytest.raises(ValueError, match=rf"exceed the model's {limit} positions: shorten prefix"):
        run_eval(eval_cfg(head=["quest"], prefix=limit), **quiet)
    for run, cfg in ((run_eval, eval_cfg(head=["eagle3"])),
                     (run_rollout_mismatch, OmegaConf.structured(RolloutMismatchConfig(
                         head=["eagle3"], budget=[4], lengths=[3], prompt=20, documents=["argparse.py"],
                         out=str(tmp_path / "r"))))):
        if run is run_rollout_mismatch:
            cfg.model = "tiny"
        with pytest.raises(ValueError, match="needs the draft") as e:
            run(cfg, **quiet)
        assert "retrieval=" in str(e.value) and "transform.retrieval" not in str(e.value)
    df = run_eval(eval_cfg(head=["quest", "quest"]), **quiet)
    assert df["head"].tolist() == ["quest"]
