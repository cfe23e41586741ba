"""``kvtransform bench decode`` (SpeContext Table 5): the sampled-step integration, the byte and memory models, the
config checks, ``SpeContextRuntime.decode_from`` against ``generate``, the bounded head prefills, and a CPU smoke
run of the whole suite on the tiny shape."""
import math

import pytest
import torch

import kvtransform as kvt
from kvtransform.bench.decode import (MODELS, integrate_steps, max_requests, per_request_bytes, sample_contexts,
                                      step_bytes)
from kvtransform.models import tiny_model

SHAPE8B = dict(layers=32, kv_heads=8, heads=32, head_dim=128, vocab=128256)


def test_sample_contexts_cover_the_run_and_leave_room_for_a_sample():
    c = sample_contexts(2048, 32768, 5, 20)
    assert c[0] == 2049 and c[-1] == 2048 + 32768 - 1 - 20 and len(c) == 5 and c == sorted(c)
    assert sample_contexts(100, 30, 1, 10) == [101]


def test_integrate_steps_is_exact_for_linear_step_times():
    inp, out = 1000, 501
    ctx = [1001, 1250, 1500]
    ms = [1.0 + 0.01 * (c - 1001) for c in ctx]          # t(L) linear in the context
    exact = sum(1.0 + 0.01 * (L - 1001) for L in range(inp + 1, inp + out)) / 1000
    assert integrate_steps(ctx, ms, inp, out) == pytest.approx(exact, rel=1e-12)
    # constant beyond the last sample
    assert integrate_steps([1001], [2.0], inp, out) == pytest.approx(2.0 * (out - 1) / 1000)


def test_step_bytes_dense_sparse_quest():
    per_tok = 2 * 32 * 8 * 128 * 2                       # K+V, all layers, bf16: 128 KiB
    assert per_tok == 131072
    assert step_bytes("dense", SHAPE8B, 4, 10000, 34816, 2048) == 4 * per_tok * 10000
    assert step_bytes("hf_sdpa", SHAPE8B, 4, 10000, 34816, 2048) == 4 * per_tok * 10000
    head = 8 * 128 * 2 * 10000
    assert step_bytes("specontext", SHAPE8B, 4, 10000, 34816, 2048) == 4 * (per_tok * 2048 + head)
    assert step_bytes("specontext", SHAPE8B, 1, 1000, 34816, 2048) == per_tok * 1000 + 8 * 128 * 2 * 1000
    q = step_bytes("quest", SHAPE8B, 1, 10000, 34816, 2048, page_size=16)
    assert q == per_tok * 2048 + per_tok * math.ceil(34816 / 16)


def test_max_requests_fits_memory_and_is_bounded():
    gib = 2 ** 30
    per = per_request_bytes("dense", SHAPE8B, 34816)
    assert per > 2 * 32 * 8 * 34816 * 128 * 2            # more than the KV cache itself
    n = max_requests("dense", SHAPE8B, 34816, 139 * gib, 8 * gib)
    assert n * per <= 131 * gib < (n + 1) * per
    assert max_requests("hf_sdpa", SHAPE8B, 34816, 139 * gib, 8 * gib) <= n + 1
    assert max_requests("dense", SHAPE8B, 34816, 1 * gib, 8 * gib) == 1     # never 0
    assert max_requests("dense", SHAPE8B, 256, 139 * gib, 0, cap=64) == 64


@pytest.mark.parametrize("override,match", [
    (["output=10"], "shorter than one timed sample"),
    (["n0=1"], "n0=1"),
    (["requests=-1"], "requests=-1"),
    (["reserve_gb=-1"], "reserve_gb"),
    (["samples=0"], "samples=0"),
])
def test_bad_decode_settings_are_refused(override, match):
    from kvtransform.bench import compose_jobs

    with pytest.raises(ValueError, match=match):
        compose_jobs("decode", override)


def test_model_shapes_by_name():
    from kvtransform.bench import compose_jobs

    assert [str(c.model) for _, c in compose_jobs("decode", ["model=llama-8b,qwen3-8b"], multirun=True)] == \
        ["llama-8b", "qwen3-8b"]
    with pytest.raises(ValueError, match="model=llama-70b: choose one of llama-8b, qwen3-8b, smollm2-135m, tiny"):
        compose_jobs("decode", ["model=llama-70b"])


