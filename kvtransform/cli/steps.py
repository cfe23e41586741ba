"""Transform-specific steps of ``kvtransform optimize``, run after the transform and before saving: the CLI looks
them up here by the transform's name, so no transform imports the CLI (``docs/ARCHITECTURE.md``, CLI floor).

A step is ``fn(model, tokenizer, opt, config, console) -> dict``; a non-empty dict means it did timed work (the
DualKV demo), whose wall time the summary line reports on its own.
"""
from __future__ import annotations

from typing import Callable, Optional

__all__ = ["STEPS", "step_for"]


def dualkv_demo(model, tokenizer, opt, cfg, console) -> dict:
    """``transform=dualkv``: the GRPO-like demo (``transform.demo.*``, :mod:`.dualkv_demo`)."""
    if not cfg.demo.enabled:
        return {}
    from .dualkv_demo import run_demo

    d = cfg.demo
    console.print(
        f"[bold]DualKV demo[/bold]: sampling {d.num_responses} responses (up to {d.max_new_tokens} tokens) from "
        f"the model, checking log-probs and gradients against the original, timing forward+backward "
        f"({d.repeats} repeats) packed vs replicated; this can take minutes on a CPU. "
        f"Skip it with transform.demo.enabled=false")
    return run_demo(model, tokenizer, opt, cfg, console=console)


def specontext_head(model, tokenizer, opt, cfg, console) -> dict:
    """``transform=specontext``: one line on the retrieval head and what it measured
    (:func:`kvtransform.transforms.specontext.head_summary`)."""
    from rich.markup import escape

    from ..transforms.specontext import head_summary

    console.print(escape(head_summary(opt)))
    return {}


#: transform name -> its step.
STEPS: dict = {"dualkv": dualkv_demo, "specontext": specontext_head}


def step_for(tcfg) -> Optional[Callable]:
    """The step for the transform config ``tcfg``: :data:`STEPS` by its name, else the ``cli_step`` a transform
    registered outside this package gave :func:`kvtransform.transforms.register_transform` (a plain callable that
    must not import ``kvtransform.cli``), else None."""
    if tcfg.name in STEPS:
        return STEPS[tcfg.name]
    from ..api import check_available

    return check_available(tcfg).cli_step
