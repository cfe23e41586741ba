"""The transforms package: handlers registered by config type, config versions, artifacts that load in a fresh
interpreter into the class that wrote them (docs/ARCHITECTURE.md)."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import kvtransform as kvt
from kvtransform.config import CanonicalConfig, TransformConfig, config_from_dict
from kvtransform.transforms import _REGISTRY, register_transform, registered, spec_for
from kvtransform.transforms.canonical import canonical_transform
from kvtransform.transforms.dualkv import DualKVModule


def test_every_transform_registered_by_config_type():
    assert {"canonical", "dualkv"} <= set(registered())
    assert spec_for(kvt.DualKVConfig()).module_type is DualKVModule
    assert spec_for(kvt.CanonicalConfig()).handler is canonical_transform
    assert not issubclass(kvt.DualKVConfig, CanonicalConfig) and issubclass(kvt.DualKVConfig, TransformConfig)


def test_a_new_transform_is_one_registration():
    """A config subclass with its own handler is dispatched by type; an unregistered type is a clear error."""

    @dataclasses.dataclass
    class EchoConfig(TransformConfig):
        name: str = "echo"

    calls = []

    @register_transform(EchoConfig)
    def echo(model, cfg, tokenizer=None, progress=True):
        calls.append(cfg)
        return kvt.OptimizedModule(torch.nn.Identity(), cfg, kvt.Report())

    try:
        model = kvt.tiny_model("llama")
        out = kvt.transform(model, EchoConfig(), progress=False)
        assert calls and isinstance(out, kvt.OptimizedModule)
    finally:
        _REGISTRY.pop(EchoConfig)

    @dataclasses.dataclass
    class OtherConfig(TransformConfig):
        name: str = "other"

    with pytest.raises(ValueError, match="transform 'other' is not available.*available: .*canonical"):
        kvt.transform(kvt.tiny_model("llama"), OtherConfig(), progress=False)
    with pytest.raises(TypeError, match="TransformConfig subclass"):
        register_transform(dict)
    with pytest.raises(TypeError, match="abstract"):
        TransformConfig().validate()


def test_config_version():
    assert kvt.CanonicalConfig().version == 1
    assert config_from_dict({"name": "dualkv"}).version == 1      # an artifact written before versions existed
    with pytest.raises(ValueError, match="newer than this kvtransform understands"):
        config_from_dict({"name": "canonical", "version": 99})
    with pytest.raises(ValueError, match="version must be an integer >= 1"):
        config_from_dict({"name": "canonical", "version": 0})


_LOAD_AND_RUN = textwrap.dedent("""
    import sys, torch
    import kvtransform as kvt
    opt = kvt.load(sys.argv[1])
    probe = torch.load(sys.argv[2], weights_only=False)
    out = opt.probe(probe["inputs"])
    print(type(opt).__name__, float((out - probe["outputs"]).abs().max()))
