"""The ``kvtransform`` command line.

Subcommands::

    kvtransform optimize [MODEL] [key=value ...]   # load → transform → report → save → reload check (Hydra config)
    kvtransform inspect MODEL [--attn-implementation eager] [--json]
    kvtransform bench SUITE [overrides ...] [-m]   # forwarded to kvtransform.bench.run
    kvtransform generate [MODEL] prompt="..." [key=value ...]   # SpeContext generation, prints the text
    kvtransform distill-retrieval-head [MODEL] [key=value ...]  # train the distilled retrieval head (Hydra)
    kvtransform eval-sparse [MODEL] [key=value ...] [-m]        # sparse-decode accuracy table (Hydra)
    kvtransform plan-memory [MODEL] gpu_gb=80 batch=32 input_len=2048 output_len=32768   # KV offload plan (Hydra)

``optimize`` is a Hydra app composed from ``kvtransform.conf`` (``config.yaml`` + groups ``model/`` and
``transform/``) on top of structured configs registered in Hydra's ConfigStore: :class:`OptimizeConfig`,
:class:`ModelConfig` and the transform dataclasses of :mod:`kvtransform.config`. A misspelt key is an error that names
the valid keys, a bad value names what the key accepts; ``--cfg job`` prints the composed config, resolved;
``--help`` lists groups and keys. Hydra writes no run directory, ``.hydra/`` folder or log file: the artifact goes to
``out`` only.

Bad input (unknown model, bad path, existing ``out``, config typo, verification failure) prints one ``error:`` line
and exits with status 2; set ``KVT_DEBUG=1`` for the full traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from ..api import check_available
from ..config import config_from_dict
from .errors import USER_ERROR_EXIT, UsageError, console as _console, fail as _fail, guard as _guard
from .overrides import check_overrides, split_args
from .schema import EMIT_KINDS, ModelConfig, OptimizeConfig, register_configs

register_configs()

__all__ = ["main", "ModelConfig", "OptimizeConfig", "UsageError"]

_T_START = time.perf_counter()  # process start, near enough: the wall time printed by optimize counts from here

def reload_check(opt, out: Path, tokenizer) -> tuple[float, tuple]:
    """Load the artifact at ``out`` in a fresh Python process and compare its :meth:`probe` outputs with ``opt``'s
    (a user's ``kvt.load`` sees only what importing kvtransform registers). Returns ``(max abs error, shape)``.

    Raises:
        RuntimeError: the reloaded artifact fails to load or gives different outputs.
    """
    import json
    import subprocess
    import tempfile

    import torch

    inputs = opt.probe_inputs(tokenizer)
    want = opt.probe(inputs).cpu()
    tol = 1e-5 * max(1.0, float(want.double().abs().max())) if want.is_floating_point() else 0.0
    with tempfile.TemporaryDirectory(prefix="kvt-reload-") as tmp:
        probe_file = Path(tmp) / "probe.pt"
        torch.save({"inputs": inputs, "outputs": want, "tolerance": tol}, probe_file)
        proc = subprocess.run([sys.executable, "-m", "kvtransform.cli.reload_check", str(out), str(probe_file)],
                              capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the artifact {out} does not load in a fresh Python process: {tail}")
    res = json.loads(lines[-1])
    if proc.returncode != 0:
        raise RuntimeError(f"the artifact reloaded from {out} in a fresh process gives different outputs (max abs "
                           f"error {res['max_abs_error']:.3g}, shape {res['shape']} vs {list(want.shape)})")
    return res["max_abs_error"], tuple(want.shape)


def _emit_kinds(cfg: DictConfig) -> list:
    """``cfg.emit`` as a list, checked (UsageError names the accepted values)."""
    emit = list(cfg.get("emit", ["pt2"]))
    bad = [e for e in emit if e not in EMIT_KINDS]
    if bad or not emit:
        raise UsageError(f"emit={emit}: give a non-empty list of {', '.join(EMIT_KINDS)} (e.g. emit=[pt2,onnx])")
    return emit


def _transform_config(cfg: DictConfig):
    """The transform dataclass, its values validated, and the transform available: all before the model loads."""
    try:
        tcfg = config_from_dict(OmegaConf.to_container(cfg.transform, resolve=True))
    except ValueError as e:
        raise UsageError(f"invalid transform setting: {e}") from None
    check_available(tcfg)  # the error kvt.transform gives, before the model is loaded
    return tcfg


def run_optimize(cfg: DictConfig) -> dict:
    """The ``optimize`` job: load → transform (captures, rewrites, verifies) → report → save → reload check.

    Args:
        cfg: composed :class:`OptimizeConfig`.

    Returns:
        timings in seconds: ``startup`` (process start to load), ``load``, ``transform``, ``demo`` (the DualKV
        demo, 0 when it does not run), ``save``, ``reload``, ``onnx`` (0 unless ``emit`` has ``onnx``), ``total``
        (process start to end).

    Raises:
        FileExistsError: ``out`` exists and is not empty and ``overwrite`` is false (checked before loading).
        UsageError: an invalid transform config value, a transform that is not built (``specontext``), or an
            ``emit`` list that is empty or names something other than ``pt2`` / ``onnx``; checked before loading.
        ValueError / FileNotFoundError: from :func:`kvtransform.models.load_model` and the transform.
        RuntimeError: the reloaded artifact gives different logits.
    """
    import torch

    import kvtransform as kvt
    from ..models import load_model

    console = _console()
    from ..transforms.base import check_output_dir

    out = check_output_dir(cfg.out, cfg.overwrite)  # before loading the model: never replace what is not an artifact
    tcfg = _transform_config(cfg)
    emit = _emit_kinds(cfg)

    import transformers  # noqa: F401  (imported before the clock starts: startup is reported on its own)

    t0 = time.perf_counter()
    model, tok = load_model(cfg.model.name, dtype=cfg.model.dtype, attn_implementation=cfg.model.attn_implementation)
    t1 = time.perf_counter()
    console.print(f"[bold]Loaded[/bold] {cfg.model.name} ({type(model).__name__}, {model.dtype}) in {t1 - t0:.1f} s")

    opt = kvt.transform(model, tcfg, tokenizer=tok)
    t2 = time.perf_counter()
    opt.report.print()
    demo_s = 0.0
    step = check_available(tcfg).cli_step  # a transform-specific step (the DualKV demo), before saving
    if step is not None:
        td = time.perf_counter()
        if step(model, tok, opt, tcfg, console):
            demo_s = time.perf_counter() - td
    t_save = t3 = t4 = time.perf_counter()
    if "pt2" in emit:
        opt.save(str(out), overwrite=cfg.overwrite)
        t3 = time.perf_counter()
        console.print(f"[bold]Saved[/bold] artifact to {out}")

        err, shape = reload_check(opt, out, tok)
        t4 = time.perf_counter()
        console.print(f"[bold]Reloaded[/bold] {out} in a fresh process: same outputs on a {shape} probe (max abs "
                      f"diff {err:.2g})")
    t5 = t4
    if "onnx" in emit:
        onnx_path = opt.export_onnx(out / "model.onnx", tokenizer=tok)
        t5 = time.perf_counter()
        console.print(f"[bold]Wrote[/bold] {onnx_path} (ONNX opset 23; onnxruntime matches the module on a probe)")
    times = dict(startup=t0 - _T_START, load=t1 - t0, transform=t2 - t1, demo=demo_s, save=t3 - t_save,
                 reload=t4 - t3, onnx=t5 - t4, total=t5 - _T_START)
    demo = f", dualkv demo {times['demo']:.1f} s" if demo_s else ""
    console.print(
        f"[bold green]Done[/bold green] in {times['total']:.1f} s wall "
        f"(startup/imports {times['startup']:.1f} s, load {times['load']:.1f} s, "
        f"transform+verify {times['transform']:.1f} s{demo}, save {times['save']:.1f} s, "
        f"reload check {times['reload']:.1f} s" + (f", onnx {times['onnx']:.1f} s" if "onnx" in emit else "") + ")"
    )
    del torch
    return times


def _optimize(args: Sequence[str]) -> int:
    import hydra

    argv, overrides, multirun = split_args(args)
    if any(a in ("--cfg", "-c") for a in argv) and "--resolve" not in argv:
        argv.append("--resolve")  # --cfg job shows out as the directory it will be, not ${kvt_slug:...}
    if not multirun and not any(a in ("--help", "-h", "--hydra-help", "--shell-completion", "-sc") for a in argv):
        check_overrides(overrides)

    @hydra.main(version_base="1.3", config_path="pkg://kvtransform.conf", config_name="config")
    def _task(cfg: DictConfig) -> None:
        _guard(run_optimize, cfg)

    saved = sys.argv
    sys.argv = ["kvtransform optimize", *argv]
    try:
        _task()
    finally:
        sys.argv = saved
    return 0


# ---- inspect ------------------------------------------------------------------------------------------------------


def _inspect(args: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="kvtransform inspect",
        description="Load MODEL, capture it with torch.export and print the table of attention sites found "
        "(layer, kind, q/kv heads, head_dim, mask kind, status). Nothing is written.",
    )
    p.add_argument("model", help="registry name (e.g. smollm2-135m), local HF directory, .gguf file or cached hub id")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto (default float32)")
    p.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    ns = p.parse_args(list(args))

    def run() -> None:
        import json

        import kvtransform as kvt
        from ..models import load_model

        model, _ = load_model(ns.model, dtype=ns.dtype, attn_implementation=ns.attn_implementation)
        report = kvt.inspect(model, progress=not ns.json)
        if ns.json:
            print(json.dumps(report.to_dict(), indent=2, default=str))
        else:
            report.print()

    _guard(run)
    return 0


# ---- bench --------------------------------------------------------------------------------------------------------

_BENCH_HELP = """usage: kvtransform bench SUITE [key=value ...] [-m]

Run a benchmark suite (kvtransform.bench.run): long-format CSV, markdown table and plot; every row prints the
command that reproduces it. `kvtransform bench SUITE --help` shows the suite's options."""


def _bench(args: Sequence[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        try:
            from ..bench import SUITES

            suites = f"\n\nsuites: {', '.join(SUITES)}"
        except ImportError:
            suites = ""
        print(_BENCH_HELP + suites)
        return 0
    try:
        from ..bench import run
    except ImportError:
        _fail("kvtransform bench is not available in this version (kvtransform.bench.run is missing)")
    rc = _guard(run, args[0], list(args[1:]))
    return int(rc) if isinstance(rc, int) else 0


# ---- generate -----------------------------------------------------------------------------------------------------

_GENERATE_HELP = """usage: kvtransform generate [MODEL] prompt="..." [key=value ...]

Load MODEL (default smollm2-135m), apply the SpeContext transform (sparse retrieval decode, arXiv 2512.00722) and
print the generated text. Nothing is written.

keys:
  prompt=TEXT               the prompt (required)
  max_new_tokens=N          tokens to generate (default 128)
  chat=true|false           wrap the prompt in the tokenizer's chat template (default: true when it has one)
  do_sample=true|false      sample instead of greedy (default false); temperature=, top_k=, top_p=, seed=
  transform=specontext      the only transform with generate
  transform.KEY=VALUE       SpeContextConfig keys: head, budget, num_sink, num_recent, page_size, cuda_graphs, ...
  model.dtype=float32       float32 | bfloat16 | float16 | auto"""

_GENERATE_KEYS = {"prompt": None, "max_new_tokens": 128, "chat": None, "do_sample": False, "temperature": 1.0,
                  "top_k": None, "top_p": None, "seed": None, "model.dtype": "float32"}


def _parse_generate_args(args: Sequence[str]) -> tuple[Optional[str], dict, dict]:
    """``[MODEL] key=value ...`` → (model, generation options, transform config dict). Values are YAML scalars.

    Raises:
        UsageError: an unknown key, a transform other than specontext, a missing prompt, a second MODEL.
    """
    import yaml

    model, opts, tcfg = None, dict(_GENERATE_KEYS), {"name": "specontext"}
    for a in args:
        key, sep, raw = a.partition("=")
        if not sep:
            if model is not None:
                raise UsageError(f"unexpected argument {a!r}: give one MODEL, then key=value settings")
            model = a
            continue
        value = raw if key == "prompt" else yaml.safe_load(raw) if raw else None
        if key == "transform":
            if value != "specontext":
                raise UsageError(f"kvtransform generate runs transform=specontext only; got transform={raw}")
        elif key.startswith("transform."):
            tcfg[key[len("transform."):]] = value
        elif key in opts:
            opts[key] = value
        else:
            from ..config import SpeContextConfig

            spec_keys = [f.name for f in dataclasses.fields(SpeContextConfig)]
            close = ([f"transform.{key}"] if key in spec_keys else
                     difflib.get_close_matches(key, list(opts) + ["transform"], n=1))
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(f"unknown key {key!r}{hint}; keys: {', '.join(opts)}, transform.<key>")
    if not opts["prompt"]:
        raise UsageError('give the prompt: kvtransform generate MODEL prompt="..."')
    _check_generate_options(opts)
    return model, opts, tcfg


def _check_generate_options(opts: dict) -> None:
    """Generation options checked before the model loads (UsageError names the key and what it accepts)."""

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    n = opts["max_new_tokens"]
    if not is_int(n) or n < 1:
        raise UsageError(f"max_new_tokens must be an integer >= 1; got {n!r}")
    for key in ("chat", "do_sample"):
        if opts[key] is not None and not isinstance(opts[key], bool):
            raise UsageError(f"{key} must be true or false; got {opts[key]!r}")
    t = opts["temperature"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t < float("inf")):
        raise UsageError(f"temperature must be a number > 0; got {t!r}")
    if opts["top_k"] is not None and (not is_int(opts["top_k"]) or opts["top_k"] < 0):
        raise UsageError(f"top_k must be an integer >= 0 (0 or null = off); got {opts['top_k']!r}")
    p = opts["top_p"]
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
        raise UsageError(f"top_p must be a number in (0, 1] (1 or null = off); got {p!r}")
    if opts["seed"] is not None and (not is_int(opts["seed"]) or opts["seed"] < 0):
        raise UsageError(f"seed must be an integer >= 0; got {opts['seed']!r}")


def _warn_small_cpu_threads() -> None:
    """On a CPU-only machine of few cores with more than one intra-op thread and no OMP_NUM_THREADS, say that the
    decode loop's small ops can spin those threads: measured 10-18x slower per step on a shared 2-core machine."""
    import os

    import torch

    if torch.cuda.is_available() or "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() <= 1 or \
            (os.cpu_count() or 1) > 4:
        return
    _console(stderr=True).print(f"[dim]note: {torch.get_num_threads()} CPU threads on a {os.cpu_count()}-core machine: "
                                f"if decode is slow (other jobs running), OMP_NUM_THREADS=1 kvtransform generate ... "
                                f"was 10-18x faster per step in our measurements (README)[/dim]")


def _generate(args: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in args):
        print(_GENERATE_HELP)
        return 0

    def run() -> None:
        import torch

        import kvtransform as kvt
        from ..models import load_model

        name, opts, tdict = _parse_generate_args(args)
        try:
            tcfg = config_from_dict(tdict)
        except ValueError as e:
            raise UsageError(f"invalid transform setting: {e}") from None
        n = opts["max_new_tokens"]
        _warn_small_cpu_threads()
        model, tok = load_model(name or "smollm2-135m", dtype=opts["model.dtype"])
        if tok is None:
            raise UsageError(f"{name} has no tokenizer: kvtransform generate needs one to encode the prompt")
        sp = kvt.transform(model, tcfg, tokenizer=tok)
        chat = opts["chat"] if opts["chat"] is not None else bool(getattr(tok, "chat_template", None))
        if chat:
            text = tok.apply_chat_template([{"role": "user", "content": opts["prompt"]}], tokenize=False,
                                           add_generation_prompt=True)
            ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        else:
            ids = tok(opts["prompt"], return_tensors="pt")["input_ids"]
        out = sp.generate(ids.to(next(model.parameters()).device), max_new_tokens=n, do_sample=bool(opts["do_sample"]),
                          temperature=opts["temperature"], top_k=opts["top_k"], top_p=opts["top_p"],
                          seed=opts["seed"], return_dict_in_generate=True)
        print(tok.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True))
        st = out.stats
        _console(stderr=True).print(
            f"[dim]{st.new_tokens} new tokens, head={st.head} budget={st.budget}: prefill {st.prefill_s:.2f} s "
            f"({st.prefill_tokens_per_s:.0f} tok/s), decode {st.decode_s:.2f} s ({st.ms_per_step:.1f} ms/step), "
            f"KV cache {st.kv_bytes / 2**20:.1f} MiB[/dim]")
        del torch

    _guard(run)
    return 0


# ---- distill-retrieval-head, eval-sparse --------------------------------------------------------------------------


def _hydra_command(args: Sequence[str], config_name: str, prog: str, job) -> int:
    """Run ``job(cfg)`` as a Hydra app composed from ``kvtransform.conf/<config_name>.yaml`` (``[MODEL]
    key=value ... [-m]``); a typo or bad value is one ``error:`` line (exit 2)."""
    import hydra

    argv, overrides, multirun = split_args(args)
    if not multirun and not any(a in ("--help", "-h", "--hydra-help", "--shell-completion", "-sc") for a in argv):
        check_overrides(overrides, config_name)

    @hydra.main(version_base="1.3", config_path="pkg://kvtransform.conf", config_name=config_name)
    def _task(cfg: DictConfig) -> None:
        _guard(job, cfg)

    saved = sys.argv
    sys.argv = [prog, *argv]
    try:
        _task()
    finally:
        sys.argv = saved
    return 0


def _distill_job(cfg: DictConfig) -> None:
    from ..distill import distill

    res = distill(cfg, log=_console().print)
    _console().print(f"[bold]Saved[/bold] the distilled head to {res['out']} after {res['steps']} steps in "
                     f"{res['seconds'] / 60:.1f} min (top-k teacher mass on the training text "
                     f"{res['captured']:.3f}); use it with transform.head=distilled transform.retrieval={res['out']}")


def _eval_job(cfg: DictConfig) -> None:
    from ..eval_sparse import markdown, run_eval, summarize

    df = run_eval(cfg)
    _console().print(markdown(summarize(df)), soft_wrap=True)  # a markdown table: never wrapped at 80 columns
    _console().print(f"[bold]Wrote[/bold] {cfg.out}/results.csv, results.md, results.png")


def _plan_memory_job(cfg: DictConfig) -> None:
    from ..runtime.memory import run_plan_memory

    _console().print(run_plan_memory(cfg).table(), soft_wrap=True)


def _plan_memory(args: Sequence[str]) -> int:
    """``kvtransform plan-memory MODEL gpu_gb=... batch=... input_len=... output_len=...``: the SpeContext memory
    model (arXiv 2512.00722 §6): when each layer's KV moves to CPU and the largest batch, as a table."""
    return _hydra_command(args, "plan_memory", "kvtransform plan-memory", _plan_memory_job)


def _distill(args: Sequence[str]) -> int:
    return _hydra_command(args, "distill_retrieval_head", "kvtransform distill-retrieval-head", _distill_job)


def _eval_sparse(args: Sequence[str]) -> int:
    return _hydra_command(args, "eval_sparse", "kvtransform eval-sparse", _eval_job)


# ---- entry point --------------------------------------------------------------------------------------------------

_HELP = """usage: kvtransform COMMAND [ARGS ...]

Rewrite attention in Hugging Face causal LMs (Llama, Qwen2, Qwen3, Mistral, ...) into kvtransform's ops:
canonical kvt.attention, DualKV shared-prefix training attention, SpeContext sparse decode.

commands:
  optimize [MODEL] [key=value ...]   load, capture, rewrite, verify, save and reload-check a model
                                     (default model smollm2-135m, transform=canonical; --cfg job prints the config)
  inspect MODEL                      print the attention sites found in MODEL
  bench SUITE [key=value ...] [-m]   run a benchmark suite
  generate [MODEL] prompt="..."      generate text with SpeContext sparse decode (transform.budget=..., ...)
  distill-retrieval-head [MODEL]     train the distilled retrieval head on MODEL's own attention (Hydra)
  eval-sparse [MODEL] [-m]           recall / NLL / greedy agreement of retrieval heads on real text (Hydra)
  plan-memory [MODEL] gpu_gb=80 batch=32 input_len=2048 output_len=32768
                                     when each layer's KV moves to CPU (SpeContext offload) and the largest batch

MODEL: a registry name ({names}), a local HF model directory, a .gguf file, or a hub id in the local HF cache.
Run `kvtransform COMMAND --help` for a command's options."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point ``kvtransform``.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        exit status: 0 on success. User errors raise ``SystemExit(2)`` after printing one ``error:`` line.
    """
    from ..models import REGISTRY

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_HELP.format(names=", ".join(sorted(REGISTRY))))
        return 0 if args else USER_ERROR_EXIT
    if args[0] in ("-V", "--version"):
        from .. import __version__

        print(f"kvtransform {__version__}")
        return 0
    commands = {"optimize": _optimize, "inspect": _inspect, "bench": _bench, "generate": _generate,
                "distill-retrieval-head": _distill, "eval-sparse": _eval_sparse, "plan-memory": _plan_memory}
    cmd = commands.get(args[0])
    if cmd is None:
        close = difflib.get_close_matches(args[0], list(commands), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        _fail(f"unknown command {args[0]!r}{hint}; commands: {', '.join(commands)}. See `kvtransform --help`")
    return _guard(cmd, args[1:])


if __name__ == "__main__":
    sys.exit(main())