@pytest.mark.parametrize("head", ["quest", "dense"])
def test_decode_from_continues_exactly_like_generate(head):
    """prefill + decode_from(next token, n) produce the tokens generate makes after its first one."""
    model = tiny_model("llama")
    sp = kvt.transform(model, kvt.SpeContextConfig(budget=16, head=head), progress=False)
    rt = sp.runtime
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in (30, 41)]
    ids = torch.stack([torch.cat([torch.zeros(41 - len(r), dtype=torch.long), r]) for r in rows])
    am = (torch.arange(41)[None] >= torch.tensor([[41 - len(r)] for r in rows])).long()
    ref = sp.generate(ids, am, max_new_tokens=12, eos_token_id=None)[:, 41:]
    cache, logits = rt.prefill(rows, 41 + 12, torch.device("cpu"))
    out = rt.decode_from(cache, logits.argmax(-1), 11)
    assert out.sequences.shape == (2, 11) and out.stats.decode_steps == 11
    assert torch.equal(out.sequences, ref[:, 1:])
    assert torch.equal(cache.cache_seqlens, torch.tensor([30 + 11, 41 + 11], dtype=torch.int32))
    with pytest.raises(ValueError, match="do not fit the cache"):
        rt.decode_from(cache, logits.argmax(-1), 5)
    with pytest.raises(ValueError, match="tokens must be integer ids of shape"):
        rt.decode_from(cache, logits.argmax(-1)[:1], 1)


