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
    copies = 32 · k · 2048 · 4096 · (1 − overlap); t = f · reads / hbm + copies / link. k is the plan's count at the
    capacity the runtime holds before the step: n + 1 (chunk 1), or n + 1 rounded up to a 1024-token chunk."""
    plan = plan_memory(MODEL, HEAD, batch=32, **SIZES)
    n = max(t for t in plan.thresholds if t is not None) - 10  # 9 tokens before the last move
    chunked = -(-(n + 1) // 1024) * 1024
    reads = 16_060_522_496 + 300_000_000 + 32 * (32 * 2048 * 4096 + n * 2048)
    for chunk, capacity in ((1, n + 1), (1024, chunked)):
        k = len(plan.offloaded_at(capacity))
        assert k > 0
        sm = StepModel(hbm_bytes_per_s=4.2e12, link_bytes_per_s=42e9, overlap=0.25, gpu_factor=1.5, chunk=chunk)
        copies = 32 * k * 2048 * 4096 * 0.75
        assert step_seconds(plan, n, sm) == pytest.approx(1.5 * reads / 4.2e12 + copies / 42e9, rel=1e-12)
    assert len(plan.offloaded_at(chunked)) > len(plan.offloaded_at(n + 1))  # the last layer moves early at chunk 1024
    # the self head scores every cached key of layer 0: n · c / 2 more per row
    selfish = plan_memory(MODEL, HeadMemory(resident_layers=1), batch=4, **SIZES)
    sm = StepModel(1.0, 1.0, overlap=1.0)
    assert step_seconds(selfish, n, sm) == 16_060_522_496 + 4 * (32 * 2048 * 4096 + n * 4096 // 2)


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


def test_the_scan_matches_every_batch_and_stays_fast_when_many_rows_fit():
    """The best batch of a scan over every batch that fits equals :func:`best_batch`'s (a grid 1 % apart past 512
    rows, refined around its best point), and a shape where over 500,000 one-token rows fit is answered (it was a
    scan of every batch)."""
    sm = StepModel(4.2e12, 42e9, overlap=0.5, gpu_factor=1.8, chunk=1024)
    top = plan_memory(MODEL, HEAD, batch=1, **SIZES).max_batch
    every = max(range(1, top + 1), key=lambda b: (tokens_per_second(plan_memory(MODEL, HEAD, batch=b, **SIZES), sm),
                                                  -b))
    assert best_batch(MODEL, HEAD, sm, **SIZES)[0].batch == every
    short = dict(gpu_bytes=int(79.1 * GIB), input_len=1, output_len=1024, budget=1)
    top = plan_memory(MODEL, HeadMemory(), batch=1, **short).max_batch
    assert top > 500_000
    plan, rate = best_batch(MODEL, HeadMemory(), StepModel(4.2e12, 42e9), **short)
    assert 1 <= plan.batch <= top and rate > 0
    # a pinned-memory bound: the best batch within it (pinned bytes grow with the batch), one line when one row
    # already needs more
    unbounded, _ = best_batch(MODEL, HEAD, StepModel(4.2e12, 42e9, overlap=1.0), **SIZES)
    bound = unbounded.pinned_bytes // 3
    within, _ = best_batch(MODEL, HEAD, StepModel(4.2e12, 42e9, overlap=1.0), host_bytes=bound, **SIZES)
    assert 0 < within.pinned_bytes <= bound < unbounded.pinned_bytes and within.batch < unbounded.batch
    assert plan_memory(MODEL, HEAD, batch=within.batch + 1, **SIZES).pinned_bytes > bound
    tight = dict(SIZES, gpu_bytes=int(17 * GIB))
    with pytest.raises(ValueError, match="one row needs .* GiB of pinned CPU memory"):
        best_batch(MODEL, HEAD, sm, host_bytes=1, **tight)
    for bad in (-3, True, 2.7, "7"):
        with pytest.raises(ValueError, match="max_batch=.* must be an integer >= 0"):
            best_batch(MODEL, HEAD, sm, max_batch=bad, **SIZES)


@pytest.mark.parametrize("kw,match", [
    (dict(hbm_bytes_per_s=True, link_bytes_per_s=1e9), "hbm_bytes_per_s=True must be a positive number"),
    (dict(hbm_bytes_per_s=10 ** 400, link_bytes_per_s=1e9), "hbm_bytes_per_s=1000.* must be a positive number"),
    (dict(hbm_bytes_per_s=1e12, link_bytes_per_s=1e9, chunk=0), r"chunk=0 must be an integer >= 1"),
    (dict(hbm_bytes_per_s=0, link_bytes_per_s=1e9), "hbm_bytes_per_s=0 must be a positive number"),
    (dict(hbm_bytes_per_s=1e12, link_bytes_per_s=float("nan")), "link_bytes_per_s=nan must be a positive"),
    (dict(hbm_bytes_per_s=1e12, link_bytes_per_s=1e9, overlap=1.5), r"overlap=1.5 must be a fraction in \[0, 1\]"),
    (dict(hbm_bytes_per_s=1e12, link_bytes_per_s=1e9, gpu_factor=0.5), "gpu_factor=0.5 must be >= 1"),
])
def test_bad_rates_are_refused_in_one_line(kw, match):
    with pytest.raises(ValueError, match=match):
        StepModel(**kw)


def test_numpy_scalars_are_numbers():
    np = pytest.importorskip("numpy")
    sm = StepModel(np.float32(1e12), np.int64(10 ** 10), np.float32(0.5), np.float64(1.5), np.int64(8))
    assert sm.overlap == 0.5 and sm.chunk == 8
