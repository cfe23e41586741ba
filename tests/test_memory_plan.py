"""The SpeContext memory model (arXiv 2512.00722 §6, Eq. 6–8): thresholds and largest batch for Llama-3-8B on an
80 GiB GPU against a hand calculation, and the plan-memory command."""
import json
import subprocess
import sys

import pytest
import torch
import transformers

from kvtransform.runtime.memory import HeadMemory, ModelMemory, plan_memory

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                 tie_word_embeddings=False)


def test_llama3_8b_on_80gib_matches_hand_calculation():
    """Hand calculation (Llama-3-8B, bf16, 80 GiB GPU, batch 32, [2048 in, 32768 out] so S = 34816, budget 2048, a
    head of 1 GiB weights with its own one-layer key+value cache c_h = 2·8·128·2 = 4096 B/token, reserve 4 GiB).

    Parameters: embedding and LM head 2 × 128256·4096 = 1,050,673,152; per layer q/o 2 × 4096² = 33,554,432, k/v
    2 × 4096·1024 = 8,388,608, MLP 3 × 4096·14336 = 176,160,768, norms 8,192: 218,112,000 × 32 = 6,979,584,000; final
    norm 4,096; total 8,030,261,248 → W = 16,060,522,496 B.

    M − W − P − R = 85,899,345,920 − 16,060,522,496 − 1,073,741,824 − 4,294,967,296 = 64,470,114,304 B.
    c = 2·8·128·2 = 4096 B per token, layer and row; L·c + c_h = 135,168.

    T_1 = ⌊64,470,114,304 / (32 · 135,168)⌋ + 1 = ⌊14,905.1⌋ + 1 = 14,906 (layer 31);
    T_2 = ⌊(64,470,114,304 − 32·1·2048·4096) / (32 · (31·4096 + 4096))⌋ + 1 = ⌊64,201,678,848 / 4,194,304⌋ + 1
        = 15,307 (layer 30);
    T_21 = ⌊(64,470,114,304 − 32·20·2048·4096) / (32 · (12·4096 + 4096))⌋ + 1 = ⌊59,101,405,184 / 1,703,936⌋ + 1
        = 34,686 (layer 11), ≤ 34,816; T_22 = ⌊58,832,969,728 / 1,572,864⌋ + 1 = 37,405 > S: 21 layers move.
    Largest batch without offload: ⌊64,470,114,304 / (34,816 · 135,168)⌋ = ⌊13.7⌋ = 13; with offload
    ⌊64,470,114,304 / max(2048 · 135,168, 32·2048·4096 + 34,816·4096)⌋ = ⌊64,470,114,304 / 411,041,792⌋ = 156.
    """
    mm = ModelMemory.from_config(transformers.LlamaConfig(**LLAMA3_8B), torch.bfloat16)
    assert mm.weight_bytes == 16_060_522_496 and mm.kv_token_bytes == 4096
    plan = plan_memory(mm, HeadMemory(weight_bytes=2 ** 30, token_bytes=4096), gpu_bytes=80 * 2 ** 30, batch=32,
                       input_len=2048, output_len=32768, budget=2048, reserve_bytes=4 * 2 ** 30)
    assert plan.max_batch_resident == 13 and plan.max_batch == 156
    assert plan.thresholds[31] == 14_906 and plan.thresholds[30] == 15_307 and plan.thresholds[11] == 34_686
    assert plan.thresholds[:11] == [None] * 11
    moved = [plan.thresholds[l] for l in range(31, 10, -1)]
    assert moved == sorted(moved)  # last layer first, thresholds non-decreasing
    assert plan.offloaded_at(34_816) == list(range(11, 32)) and plan.offloaded_at(14_905) == []
    assert plan.peak_bytes <= 80 * 2 ** 30 < plan.resident_bytes
    for n in (14_905, 20_000, 34_816):  # the plan keeps every length inside the GPU
        assert plan.gpu_bytes_at(n) <= 80 * 2 ** 30


