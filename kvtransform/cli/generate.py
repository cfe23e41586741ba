"""``kvtransform generate [MODEL] prompt="..." [key=value ...]``: SpeContext sparse retrieval decode (arXiv
2512.00722) on MODEL, the generated text on stdout, the run's numbers on stderr."""
from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from ..config import config_from_dict
from ..utils import is_count, stage
from .errors import UsageError, console as _console
from .keyvalue import check_model_dtype, key_value_main, parse_key_values

__all__ = ["main", "choose_threads", "check_threads"]

HELP = """usage: kvtransform generate [MODEL] prompt="..." [key=value ...]

Load MODEL (default smollm2-135m), apply the SpeContext transform (sparse retrieval decode, arXiv 2512.00722) and
print the generated text. Nothing is written.

keys:
  prompt=TEXT               the prompt (required)
  max_new_tokens=N          tokens to generate (default 128)
  chat=true|false           wrap the prompt in the tokenizer's chat template (default: true when it has one)
  do_sample=true|false      sample instead of greedy (default false); temperature=, top_k=, top_p=, seed=
  threads=N|auto            torch CPU threads (default auto: 1 on a CPU-only machine of at most 4 cores unless
                            OMP_NUM_THREADS is set, where more threads spin on decode's small ops; else torch's
                            default)
  transform=specontext      the only transform with generate
  transform.KEY=VALUE       SpeContextConfig keys: head, budget, num_sink, num_recent, page_size, cuda_graphs, ...
  model.dtype=float32       float32 | bfloat16 | float16 | auto"""

KEYS = {"prompt": None, "max_new_tokens": 128, "chat": None, "do_sample": False, "temperature": 1.0, "top_k": None,
        "top_p": None, "seed": None, "threads": "auto", "transform": "specontext", "model.dtype": "float32"}

SMALL_CPU = 4  # cores: at most this many, CPU-only, and threads=auto picks one thread


def _spec_hint(key: str):
    from ..config import SpeContextConfig

    return f"transform.{key}" if key in {f.name for f in dataclasses.fields(SpeContextConfig)} else None


def parse_args(args: Sequence[str]) -> tuple[str, dict, dict]:
    """``[MODEL] key=value ...`` → (model, generation options, transform config dict), checked before any load.

    Raises:
        UsageError: an unknown key, a transform other than specontext, a missing prompt, a second MODEL, a bad value.
    """
    model, opts, tcfg = parse_key_values(args, KEYS, raw_keys=("prompt",), prefixes=("transform.",), hint=_spec_hint)
    for name in (opts["transform"], tcfg.pop("name", "specontext")):  # transform=... or transform.name=...
        if name != "specontext":
            raise UsageError(f"kvtransform generate runs transform=specontext only; got transform={name}")
    if not opts["prompt"]:
        raise UsageError('give the prompt: kvtransform generate MODEL prompt="..."')
    _check_options(opts)
    return model, opts, {"name": "specontext", **tcfg}


def _check_options(opts: dict) -> None:
    """Generation options checked before the model loads (UsageError names the key and what it accepts)."""
    n = opts["max_new_tokens"]
    if not is_count(n, 1):
        raise UsageError(f"max_new_tokens must be an integer >= 1; got {n!r}")
    for key in ("chat", "do_sample"):
        if opts[key] is not None and not isinstance(opts[key], bool):
            raise UsageError(f"{key} must be true or false; got {opts[key]!r}")
    t = opts["temperature"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t < float("inf")):
        raise UsageError(f"temperature must be a number > 0; got {t!r}")
    if opts["top_k"] is not None and not is_count(opts["top_k"], 0):
        raise UsageError(f"top_k must be an integer >= 0 (0 or null = off); got {opts['top_k']!r}")
    p = opts["top_p"]
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
        raise UsageError(f"top_p must be a number in (0, 1] (1 or null = off); got {p!r}")
    if opts["seed"] is not None and not is_count(opts["seed"], 0, 2 ** 64 - 1):
        raise UsageError(f"seed must be an integer in [0, 2**64); got {opts['seed']!r}")
    check_threads(opts["threads"])
    check_model_dtype(opts["model.dtype"])


