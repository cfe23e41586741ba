"""Plumbing of ``kvtransform bench`` on CPU at tiny shapes: config strictness, sweep expansion, the
layout helpers and FLOP floor, each method's output against the dense reference, and the CSV / markdown / PNG
outputs. Timings here mean nothing; the numbers come from the H200 (BENCHMARKS.md)."""
from __future__ import annotations

import math
import os
import re

import pytest
import torch

from kvtransform.bench import compose_jobs, flops, masks, methods, repro_command, report, run, runner, seed, timing
from kvtransform.layout import DualKVLayout

TINY = ["r_min=3", "r_max=9", "hidden=64", "heads=4", "kv_heads=2", "head_dim=16", "mlp=96", "dtype=float32",
        "warmup=0", "iters=1", "device=cpu"]


def test_config_typo_is_an_error():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose_jobs("dualkv-layer", ["Pp=5059"])
    with pytest.raises(ConfigCompositionException):
        compose_jobs("dualkv-layer", ["method=fa3"])  # enum: not a method
    with pytest.raises(ValueError, match="unknown benchmark suite"):
        compose_jobs("dualkv-layr", [])
    from kvtransform.bench import run
    with pytest.raises(ValueError, match="unknown benchmark suite 'layer'; suites: dualkv-layer"):
        run("layer", ["--help"])  # (was a bare KeyError: 'layer')
    with pytest.raises(ValueError, match="-m"):
        compose_jobs("dualkv-layer", ["P=5059,8192"])  # a sweep needs -m


def test_sweep_expands_cartesian_product():
    jobs = compose_jobs("dualkv-layer", ["P=5059,8192", "mb=4,8", "method=fa2,dualkv", "iters=3"], multirun=True)
    assert len(jobs) == 8
    combos = {(c.P, c.mb, c.method.value) for _, c in jobs}
    assert combos == {(P, mb, m) for P in (5059, 8192) for mb in (4, 8) for m in ("fa2", "dualkv")}
    assert all(c.iters == 3 for _, c in jobs)
    # hydra sweep syntax beyond comma lists
    assert [c.mb for _, c in compose_jobs("dualkv-layer", ["mb=range(4,17,4)"], multirun=True)] == [4, 8, 12, 16]
    # defaults: the paper's setup
    (_, c), = compose_jobs("dualkv-layer", [])
    assert (c.hidden, c.heads, c.kv_heads, c.head_dim, c.mlp, c.seed, c.warmup) == (4096, 32, 8, 128, 14336, 42, 2)
    (_, a), = compose_jobs("dualkv-attn", [])
    assert a.mode.value == "attn"


def test_response_lengths_and_floor_match_the_calibration_table():
    assert runner.response_lengths(4) == [1483, 1106, 1185, 1193]  # seed 42, U[131, 2048]
    for (P, mb), row in seed.table("h200_layer").items():
        (_, cfg), = compose_jobs("dualkv-layer", [f"P={P}", f"mb={mb}"])
        s = runner.Shape.of(cfg)
        assert (s.T, s.T_rep) == (row["T_packed"], row["T_replicated"])
        assert s.floor_ms == pytest.approx(row["floor_ms"], abs=0.06)


def test_layout_indices():
    P, R = 5, [3, 2]
    lay = DualKVLayout.from_lengths([(P, R)])
    assert masks.segment_ids(lay).tolist() == [0] * 5 + [1] * 3 + [2] * 2
    rep = lay.replicated_index()
    assert rep.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 8, 9]
    back = runner.packed_from_replicated(lay)
    assert torch.equal(rep[back], torch.arange(P + sum(R)))
    assert back[:P].tolist() == list(range(P))  # the prompt from the first copy
    pairs = 15 + (3 * 5 + 6) + (2 * 5 + 3)
    assert lay.visible_pairs() == pairs
    assert flops.attention_flops(lay, 4, 16) == 4 * 16 * 4 * pairs
    assert flops.attention_flops(pairs, 4, 16, backward=True) == 2.5 * 4 * 16 * 4 * pairs