def test_layers_the_head_reads_are_never_offloaded():
    """``HeadMemory.resident_layers`` (the ``self`` head reads layer 0's cache): at a batch whose plain plan moves
    every layer, the plan keeps layer 0 and still fits; the largest batch drops accordingly."""
    mm = ModelMemory.from_config(transformers.LlamaConfig(**LLAMA3_8B), torch.bfloat16)
    kw = dict(gpu_bytes=80 * 2 ** 30, input_len=2048, output_len=32768, budget=2048)
    free = plan_memory(mm, HeadMemory(), batch=250, **kw)
    assert free.thresholds[0] is not None  # without the pin layer 0 moves too
    pinned = plan_memory(mm, HeadMemory(resident_layers=1), batch=150, **kw)
    assert pinned.thresholds[0] is None and all(t is not None for t in pinned.thresholds[1:])
    assert pinned.peak_bytes <= 80 * 2 ** 30 and pinned.max_batch < free.max_batch
    with pytest.raises(ValueError, match="every layer but the 1 the retrieval head reads"):
        plan_memory(mm, HeadMemory(resident_layers=1), batch=pinned.max_batch + 1, **kw)


def test_a_budget_past_the_request_never_refuses_what_fits_resident():
    """budget 2048 > input + output 1000: the offload slots would exceed the cache; a batch that fits resident is
    planned without moves (it was refused as needing offload)."""
    mm = ModelMemory(10 ** 9, 32, 8, 128, 2)
    plan = plan_memory(mm, HeadMemory(), gpu_bytes=20 * 10 ** 9, batch=144, input_len=500, output_len=500,
                       budget=2048)
    assert plan.max_batch >= plan.max_batch_resident >= 144 and plan.thresholds == [None] * 32


def test_small_request_needs_no_offload_and_too_large_batch_is_refused():
    mm = ModelMemory.from_config(transformers.LlamaConfig(**LLAMA3_8B), torch.bfloat16)
    plan = plan_memory(mm, HeadMemory(), gpu_bytes=80 * 2 ** 30, batch=1, input_len=2048, output_len=4096,
                       budget=2048)
    assert not plan.needs_offload and plan.offloaded_at(6144) == []
    with pytest.raises(ValueError, match="lower the batch to 2"):  # 2 rows: ⌊(85.9e9 − 16.06e9) / (2048·131072)⌋
        plan_memory(mm, HeadMemory(), gpu_bytes=80 * 2 ** 30, batch=400, input_len=2048 * 128, output_len=16,
                    budget=2048)
    with pytest.raises(ValueError, match="positive integer sizes"):
        plan_memory(mm, HeadMemory(), gpu_bytes=80 * 2 ** 30, batch=0, input_len=1, output_len=1, budget=1)
    with pytest.raises(ValueError, match=r"head must be a HeadMemory; got NoneType \(HeadMemory\(\) for a head"):
        plan_memory(mm, None, gpu_bytes=80 * 2 ** 30, batch=1, input_len=1, output_len=1, budget=1)  # AttributeError
    with pytest.raises(ValueError, match="plan_memory's model must be a ModelMemory; got LlamaConfig"):
        plan_memory(transformers.LlamaConfig(), HeadMemory(), gpu_bytes=2 ** 30, batch=1, input_len=1, output_len=1,
                    budget=1)
    # the weights alone (16.06e9 bytes = 14.96 GiB) do not fit: the fix is more memory, not "lower the batch to 0"
    with pytest.raises(ValueError, match=r"no batch fits 9.313 GiB: the weights, head and reserve alone take 14.96 "
                                         r"GiB.*raise gpu_gb"):
        plan_memory(mm, HeadMemory(), gpu_bytes=10 ** 10, batch=8, input_len=2048, output_len=4096, budget=2048)


