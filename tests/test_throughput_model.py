"""The decode throughput model under KV offload (kvtransform.runtime.throughput; SpeContext arXiv 2512.00722 §5–6):
a step time checked by hand, and the request count it picks against the largest that fits."""
import pytest

from kvtransform.runtime.memory import GIB, HeadMemory, ModelMemory, plan_memory
from kvtransform.runtime.throughput import StepModel, best_batch, step_seconds, tokens_per_second

# Llama-8B-shaped: 16.06 GB of weights, 32 layers, 8 KV heads, head_dim 128, bf16 (c = 4096 B per token and layer)
MODEL = ModelMemory(weight_bytes=16_060_522_496, num_layers=32, num_kv_heads=8, head_dim=128, kv_dtype_bytes=2)
HEAD = HeadMemory(weight_bytes=300_000_000, token_bytes=2048)
SIZES = dict(gpu_bytes=int(71.1 * GIB), input_len=2048, output_len=32768, budget=2048)


def test_step_time_matches_hand_calculation():
    """Batch 32 at n = 30,000 with k offloaded layers: reads = W + P + 32 · (32 · 2048 · 4096 + 30,000 · 2048) and
    copies = 32 · k · 2048 · 4096 · (1 − overlap); t = f · reads / hbm + copies / link."""
    plan = plan_memory(MODEL, HEAD, batch=32, **SIZES)
    n = 30_000
    k = len(plan.offloaded_at(n))
    assert k > 0
    sm = StepModel(hbm_bytes_per_s=4.2e12, link_bytes_per_s=42e9, overlap=0.25, gpu_factor=1.5)
    reads = 16_060_522_496 + 300_000_000 + 32 * (32 * 2048 * 4096 + n * 2048)
    copies = 32 * k * 2048 * 4096 * 0.75
    assert step_seconds(plan, n, sm) == pytest.approx(1.5 * reads / 4.2e12 + copies / 42e9, rel=1e-12)


def test_free_copies_pick_the_largest_batch_and_full_churn_a_smaller_one():
    """With elastic loading free (every selection kept, overlap 1) more rows only add tokens/s: the largest batch
    that fits wins. With every entry new each step over a 42 GB/s link (the decode suite's random-weight heads on the
    H200) a batch that offloads little wins, and it beats the largest batch's modelled rate."""
    largest = plan_memory(MODEL, HEAD, batch=1, **SIZES).max_batch
    free = StepModel(4.2e12, 42e9, overlap=1.0, gpu_factor=1.8)
    plan, rate = best_batch(MODEL, HEAD, free, **SIZES)
    assert plan.batch == largest and rate == pytest.approx(tokens_per_second(plan, free))
    churn = StepModel(4.2e12, 42e9, overlap=0.0, gpu_factor=1.8)
    plan, rate = best_batch(MODEL, HEAD, churn, **SIZES)
    top = plan_memory(MODEL, HEAD, batch=largest, **SIZES)
    assert plan.max_batch_resident <= plan.batch < largest
    assert rate > 2 * tokens_per_second(top, churn)
    capped, _ = best_batch(MODEL, HEAD, free, max_batch=5, **SIZES)
    assert capped.batch == 5


@pytest.mark.parametrize("kw,match", [
    (dict(hbm_bytes_per_s=0, link_bytes_per_s=1e9), "hbm_bytes_per_s=0 must be a positive number"),
    (dict(hbm_bytes_per_s=1e12, link_bytes_per_s=float("nan")), "link_bytes_per_s=nan must be a positive"),
    (dict(hbm_bytes_per_s=1e12, link_bytes_per_s=1e9, overlap=1.5), r"overlap=1.5 must be a fraction in \[0, 1\]"),
    (dict(hbm_bytes_per_s=1e12, link_bytes_per_s=1e9, gpu_factor=0.5), "gpu_factor=0.5 must be >= 1"),
])
def test_bad_rates_are_refused_in_one_line(kw, match):
    with pytest.raises(ValueError, match=match):
        StepModel(**kw)