def test_masks_agree_on_multi_group_layouts():
    """The dense mask, the mask_mod and the block masks describe the same pairs (two groups, GQA-free)."""
    lay = DualKVLayout.from_lengths([(5, [3, 2]), (4, [1]), (3, [])])
    dense = masks.shared_prefix_dense_mask(lay)
    T = lay.total_tokens
    i = torch.arange(T)
    mm = masks.shared_prefix_mask_mod(lay)(0, 0, i[:, None], i[None, :])
    assert torch.equal(dense, mm)
    assert int(dense.sum()) == lay.visible_pairs()
    partial, full = masks.shared_prefix_block_masks(lay, block=4)
    nb = (T + 3) // 4
    pad = torch.zeros(nb * 4, nb * 4, dtype=torch.bool)
    pad[:T, :T] = dense
    blocks = pad.view(nb, 4, nb, 4).permute(0, 2, 1, 3).reshape(nb, nb, 16)
    assert torch.equal(full, blocks.all(-1)) and torch.equal(partial, blocks.any(-1) & ~blocks.all(-1))


@pytest.mark.parametrize("name", ["fa2", "pg", "dualkv"])
def test_methods_match_reference(name):
    """Each method's attention output and its input gradients equal the dense-mask reference (fp32, GQA 2)."""
    (_, cfg), = compose_jobs("dualkv-layer", ["P=13", "mb=3"] + TINY)
    dev = torch.device("cpu")
    P, R = 13, runner.response_lengths(3, 3, 9, 42)
    lay = DualKVLayout.from_lengths([(P, R)])
    T = P + sum(R)
    q = torch.randn(T, 4, 16, dtype=torch.float64)
    k, v = torch.randn(T, 2, 16, dtype=torch.float64), torch.randn(T, 2, 16, dtype=torch.float64)
    do = torch.randn(T, 4, 16, dtype=torch.float64)
    ref = methods.Reference()
    ref.setup(lay, cfg, dev)
    m = methods.METHODS[name]()
    m.setup(lay, cfg, dev)
    if name == "dualkv":
        q, k, v, do = (t.float() for t in (q, k, v, do))

    def grads(meth, replicated):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        if replicated:
            idx = lay.replicated_index()
            back = runner.packed_from_replicated(lay)
            o = meth(qq[idx], kk[idx], vv[idx])[back]
        else:
            o = meth(qq, kk, vv)
        o.backward(do)
        return o.detach(), qq.grad, kk.grad, vv.grad

    tol = 1e-10 if q.dtype == torch.float64 else 1e-4
    for a, b in zip(grads(m, m.replicated), grads(ref, False)):
        assert (a - b).norm() / b.norm() < tol


def test_run_writes_csv_markdown_plot(tmp_path, capsys):
    out = tmp_path / "res"
    rows = run("dualkv-layer", ["-m", "P=11,17", "mb=2", f"out_dir={out}"] + TINY)
    names = {r["method"] for r in rows}
    assert {"reference", "fa2", "pg", "flex", "flex_rebuild", "dualkv"} <= names
    assert "dualkv_kernel" not in names  # attn mode only
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["method"] for r in ok} >= {"reference", "fa2", "pg", "dualkv"}
    for r in ok:  # same layer, same inputs: every method's attention agrees with the first one run
        assert r["check_rel_err"] < 1e-4
        assert r["ms_p20"] <= r["ms_p50"] <= r["ms_p80"]
        assert r["cmd"].startswith("kvtransform bench dualkv-layer ") and f"method={r['method']}" in r["cmd"]
        assert "out_dir" not in r["cmd"]
    flex = [r for r in rows if r["method"] == "flex"][0]
    assert flex["status"].startswith("unavailable")  # no FlexAttention backward on CPU
    for f in ("results.csv", "results.md", "results.png"):
        assert (out / f).stat().st_size > 0
    df = report.read_csv(str(out / "results.csv"))
    assert len(df) == len(rows) and set(report.COLUMNS) <= set(df.columns)
    assert str(df["commit"].iloc[0]) == rows[0]["commit"]  # a hex hash stays a string
    md = (out / "results.md").read_text()
    assert "| 11 | 2 |" in md and "| 17 | 2 |" in md and "paper dualkv" in md
    assert "Targets (dualkv ≤ 1.25× floor" in md
    printed = capsys.readouterr().out
    assert "kvtransform bench dualkv-layer P=11 mb=2" in printed and printed.rstrip().endswith(md.rstrip()[-40:])

    # append: a rerun of one row replaces it, the others stay
    run("dualkv-layer", ["P=11", "mb=2", "method=fa2", "append=true", "plot=false", f"out_dir={out}"] + TINY)
    df2 = report.read_csv(str(out / "results.csv"))
    assert len(df2) == len(df)