def test_plan_memory_cli(tmp_path, capsys):
    cfg = dict(LLAMA3_8B, architectures=["LlamaForCausalLM"], model_type="llama")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # GiB, as the decode suite's gpu_gb: the hand calculation's 80 GiB GPU, 1 GiB head, 4 GiB reserve
    cmd = [sys.executable, "-m", "kvtransform.cli", "plan-memory", str(tmp_path), "gpu_gb=80", "batch=32",
           "head_gb=1", "head_token_bytes=4096", "reserve_gb=4", "input_len=2048", "output_len=32768"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "| 1 | 31 | 14906 |" in p.stdout and "| 21 | 11 | 34686 |" in p.stdout
    assert "largest batch 13 resident, 156 with offload" in p.stdout and "GPU 80.0 GiB" in p.stdout
    # the refusals through the same entry point in process (a fresh interpreter per call costs ~6 s of imports)
    for arg, msg in (("batch=9000", "lower the batch"),
                     ("head_gb=79", "raise gpu_gb (or lower head_gb, reserve_gb"),  # the head alone fills the GPU
                     ("head_resident_layers=33", "head_resident_layers=33 is more than the model's 32 layers")):
        rc, _, err = _main_in_process(cmd[3:5] + [arg], capsys)
        assert rc == 2 and err.count("error:") == 1 and msg in err and "Traceback" not in err, err


def _main_in_process(args, capsys) -> tuple:
    """``(exit status, stdout, stderr)`` of ``kvtransform <args>`` run through :func:`kvtransform.cli.main` in this
    process."""
    from kvtransform.cli import main

    capsys.readouterr()
    try:
        rc = main(args)
    except SystemExit as e:
        rc = e.code
    return ((0 if rc is None else rc),) + tuple(capsys.readouterr())


def test_plan_memory_defaults_fit_the_default_model(capsys):
    """``kvtransform plan-memory`` with no arguments plans the default model (SmolLM2-135M, an 8192-token window):
    its default request shape fits that window (a longer one is refused as past the context window)."""
    from kvtransform.cli import main

    try:
        rc = main(["plan-memory"])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert rc in (0, None), err
    assert "[2048 in, 6144 out]" in " ".join(out.split())


@pytest.mark.parametrize("arg,msg", [("gpu_gb=inf", "gpu_gb=inf must be a number of GiB from 1e-09 to 1048576"),
                                     ("gpu_gb=1e300", "gpu_gb=1e+300 must be a number of GiB from 1e-09 to"),
                                     ("gpu_gb=1e-12", "gpu_gb=1e-12 must be a number of GiB from 1e-09 to"),
                                     ("reserve_gb=nan", "reserve_gb=nan must be a number of GiB from 0 to 1048576"),
                                     ("head_gb=true", "invalid value for 'head_gb': expected a number"),
                                     ("head_resident_layers=-1", "head_resident_layers=-1 must be an integer >= 0"),
                                     ("batch=0", "batch=0 must be an integer >= 1"),
                                     ("input_len=-5", "input_len=-5 must be an integer >= 1")])
def test_plan_memory_cli_bad_values(tmp_path, capsys, arg, msg):
    """One error line and exit 2 (no OverflowError traceback for inf or 1e300 GiB), checked before the model is
    read (in process: the subprocess path is ``test_plan_memory_cli``'s)."""
    rc, _, err = _main_in_process(["plan-memory", str(tmp_path / "no-model"), arg], capsys)
    assert rc == 2 and err.count("error:") == 1 and msg in err, err
    assert "Traceback" not in err


def test_plan_memory_cli_throughput(tmp_path, capsys):
    """With ``hbm_gbps`` and ``link_gbps`` the command adds the modelled decode tokens/s of the batch, of the batch
    with the most and of the largest resident batch (the same numbers as
    :func:`kvtransform.runtime.throughput.best_batch` in process); half a pair, a GB/s that overflows, an overlap
    outside [0, 1], a factor below 1 or a negative host_gb is one error line (in process: the subprocess path is
    ``test_plan_memory_cli``'s)."""
    from kvtransform.runtime.throughput import StepModel, best_batch, tokens_per_second

    cfg = dict(LLAMA3_8B, architectures=["LlamaForCausalLM"], model_type="llama")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    cmd = ["plan-memory", str(tmp_path), "gpu_gb=80", "batch=32", "head_gb=1", "head_token_bytes=4096", "reserve_gb=4",
           "input_len=2048", "output_len=32768"]
    rc, out, err = _main_in_process(cmd + ["hbm_gbps=4200", "link_gbps=42", "overlap=0.1", "gpu_factor=1.8"], capsys)
    assert rc in (0, None), err
    model = ModelMemory.from_config(transformers.LlamaConfig(**LLAMA3_8B), torch.bfloat16)
    head = HeadMemory(weight_bytes=2 ** 30, token_bytes=4096)
    sizes = dict(gpu_bytes=80 * 2 ** 30, input_len=2048, output_len=32768, budget=2048, reserve_bytes=4 * 2 ** 30)
    sm = StepModel(4200e9, 42e9, 0.1, 1.8)
    best, rate = best_batch(model, head, sm, **sizes)
    mine = tokens_per_second(plan_memory(model, head, batch=32, **sizes), sm)
    assert 1 <= best.batch < 156  # full churn over PCIe: not the largest batch that fits
    out = " ".join(out.split())  # (the console may wrap)
    on_cpu = len(plan_memory(model, head, batch=32, **sizes).offloaded_at(32768 + 2048))
    assert f"batch 32 (the plan above): {mine:,.0f} ({on_cpu} layers on CPU by the last token) the most: batch " \
           f"{best.batch}: {rate:,.0f} (" in out, out
    resident = plan_memory(model, head, batch=13, **sizes)  # the hand calculation's largest resident batch
    assert f"without offload: batch 13 (the largest resident): {tokens_per_second(resident, sm):,.0f}" in out
    for args, msg in ((["hbm_gbps=4200"], "link_gbps=0.0: the throughput model needs both rates > 0 (or neither)"),
                      (["hbm_gbps=1e300", "link_gbps=42"], "hbm_gbps=1e+300 must be a number of GB/s from 0 to 1000000"),
                      (["link_gbps=-3", "hbm_gbps=4200"], "link_gbps=-3.0 must be a number of GB/s from 0 to"),
                      (["overlap=1.5"], "overlap=1.5 must be a fraction from 0 to 1"),
                      (["overlap=nan"], "overlap=nan must be a fraction from 0 to 1"),
                      (["gpu_factor=0.5"], "gpu_factor=0.5 must be a step's time over its floor from 1 to 1000000"),
                      (["host_gb=-1"], "host_gb=-1.0 must be a number of GiB from 0 to 1048576 (0: no bound)")):
        rc, out, err = _main_in_process(cmd + args, capsys)
        assert rc == 2 and err.count("error:") == 1 and msg in " ".join(err.split()), err


@pytest.mark.parametrize("field,value,msg", [
    ("num_hidden_layers", 0, "num_hidden_layers=0 must be an integer >= 1"),
    ("num_key_value_heads", 0, "num_key_value_heads=0 must be an integer >= 1"),
    ("hidden_size", 0, "head_dim=0 (hidden_size / num_attention_heads where not given) must be"),
    ("num_hidden_layers", "32", "expected int, got str"),
    ("num_key_value_heads", 7, "num_attention_heads=32 is not a multiple of num_key_value_heads=7")])
def test_plan_memory_bad_model_config(tmp_path, capsys, field, value, msg):
    """A config.json whose sizes the memory model divides by: one error line naming the field (it was a
    ZeroDivisionError or a transformers traceback)."""
    from kvtransform.cli import main

    cfg = dict(LLAMA3_8B, architectures=["LlamaForCausalLM"], model_type="llama", **{field: value})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as e:
        main(["plan-memory", str(tmp_path)])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and err.count("error:") == 1 and msg in err and "Traceback" not in err, err


def test_model_memory_refuses_heads_that_do_not_divide():
    """Query heads that KV heads do not divide, or a hidden size that heads do not divide with no head_dim: one line
    (the memory model counted a KV cache for a model that cannot exist)."""
    cfg = transformers.LlamaConfig(**LLAMA3_8B)
    cfg.num_key_value_heads = 5
    with pytest.raises(ValueError, match="num_attention_heads=32 is not a multiple of num_key_value_heads=5"):
        ModelMemory.from_config(cfg)
    cfg = transformers.LlamaConfig(**LLAMA3_8B)
    cfg.hidden_size, cfg.head_dim = 4100, None
    with pytest.raises(ValueError, match="hidden_size=4100 is not a multiple of num_attention_heads=32 and no head_dim"):
        ModelMemory.from_config(cfg)


def test_plan_memory_limits_from_python_and_the_context_window(tmp_path, capsys):
    """NumPy integers are sizes like ints; bad ModelMemory / HeadMemory fields are one line; a request past the
    model's context window is refused; a huge GPU with tiny requests (10^8 rows fit) plans in seconds."""
    import time

    import numpy as np

    from kvtransform.cli import main
    from kvtransform.runtime.throughput import StepModel, best_batch

    model = ModelMemory.from_config(transformers.LlamaConfig(**LLAMA3_8B), torch.bfloat16)
    assert model.max_positions == transformers.LlamaConfig(**LLAMA3_8B).max_position_embeddings
    sizes = dict(gpu_bytes=np.int64(80 * 2 ** 30), input_len=np.int64(2048), output_len=2048, budget=np.int32(512))
    assert plan_memory(model, HeadMemory(), batch=np.int64(3), **sizes).batch == 3
    for bad, msg in ((lambda: HeadMemory(token_bytes=-1), "HeadMemory.token_bytes=-1 must be an integer >= 0"),
                     (lambda: ModelMemory(1, 0, 8, 128, 2), "ModelMemory.num_layers=0 must be an integer >= 1"),
                     (lambda: ModelMemory(-5, 32, 8, 128, 2), "ModelMemory.weight_bytes=-5 must be an integer >= 0")):
        with pytest.raises(ValueError, match=msg):
            bad()
    cfg = dict(LLAMA3_8B, architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=8192)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit):
        main(["plan-memory", str(tmp_path), "input_len=4096", "output_len=4097"])
    assert "8193 tokens is past the model's context window (8192" in " ".join(capsys.readouterr().err.split())
    (tmp_path / "config.json").write_text(json.dumps(transformers.T5Config().to_dict()))  # not a causal LM
    with pytest.raises(SystemExit):
        main(["plan-memory", str(tmp_path)])
    err = capsys.readouterr().err
    assert "model type 't5' has no causal-LM class" in err and len(err) < 400, err
    t0 = time.perf_counter()
    plan, rate = best_batch(model, HeadMemory(), StepModel(4200e9, 42e9), gpu_bytes=100_000 * 2 ** 30, input_len=1,
                            output_len=1, budget=1)
    assert plan.batch > 10 ** 8 and rate > 0 and time.perf_counter() - t0 < 30


