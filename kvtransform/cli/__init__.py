"""The ``kvtransform`` command line: this module dispatches, one module per sub-command does the work.

Subcommands::

    kvtransform optimize [MODEL] [key=value ...]                # load, transform, report, save, reload check
    kvtransform inspect [MODEL] [key=value ...]                 # the attention sites found
    kvtransform bench SUITE [key=value ...] [-m]                # forwarded to kvtransform.bench.run
    kvtransform generate [MODEL] prompt="..." [key=value ...]   # SpeContext generation, prints the text
    kvtransform distill-retrieval-head [MODEL] [key=value ...]  # train the distilled retrieval head
    kvtransform eval-sparse [MODEL] [key=value ...] [-m]        # sparse-decode accuracy table
    kvtransform rollout-mismatch [MODEL] [key=value ...]        # KL / importance weights of sparse rollouts
    kvtransform plan-memory [MODEL] gpu_gb=80 batch=32 ...      # KV offload plan

Command ``c`` lives in ``kvtransform/cli/<c>.py`` (``distill-retrieval-head``: ``distill.py``; dashes as
underscores), with a ``main(args) -> exit status``.

Every command but ``bench`` takes ``[MODEL] key=value ...`` and defaults to the model ``smollm2-135m``. ``optimize``,
``eval-sparse``, ``rollout-mismatch``, ``distill-retrieval-head`` and ``plan-memory`` are Hydra apps composed from
``kvtransform.conf`` (:mod:`.hydra_app`) on structured configs registered in Hydra's ConfigStore (:mod:`.schema`): a
misspelt key is an error that names the valid keys, a bad value names what the key accepts; ``--cfg job`` prints the
composed config, resolved; ``--help`` lists groups and keys. Hydra writes no run directory, ``.hydra/`` folder or log
file. ``generate`` and ``inspect`` parse the same ``key=value`` form themselves (:mod:`.keyvalue`).

Bad input (unknown model, bad path, existing ``out``, config typo, verification failure) prints one ``error:`` line
and exits with status 2 (:mod:`.errors`); set ``KVT_DEBUG=1`` for the full traceback.
"""
from __future__ import annotations

import difflib
import sys
from typing import Optional, Sequence

from . import optimize  # noqa: I001  (first: optimize's wall time counts from its import)
from . import bench, distill, eval_sparse, generate, inspect, plan_memory, rollout_mismatch
from .errors import USER_ERROR_EXIT, UsageError, fail, guard
from .optimize import reload_check, run_optimize
from .schema import ModelConfig, OptimizeConfig

__all__ = ["main", "COMMANDS", "ModelConfig", "OptimizeConfig", "UsageError", "reload_check", "run_optimize"]

#: command name -> ``fn(args) -> exit status``.
COMMANDS = {"optimize": optimize.main, "inspect": inspect.main, "bench": bench.main, "generate": generate.main,
            "distill-retrieval-head": distill.main, "eval-sparse": eval_sparse.main, "plan-memory": plan_memory.main,
            "rollout-mismatch": rollout_mismatch.main}

_HELP = """usage: kvtransform COMMAND [ARGS ...]

Rewrite attention in Hugging Face causal LMs (Llama, Qwen2/3, Mistral, Gemma 2/3, gpt-oss, Qwen3-MoE, Phi-3,
...) into kvtransform's ops: canonical kvt.attention, DualKV shared-prefix training attention, SpeContext sparse decode.

commands:
  optimize [MODEL] [key=value ...]   load, capture, rewrite, verify, save and reload-check a model
                                     (transform=canonical by default; --cfg job prints the config)
  inspect [MODEL] [key=value ...]    print the attention sites found in MODEL (model.dtype=..., json=true)
  bench SUITE [key=value ...] [-m]   run a benchmark suite
  generate [MODEL] prompt="..."      generate text with SpeContext sparse decode (transform.budget=..., threads=...)
  distill-retrieval-head [MODEL]     train the distilled retrieval head on MODEL's own attention (Hydra)
  eval-sparse [MODEL] [-m]           recall / NLL / greedy agreement of retrieval heads on real text (Hydra)
  rollout-mismatch [MODEL]           KL(sparse || dense) and importance weights of sparse-sampled rollouts (Hydra)
  plan-memory [MODEL] gpu_gb=80 batch=32 input_len=2048 output_len=6144
                                     when each layer's KV moves to CPU (SpeContext offload) and the largest batch

MODEL (default smollm2-135m): a registry name ({names}), a local HF model directory, a .gguf file, or a hub id in
the local HF cache. Run `kvtransform COMMAND --help` for a command's options."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point ``kvtransform`` (``pyproject.toml``: ``kvtransform = "kvtransform.cli:main"``; also
    ``python -m kvtransform.cli``).

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
    cmd = COMMANDS.get(args[0])
    if cmd is None:
        close = difflib.get_close_matches(args[0], list(COMMANDS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        fail(f"unknown command {args[0]!r}{hint}; commands: {', '.join(COMMANDS)}. See `kvtransform --help`")
    return guard(cmd, args[1:])


if __name__ == "__main__":
    sys.exit(main())