def test_attn_mode_rows(tmp_path):
    rows = run("dualkv-attn", ["P=9", "mb=2", "method=pg", f"out_dir={tmp_path}", "plot=false"] + TINY)
    assert [r["pass"] for r in rows] == ["fwd", "bwd", "fwdbwd"]
    assert all(r["status"] == "ok" and r["tflops"] > 0 for r in rows)
    assert rows[2]["ms_p50"] == pytest.approx(rows[0]["ms_p50"] + rows[1]["ms_p50"])  # one iteration
    md = (tmp_path / "results.md").read_text()
    assert "| 9 | 2 |" in md and "pg" in md


def test_markdown_against_paper_rows():
    """A synthetic CSV on the paper's shapes renders ratios against the paper and the floor, and target ticks."""
    import pandas as pd

    rows = []
    for m, ms, gb in [("dualkv", 40.0, 3.0), ("flex", 60.0, 3.5), ("fa2", 150.0, 6.0), ("pg", 120.0, 9.0)]:
        rows.append(dict(suite="dualkv-layer", mode="layer", method=m, impl="", **{"pass": "fwdbwd"}, P=5059, mb=4, T=10026,
                         T_packed=10026, T_replicated=25203, ms_p20=ms, ms_p50=ms, ms_p80=ms, gb=gb, floor_ms=19.6,
                         status="ok", device="H200", commit="abc", torch="2.11", dtype="bfloat16", cmd="x"))
    md = report.markdown(pd.DataFrame(rows))
    line = [ln for ln in md.splitlines() if ln.startswith("| 5059 | 4 | 10026")][0]
    assert "40.0" in line and "36.6" in line and "93.2" in line and "3.75×" in line  # fa2/dualkv
    assert "✗ 2.04×" in md and "✓ 1.50×" in md and "✓ 3.75×" in md and "✓ 3.0 / 4.0" in md
    assert "85.8" in md  # calibration row exists for (5059, 4)


def test_report_cli(tmp_path, capsys):
    run("dualkv-layer", ["P=7", "mb=2", "method=fa2", f"out_dir={tmp_path}", "plot=false"] + TINY)
    report.main([str(tmp_path / "results.csv"), "--repro", "--plot", str(tmp_path / "p.png")])
    out = capsys.readouterr().out
    assert "kvtransform bench dualkv-layer P=7 mb=2" in out and "method=fa2" in out
    assert os.path.getsize(tmp_path / "p.png") > 0


def test_repro_command_and_percentile():
    assert repro_command("dualkv-layer", ["P=5059", "out_dir=x", "method=all"], "fa2") == \
        "kvtransform bench dualkv-layer P=5059 method=fa2"
    assert timing.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert timing.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 20) == pytest.approx(1.8)
    assert math.isclose(timing.percentile([5.0], 80), 5.0)


def test_cli_forwards_to_bench(tmp_path):
    cli = pytest.importorskip("kvtransform.cli")
    rc = cli.main(["bench", "dualkv-layer", "P=7", "mb=2", "method=pg", f"out_dir={tmp_path}", "plot=false"] + TINY)
    assert rc == 0 and (tmp_path / "results.csv").exists()


@pytest.mark.parametrize("P,R,block", [(5, [3, 2], 4), (17, [15, 16, 97], 16), (300, [100, 257, 31], 128),
                                       (640, [128, 256], 128), (1, [1, 1], 16)])
def test_layout_block_mask_equals_create_block_mask(P, R, block):
    """The FlexAttention block mask built from the layout is exactly create_block_mask's (all index tensors)."""
    from torch.nn.attention.flex_attention import create_block_mask

    lay = DualKVLayout.from_lengths([(P, R)])
    T = lay.total_tokens
    a = create_block_mask(masks.shared_prefix_mask_mod(lay), None, None, T, T, device="cpu", BLOCK_SIZE=block)
    b = masks.shared_prefix_block_mask(lay, block=block)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                 "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_typo_messages_name_the_fix():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match=r"unknown key 'Pp'.*did you mean 'P'"):
        compose_jobs("dualkv-layer", ["Pp=5059"])
    with pytest.raises(ConfigCompositionException, match="expected one of"):
        compose_jobs("dualkv-layer", ["method=fa3"])
    # bench composes its jobs without a Hydra run: ${hydra:...} once failed at its first read as "HydraConfig was
    # not set", naming neither the value nor the fix
    with pytest.raises(ValueError, match=r"out_dir=b/\$\{hydra:job.num\}: bench composes its jobs itself.*drop it"):
        compose_jobs("decode", ["out_dir=b/${hydra:job.num}", "input=16,32"], multirun=True)


