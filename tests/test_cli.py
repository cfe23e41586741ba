"""The ``kvtransform`` CLI: help, --cfg job, config typos, bad input, and optimize on a tiny model."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from kvtransform.cli import main


def kvt_load_default():
    import kvtransform as kvt

    return kvt.load_model("smollm2-135m")


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


@pytest.fixture
def reload_in_process(monkeypatch):
    """optimize's reload check (``kvtransform.cli.optimize.reload_check``: probe file, tolerance, verdict) with its
    child ``python -m kvtransform.cli.reload_child`` run in this process, for tests about other steps (a fresh
    interpreter costs ~6 s of imports; test_optimize_tiny_model and tests/test_transforms.py run it for real)."""
    import contextlib
    import importlib
    import io

    child = importlib.import_module("kvtransform.cli.reload_child")

    real_run = subprocess.run

    def run(cmd, *args, **kwargs):
        if list(cmd[1:3]) != ["-m", "kvtransform.cli.reload_child"]:
            return real_run(cmd, *args, **kwargs)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = child.main(list(cmd[3:]))
        return subprocess.CompletedProcess(cmd, rc, stdout=out.getvalue(), stderr="")

    monkeypatch.setattr(subprocess, "run", run)


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
    assert "kvtransform optimize transform=dualkv --help" in out  # how to see every transform's keys
    assert _cwd_is_empty()


def test_optimize_help_shows_the_selected_transforms_keys(capsys):
    rc, out, _ = _run(["optimize", "transform=dualkv", "--help"], capsys)
    assert rc == 0 and "keys below are those of transform=dualkv" in out
    assert "verify_groups:" in out and "num_responses:" in out
    assert "with these settings it is outputs/smollm2-135m-dualkv" in out  # out's default, resolved


@pytest.mark.parametrize("cmd", ["inspect", "bench", "generate"])
def test_subcommand_help(capsys, cmd):
    rc, out, _ = _run([cmd, "--help"], capsys)
    assert rc == 0 and f"kvtransform {cmd}" in out


@pytest.mark.parametrize("cmd,key", [("eval-sparse", "continuation=N"), ("plan-memory", "head_resident_layers=N"),
                                     ("distill-retrieval-head", "budget_fraction=F")])
def test_hydra_subcommand_help_is_the_commands_own(capsys, cmd, key):
    """Not Hydra's generic page (which listed optimize's transform group): what the command does, its keys with
    their meaning, examples, then the composed defaults."""
    rc, out, _ = _run([cmd, "--help"], capsys)
    assert rc == 0 and out.startswith(f"kvtransform {cmd} [MODEL]") and key in out and "Examples:" in out
    assert "transform: canonical" not in out and "Powered by Hydra" not in out
    assert "model:\n  name: smollm2-135m" in out     # the defaults, as composed


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
        ("transform.budget=64", ["'budget' is a key of transform=specontext: add transform=specontext"]),
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


@pytest.mark.parametrize("args,expected", [
    (["-m", "transform.budgt=3,4"], "'transform.budget'"),                     # a typo'd key swept
    (["-m", "ovrwrite=true", "threads=1,2"], "'overwrite'"),                   # a typo'd key beside a sweep
    (["-m", "threads=1,2", "transform.budget=8,lots"], "invalid value for 'transform.budget'"),  # a later value
    (["-m", "transform=canonical,dualk"], "unknown transform 'dualk'; did you mean 'dualkv'?"),
    (["-m", "threads=glob(*)"], "glob() picks the options of a config group (model, transform), and threads is a "
                                "setting"),                                    # Hydra ran no job for it (exit 0)
    (["-m", "threads=interval(1,2)"], "interval() needs a sweeper plugin"),  # Hydra: a traceback
    (["-m", "transform=glob(nope*)"], "transform=glob(nope*) matches no transform option; choices: canonical"),
    # a glob over a group is expanded for the check: transform.budget is a key of the specontext it picks
    (["-m", "transform=glob(spec*)", "transform.budget=8", "transform.verify.lengths=[0]"],
     "verify.lengths must be integers >= 2 tokens; got 0 (the -m sweep's job with transform=specontext; no job"),
])
def test_sweep_typos_and_bad_values_are_named_before_any_job(capsys, args, expected):
    """A -m sweep is checked as a single run is, each swept value once: a typo or a bad value in any job gives one
    error line naming the fix before the first job runs (not Hydra's multi-line error, nor a failure mid-sweep)."""
    pre = ["transform=specontext"] if "budg" in " ".join(args) and "glob" not in " ".join(args) else []
    rc, out, err = _run(["optimize", *pre, *args], capsys)
    assert rc == 2 and expected in err and err.count("error:") == 1, err
    assert "Traceback" not in err and _cwd_is_empty()


@pytest.mark.parametrize("args,expected,job", [
    (["optimize", "-m", "model.dtype=float32,float8"], "model.dtype: unknown dtype 'float8'", "model.dtype=float8"),
    (["optimize", "-m", "transform=dualkv", "transform.verify.tolerance=1e-3,-1"],
     "verify.tolerance must be a finite number > 0", "transform.verify.tolerance=-1"),
    (["eval-sparse", "-m", "budget=64,-1"], "budget must be >= 1 token per KV head; got -1", "budget=-1"),
    (["distill-retrieval-head", "-m", "steps=5,0"], "steps must be an integer >= 1; got 0", "steps=0"),
    (["rollout-mismatch", "-m", "seed=1,-1"], "seed must be an integer >= 0 and < 2**63; got -1", "seed=-1"),
    # a value bad only beside another job's value: every job of the sweep is checked
    (["eval-sparse", "-m", "num_sink=0,8", "budget=16,4"], "num_sink must be an integer in [0, smallest budget 4]; "
                                                           "got 8", "num_sink=8 budget=4"),
    # ${hydra:job.num} in a setting resolves to each job's number for the check (not "HydraConfig was not set")
    (["rollout-mismatch", "-m", "seed=${hydra:job.num}", "budget=8,-16"], "budget and lengths must be integers >= 1",
     "budget=-16"),
    (["optimize", "-m", "transform=specontext", "transform.head=auto,distilled", "transform.retrieval=/no/such/dir"],
     "transform.retrieval=/no/such/dir: no such directory", "transform.head=auto"),
    (["optimize", "-m", "transform=specontext", "transform.head=distilled,quest", "transform.retrieval=/tmp"],
     "which head='quest' does not read: set head=distilled", "transform.head=quest"),
    (["optimize", "-m", "model.name=smollm2-135m,/no/such/model"], "model: /no/such/model: no such file or directory",
     "model.name=/no/such/model"),
    (["eval-sparse", "-m", "retrieval=self,/no/such/dir"], "retrieval=/no/such/dir: no such directory",
     "retrieval=/no/such/dir"),
    (["rollout-mismatch", "-m", "head=[oracle]", "retrieval=self,/tmp"], "which no head of ['oracle'] reads",
     "retrieval=/tmp"),
])
def test_sweep_values_each_command_refuses_are_named_before_any_job(capsys, args, expected, job):
    """A value of the right type that the command itself refuses (a dtype, a negative tolerance, budget or seed, a
    missing head directory), in a later job of a -m sweep or only in combination with another swept value: one
    error line naming that job before any job runs (not after job 0 ran and wrote its output)."""
    rc, out, err = _run(args, capsys)
    assert rc == 2 and expected in err and err.count("error:") == 1, err
    assert f"(the -m sweep's job with {job}; no job was run)" in err, err
    assert "Traceback" not in err and _cwd_is_empty()


def test_sweep_over_out_checks_each_results_table_before_any_job(tmp_path, capsys):
    """eval-sparse merges into each job's out: a damaged results.csv in a later job's out is named before the first
    job runs (the first job's table is not written)."""
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "results.csv").write_text("model,document\nx,y\n")
    rc, out, err = _run(["eval-sparse", "-m", f"out={tmp_path / 'good'},{tmp_path / 'bad'}"], capsys)
    assert rc == 2 and "results.csv cannot be merged" in err and f"job with out={tmp_path / 'bad'};" in err, err
    assert not (tmp_path / "good").exists()


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
    rc, _, err = _run(["optimize", "smollm2-135m", f"out={out}"], capsys)  # out is checked before the model loads
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
    assert "inputs of random token ids (no tokenizer)" in err and "real inputs" not in err  # no tokenizer saved
    report = json.loads((out / "report.json").read_text())
    assert report["verification"]["passed"] is True
    assert len(report["sites"]) == 2 and all(s["status"] == "canonical" for s in report["sites"])
    # a second run into the same directory needs overwrite=true
    rc, _, err = _run(["optimize", str(model_dir), f"out={out}"], capsys)
    assert rc == 2 and "overwrite=true" in err
    assert sorted(os.listdir(tmp_path)) == ["artifact", "tiny-llama"]  # Hydra wrote nothing else in cwd


