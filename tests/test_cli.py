"""The ``kvtransform`` CLI: help, --cfg job, config typos, bad input, and optimize on a tiny model."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from kvtransform.cli import main


def _run(args, capsys):
    """Call main(args); return (exit code, stdout, stderr)."""
    try:
        rc = main(args)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Run every CLI test in an empty cwd, so a test can check that Hydra left nothing behind."""
    monkeypatch.chdir(tmp_path)


def _cwd_is_empty():
    return os.listdir(".") == []


def test_help(capsys):
    rc, out, _ = _run(["--help"], capsys)
    assert rc == 0
    for word in ("optimize", "inspect", "bench", "smollm2-135m"):
        assert word in out


def test_no_args_prints_usage(capsys):
    rc, out, _ = _run([], capsys)
    assert rc != 0 and "usage: kvtransform" in out


def test_optimize_help(capsys):
    rc, out, _ = _run(["optimize", "--help"], capsys)
    assert rc == 0
    assert "kvtransform optimize [MODEL]" in out
    assert "transform: canonical, dualkv, specontext" in out
    assert "overwrite: false" in out
    assert _cwd_is_empty()


@pytest.mark.parametrize("cmd", ["inspect", "bench"])
def test_subcommand_help(capsys, cmd):
    rc, out, _ = _run([cmd, "--help"], capsys)
    assert rc == 0 and f"kvtransform {cmd}" in out


def test_cfg_job_defaults(capsys):
    rc, out, _ = _run(["optimize", "--cfg", "job", "--resolve"], capsys)
    assert rc == 0
    cfg = yaml.safe_load(out)
    assert cfg["model"] == {"name": "smollm2-135m", "dtype": "float32", "attn_implementation": "sdpa"}
    assert cfg["transform"]["name"] == "canonical" and cfg["transform"]["verify"]["enabled"] is True
    assert cfg["out"] == "outputs/smollm2-135m-canonical" and cfg["overwrite"] is False
    assert _cwd_is_empty()  # no outputs/<date>/, .hydra/ or log file


def test_cfg_job_overrides_and_positional_model(capsys):
    rc, out, _ = _run(["optimize", "models/My Model.gguf", "transform=specontext", "transform.budget=64",
                       "model.dtype=bfloat16", "--cfg", "job", "--resolve"], capsys)
    assert rc == 0
    cfg = yaml.safe_load(out)
    assert cfg["model"]["name"] == "models/My Model.gguf" and cfg["model"]["dtype"] == "bfloat16"
    assert cfg["transform"]["name"] == "specontext" and cfg["transform"]["budget"] == 64
    assert cfg["out"] == "outputs/My_Model-specontext"


def test_cfg_job_dualkv(capsys):
    rc, out, _ = _run(["optimize", "smollm2-135m", "transform=dualkv", "out=o", "--cfg", "job"], capsys)
    assert rc == 0
    cfg = yaml.safe_load(out)
    assert cfg["transform"]["name"] == "dualkv" and "verify_groups" in cfg["transform"] and cfg["out"] == "o"


@pytest.mark.parametrize(
    "override,expected",
    [
        ("transform.budgt=3", ["'transform.budget'", "transform.num_sink"]),
        ("model.nam=x", ["'model.name'", "model.attn_implementation"]),
        ("transform.verify.lenghts=[1]", ["'transform.verify.lengths'", "transform.verify.tolerance"]),
        ("ovrwrite=true", ["'overwrite'", "model, transform, out, overwrite"]),
    ],
)
def test_config_typo_names_valid_keys(capsys, override, expected):
    args = ["optimize", override] if "budgt" not in override else ["optimize", "transform=specontext", override]
    rc, out, err = _run(args, capsys)
    assert rc == 2
    assert "error: unknown config key" in err and "Valid keys" in err
    for e in expected:
        assert e in err
    assert "Traceback" not in err and _cwd_is_empty()


def test_unknown_transform_option(capsys):
    rc, _, err = _run(["optimize", "transform=dualkvv"], capsys)
    assert rc == 2 and "canonical" in err and "dualkv" in err and "specontext" in err


def test_bad_value_type(capsys):
    rc, _, err = _run(["optimize", "transform=specontext", "transform.budget=lots"], capsys)
    assert rc == 2 and "error:" in err and "budget" in err


def test_unknown_model(capsys):
    rc, _, err = _run(["optimize", "smollm3-135m"], capsys)
    assert rc == 2
    assert "unknown model 'smollm3-135m'" in err and "smollm2-135m" in err
    assert "Traceback" not in err and _cwd_is_empty()


def test_bad_path(capsys):
    rc, _, err = _run(["optimize", "./no/such/dir"], capsys)
    assert rc == 2 and "no such file or directory" in err


def test_inspect_unknown_model(capsys):
    rc, _, err = _run(["inspect", "nope-model"], capsys)
    assert rc == 2 and "unknown model" in err


def test_existing_out_dir(capsys, tmp_path):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, _, err = _run(["optimize", "smollm3-135m", f"out={out}"], capsys)  # out is checked before the model
    assert rc == 2 and "exists and is not empty" in err and "overwrite=true" in err
    assert os.listdir(out) == ["keep.txt"]


def test_unknown_command(capsys):
    rc, _, err = _run(["optimise"], capsys)
    assert rc == 2 and "did you mean 'optimize'" in err


def test_console_script_error_has_no_traceback(tmp_path):
    """Through a real process: one error line, exit status 2, nothing written."""
    p = subprocess.run([sys.executable, "-m", "kvtransform.cli", "optimize", "model.dtyp=float16"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "'model.dtype'" in p.stderr
    assert os.listdir(tmp_path) == []


def test_optimize_tiny_model(tmp_path, capsys):
    """optimize end to end on a tiny Llama directory: report, artifact, reload check, wall time."""
    from kvtransform.models import tiny_model

    model_dir = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(model_dir)
    out = tmp_path / "artifact"
    rc, stdout, err = _run(["optimize", str(model_dir), f"out={out}", "transform.verify.lengths=[5,12]"], capsys)
    assert rc == 0, err
    assert "verification" in stdout and "Reloaded" in stdout and "Done in" in stdout
    report = json.loads((out / "report.json").read_text())
    assert report["verification"]["passed"] is True
    assert len(report["sites"]) == 2 and all(s["status"] == "canonical" for s in report["sites"])
    # a second run into the same directory needs overwrite=true
    rc, _, err = _run(["optimize", str(model_dir), f"out={out}"], capsys)
    assert rc == 2 and "overwrite=true" in err
    assert sorted(os.listdir(tmp_path)) == ["artifact", "tiny-llama"]  # Hydra wrote nothing else in cwd


def test_inspect_tiny_model(tmp_path, capsys):
    from kvtransform.models import tiny_model

    model_dir = tmp_path / "tiny-qwen3"
    tiny_model("qwen3").save_pretrained(model_dir)
    rc, stdout, err = _run(["inspect", str(model_dir), "--json"], capsys)
    assert rc == 0, err
    report = json.loads(stdout[stdout.index("{"):])
    assert len(report["sites"]) == 2