""")


@pytest.mark.parametrize("name,family", [("canonical", "qwen3_moe"), ("dualkv", "qwen3")])
def test_artifact_loads_in_a_fresh_process(tmp_path, name, family):
    """A saved artifact loads in a new interpreter into the class that wrote it and computes the same outputs
    (a mixture-of-experts program calls transformers' ``grouped_mm_fallback`` op, which ``kvt.load`` registers)."""
    model = kvt.tiny_model(family)
    opt = kvt.transform(model, name, progress=False)
    opt.save(tmp_path / "art")
    inputs = opt.probe_inputs()
    torch.save({"inputs": inputs, "outputs": opt.probe(inputs)}, tmp_path / "probe.pt")
    proc = subprocess.run([sys.executable, "-c", _LOAD_AND_RUN, str(tmp_path / "art"), str(tmp_path / "probe.pt")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cls, err = proc.stdout.split()
    assert cls == type(opt).__name__ and float(err) <= 1e-5


def test_cli_reload_check_runs_in_a_fresh_process(tmp_path, monkeypatch):
    """The CLI's reload check fails when the artifact does not load in a new interpreter (here: a corrupt
    model.pt2), even though the writing process could still use its in-memory module."""
    from kvtransform.cli import reload_check

    model = kvt.tiny_model("llama")
    opt = kvt.transform(model, "canonical", progress=False)
    out = opt.save(tmp_path / "art")
    err, shape = reload_check(opt, out, None)
    assert err <= 1e-5 and shape[0] == 1
    (out / "model.pt2").write_bytes(b"not a program")
    with pytest.raises(RuntimeError, match="does not load in a fresh Python process"):
        reload_check(opt, out, None)


def test_save_never_replaces_what_is_not_an_artifact(tmp_path, monkeypatch):
    """overwrite replaces an earlier artifact only: a file, a user's directory, the current directory are refused
    (nothing deleted), and a failed replace leaves no stray temporary directory."""
    opt = kvt.transform(kvt.tiny_model("llama"), kvt.CanonicalConfig(verify=kvt.VerifyConfig(enabled=False)),
                        progress=False)
    user = tmp_path / "proj"
    (user / "src").mkdir(parents=True)
    (user / "src" / "keep.py").write_text("x = 1\n")
    with pytest.raises(FileExistsError, match="not a kvtransform artifact"):
        opt.save(user, overwrite=True)
    assert (user / "src" / "keep.py").read_text() == "x = 1\n"
    for marker, text in (("config.yaml", "lr: 0.1\n"), ("meta.json", '{"transform": "canonical"}')):
        (user / marker).write_text(text)  # a project holding a file of an artifact's name is still not one
        with pytest.raises(FileExistsError, match="not a kvtransform artifact"):
            opt.save(user, overwrite=True)
        assert (user / "src" / "keep.py").read_text() == "x = 1\n"
    note = tmp_path / "notes.txt"
    note.write_text("mine")
    with pytest.raises(FileExistsError, match="is a file"):
        opt.save(note, overwrite=True)
    assert note.read_text() == "mine"
    monkeypatch.chdir(user)
    with pytest.raises(FileExistsError, match="current directory"):
        opt.save(".", overwrite=True)
    art = opt.save(tmp_path / "art")
    assert oct(art.stat().st_mode & 0o077) != "0o0"       # readable like any new directory (mkdtemp gives 0700)
    opt.save(tmp_path / "art", overwrite=True)             # an artifact is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "notes.txt", "proj"]


def test_loaded_artifact_keeps_a_tied_weight_one_parameter(tmp_path):
    """A tied embedding / LM head comes back from an artifact as one trained Parameter (torch.export.load gives two
    over one storage, one of them never receiving a gradient): the loaded module has the fresh one's parameters and
    the same gradients."""
    from kvtransform.models import tiny_model

    model = tiny_model("llama")
    model.lm_head.weight = model.model.embed_tokens.weight
    opt = kvt.transform(model, "canonical")
    loaded = kvt.load(opt.save(tmp_path / "a", progress=False), progress=False)
    assert len(list(loaded.parameters())) == len(list(opt.parameters()))
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    grads = []
    for mod in (opt, loaded):
        mod.zero_grad(set_to_none=True)
        out = mod(ids)
        getattr(out, "logits", out).float().pow(2).mean().backward()
        grads.append({n.split("gm.")[-1]: p.grad for n, p in mod.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert grads[1][name] is not None and torch.allclose(grads[1][name], g, atol=1e-6), name


def test_load_names_a_damaged_file_in_one_line(tmp_path, capfd):
    """A truncated or overwritten program and a malformed meta.json: one ValueError line naming the file and the
    fix, not the zip reader's or the JSON parser's traceback (nor torch.export's logged one)."""
    import shutil

    from kvtransform.models import tiny_model

    art = kvt.transform(tiny_model("llama"), "canonical").save(tmp_path / "a", progress=False)
    data = (art / "model.pt2").read_bytes()
    meta = json.loads((art / "meta.json").read_text())
    config = (art / "config.yaml").read_text()
    for i, (name, damage) in enumerate([
            ("config.yaml", config[: config.index("verify:")].encode()),  # parses: it loaded with default settings
            ("config.yaml", config[: config.index("  batch_size:")].encode()),
            ("model.pt2", b"junk"), ("model.pt2", data[: len(data) // 2]), ("meta.json", b"{oops"),
            ("meta.json", b"[1, 2]"), ("config.yaml", b"name: [canonical\n  bad: {"), ("config.yaml", b""),
            ("config.yaml", b"- 1\n- 2\n"), ("report.json", b'{"sites": 5}'),
            ("meta.json", json.dumps({**meta, "max_seq_len": "abc"}).encode()),
            ("meta.json", json.dumps({**meta, "config_keys": [{}]}).encode())]):
        bad = tmp_path / f"bad_{i}_{name}"
        shutil.copytree(art, bad)
        (bad / name).write_bytes(damage)
        with pytest.raises(ValueError, match=rf"{name} is damaged .*save the artifact again"):
            kvt.load(bad, progress=False)
    import zipfile

    gutted = tmp_path / "gutted"  # a whole zip archive without the program's members
    shutil.copytree(art, gutted)
    with zipfile.ZipFile(art / "model.pt2") as zin, zipfile.ZipFile(gutted / "model.pt2", "w") as zout:
        for member in zin.namelist():
            if not member.endswith(".json"):
                zout.writestr(member, zin.read(member))
    with pytest.raises(ValueError, match=r"model.pt2 is damaged \(RuntimeError: the archive holds no exported"):
        kvt.load(gutted, progress=False)
    assert "Traceback" not in capfd.readouterr().err
    flipped = tmp_path / "flipped"  # weight bytes changed in place: the zip CRCs catch it (torch's reader does not)
    shutil.copytree(art, flipped)
    with zipfile.ZipFile(art / "model.pt2") as z:
        info = max((i for i in z.infolist() if "/data/weights/" in i.filename), key=lambda i: i.file_size)
        start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    raw = bytearray(data)
    raw[start:start + 64] = bytes(b ^ 0x80 for b in raw[start:start + 64])
    (flipped / "model.pt2").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"model.pt2 is damaged \(BadZipFile: member .* fails its CRC check\)"):
        kvt.load(flipped, progress=False)
    opt = kvt.load(art, progress=False)
    with pytest.raises(ValueError, match="overwrite must be True or False; got 'false'"):
        opt.save(art, overwrite="false", progress=False)
    assert kvt.load(art, progress=False) is not None
    swapped = tmp_path / "swapped"  # a config of another transform beside this program: not loaded as that module
    shutil.copytree(art, swapped)
    (swapped / "config.yaml").write_text((art / "config.yaml").read_text().replace("name: canonical", "name: dualkv"))
    with pytest.raises(ValueError, match="is a 'dualkv' config but meta.json says transform 'canonical'"):
        kvt.load(swapped, progress=False)


def test_canonical_module_runs_large_batches_in_slices_and_refuses_a_cast():
    """More rows than the captured batch bound run in slices (a raw export guard before); weights cast after the
    transform are refused in one line (a dtype mismatch deep in the program before)."""
    from kvtransform.capture import MAX_BATCH
    from kvtransform.models import tiny_model

    opt = kvt.transform(tiny_model("llama"), "canonical", progress=False)
    ids = torch.randint(3, 100, (MAX_BATCH + 3, 2), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = opt(ids)
        assert out.shape[0] == MAX_BATCH + 3 and torch.equal(out[-3:], opt(ids[-3:]))
    opt.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"captured in torch.float32 and its weights are now torch.bfloat16: .*cast "
                                         r"the model before kvt.transform"):
        opt(ids[:2])


def test_save_refuses_a_disk_without_room_for_the_weights(tmp_path, monkeypatch):
    """torch's archive writer aborts the process on a full disk: save checks the free space against the weights
    first (one line naming the fix) and writes nothing."""
    import collections

    import kvtransform.utils as kvt_utils

    opt = kvt.transform(kvt.tiny_model("llama"), "canonical", progress=False)
    need = opt.weight_bytes()
    assert need >= sum(p.numel() * p.element_size() for p in kvt.tiny_model("llama").parameters()) // 2
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(kvt_utils.shutil, "disk_usage", lambda p: usage(1 << 40, 0, need))
    with pytest.raises(OSError, match=r"needs at least \d+ MiB \(the weights and 64 MiB of room\) and .* MiB free: free some space or choose out="):
        opt.save(tmp_path / "a" / "art")
    assert list(tmp_path.iterdir()) == []