def test_optimize_keeps_no_artifact_that_does_not_reload(tmp_path, capsys, reload_in_process, monkeypatch):
    """A reload-check failure is one `error:` line; the artifact that failed it is not left on disk, and with
    overwrite=true the artifact that was there stays as it was (the new one is checked before it moves in)."""
    from kvtransform.cli import optimize
    from kvtransform.models import tiny_model

    def broken(opt, out, tok):
        raise optimize.ArtifactReloadError(f"the artifact {out} does not load in a fresh Python process: boom")

    model_dir = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(model_dir)
    out = tmp_path / "artifact"
    args = ["optimize", str(model_dir), f"out={out}", "transform.verify.lengths=[5]"]
    rc, _, err = _run(args, capsys)
    assert rc == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    monkeypatch.setattr(optimize, "reload_check", broken)
    for extra in ([], ["overwrite=true"]):
        target = out if extra else tmp_path / "fresh"
        rc, _, err = _run(args[:2] + [f"out={target}"] + args[3:] + extra, capsys)
        assert rc == 2 and f"boom; nothing was written to {target}" in err and "Traceback" not in err, err
    assert not (tmp_path / "fresh").exists()
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(os.listdir(tmp_path)) == ["artifact", "tiny-llama"]  # no staging directory left behind