@pytest.mark.parametrize("overrides, msg", [
    (["r_min=9", "r_max=3"], r"r_min=9 > r_max=3.*set r_min <= r_max"),
    (["P=-3"], r"P=-3: .*must be >= 1"),
    (["mb=0"], r"mb=0: .*must be >= 1"),
    (["r_min=0"], r"r_min=0: .*must be >= 1"),
    (["iters=0"], r"iters=0: .*must be >= 1"),
    (["warmup=-1"], r"warmup=-1: .*must be >= 0"),
    (["min_iters=0"], r"min_iters=0"),
    (["head_dim=0"], r"head_dim=0"),
    (["heads=4", "kv_heads=3"], r"not divisible by kv_heads=3"),
    (["time_budget_s=-1"], r"time_budget_s=-1"),
    (["matmul_tflops=0"], r"matmul_tflops=0"),
    (["fa2_impl=fa3"], r"fa2_impl=fa3: fa2_impl must be one of auto, varlen, sdpa"),
    (["flex_mask=dense"], r"flex_mask must be one of"),
    (["device=gpu0"], r"device=gpu0: device must be auto, cpu, cuda or cuda:N"),
])
def test_bad_values_fail_before_any_job(overrides, msg):
    with pytest.raises(ValueError, match=msg):
        compose_jobs("dualkv-attn", overrides)
    with pytest.raises(ValueError, match=msg):
        run("dualkv-layer", overrides + ["out_dir=unused"])


def test_bad_sweep_value_names_the_job_and_runs_nothing(tmp_path):
    with pytest.raises(ValueError, match=r"job P=-3.*P=-3: .*must be >= 1"):
        run("dualkv-layer", ["-m", "P=7,-3", "mb=2", f"out_dir={tmp_path}"] + TINY)
    assert not os.listdir(tmp_path)  # the good job did not run either


@pytest.mark.parametrize("sweep", ["P=glob(*)", "P=interval(7,9)"])
def test_glob_and_interval_sweeps_are_refused_in_one_line(tmp_path, sweep):
    """glob() picks config group options (a suite has none: Hydra said "ConfigLoader is not set") and interval()
    needs a sweeper plugin: named, with the sweeps bench takes, before any job."""
    with pytest.raises(ValueError, match=rf"^{re.escape(sweep)}: bench sweeps take a list of values"):
        run("dualkv-layer", ["-m", sweep, f"out_dir={tmp_path}"] + TINY)
    assert not os.listdir(tmp_path)