def test_plan_memory_offers_no_offload_to_a_sliding_window_model(tmp_path, capsys):
    """plan-memory planned layer moves and modelled offloaded batches for a model with sliding-window layers, which
    generate then refuses to offload: a batch that needs offload is refused in one line naming the largest resident
    batch, and the throughput lines stay among resident batches."""
    from kvtransform.tiny_models import TINY_WINDOW, tiny_model

    assert ModelMemory.from_model(tiny_model("gemma2")).window == TINY_WINDOW
    assert ModelMemory.from_model(tiny_model("llama")).window == 0
    tiny_model("gemma2").save_pretrained(tmp_path / "g")
    cmd = ["plan-memory", str(tmp_path / "g"), "gpu_gb=0.0004", "input_len=100", "output_len=100", "budget=8"]
    rc, out, err = _main_in_process(cmd + ["batch=8"], capsys)
    assert rc == 2 and "batch 8 needs KV offload, which does not take sliding-window layers yet" in err
    assert "the largest resident batch is 4" in err
    rc, out, err = _main_in_process(cmd + ["batch=2", "hbm_gbps=100", "link_gbps=1"], capsys)
    assert rc == 0, err
    assert "no offload (sliding-window layers)" in out and "the most: batch 4:" in out
    assert "0 layers on CPU by the last token" in out and "1 layers on CPU" not in out