def test_optimize_moves_in_only_what_out_still_allows(tmp_path, capsys, reload_in_process, monkeypatch):
    """`out` is checked again right before the move: what appeared there during the run (another run's artifact, a
    user's files) is never replaced without overwrite=true; a failed ONNX step leaves the previous artifact as it
    was; a symlinked `out` is written through; `out=.` is refused before loading."""
    from kvtransform.cli import optimize
    from kvtransform.models import tiny_model

    model_dir = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(model_dir)
    base = [str(model_dir), "transform.verify.lengths=[5]"]
    real_check = optimize.reload_check
    out = tmp_path / "raced"

    def check_then_someone_writes(opt, staged, tok):
        res = real_check(opt, staged, tok)
        out.mkdir()
        (out / "notes.txt").write_text("precious")
        return res

    monkeypatch.setattr(optimize, "reload_check", check_then_someone_writes)
    rc, _, err = _run(["optimize", base[0], f"out={out}", base[1]], capsys)
    assert rc == 2 and "exists and is not empty" in err, err
    assert os.listdir(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "precious"
    monkeypatch.setattr(optimize, "reload_check", real_check)

    target = tmp_path / "target"
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    target.mkdir()
    rc, _, err = _run(["optimize", base[0], f"out={link}", base[1]], capsys)
    assert rc == 0 and link.is_symlink() and (target / "meta.json").is_file(), err
    before = {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()}

    def onnx_fails(self, path, **kw):
        raise ValueError("cannot emit ONNX here")

    import kvtransform.transforms.base as tb
    monkeypatch.setattr(tb.OptimizedModule, "export_onnx", onnx_fails)
    rc, _, err = _run(["optimize", base[0], f"out={link}", base[1], "emit=[pt2,onnx]", "overwrite=true"], capsys)
    assert rc == 2 and "cannot emit ONNX here" in err, err
    assert {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()} == before
    assert not [p for p in tmp_path.iterdir() if "staging" in p.name]

    monkeypatch.chdir(tmp_path / "raced")
    (tmp_path / "raced" / "notes.txt").unlink()
    rc, _, err = _run(["optimize", "smollm2-135m", "out=."], capsys)  # an empty current directory too
    assert rc == 2 and "is the current directory" in err, err


def test_reload_child_module_leaves_the_exported_function():
    """The fresh-process child is its own module name: importing it does not rebind ``kvtransform.cli.reload_check``
    (optimize's function, exported by the package)."""
    import importlib

    import kvtransform.cli as cli
    from kvtransform.cli.optimize import reload_check

    importlib.import_module("kvtransform.cli.reload_child")
    assert cli.reload_check is reload_check


def test_reload_check_names_a_killed_check(tmp_path, monkeypatch):
    """A reload-check process stopped by a signal (e.g. the OOM killer) is reported as such, not blamed on the
    artifact."""
    import subprocess as sp

    from kvtransform.cli import optimize

    class Opt:
        def probe_inputs(self, tok):
            return {"input_ids": torch.zeros(1, 3, dtype=torch.long)}

        def probe(self, inputs):
            return torch.zeros(1, 3, 5)

    monkeypatch.setattr(sp, "run", lambda *a, **k: sp.CompletedProcess(a, -9, stdout="", stderr=""))
    with pytest.raises(optimize.ArtifactReloadError, match="stopped by signal 9"):
        optimize.reload_check(Opt(), tmp_path, None)


@pytest.mark.parametrize("out,expected", [("afile.txt/sub", "is a file: the artifact directory"),
                                          ("", "the output directory is empty")])
def test_optimize_refuses_an_output_path_inside_a_file_before_loading(tmp_path, capsys, monkeypatch, out, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile.txt").write_text("mine")
    rc, _, err = _run(["optimize", "smollm2-135m", f"out={out}"], capsys)  # checked before the model loads
    assert rc == 2 and expected in err, err
    assert (tmp_path / "afile.txt").read_text() == "mine"


def test_ctrl_c_is_one_line_and_status_130(capsys, monkeypatch):
    from kvtransform.cli import errors

    def interrupted(args):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as e:
        errors.guard(interrupted, [])
    assert e.value.code == errors.INTERRUPTED_EXIT == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err


def test_inspect_tiny_model(tmp_path, capsys):
    from kvtransform.models import tiny_model

    model_dir = tmp_path / "tiny-qwen3"
    tiny_model("qwen3").save_pretrained(model_dir)
    rc, stdout, err = _run(["inspect", str(model_dir), "--json"], capsys)
    assert rc == 0, err
    report = json.loads(stdout[stdout.index("{"):])
    assert len(report["sites"]) == 2
    rc, stdout, err = _run(["inspect", str(model_dir)], capsys)
    assert rc == 0, err
    assert "attention sites (2)" in stdout  # what inspect does: find the sites; nothing rewritten or verified
    assert "rewritten" not in stdout and "verification" not in stdout and "passes" not in stdout


@pytest.mark.parametrize(
    "override,expected",
    [
        ("transform.verify.lengths=16", "invalid value for 'transform.verify.lengths': expected a list of integers"),
        ("transform.verify.batch_size=abc", "invalid value for 'transform.verify.batch_size': expected an integer"),
        ("overwrite=maybe", "invalid value for 'overwrite': expected true or false (got maybe)"),
    ],
)
def test_bad_value_is_not_reported_as_unknown_key(capsys, override, expected):
    rc, _, err = _run(["optimize", override], capsys)
    assert rc == 2 and expected in err, err
    assert "unknown config key" not in err and "Did you mean" not in err


def test_group_typos_suggest_the_group_choice(capsys):
    rc, _, err = _run(["optimize", "transfrom=dualkv"], capsys)
    assert rc == 2 and "Did you mean 'transform=dualkv'" in err and "transform.name" not in err
    rc, _, err = _run(["optimize", "transform=dualk"], capsys)
    assert rc == 2 and "did you mean 'dualkv'? choices: canonical, dualkv, specontext" in err
    rc, _, err = _run(["optimize", "modle.name=x"], capsys)
    assert rc == 2 and "Did you mean 'model.name'" in err


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["transform.verify.lengths=[0]"], "verify.lengths must be integers >= 2"),
        (["transform=specontext", "transform.head=nope"], "unknown retrieval head"),
        (["transform=specontext", "transform.budget=0"], "budget must be >= 1"),
        (["threads=0"], "threads must be auto or an integer from 1"),
        (["transform=specontext", "emit=[pt2,onnx]"], "emit=[...,onnx] with transform=specontext"),
    ],
)
def test_transform_config_checked_before_loading(capsys, tmp_path, overrides, expected):
    # the model path does not exist: the config error must come first, also before an existing output directory
    rc, _, err = _run(["optimize", "./no/such/dir", *overrides], capsys)
    assert rc == 2 and expected in err and "no such file" not in err, err
    (tmp_path / "artifact.txt").write_text("not empty")
    rc, _, err = _run(["optimize", "./no/such/dir", f"out={tmp_path}", *overrides], capsys)
    assert rc == 2 and expected in err and "exists" not in err, err


