"""Reload check in a fresh interpreter: ``python -m kvtransform.cli.reload_child ARTIFACT_DIR PROBE_FILE``.

``kvtransform optimize`` saves the artifact, writes the probe inputs and the writer's outputs to ``PROBE_FILE``
(``torch.save``), and runs this module in a new process, so the check sees what a user's ``kvt.load(dir)`` sees: only
what importing kvtransform registers, not what the writing process happened to import. Prints one JSON line
``{"max_abs_error": ..., "shape": [...], "class": ...}``; exit status 0 when the outputs agree within the probe
file's tolerance, 1 otherwise.
"""
from __future__ import annotations

import json
import sys


def main(argv=None) -> int:
    import torch

    import kvtransform as kvt

    artifact, probe_file = (argv or sys.argv[1:])[:2]
    probe = torch.load(probe_file, weights_only=False)
    opt = kvt.load(artifact, progress=False)
    got = opt.probe(probe["inputs"]).cpu()
    want = probe["outputs"]
    same_shape = tuple(got.shape) == tuple(want.shape)
    err = float((got.double() - want.double()).abs().max()) if same_shape and got.numel() else \
        (0.0 if same_shape else float("inf"))
    print(json.dumps({"max_abs_error": err, "shape": list(got.shape), "class": type(opt).__name__}))
    return 0 if err <= probe["tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