def test_cli_bad_value_is_one_error_line(tmp_path, capsys):
    cli = pytest.importorskip("kvtransform.cli")
    for argv in (["r_min=9", "r_max=3"], ["P=-3"]):
        with pytest.raises(SystemExit) as e:
            cli.main(["bench", "dualkv-attn", f"out_dir={tmp_path}"] + argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and "Traceback" not in err
    assert not os.listdir(tmp_path)
    from kvtransform.bench import main

    assert main(["dualkv-layer", "P=-3", f"out_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.startswith("error: bad benchmark setting: P=-3")


# ------------------------------------------------------------------------------------------------------ decode-ops
DECODE_TINY = ["batch=2", "heads=4", "kv_heads=2", "head_dim=16", "budget=16", "warmup=0", "iters=2",
               "bandwidth_mib=1", "device=cpu"]


def test_decode_ops_config():
    (_, c), = compose_jobs("decode-ops", [])
    assert (c.S, c.batch, c.heads, c.kv_heads, c.head_dim, c.budget) == (32768, 32, 32, 8, 128, 2048)
    assert c.cuda_graph and c.tune.value == "none" and not c.kernel_check
    jobs = compose_jobs("decode-ops", ["S=4096,16384,32768", "tune=small"], multirun=True)
    assert [j.S for _, j in jobs] == [4096, 16384, 32768] and all(j.tune.value == "small" for _, j in jobs)


@pytest.mark.parametrize("overrides, msg", [
    (["S=0"], r"S=0: .*must be >= 1"),
    (["budget=4096", "S=1024"], r"budget=4096 > S=1024"),
    (["heads=6", "kv_heads=4"], r"not divisible by kv_heads=4"),
    (["head_dim=512"], r"head_dim=512"),
    (["warmup=-1"], r"warmup=-1"),
    (["sample_ms=0"], r"sample_ms=0"),
    (["device=tpu9"], r"device must be auto"),
])
def test_decode_ops_bad_values(overrides, msg):
    with pytest.raises(ValueError, match=msg):
        compose_jobs("decode-ops", overrides)


def test_misspelt_keys_error_in_every_suite():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match=r"unknown key 'seqlen'.*decode-ops"):
        compose_jobs("decode-ops", ["seqlen=4096"])
    with pytest.raises(ConfigCompositionException, match=r"did you mean 'budget'"):
        compose_jobs("decode-ops", ["budgett=64"])
    with pytest.raises(ConfigCompositionException):
        compose_jobs("decode-ops", ["tune=huge"])  # enum: small, full or none
    with pytest.raises(ConfigCompositionException, match=r"did you mean 'tune'"):
        compose_jobs("dualkv-attn", ["tunee=true"])


def test_decode_ops_smoke(tmp_path, capsys):
    """Every op on CPU at tiny shapes (the ops' CPU path, the Triton scoring kernel under the interpreter), one CSV
    with the bandwidth rows, the floor per row, the markdown table and the plot."""
    rows = run("decode-ops", ["S=64", f"out_dir={tmp_path}"] + DECODE_TINY)
    by = {r["method"]: r for r in rows}
    assert {"copy", "read", "sparse_decode", "gather_sdpa", "sdpa", "retrieval_topk", "topk"} <= set(by)
    for name in ("sparse_decode", "sparse_decode_slots", "gather_sdpa", "sdpa", "retrieval_topk",
                 "retrieval_scoring", "topk"):
        r = by[name]
        assert r["status"] == "ok", (name, r["status"])
        assert r["ms_p20"] <= r["ms_p50"] <= r["ms_p80"]
        assert r["cmd"].startswith("kvtransform bench decode-ops S=64 ") and f"method={name}" in r["cmd"]
    assert by["sdpa"]["bytes_gb"] == pytest.approx((2 * 2 * 2 * 64 * 16 * 2 + (2 * 2 * 4 * 16 + 2 * 2 * 2 * 16) * 2)
                                                   / 1e9)
    assert by["sparse_decode"]["floor_ms"] == pytest.approx(by["sparse_decode"]["bytes_gb"] / by["copy"]["gbps"] * 1e3)
    assert (by["sparse_decode"]["impl"], by["retrieval_scoring"]["impl"], by["sdpa"]["impl"]) == \
        ("torch reference", "triton interpreter", "torch")  # what each row ran on this CPU
    df = report.read_csv(str(tmp_path / "results.csv"))
    assert len(df) == len(rows) and set(report.COLUMNS) <= set(df.columns)
    md = (tmp_path / "results.md").read_text()
    assert "| 64 | sparse_decode | sparse_decode | gather |" in md and "copy" in md
    assert (tmp_path / "results.png").stat().st_size > 0
    # append: one op rerun replaces its row
    run("decode-ops", ["S=64", "method=sdpa", "append=true", "plot=false", f"out_dir={tmp_path}"] + DECODE_TINY)
    df2 = report.read_csv(str(tmp_path / "results.csv"))
    assert len(df2) == len(df)  # the rerun's copy/read/sdpa rows replace theirs
    assert (df2["method"] == "sdpa").sum() == 1


def test_dualkv_attn_tune_smoke(tmp_path, monkeypatch):
    """tune=true on CPU (Triton interpreter): every candidate a row, timed with the job's attention variants,
    dualkv_kernel timed with the best."""
    from kvtransform.bench import tune
    from kvtransform.kernels import dualkv as K

    monkeypatch.setattr(tune, "FWD_CANDS", [(32, 32, 4, 1), (32, 16, 4, 1)])
    monkeypatch.setattr(tune, "DQ_CANDS", [(32, 32, 4, 1)])
    monkeypatch.setattr(tune, "DKDV_CANDS", [(32, 32, 4, 1), (16, 32, 4, 1)])
    seen = []
    for name in ("dualkv_fwd", "dualkv_bwd"):
        def spy(*a, _f=getattr(K, name), **kw):
            seen.append((kw.get("softcap"), kw.get("sinks") is not None))
            return _f(*a, **kw)
        monkeypatch.setattr(K, name, spy)
    rows = run("dualkv-attn", ["P=9", "mb=2", "method=dualkv_kernel", "tune=true", f"out_dir={tmp_path}",
                               "plot=false", "softcap=30", "sinks=true"] + TINY)
    assert seen and set(seen) == {(30.0, True)}  # every sweep and timed call ran the soft-capped, sink variant
    tuned = [r for r in rows if r["method"] == "dualkv_kernel_tune"]
    assert len(tuned) == 5 and all(r["status"] == "ok" and r["pass"] == "tune" for r in tuned)
    assert {re.search(r" (fwd|dq|dkdv)=\(", r["params"]).group(1) for r in tuned} == {"fwd", "dq", "dkdv"}
    kern = [r for r in rows if r["method"] == "dualkv_kernel"]
    assert [r["pass"] for r in kern] == ["fwd", "bwd", "fwdbwd"] and all(r["status"] == "ok" for r in kern)
    assert "fwd:32/" in kern[0]["impl"]
    df = report.read_csv(str(tmp_path / "results.csv"))
    assert len(df) == len(rows)  # tune rows differ in params: none replaced


def test_time_steps_marks_on_cpu():
    calls = []
    out = timing.time_steps(lambda mark: (calls.append(1), mark()), "cpu", warmup=2, iters=3)
    assert len(calls) == 5 and len(out) == 3 and all(len(t) == 2 for t in out)
    q = timing.quantiles([1.0, 2.0, 3.0])
    assert (q["ms_p50"], q["ms_mean"]) == (2.0, 2.0)


def test_compiled_layer_rows_on_cpu(tmp_path):
    """``dualkv_compiled`` runs the whole layer under torch.compile (aot_eager on CPU) around the opaque kvt op and
    agrees with the eager ``dualkv`` row; ``flex_compiled`` is unavailable on CPU; neither is in ``all`` on CPU or in
    the attn mode."""
    rows = run("dualkv-layer", ["-m", "P=11", "mb=2", "method=dualkv,dualkv_compiled,flex_compiled",
                                f"out_dir={tmp_path}", "plot=false"] + TINY)
    by = {r["method"]: r for r in rows}
    assert by["dualkv_compiled"]["status"] == "ok", by["dualkv_compiled"]["status"]
    assert by["dualkv_compiled"]["check_vs"] == "dualkv" and by["dualkv_compiled"]["check_rel_err"] < 1e-5
    assert "torch.compile(layer, aot_eager" in by["dualkv_compiled"]["impl"]
    assert by["flex_compiled"]["status"].startswith("unavailable")
    assert "Whole layer under torch.compile" in (tmp_path / "results.md").read_text()
    (_, cfg), = compose_jobs("dualkv-layer", ["P=11", "mb=2"] + TINY)
    assert not set(methods.COMPILED) & set(methods.methods_for(cfg, torch.device("cpu"), 20))
    assert set(methods.COMPILED) <= set(methods.methods_for(cfg, torch.device("cuda"), 20))
    (_, acfg), = compose_jobs("dualkv-attn", ["P=11", "mb=2"] + TINY)
    assert not set(methods.COMPILED) & set(methods.methods_for(acfg, torch.device("cuda"), 20))


def test_each_invocation_checks_its_own_rows(tmp_path):
    """``check_vs`` names a method of the same ``run``: an earlier invocation on the same shape in this process
    (another method first) is not what the rows are compared with."""
    run("dualkv-layer", ["P=11", "mb=2", "method=fa2", f"out_dir={tmp_path / 'a'}", "plot=false"] + TINY)
    rows = run("dualkv-layer", ["P=11", "mb=2", "method=dualkv", f"out_dir={tmp_path / 'b'}", "plot=false"] + TINY)
    assert rows[0]["check_vs"] == "dualkv" and rows[0]["check_rel_err"] == 0.0


def test_csv_keeps_counts_whole(tmp_path):
    """A count column that some rows lack (NaN there) is written as whole numbers, also after an append merges an
    older file; a measured float column stays float."""
    path = str(tmp_path / "results.csv")
    rows = [dict(suite="decode", mode="gen", method="dense", params="a", requests=12, offloaded_layers=None,
                 ms_p50=1.5),
            dict(suite="decode", mode="gen", method="specontext_offload", params="b", requests=14, offloaded_layers=4,
                 ms_p50=2.0)]
    report.write_csv(rows, path)
    report.write_csv(rows[:1], path, append=True)
    lines = open(path).read().splitlines()
    header = lines[0].split(",")
    cells = [dict(zip(header, line.split(","))) for line in lines[1:]]
    assert sorted((c["requests"], c["offloaded_layers"], c["ms_p50"]) for c in cells) == [("12", "", "1.5"),
                                                                                            ("14", "4", "2.0")]


def test_results_files_are_written_atomically(tmp_path, monkeypatch):
    """A run killed while writing results.csv / .md / .png leaves the earlier files whole and no temporary file;
    a run without a plot (plot=false, or nothing to plot) removes an earlier results.png (it showed rows the CSV no
    longer holds)."""
    import pandas as pd

    rows = [dict(suite="decode", mode="gen", method="dense", params="a", requests=12, ms_p50=1.5)]
    report.write_all(rows, str(tmp_path), plot=False)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["results.csv", "results.md"]

    def killed(self, path, *a, **k):
        open(path, "w").write("suite,mo")
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(pd.DataFrame, "to_csv", killed)
        with pytest.raises(KeyboardInterrupt):
            report.write_all(rows * 2, str(tmp_path), plot=False)
    with monkeypatch.context() as m:
        m.setattr(report, "markdown", lambda df: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            report.write_all(rows, str(tmp_path), plot=False)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    for plot in (True, False):
        (tmp_path / "results.png").write_bytes(b"an earlier plot")
        monkeypatch.setattr(report, "plot_any", lambda df, path: False)
        paths = report.write_all(rows, str(tmp_path), plot=plot)
        assert sorted(os.path.basename(p) for p in paths) == ["results.csv", "results.md"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv", "results.md"]


def test_an_out_dir_that_cannot_hold_the_results_fails_before_any_job(tmp_path, monkeypatch):
    """A file, a path inside a file, or an unwritable place: one line before the first job runs (the results of a
    whole run were lost after it); nothing is created."""
    (tmp_path / "afile").write_text("x")
    ran = []
    monkeypatch.setattr(runner, "run_job", lambda cfg, on_row: ran.append(1) or [])
    for out_dir, msg in ((tmp_path / "afile", r"is a file\): choose another out_dir=<directory>"),
                         (tmp_path / "afile" / "x", "is a file"), ("/proc/kvt-bench-x", "is not writable")):
        with pytest.raises(ValueError, match=msg):
            run("dualkv-layer", [f"out_dir={out_dir}", "device=cpu"])
    assert ran == [] and sorted(os.listdir(tmp_path)) == ["afile"]


def test_a_sweep_over_any_setting_keeps_its_rows_and_checks_within_its_setting(tmp_path):
    """A -m sweep over dtype (or seed, r_max, qk_norm, ...) kept only the last job's rows (their params named P and mb
    alone, so they replaced each other), and the correctness check compared a method with another setting's output
    (window or qk_norm: a 59-93 % "error" on an exact method) or, jobs alternating settings, with itself. Now each
    setting that differs from the suite default names the row, and each method is checked against the first method
    of its own setting; results.md gives each setting its own tables."""
    base = [t for t in TINY if not t.startswith("dtype=")]
    out = tmp_path / "sweep"
    rows = run("dualkv-attn", ["-m", "method=dualkv,reference", "dtype=float32,float16", "qk_norm=true,false", "P=9",
                               "mb=2", "plot=false", f"out_dir={out}"] + base)
    df = report.read_csv(str(out / "results.csv"))
    fwd = df[df["pass"] == "fwd"]
    assert len(fwd) == 8 and fwd["params"].nunique() == 4  # 2 methods x 4 settings, none dropped
    assert {"P=9 mb=2 r_min=3 r_max=9 hidden=64 heads=4 kv_heads=2 head_dim=16 mlp=96 qk_norm=false dtype=float16"} <= \
        set(fwd["params"])
    ref = fwd[fwd["method"] == "reference"]
    assert (ref["check_vs"] == "dualkv").all() and (ref["check_rel_err"] < 1e-2).all(), ref[["params", "check_rel_err"]]
    md = (out / "results.md").read_text()
    assert md.count("Setting: ") == 4 and "qk_norm=false dtype=float16" in md
    assert len(rows) >= 8
