"""Capture failures are one clear error naming the model feature (no exporter output); dynamic-NTK RoPE is captured
up to the model's original maximum length (``docs/ARCHITECTURE.md``, capture)."""
import pytest
import torch

import kvtransform as kvt
from kvtransform.capture import CaptureError, capture, capture_packed
from kvtransform.models import tiny_model

DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}


def test_dynamic_rope_is_captured_and_verified():
    model = tiny_model("llama", rope_scaling=DYNAMIC)
    rope = model.model.rotary_emb
    opt = kvt.transform(model, "canonical", progress=False)
    assert opt.report.verification.passed is True
    assert rope.rope_type == "dynamic"  # the model is left as it was
    ids = torch.randint(3, 128, (2, 256))
    am = torch.ones_like(ids)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=am).logits
        got = opt(ids, am)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_dynamic_rope_past_its_length_is_refused_by_name():
    model = tiny_model("llama", rope_scaling=DYNAMIC)
    with pytest.raises(CaptureError, match=r"dynamic-NTK RoPE .*rope_type.*past 256 positions.*512 positions"):
        capture(model, max_seq_len=512)
    with pytest.raises(CaptureError, match=r"dynamic-NTK RoPE .*unbounded position axis.*'default'"):
        capture_packed(model)


def test_capture_failure_is_one_line_naming_the_source(capfd):
    model = tiny_model("llama")

    def branch_on_values(module, args):  # a model feature torch.export cannot trace
        if args[0].sum() > 0:
            return None

    model.model.layers[0].register_forward_pre_hook(branch_on_values)
    with pytest.raises(CaptureError) as ei:
        kvt.transform(model, "canonical", progress=False)
    msg = str(ei.value)
    assert "\n" not in msg and isinstance(ei.value, RuntimeError)
    assert "data-dependent control flow" in msg and "test_capture.py" in msg and "`if args[0].sum() > 0:`" in msg
    assert "KVT_DEBUG=1" in msg and ei.value.__cause__ is not None
    out, err = capfd.readouterr()
    assert "def forward" not in out + err and len((out + err).splitlines()) < 3