def test_cfg_job_is_resolved(capsys):
    rc, out, _ = _run(["optimize", "transform=dualkv", "--cfg", "job"], capsys)
    assert rc == 0 and "${" not in out
    assert yaml.safe_load(out)["out"] == "outputs/smollm2-135m-dualkv"


def test_bench_error_has_no_exception_class(capsys):
    rc, _, err = _run(["bench", "dualkv-layer", "Pp=8192"], capsys)
    assert rc == 2 and err.startswith("error: unknown key 'Pp'") and "Exception" not in err
    rc, _, err = _run(["bench", "dualkv-layer", "P=abc"], capsys)
    assert rc == 2 and err.startswith("error: invalid value for 'P'") and "Exception" not in err


def test_optimize_dualkv_demo_time_is_labelled(tmp_path, capsys, reload_in_process):
    """The DualKV demo announces itself (and how to skip it) and its time is not counted as save."""
    from kvtransform.models import tiny_model

    model_dir = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(model_dir)
    rc, stdout, err = _run(["optimize", str(model_dir), "transform=dualkv", f"out={tmp_path / 'a'}",
                            "transform.verify.lengths=[5]", "transform.demo.num_responses=2",
                            "transform.demo.max_new_tokens=2", "transform.demo.repeats=1"], capsys)
    assert rc == 0, err
    flat = " ".join(stdout.split())
    assert "transform.demo.enabled=false" in flat and "dualkv demo" in flat and "demo wall time" in flat
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert report["timings"]["demo"] > 0


def test_adding_keys_with_plus_is_refused(capsys):
    rc, _, err = _run(["optimize", "+foo=1"], capsys)
    assert rc == 2 and "adding keys with '+' is not supported" in err, err