def test_head_prefills_are_chunked_and_match_the_one_shot_result():
    """The distilled-style key cache built in chunks equals the one built at once; quest's per-layer page min/max
    equals the all-layer reduction."""
    from kvtransform.runtime.cache import KVCache
    from kvtransform.runtime.heads import make_head

    model = tiny_model("llama")
    cfg = kvt.SpeContextConfig(budget=16, head="self")
    c = model.config
    cache = KVCache.allocate(c.num_hidden_layers, 3, c.num_key_value_heads, 37, c.hidden_size // c.num_attention_heads,
                             torch.float32, "cpu")
    torch.manual_seed(0)
    cache.k.normal_()
    cache.v.normal_()
    cache.token_ids.random_(3, 128)
    cache.cache_seqlens.copy_(torch.tensor([5, 37, 20], dtype=torch.int32))
    q = make_head("quest", cfg)
    q.prefill(cache)
    L, b, h, s, d = cache.k.shape
    valid = (torch.arange(48)[None] < cache.cache_seqlens[:, None])[None, :, None, :, None]
    k = torch.nn.functional.pad(cache.k, (0, 0, 0, 48 - 37))
    kmax = k.masked_fill(~valid, float("-inf")).view(L, b, h, 3, 16, d).amax(4)
    kmax = torch.where(torch.isfinite(kmax), kmax, torch.zeros_like(kmax))
    # a multiple of 8 pages (aligned page-score rows); the pages past the cache hold no key (0 after _finite)
    assert q.kmax.shape[3] == 8 and torch.equal(q.kmax[:, :, :, :3], kmax) and not q.kmax[:, :, :, 3:].any()

    from kvtransform.runtime.distilled import DistilledBlock, DistilledHead

    head = DistilledHead(cfg)
    head.embed = model.get_input_embeddings().weight.detach()
    torch.manual_seed(0)
    head.block = DistilledBlock(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                c.hidden_size // c.num_attention_heads, window=3, dim=32)
    torch.nn.init.normal_(head.block.down.weight, std=0.02)
    head.window = 3
    head.prefill(cache)
    one_shot = head.keys.clone()
    head.PREFILL_TOKENS = 7                                  # 7 // 3 rows = 2 positions per chunk
    head.prefill(cache)
    assert torch.allclose(head.keys, one_shot, atol=1e-6, rtol=1e-6)


def test_decode_suite_smoke_on_cpu(tmp_path):
    """The whole suite on the tiny shape: a throughput row, a row per sampled step and the validation row per
    method; every number positive; the markdown table and the CSV written."""
    from kvtransform.bench import run

    rows = run("decode", ["-m", "model=tiny", "input=32", "output=24", "samples=2", "steps=2", "n0=2",
                          "requests=2", "validate=true", "method=dense,hf_sdpa", f"out_dir={tmp_path}", "plot=false"])
    runs = [r for r in rows if r["pass"] == "run"]
    assert [r["method"] for r in runs] == ["dense", "hf_sdpa"]
    for r in runs:
        assert r["status"] == "ok", r["status"]
        assert r["requests"] == 2 and r["tokens_per_s"] > 0 and r["decode_s"] > 0 and r["prefill_s"] > 0
    steps = [r for r in rows if r["pass"] == "step"]
    # a step whose longer run was never slower (a loaded CPU) is kept as a "noisy" row without a time; the run row
    # needs one timed step per method (else the method fails: asserted ok above)
    assert len(steps) == 4 and all(r["ms_p50"] >= 0 if r["status"] == "ok" else
                                   r["ms_p50"] is None and r["status"].startswith("noisy") for r in steps), steps
    assert {r["context"] for r in steps} == set(sample_contexts(32, 24, 2, 4))
    val = [r for r in rows if r["pass"] == "validate"]
    assert len(val) == 2 and all(r["decode_s"] > 0 for r in val)
    md = (tmp_path / "results.md").read_text()
    assert "| tiny | 32 | 24 | dense | 2 |" in md and "Validation" in md
    assert MODELS["tiny"]["layers"] == 2


def test_sweep_over_a_runtime_setting_keeps_every_jobs_rows(tmp_path):
    """A non-default runtime setting is part of a row's params, so a -m sweep over it does not de-duplicate the
    jobs' rows into the last one."""
    import pandas as pd

    from kvtransform.bench import run

    run("decode", ["-m", "model=tiny", "input=32", "output=12", "samples=2", "steps=2", "n0=2", "requests=2",
                   "method=dense", "fuse_projections=none,all", f"out_dir={tmp_path}", "plot=false"])
    df = pd.read_csv(tmp_path / "results.csv")
    params = sorted(df[df["pass"] == "run"]["params"])
    assert params == ["model=tiny input=32 output=12", "model=tiny input=32 output=12 fuse_projections=none"]
    assert (df["pass"] == "step").sum() == 4


def test_context_beyond_the_models_positions_is_refused_before_running():
    from kvtransform.bench import compose_jobs

    with pytest.raises(ValueError, match="exceed the 8192 positions of model=tiny"):
        compose_jobs("decode", ["model=tiny", "input=9000", "output=100"])


def test_per_step_retries_noise_and_gives_nan_when_never_slower():
    from kvtransform.bench.decode_sampling import per_step

    times = iter([1.0, 0.9, 1.0, 1.5])           # first pair: longer run faster (noise), second pair: +0.5 s
    assert per_step(lambda n: next(times), 4, 10) == pytest.approx(50.0)
    assert math.isnan(per_step(lambda n: 1.0, 4, 10, tries=2))


def test_markdown_survives_a_job_without_results():
    import pandas as pd

    from kvtransform.bench.report import markdown

    df = pd.DataFrame([dict(suite="decode", mode="decode", method="dense", **{"pass": "run"}, model="tiny",
                            input=9000, output=24, budget=2048, status="skip: too long", device="cpu", commit="x",
                            torch="2", dtype="bfloat16")])
    assert "skip: too long" in markdown(df)


@pytest.mark.parametrize("key", ["compile", "cuda_graphs", "offload"])
def test_specontext_switches_must_be_bools(key):
    with pytest.raises(ValueError, match=f"{key} must be true or false"):
        kvt.SpeContextConfig(**{key: "false"}).validate()


def test_decode_from_refuses_bad_ids_and_foreign_caches():
    from kvtransform.runtime.cache import KVCache

    model = tiny_model("llama")
    sp = kvt.transform(model, kvt.SpeContextConfig(budget=16, head="recent"), progress=False)
    rt, info = sp.runtime, sp.info
    cache = KVCache.allocate(info.num_layers, 2, info.num_kv_heads, 32, info.head_dim, torch.float32, "cpu")
    cache.cache_seqlens.fill_(4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rt.decode_from(cache, torch.tensor([5, info.vocab_size]), 2)
    with pytest.raises(ValueError, match="integer ids"):
        rt.decode_from(cache, torch.tensor([True, False]), 2)
    with pytest.raises(ValueError, match="pad_token_id"):
        rt.decode_from(cache, torch.tensor([5, 6]), 2, pad_token_id=-1)
    other = KVCache.allocate(info.num_layers + 1, 2, info.num_kv_heads, 32, info.head_dim, torch.float32, "cpu")
    with pytest.raises(ValueError, match="allocate it with KVCache.allocate for this model"):
        rt.decode_from(other, torch.tensor([5, 6]), 2)
    out = rt.decode_from(cache, torch.tensor([5, 6]), torch.tensor(3))
    assert out.sequences.shape == (2, 3)


def test_build_model_overrides_a_shape_and_refuses_unknown_keys():
    from kvtransform.bench.decode import MODELS, build_model

    m = build_model("tiny", torch.float32, torch.device("cpu"), layers=1, vocab=100)
    assert m.config.num_hidden_layers == 1 and m.config.vocab_size == 100
    assert MODELS["smollm2-135m"]["tie"] and MODELS["smollm2-135m"]["vocab"] == 49152
    with pytest.raises(ValueError, match="unknown shape key"):
        build_model("tiny", torch.float32, torch.device("cpu"), layerz=1)
    with pytest.raises(ValueError, match="unknown model shape"):
        build_model("llama-9b", torch.float32, torch.device("cpu"))


def _oom_job(monkeypatch, where, fail_times, keep=None, **cfg):
    """run_job on the tiny shape with ``where`` (a name run_job looks up in bench.decode) raising CUDA OOM
    ``fail_times`` times; ``keep``: the sweep cache to run with (default a fresh one: a new model and transform)."""
    from kvtransform.bench import decode as D
    from kvtransform.bench.config import DecodeBenchConfig, DType

    real, calls = getattr(D, where), []

    def failing(*a, **k):
        calls.append(a)
        if len(calls) <= fail_times:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*a, **k)

    c = DecodeBenchConfig(model="tiny", input=16, output=12, method="dense", device="cpu", samples=1, steps=2, n0=2,
                          compile=False, dtype=DType.float32, cpu_memory_gb=0.0005, **cfg)
    with monkeypatch.context() as m:
        m.setattr(D, where, failing)
        m.setattr(D, "_KEEP", {} if keep is None else keep)  # fresh: the sweep cache would skip Ours
        return [r for r in D.run_job(c) if r["pass"] == "run"][0], calls


def test_oom_in_decode_retries_with_fewer_requests(monkeypatch):
    row, calls = _oom_job(monkeypatch, "time_ours", 2)
    assert row["status"] == "ok" and "2 out-of-memory retries" in row["note"]
    first = calls[0][1].batch  # the cache each attempt timed
    assert [c[1].batch for c in calls] == [first, max(1, int(first * 0.9)), max(1, int(int(first * 0.9) * 0.9))]
    assert row["requests"] == calls[-1][1].batch


def test_oom_in_prefill_or_before_sizing_is_reported_not_retried(monkeypatch):
    keep = {}  # one model and transform for the two calls after the transform (as a sweep's jobs share them)
    row, calls = _oom_job(monkeypatch, "prefill_ours", 5, keep)
    assert len(calls) == 1 and row["status"].startswith("oom in ") and row["requests"] >= 1
    row, calls = _oom_job(monkeypatch, "time_ours", 1, keep, requests=3)  # an explicit count is never changed
    assert len(calls) == 1 and row["status"].startswith("oom")
    row, calls = _oom_job(monkeypatch, "Ours", 5)  # the transform itself: no request count chosen yet
    assert len(calls) == 1 and row["status"].startswith("oom in ") and row["requests"] is None


def test_suite_help_explains_every_key_and_lists_choices(capsys):
    from kvtransform.bench import SUITES, run, suite_help

    text = suite_help("decode")
    assert "budget: SpeContext's B" in text and "method: all, hf_sdpa, hf_static, dense" in text
    assert ":func:" not in text and "``" not in text and "model: llama-8b" in text  # plain text, then the defaults
    assert run("decode", ["--help"]) == [] and "Choices:" in capsys.readouterr().out
    for suite in SUITES:
        assert suite_help(suite).startswith(f"kvtransform bench {suite} ")


def test_gpu_gb_cap_counts_everything_in_use_and_shrinks_the_request_count():
    """Under a cap the device looks ``gpu_gb`` GiB large: what is in use counts against it; the allocator fraction
    leaves room for the memory outside PyTorch; an H200's Llama-8B [2k, 32k] count drops at an A800's 79.1 GiB."""
    from kvtransform.bench.decode_model import GIB, cap_fraction, capped_free

    total, used = int(139.8 * GIB), int(16 * GIB)                 # weights + context in use
    assert capped_free(total - used, total, 0) == total - used    # no cap: today's free memory
    assert capped_free(total - used, total, int(79.1 * GIB)) == int(79.1 * GIB) - used
    assert capped_free(total - used, total, 10 * GIB) == 0        # never negative
    frac = cap_fraction(int(79.1 * GIB), total, total - used, 15 * GIB)   # 1 GiB outside PyTorch
    assert frac * total == pytest.approx(78.1 * GIB, rel=1e-9)
    full = max_requests("dense", SHAPE8B, 34816, total - used, 8 * GIB)
    a800 = max_requests("dense", SHAPE8B, 34816, capped_free(total - used, total, int(79.1 * GIB)), 8 * GIB)
    assert a800 * per_request_bytes("dense", SHAPE8B, 34816) <= (79.1 - 16 - 8) * GIB and 1 <= a800 < full


def test_memory_cap_holds_the_cuda_allocator_to_the_cap_and_restores_it(monkeypatch):
    """On CUDA the cap is PyTorch's per-process memory fraction of the device's index while the block runs, 1 (the
    whole device) after."""
    from kvtransform.bench.decode import memory_cap
    from kvtransform.bench.decode_model import GIB

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (100 * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 38 * GIB)   # 2 GiB outside PyTorch
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    devices = []  # set_per_process_memory_fraction refuses a bare "cuda" device: it must get an index

    def fraction(f, d=None):
        calls.append(f)
        devices.append(d)

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", fraction)
    with memory_cap(torch.device("cuda"), 80 * GIB) as limit:
        assert calls == [pytest.approx(78 / 140)] and limit == pytest.approx(78 * GIB, abs=1)
        assert devices == [0]
    assert calls[-1] == 1.0
    with pytest.raises(RuntimeError):                             # restored on the way out of an error too
        with memory_cap(torch.device("cuda"), 80 * GIB):
            raise RuntimeError("boom")
    assert calls[-1] == 1.0
    with memory_cap(torch.device("cuda"), 0) as limit:            # gpu_gb=0: nothing limited
        assert limit is None and len(calls) == 4
    with memory_cap(torch.device("cpu"), 3 * GIB) as limit:       # a CPU: accounting only
        assert limit == 3 * GIB and len(calls) == 4


def test_decode_suite_sizes_for_the_gpu_gb_cap_and_records_it(tmp_path):
    """The tiny shape on CPU with a cap of the weights plus three hf_sdpa requests: the automatic count is 3 (256
    without the cap), every row records gpu_gb, and the table labels the capped configuration."""
    from kvtransform.bench import run
    from kvtransform.bench.decode_model import GIB, build_model, held_bytes

    shape = dict(layers=2, kv_heads=2, heads=4, head_dim=16, vocab=512)
    per = per_request_bytes("hf_sdpa", shape, 16 + 12, itemsize=4)
    cap = (held_bytes(build_model("tiny", torch.float32, "meta")) + 3 * per + 16) / GIB
    assert max_requests("hf_sdpa", shape, 28, 4 * GIB, 0, 4) == 256      # uncapped: cpu_memory_gb, max_requests
    rows = run("decode", ["model=tiny", "input=16", "output=12", "samples=1", "steps=2", "n0=2", "method=hf_sdpa",
                          "prefill_tokens=16", "dtype=float32", f"gpu_gb={cap}", f"out_dir={tmp_path}", "plot=false"])
    assert {r["pass"] for r in rows} == {"run", "step"} and all(r["gpu_gb"] == cap for r in rows)
    run_row = [r for r in rows if r["pass"] == "run"][0]
    assert run_row["status"] == "ok" and run_row["requests"] == 3 and f"gpu_gb={cap}" in run_row["params"]
    assert f"| tiny @{cap:g} GiB | 16 | 12 | hf_sdpa | 3 |" in (tmp_path / "results.md").read_text()


def test_offload_method_serves_more_requests_under_a_cap_with_layers_on_cpu(tmp_path):
    """``specontext_offload`` under a cap that holds three resident ``specontext`` requests: the memory plan serves
    more (``offload_count=largest``), the sampled steps run with layers on CPU (elastic loading through the runtime's
    offload engine), the validation run agrees with the estimate's sign, the default ``offload_count=throughput``
    serves at most as many, and ``host_gb`` bounds the count."""
    from kvtransform.bench import run
    from kvtransform.bench.decode_model import GIB, build_model, held_bytes

    from kvtransform.bench.decode_ours import distilled_state

    shape = dict(layers=2, kv_heads=2, heads=4, head_dim=16, vocab=512)
    per = per_request_bytes("specontext", shape, 8 + 40, itemsize=4)
    model = build_model("tiny", torch.float32, "cpu")
    head = sum(t.numel() * t.element_size() for t in distilled_state(model)[0].values() if isinstance(t, torch.Tensor))
    cap = (held_bytes(model) + head + 3 * per + 16) / GIB  # the weights, the head's and 3 resident requests
    args = ["model=tiny", "input=8", "output=40", "samples=2", "steps=2", "n0=2", "budget=4", "prefill_tokens=16",
            "dtype=float32", f"gpu_gb={cap}", "plot=false"]
    rows = run("decode", ["-m"] + args + ["method=specontext,specontext_offload", "validate=true",
                                          "offload_count=largest", f"out_dir={tmp_path}"])
    runs = {r["method"]: r for r in rows if r["pass"] == "run"}
    assert all(r["status"] == "ok" for r in runs.values()), [r["status"] for r in runs.values()]
    assert runs["specontext"]["requests"] == 3 and runs["specontext_offload"]["requests"] > 3
    assert "layers on CPU by the last token" in runs["specontext_offload"]["note"]
    steps = [r for r in rows if r["pass"] == "step" and r["method"] == "specontext_offload"]
    assert len(steps) == 2 and all(r["offloaded_layers"] >= 1 and (r["ms_p50"] > 0 if r["status"] == "ok" else
                                                                   r["status"].startswith("noisy")) for r in steps)
    assert [r for r in rows if r["pass"] == "validate" and r["method"] == "specontext_offload"][0]["decode_s"] > 0
    # offload_count=throughput (the default): the count with the most modelled tokens/s, the model calibrated on
    # two timed samples at the largest count; never more than the largest
    best = run("decode", args + ["method=specontext_offload", f"out_dir={tmp_path / 't'}"])
    best = [r for r in best if r["pass"] == "run"][0]
    assert best["status"] == "ok" and 1 <= best["requests"] <= runs["specontext_offload"]["requests"]
    assert "modelled tokens/s" in best["note"] or "not measurable" in best["note"], best["note"]
    assert "offload_count" not in best["params"] and "offload_count=largest" in runs["specontext_offload"]["params"]
    host = 1e-9  # GiB: no layer may go to CPU, so the count is the resident one at most
    capped = run("decode", args + ["method=specontext_offload", f"host_gb={host}", f"out_dir={tmp_path / 'h'}"])
    assert [r for r in capped if r["pass"] == "run"][0]["requests"] <= 3


@pytest.mark.parametrize("override,match", [
    (["gpu_gb=-1"], "gpu_gb=-1.0: gpu_gb is GiB and must be >= 0"),
    (["gpu_gb=5"], r"gpu_gb=5.0 is larger than cpu_memory_gb=4.0 .*: set gpu_gb <= 4 or gpu_gb=0"),
    (["model=smollm2-135m", "gpu_gb=0.1"], r"cannot hold model=smollm2-135m's weights \(0.2\d+ GiB\): set gpu_gb >= "),
])
def test_bad_gpu_gb_caps_are_refused_before_running(override, match):
    from kvtransform.bench import compose_jobs

    with pytest.raises(ValueError, match=match):
        compose_jobs("decode", ["model=tiny", "device=cpu", "input=16", "output=100"] + override)
    assert compose_jobs("decode", ["model=tiny", "device=cpu", "input=16", "output=100", "gpu_gb=0.5"])
