"""Every ```python block of README.md runs as written, in order, in one fresh interpreter on the default model
(SmolLM2-135M), in a temporary working directory (the snippets write out/ and model.onnx there).

A block right after a ``<!-- readme-test: skip -->`` line is not run (the README says why at that block). After the
blocks, ``_CHECKS`` asserts the real-model claims on the objects they made (canonical: 30 sites rewritten and verified,
the saved artifact reloads with the model's logits; SpeContext: a budget covering the context gives HF ``generate``'s
greedy tokens on a left-padded batch); the README's ``export_onnx`` call is the real-model ONNX test
(``export_onnx`` checks the file in onnxruntime before writing it; dynamic shapes are tested on tiny models in
``tests/test_onnx.py``)."""
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SKIP_MARK = "<!-- readme-test: skip -->"
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def readme_blocks(text: str) -> list:
    """``[(line, code, skipped)]`` for each ```python block of ``text``: its first line number (1-based), its code,
    and whether the last non-blank line before it is the skip marker."""
    out = []
    for m in _FENCE.finditer(text):
        before = [ln for ln in text[:m.start()].splitlines() if ln.strip()]
        out.append((text.count("\n", 0, m.start()) + 2, m.group(1), bool(before) and before[-1].strip() == SKIP_MARK))
    return out


def test_readme_blocks_are_found():
    """The extraction itself (fast): the README has python blocks, and the skip marker is honoured."""
    blocks = readme_blocks(README.read_text())
    assert len(blocks) >= 5
    assert any("kvt.load_model" in code for _, code, skip in blocks if not skip)
    demo = "x\n" + SKIP_MARK + "\n\n```python\nskipped()\n```\n\n```python\nrun()\n```\n"
    assert [(code, skip) for _, code, skip in readme_blocks(demo)] == [("skipped()\n", True), ("run()\n", False)]


_DRIVER = textwrap.dedent('''
    import sys, time, traceback
    blocks = {blocks!r}
    ns = {{"__name__": "__main__"}}
    for line, code in blocks:
        t0 = time.perf_counter()
        try:
            exec(compile(code, "README.md:%d" % line, "exec"), ns)
        except BaseException:
            traceback.print_exc()
            print("README_BLOCK_FAILED at README.md line %d" % line, flush=True)
            sys.exit(1)
        print("README_BLOCK_OK line %d %.1f s" % (line, time.perf_counter() - t0), flush=True)
    try:
        exec(compile({checks!r}, "test_readme.py:_CHECKS", "exec"), ns)
    except BaseException:
        traceback.print_exc()
        print("README_CHECKS_FAILED", flush=True)
        sys.exit(1)
    print("README_CHECKS_OK", flush=True)
''')

# Run after the blocks, in their namespace: the real-model claims on the README's own objects (`model`, `tok`, `opt`,
# `opt2`, `sp`), so no other test captures SmolLM2 a second time for them. Canonical: every site rewritten and
# verified, and the artifact the README saved and reloaded gives the model's logits. SpeContext: with a budget that
# covers the context (`sp`'s 1024 against prompts of 5, 200 and 900 tokens + 32 new), `generate` on a left-padded
# batch gives HF `generate`'s greedy tokens row by row. (The last README block enables and disables the HF integration
# on `model`: disable() restores the model's own attention.) A README that renames these objects fails here with a
# NameError: rename them here too.
_CHECKS = textwrap.dedent('''
    import torch
    from kvtransform.verify import text_token_ids
    r = opt.report
    assert len(r.sites) == 30 and r.count("canonical") == 30 and r.verification.passed, r.to_dict()["verification"]
    assert {(s.q_heads, s.kv_heads, s.head_dim) for s in r.sites} == {(9, 3, 64)}
    assert r.verification.max_rel_error < 1e-5, r.verification.max_rel_error
    probe = tok("The library on the hill keeps its oldest maps", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(opt2(probe), model(input_ids=probe, use_cache=False).logits, rtol=1e-4, atol=1e-4)

    rows = [text_token_ids(tok, model.config.vocab_size, n, offset=o) for n, o in ((5, 0), (200, 40), (900, 300))]
    width = max(len(row) for row in rows)
    left = [width - len(row) for row in rows]
    padded = torch.stack([torch.cat([row.new_full((n,), tok.pad_token_id or 0), row]) for n, row in zip(left, rows)])
    mask = torch.stack([(torch.arange(width) >= n).long() for n in left])
    assert sp.config.budget >= width + 32, sp.config.budget
    got = sp.generate(padded, mask, max_new_tokens=32, eos_token_id=None)
    for b, row in enumerate(rows):
        with torch.no_grad():
            ref = model.generate(row[None], attention_mask=torch.ones(1, len(row), dtype=torch.long), max_new_tokens=32,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(row):]
        assert torch.equal(got[b, width:], ref), (b, got[b, width:], ref)
''')


@pytest.mark.slow
def test_readme_python_blocks_run_in_order(tmp_path):
    blocks = [(line, code) for line, code, skip in readme_blocks(README.read_text()) if not skip]
    driver = tmp_path / "readme_driver.py"
    driver.write_text(_DRIVER.format(blocks=blocks, checks=_CHECKS))
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # as a user runs it: the CPU path is the PyTorch references
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, str(driver)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=1800)
    wall = time.perf_counter() - t0
    timings = [ln for ln in p.stdout.splitlines() if ln.startswith("README_BLOCK_")]
    assert p.returncode == 0, (f"a README block failed after {wall:.0f} s:\n" + "\n".join(timings)
                               + f"\n--- stdout (tail) ---\n{p.stdout[-4000:]}\n--- stderr (tail) ---\n"
                               f"{p.stderr[-6000:]}")
    assert len(timings) == len(blocks) and "README_CHECKS_OK" in p.stdout, p.stdout[-4000:]
    for name in ("out", "model.onnx"):
        assert (tmp_path / name).exists(), name
    print(f"README blocks: {wall:.0f} s\n" + "\n".join(timings))