def check_threads(th) -> None:
    """UsageError (one line) unless ``threads=`` is ``auto`` or an integer from 1 to the CPU count."""
    if th != "auto" and not is_count(th, 1, os.cpu_count() or 1):
        raise UsageError(f"threads must be auto or an integer from 1 to this machine's {os.cpu_count()} CPUs; "
                         f"got {th!r}")


def choose_threads(threads) -> tuple[int, str]:
    """``(torch CPU threads to use, why)`` for ``threads=`` (``auto`` or N).

    ``auto``: 1 when CUDA is unavailable, the machine has at most :data:`SMALL_CPU` cores and ``OMP_NUM_THREADS``
    is not set: there more OpenMP threads spin on the decode loop's small ops (README, section "SpeContext: long
    generation with sparse retrieval decode": on a shared 2-core CPU one decode step took ~1.5 s with 2 threads and
    103 ms with 1); otherwise torch's current default."""
    import torch

    if threads != "auto":
        return int(threads), f"threads={int(threads)}"
    if torch.cuda.is_available() or "OMP_NUM_THREADS" in os.environ or (os.cpu_count() or 1) > SMALL_CPU:
        return torch.get_num_threads(), "torch's default"
    return 1, f"auto: a {os.cpu_count()}-core CPU"


def run(args: Sequence[str]) -> None:
    import torch

    import kvtransform as kvt
    from ..models import load_model

    name, opts, tdict = parse_args(args)
    try:
        tcfg = config_from_dict(tdict)
    except ValueError as e:
        raise UsageError(f"invalid transform setting: {e}") from None
    if getattr(tcfg, "offload", False) and not torch.cuda.is_available():  # before minutes of loading
        raise UsageError("transform.offload=true plans the KV cache's layers between GPU memory and the CPU, and "
                         "torch sees no CUDA GPU here: drop transform.offload (from Python, "
                         "runtime.gpu_memory_bytes=N simulates a GPU's memory on the CPU)")
    n = opts["max_new_tokens"]
    threads, why = choose_threads(opts["threads"])
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
        _console(stderr=True).print(f"[dim]{threads} CPU thread{'s' if threads > 1 else ''} ({why}; "
                                    f"threads=N to change)[/dim]")
    model, tok = load_model(name, dtype=opts["model.dtype"])
    if tok is None:
        raise UsageError(f"{name} has no tokenizer: kvtransform generate needs one to encode the prompt: "
                         f"save the tokenizer into the model directory (tokenizer.save_pretrained(dir)), or call "
                         f"kvt.transform(model, 'specontext').generate(input_ids) from Python with ids you encoded")
    sp = kvt.transform(model, tcfg, tokenizer=tok)
    chat = opts["chat"] if opts["chat"] is not None else bool(getattr(tok, "chat_template", None))
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": opts["prompt"]}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    else:
        ids = tok(opts["prompt"], return_tensors="pt")["input_ids"]
    compiling = " (the first call compiles the decode program)" if getattr(tcfg, "compile", False) else ""
    with stage(True, f"generating up to {n} tokens{compiling}"):
        out = sp.generate(ids.to(next(model.parameters()).device), max_new_tokens=n,
                          do_sample=bool(opts["do_sample"]), temperature=opts["temperature"], top_k=opts["top_k"],
                          top_p=opts["top_p"], seed=opts["seed"], return_dict_in_generate=True)
    print(tok.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True))
    st = out.stats
    on_cpu = next(model.parameters()).device.type == "cpu"
    cpu = f", {threads} CPU thread{'s' if threads > 1 else ''}" if on_cpu else ""
    # a budget beyond the cache's length selects the whole cache (stats.budget: the tokens each step attended)
    budget = (f"budget={tcfg.budget} (past the {st.budget}-token cache: every step attended all it held)"
              if st.budget < tcfg.budget else f"budget={st.budget}")
    _console(stderr=True).print(
        f"[dim]{st.new_tokens} new tokens, head={st.head} {budget}{cpu}: prefill {st.prefill_s:.2f} s "
        f"({st.prefill_tokens_per_s:.0f} tok/s), decode "
        f"{st.decode_s:.2f} s ({st.ms_per_step:.1f} ms/step), KV cache {st.kv_bytes / 2**20:.1f} MiB[/dim]")


def main(args: Sequence[str]) -> int:
    """``kvtransform generate [MODEL] prompt="..." [key=value ...]``."""
    return key_value_main(args, HELP, run)