def test_capture_refusal_is_one_error_line(tmp_path, capsys):
    """A model feature that stops capture (dynamic-NTK RoPE on DualKV's unbounded packed axis): one `error:` line
    naming it and the config key, exit 2, nothing from the exporter."""
    from kvtransform.models import tiny_model

    model_dir = tmp_path / "tiny-dynamic-rope"
    tiny_model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}).save_pretrained(model_dir)
    capsys.readouterr()
    rc, _, err = _run(["optimize", str(model_dir), "transform=dualkv", f"out={tmp_path / 'o'}"], capsys)
    assert rc == 2, err
    err = err[err.index("error:"):]  # after the model loader's progress bar
    assert err.count("\n") == 1 and err.startswith("error: torch.export cannot capture"), err
    assert "dynamic-NTK RoPE" in err and "rope_type" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("arg,msg", [
    ("do_sample=maybe", "do_sample must be true or false"),
    ("chat=2", "chat must be true or false"),
    ("seed=abc", "seed must be an integer in [0, 2**64)"),
    ("seed=99999999999999999999999", "seed must be an integer in [0, 2**64)"),
    ("transform.name=dualkv", "runs transform=specontext only; got transform=dualkv"),  # was a traceback after it
    ("temperature=0", "temperature must be a number > 0"),
    ("temperature=.inf", "temperature must be a number > 0"),
    ("top_k=-1", "top_k must be an integer >= 0"),
    ("top_p=0", "top_p must be a number in (0, 1]"),
    ("max_new_tokens=abc", "max_new_tokens must be an integer >= 1"),
    ("model.dtype=", "model.dtype is empty"),  # (read as None: float32)
    ("budget=16", "unknown key 'budget' (did you mean 'transform.budget'?)"),
    ("transform.budget=abc", "invalid specontext config: budget: Value 'abc' of type 'str' could not be converted"),
    ("transform.budgt=8", "Key 'budgt' not in 'SpeContextConfig' (did you mean 'budget'?)"),
])
def test_generate_bad_option_before_loading(capsys, arg, msg):
    """Generation options are checked before the model loads (an unknown model would fail later)."""
    rc, _, err = _run(["generate", "no-such-model", "prompt=hi", arg], capsys)
    assert rc == 2 and err.count("error:") == 1 and msg in err, err
    assert "Traceback" not in err and _cwd_is_empty() and err.strip().count("\n") == 0     # one line


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a CUDA GPU")
def test_generate_offload_without_a_gpu_is_refused_before_loading(capsys):
    """It asked for runtime.gpu_memory_bytes, a key this command does not take, after loading the model."""
    rc, _, err = _run(["generate", "no-such-model", "prompt=hi", "transform.offload=true"], capsys)
    assert rc == 2 and "torch sees no CUDA GPU here: drop transform.offload" in err, err
    assert err.strip().count("\n") == 0 and _cwd_is_empty()


def test_plan_memory_transform_key_points_to_its_own_key(capsys):
    rc, _, err = _run(["plan-memory", "transform.budget=512"], capsys)
    assert rc == 2 and "This command has no transform group: did you mean 'budget'?" in err, err


def test_generate_threads_default_to_one_on_a_small_cpu(monkeypatch):
    """threads=auto: 1 thread on a CPU-only machine of <= 4 cores without OMP_NUM_THREADS (there 2 spinning threads
    made decode ~10x slower per step: README, SpeContext section); torch's default elsewhere; threads=N wins."""
    import os

    import torch

    from kvtransform.cli.generate import choose_threads

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert choose_threads("auto")[0] == 1
    assert choose_threads(2) == (2, "threads=2")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_threads("auto")[0] == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert choose_threads("auto")[0] == 2


@pytest.mark.parametrize("arg", ["threads=0", "threads=many", "threads=1.5", "threads=100000"])
def test_generate_bad_threads_before_loading(capsys, arg):
    rc, _, err = _run(["generate", "no-such-model", "prompt=hi", arg], capsys)
    assert rc == 2 and "threads must be auto or an integer from 1 to this machine's" in err, err  # 100000 crashed


def test_key_values_read_exponent_numbers_as_numbers():
    """YAML 1.1 reads 1e-3 as a string; key=value commands read it as Hydra does, a number."""
    from kvtransform.cli.keyvalue import _number

    assert _number("1e-3") == 1e-3 and _number("2E5") == 2e5 and _number("abc") == "abc" and _number("nan") == "nan"
    assert _number("12") == "12"  # (integers are YAML's already)


def test_generate_threads_key_is_accepted(capsys):
    """threads=1 passes the checks: the run gets as far as loading the (unknown) model."""
    rc, _, err = _run(["generate", "no-such-model", "prompt=hi", "threads=1"], capsys)
    assert rc == 2 and "unknown model 'no-such-model'" in err, err


@pytest.mark.slow
def test_generate_threads_one(tmp_path, capsys):
    """`kvtransform generate threads=1` end to end: the default model's tokenizer with a tiny random model of its
    vocabulary (the whole SmolLM2 path costs ~50 s on 2 cores; the README snippet test generates with SmolLM2)."""
    import torch

    from kvtransform.models import tiny_model

    _, tok = kvt_load_default()
    model_dir = tmp_path / "tiny-smol-vocab"
    tiny_model("llama", vocab_size=len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    before = torch.get_num_threads()
    try:
        rc, out, err = _run(["generate", str(model_dir), "prompt=The capital of France is", "max_new_tokens=4",
                             "chat=false", "threads=1", "transform.budget=64"], capsys)
        assert rc == 0, err
        line = " ".join(err.split())  # (the console wraps the closing line at its width)
        assert out.strip() and "4 new tokens" in line and "1 CPU thread:" in line, err
        # a budget beyond the cache: every cached token attended, said with the budget asked for
        assert re.search(r"budget=64 \(past the \d+-token cache: every step attended all it held\)", line), err
    finally:
        torch.set_num_threads(before)


def test_inspect_takes_key_value_settings(tmp_path, capsys):
    """inspect takes [MODEL] key=value like the other commands (model.dtype=, json=true); the old --dtype flag still
    works with a note naming the key."""
    from kvtransform.models import tiny_model

    model_dir = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(model_dir)
    rc, stdout, err = _run(["inspect", str(model_dir), "model.dtype=float32", "json=true"], capsys)
    assert rc == 0, err
    assert len(json.loads(stdout[stdout.index("{"):])["sites"]) == 2
    rc, stdout, err = _run(["inspect", f"model.name={model_dir}", "--dtype", "float32"], capsys)
    assert rc == 0 and "--dtype is deprecated: use model.dtype=float32" in err and "attention sites (2)" in stdout


@pytest.mark.parametrize("arg,msg", [("model.dtyp=float32", "unknown key 'model.dtyp' (did you mean 'model.dtype'?)"),
                                     ("json=maybe", "json must be true or false"),
                                     ("model.dtype=", "model.dtype is empty"),  # (read as None: float32)
                                     ("model.dtype=int8", "model.dtype: unknown dtype 'int8'"),
                                     ("--verbose", "unknown option '--verbose'")])
def test_inspect_bad_setting_is_one_error_line(capsys, arg, msg):
    rc, _, err = _run(["inspect", "no-such-model", arg], capsys)
    assert rc == 2 and msg in err and err.strip().count("\n") == 0, err


def test_inspect_defaults_to_the_default_model(monkeypatch, capsys):
    """No MODEL: the default model, like the Hydra commands (the loader is stubbed: nothing is loaded)."""
    import kvtransform.models as models

    seen = {}

    def fake_load(name, **kw):
        seen.update(name=name, **kw)
        raise ValueError("stop here")

    monkeypatch.setattr(models, "load_model", fake_load)
    rc, _, err = _run(["inspect", "model.dtype=bfloat16"], capsys)
    assert rc == 2 and "stop here" in err
    assert seen == {"name": "smollm2-135m", "dtype": "bfloat16", "attn_implementation": "sdpa"}


@pytest.mark.slow
def test_inspect_default_model_real(capsys):
    rc, stdout, err = _run(["inspect", "model.dtype=float32"], capsys)
    assert rc == 0, err
    assert "attention sites (30)" in stdout


def test_redirected_console_does_not_wrap_at_80_columns():
    """Output piped to a file (a log) keeps lines whole: a fresh process whose stdout is a pipe, no COLUMNS."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_TERMINAL", "TTY_COMPATIBLE")}
    code = "from kvtransform.utils import console; c = console(); print(c.is_terminal, c.width); c.print('x' * 150)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    first, second = out.splitlines()[:2]
    assert first.split()[0] == "False" and int(first.split()[1]) > 200
    assert second == "x" * 150


def test_optimize_staging_left_by_a_killed_run_is_removed(tmp_path):
    """A staging directory whose owner process on this host is gone (a SIGKILLed run) is removed by the next run
    writing beside it; one owned by a live process, or without an owner file (not made by optimize), stays."""
    import socket
    import subprocess as sp

    from kvtransform.cli import optimize

    out = tmp_path / "artifact"
    dead = sp.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    stale, live, foreign = (tmp_path / f".artifact.staging-{n}" for n in ("dead", "live", "foreign"))
    for d, owner in ((stale, f"{host} {dead.pid}"), (live, f"{host} {os.getpid()}"), (foreign, None)):
        (d / "artifact").mkdir(parents=True)
        if owner:
            (d / "owner").write_text(owner)
    printed = []

    class Console:
        def print(self, msg):
            printed.append(msg)

    new = optimize._make_staging(out, Console())
    assert not stale.exists() and live.exists() and foreign.exists()
    assert new.parent == tmp_path and (new / "owner").read_text() == f"{host} {os.getpid()}"
    assert len(printed) == 1 and str(stale) in printed[0] and str(dead.pid) in printed[0]


def test_output_dir_in_an_unwritable_directory_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    """An `out` whose directory cannot be written is refused in one line naming it, before the model loads (root
    bypasses permission bits, so the check is exercised through os.access)."""
    import kvtransform.transforms.artifact_files as tb

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(tb.os, "access", lambda p, mode: False if str(p) == str(locked) else real_access(p, mode))
    with pytest.raises(PermissionError, match="is not writable"):
        tb.check_output_dir(locked / "a" / "b", overwrite=False)
    tb.check_output_dir(tmp_path / "fine", overwrite=False)
    rc, _, err = _run(["optimize", "smollm2-135m", f"out={locked / 'a'}"], capsys)
    assert rc == 2 and "is not writable" in err and len(err.strip().splitlines()) == 1, err


def test_output_dir_the_os_refuses_is_found_by_a_real_probe(tmp_path):
    """A directory os.access calls writable that refuses new entries (root on /sys or a read-only mount) is found by
    making and removing an empty directory there; a path that is not a path is a TypeError in one line."""
    import kvtransform.transforms.artifact_files as tb

    if not os.path.isdir("/sys") or os.access("/sys", os.W_OK) is False:
        pytest.skip("needs a /sys that os.access reports writable (Linux, as root)")
    try:
        os.rmdir(__import__("tempfile").mkdtemp(dir="/sys"))
        pytest.skip("/sys accepts new directories here")
    except OSError:
        pass
    with pytest.raises(PermissionError, match=r"'/sys' is not writable \("):
        tb.check_output_dir("/sys/kvt_art", overwrite=False)
    with pytest.raises(TypeError, match="must be a path"):
        tb.check_output_dir(None, overwrite=False)
    assert list(tmp_path.iterdir()) == [] and tb.check_output_dir(tmp_path / "a", False) == tmp_path / "a"
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind


def test_eval_sparse_refuses_an_unwritable_out_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """The evaluation takes 15-40 minutes: an `out` that is a file is refused first, in one line."""
    import kvtransform.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    f = tmp_path / "afile"
    f.write_text("x")
    rc, _, err = _run(["eval-sparse", f"out={f}", "head=recent", "budget=8", "prefix=16", "continuation=4",
                       "generate=2", "documents=[argparse.py]"], capsys)
    assert rc == 2 and "choose another out=<directory>" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("content, why", [
    ("model,document,head,budget,recall_mean,recall_worst,nll_increase,agreement,select_ms\nm,a,self,64,0.9,0.",
     "its last line has no newline"),
    ("model,document,head,budget\nm,a,self,64\n", "no recall_mean, recall_worst, nll_increase, agreement, select_ms"),
    (b"\x00\xff\xfe\x01", "not a UTF-8 CSV file"),
], ids=["cut-short", "other-columns", "binary"])
def test_eval_sparse_refuses_a_damaged_results_csv_before_the_model_loads(tmp_path, capsys, monkeypatch, content,
                                                                          why):
    """An earlier results.csv the run would merge into is checked first: one left cut short by a killed run, or not
    eval-sparse's, is refused in one line naming it and the fix, not merged or failed on after the evaluation."""
    import kvtransform.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    (tmp_path / "o").mkdir()
    csv = tmp_path / "o" / "results.csv"
    csv.write_bytes(content if isinstance(content, bytes) else content.encode())
    rc, _, err = _run(["eval-sparse", f"out={tmp_path / 'o'}", "head=recent", "budget=8", "prefix=16",
                       "continuation=4", "generate=2", "documents=[argparse.py]"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{csv} cannot be merged" in err and why in err and "move it away or choose another out=" in err, err


@pytest.mark.parametrize("args, msg", [
    (["files=[nope.py]"], r"nope.py is missing .* \(files=\[...\]"),
    (["chunks_per_file=-1"], "chunks_per_file must be an integer >= 1"),
    (["topics_chunks=-1"], "topics_chunks must be an integer >= 0"),
    (["files=[]"], r"files=\[\] with topics_chunks=5 gives no training chunk: name at least one file"),
    (["files=[pydoc_data/topics.py]", "topics_chunks=0"], "gives no training chunk"),
    (["out=AFILE"], r"cannot be written \(.* is a file\): choose another out=<directory>"),
    (["device=tpu"], r"device must be auto, cpu or cuda\[:N\]; got 'tpu'"),
    (["device=cuda:x"], r"device must be auto, cpu or cuda\[:N\]"),
    (["device=CPU"], r"device must be auto, cpu or cuda\[:N\]; got 'CPU'"),
    pytest.param(["device=cuda"], "device=cuda but torch sees no CUDA device: use device=cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")),
])
def test_distill_refuses_bad_settings_before_the_model_loads(tmp_path, capsys, monkeypatch, args, msg):
    """Training files, chunk counts and the head directory are checked first; nothing is left on disk."""
    import kvtransform.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    (tmp_path / "afile").write_text("x")
    args = [a.replace("AFILE", str(tmp_path / "afile")) for a in args]
    out = [] if any(a.startswith("out=") for a in args) else [f"out={tmp_path / 'head'}"]
    rc, _, err = _run(["distill-retrieval-head", *args, *out, "steps=1", "length=64", "positions=8"], capsys)
    assert rc == 2 and re.search(msg, err) and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_multirun_jobs_get_their_own_out(tmp_path, capsys, reload_in_process):
    """A -m sweep without out= writes each job's artifact to outputs/multirun/<date_time>/<job number> (one shared out
    would make the second job refuse or replace the first's); an out= that every job would share is refused before
    any job."""
    from kvtransform.models import tiny_model

    model_dir = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(model_dir)
    rc, _, err = _run(["optimize", str(model_dir), "-m", f"out={tmp_path / 'same'}", "threads=1,2"], capsys)
    assert rc == 2 and "same directory for every job" in err and "${hydra:job.num}" in err, err
    assert not (tmp_path / "same").exists()
    rc, _, err = _run(["optimize", str(model_dir), "-m", f"out={tmp_path}/" + "${hydra:job.name}", "threads=1,2"],
                      capsys)  # an interpolation every job resolves alike is refused too
    assert rc == 2 and "same directory for every job" in err, err
    rc, _, err = _run(["optimize", str(model_dir), "-m", f"out={tmp_path / 'a'},{tmp_path / 'a'}"], capsys)
    assert rc == 2 and "same directory for every job" in err, err           # a swept out= naming one directory twice
    rc, out, err = _run(["optimize", str(model_dir), "-m", "transform.verify.lengths=[5]", "threads=1,2"], capsys)
    assert rc == 0, err
    # each job's wall time counts from its own start (job 1's "startup" held job 0's whole run)
    walls = [(float(a), float(b)) for a, b in re.findall(r"Done in ([\d.]+) s wall \(startup/imports ([\d.]+) s",
                                                         " ".join(out.split()))]
    assert len(walls) == 2 and walls[1][1] < walls[0][0], out
    sweeps = list((tmp_path / "outputs" / "multirun").iterdir())  # one folder per sweep (a second never collides)
    assert len(sweeps) == 1 and re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", sweeps[0].name), sweeps
    for job in ("0", "1"):
        meta = json.loads((sweeps[0] / job / "meta.json").read_text())
        assert meta["transform"] == "canonical"
    rc, _, err = _run(["optimize", str(model_dir), "-m", f"out={tmp_path / 'x'},{tmp_path / 'y'}"], capsys)
    assert rc == 0 and all((tmp_path / d / "meta.json").is_file() for d in "xy"), err   # out= is the sweep itself
    # eval-sparse's jobs merge their rows into one results table: a shared out= is what its sweep is for
    rc, _, err = _run(["eval-sparse", "-m", f"out={tmp_path / 'table'}", "budget=0,-1"], capsys)
    assert rc == 2 and "same directory" not in err and "budget" in err, err


def test_failed_sweep_leaves_no_empty_folders(tmp_path, capsys):
    """A -m sweep whose first job fails (after the pre-check: here the model does not load) leaves no multirun.yaml
    and no empty job or outputs/multirun folders; after a failure, a finished job's files and the sweep's
    multirun.yaml stay, empty job folders go."""
    from kvtransform.cli.hydra_app import _drop_empty_sweep

    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "config.json").write_text("{}")
    rc, _, err = _run(["optimize", "model.name=./fake", "-m", "transform=canonical,dualkv"], capsys)
    assert rc == 2 and "not a Hugging Face model config" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake"]
    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    (sweep / "0" / "meta.json").write_text("{}")
    (sweep / "1" / "sub").mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("x")
    _drop_empty_sweep(str(sweep))
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "multirun.yaml"]
    (sweep / "0" / "meta.json").unlink()
    _drop_empty_sweep(str(sweep))
    assert not sweep.exists()


def test_sigterm_cleans_up_and_kills_the_child(tmp_path):
    """SIGTERM during a command (here a child process like the reload check's) unwinds instead of ending the process
    on the spot: the child is killed with it, not left running; one 'terminated' line, exit status 143."""
    pid_file = tmp_path / "child.pid"
    child_code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    script = (
        "import subprocess, sys\n"
        "from kvtransform.cli.errors import guard\n"
        "def cmd():\n"
        f"    subprocess.run([sys.executable, '-c', {child_code!r}])\n"
        "guard(cmd)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(pid_file.read_text())
    parent.send_signal(signal.SIGTERM)
    _, err = parent.communicate(timeout=60)
    assert parent.returncode == 143 and "terminated (SIGTERM)" in err and "Traceback" not in err, err
    time.sleep(0.2)
    try:
        os.kill(child, 0)
        alive = open(f"/proc/{child}/stat").read().split()[2] != "Z" if os.path.exists(f"/proc/{child}") else False
    except ProcessLookupError:
        alive = False
    assert not alive
