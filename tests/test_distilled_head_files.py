"""The distilled retrieval head's files on disk: a damaged head directory, checkpoint or teacher cache is named in one
line with its fix (never a reader's traceback or a silently wrong head), and training writes its files atomically."""
import json
import shutil

import pytest
import torch

from kvtransform.cli import main
from kvtransform.distill import DistillConfig, distill
from kvtransform.models import tiny_model
from kvtransform.runtime.distilled import DistilledBlock, fingerprint, load_head_dir, save_head_dir


class _CharTokenizer:
    def __call__(self, text, **kw):
        return {"input_ids": torch.tensor([[3 + ord(ch) % 120 for ch in text]])}


def _cfg(out, **kw):
    return DistillConfig(**{**dict(out=str(out), files=["typing.py"], topics_chunks=0, length=64, positions=8,
                                   steps=2, checkpoint_every=1, window=2, dim=16, progress=False), **kw})


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def good_head(model, tmp_path_factory):
    c = model.config
    torch.manual_seed(0)
    block = DistilledBlock(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                           train_length=64, window=2, dim=16)
    return save_head_dir(tmp_path_factory.mktemp("heads") / "good", block, fingerprint(model))


def _edit_json(change):
    def damage(d):
        meta = json.loads((d / "head.json").read_text())
        change(meta)
        (d / "head.json").write_text(json.dumps(meta))
    return damage


def _edit_weights(change):
    def damage(d):
        (d / "head.safetensors").write_bytes(change(bytearray((d / "head.safetensors").read_bytes())))
    return damage


def _flip(offset):
    def change(b):
        b[offset] ^= 0x10
        return bytes(b)
    return change


def _new_weights(seed, inf=False):
    def write(d):
        from safetensors.torch import save_file

        torch.manual_seed(seed)
        state = {k: v.half() for k, v in DistilledBlock(**json.loads((d / "head.json").read_text())["arch"])
                 .state_dict().items()}
        if inf:
            state["w_q.weight"][0, 0] = float("inf")
        save_file(state, str(d / "head.safetensors"))
    return write


def _no_checksum(damage):  # a head written before head.json recorded the weights' SHA-256
    def both(d):
        _edit_json(lambda m: m.pop("weights_sha256"))(d)
        damage(d)
    return both


DAMAGE = {
    "weights truncated": ("head.safetensors", _edit_weights(lambda b: bytes(b[: len(b) // 2]))),
    "a weight bit flipped": ("head.safetensors", _edit_weights(_flip(-100))),     # loaded silently before
    # a crash between save_head_dir's two renames: new weights beside the old head.json (loaded silently before)
    "weights of another run": ("head.safetensors", _new_weights(1)),
    "old head, an infinite weight": ("head.safetensors", _no_checksum(_new_weights(0, inf=True))),
    "old head, weights truncated": ("head.safetensors", _no_checksum(_edit_weights(lambda b: bytes(b[:100])))),
    "old head, header length flipped": ("head.safetensors", _no_checksum(_edit_weights(_flip(3)))),
    "old head, tensor name flipped": ("head.safetensors", _no_checksum(_edit_weights(_flip(20)))),
    "json a list": ("head.json", lambda d: (d / "head.json").write_text("[]")),
    "json invalid": ("head.json", lambda d: (d / "head.json").write_text("{not json")),
    "json binary": ("head.json", lambda d: (d / "head.json").write_bytes(b"\xff\xfe\0")),
    "no arch": ("head.json", _edit_json(lambda m: m.pop("arch"))),
    "no fingerprint": ("head.json", _edit_json(lambda m: m.pop("fingerprint"))),
    "fingerprint a list": ("head.json", _edit_json(lambda m: m.update(fingerprint=[]))),      # matched any model
    "fingerprint without the embedding": ("head.json", _edit_json(lambda m: m["fingerprint"].pop("embed_sum"))),
    # NaN differs from every number in neither direction, so the fingerprint matched any model
    "fingerprint sum NaN": ("head.json", _edit_json(lambda m: m["fingerprint"].update(embed_sum=float("nan")))),
    "fingerprint sum a string": ("head.json", _edit_json(lambda m: m["fingerprint"].update(embed_abs_sum="1.0"))),
    "fingerprint shape not 2-D": ("head.json", _edit_json(lambda m: m["fingerprint"].update(embed_shape=[4]))),
    "fingerprint sum past a float": ("head.json", _edit_json(lambda m: m["fingerprint"].update(embed_sum=10 ** 400))),
    "fingerprint sum of 5000 digits": ("head.json", lambda d: (d / "head.json").write_text(
        (d / "head.json").read_text().replace('"embed_sum": ', '"embed_sum": 1' + "0" * 5000 + ", \"x\": "))),
    "fingerprint vocab NaN": ("head.json", _edit_json(lambda m: m["fingerprint"].update(vocab_size=float("nan")))),
    "fingerprint model_type a number": ("head.json", _edit_json(lambda m: m["fingerprint"].update(model_type=1.5))),
    "arch with a foreign key": ("head.json", _edit_json(lambda m: m["arch"].update(foo=1))),
    "arch not the weights'": ("head.safetensors", _edit_json(lambda m: m["arch"].update(dim=8))),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_head_is_named_in_one_line(case, model, good_head, tmp_path):
    name, damage = DAMAGE[case]
    d = shutil.copytree(good_head, tmp_path / "h")
    damage(d)
    with pytest.raises(ValueError) as e:
        load_head_dir(d, model)
    msg = str(e.value)
    assert msg.startswith(f"{d / name} is damaged (") and "\n" not in msg, msg
    assert msg.endswith(f"write the head again with `kvtransform distill-retrieval-head MODEL out={d}`, or pass "
                        f"another head"), msg


def test_the_cli_names_a_damaged_head(model, good_head, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model.save_pretrained(tmp_path / "tiny")
    d = shutil.copytree(good_head, tmp_path / "h")
    (d / "head.json").write_text("[]")
    with pytest.raises(SystemExit) as e:
        main(["optimize", str(tmp_path / "tiny"), "transform=specontext", "transform.head=distilled",
              f"transform.retrieval={d}", f"out={tmp_path / 'o'}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and err.count("error:") == 1, err
    assert f"{d / 'head.json'} is damaged (a JSON list, not an object)" in err
    assert not (tmp_path / "o").exists()


def test_distill_names_a_damaged_checkpoint_and_recomputes_a_damaged_teacher(model, tmp_path, capsys, monkeypatch):
    out = tmp_path / "h"
    distill(_cfg(out), model, _CharTokenizer(), log=lambda m: None)
    ckpt, teacher = out / "checkpoint.pt", out / "teacher.pt"
    good, st = ckpt.read_bytes(), torch.load(ckpt, weights_only=False)
    for bad, why in ((good[: len(good) // 2], "truncated zip archive"), (b"", "not a zip archive")):
        ckpt.write_bytes(bad)
        with pytest.raises(ValueError, match=rf"^{ckpt} is damaged \(.*{why}.*\): delete it to train from scratch$"):
            distill(_cfg(out), model, _CharTokenizer(), log=lambda m: None)
    for bad, why in (([1, 2], "a list, not a dict"), ({**st, "block": {}}, "RuntimeError: Error.s. in loading")):
        torch.save(bad, ckpt)
        with pytest.raises(ValueError, match=rf"^{ckpt} is damaged \({why}.*\): delete it to train from scratch$"):
            distill(_cfg(out), model, _CharTokenizer(), log=lambda m: None)
    # the command line: one error line, exit status 2
    ckpt.write_bytes(good[:100])
    import kvtransform.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: (model, _CharTokenizer()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["distill-retrieval-head", f"out={out}", "files=[typing.py]", "topics_chunks=0", "length=64",
              "positions=8", "steps=2", "checkpoint_every=1", "window=2", "dim=16", "progress=false"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and err.count("error:") == 1, err
    assert f"{ckpt} is damaged (BadZipFile: truncated zip archive" in err and "delete it to train" in err
    # a damaged teacher cache is computed again (said once) and the training resumes from the good checkpoint
    ckpt.write_bytes(good)
    targets = torch.load(teacher, weights_only=False)["items"][0]["target"]
    teacher.write_bytes(teacher.read_bytes()[:-50])
    logs = []
    assert distill(_cfg(out), model, _CharTokenizer(), log=logs.append)["steps"] == 2
    assert logs[0] == f"{teacher} is damaged (BadZipFile: truncated zip archive (no end of central directory)): " \
                      f"computing the teacher targets again" and "resumed from" in logs[1], logs
    assert torch.equal(torch.load(teacher, weights_only=False)["items"][0]["target"], targets)


def test_distill_writes_its_files_atomically(model, tmp_path, monkeypatch):
    """A run killed while torch.save writes leaves the previous checkpoint and teacher whole, and no temporary file."""
    out = tmp_path / "h"
    distill(_cfg(out), model, _CharTokenizer(), log=lambda m: None)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    real_save = torch.save

    def killed_while_writing(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        with open(f, "r+b") as fh:
            fh.truncate(100)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed_while_writing)
    for cfg in (_cfg(out, steps=3, overwrite=True), _cfg(out, positions=4, overwrite=True)):  # the checkpoint, then
        # the teacher is written again (other settings: overwrite=true, or the trained head there is refused)
        with pytest.raises(KeyboardInterrupt):
            distill(cfg, model, _CharTokenizer(), log=lambda m: None)
        assert {f.name: f.read_bytes() for f in out.iterdir()} == before


@pytest.mark.parametrize("checks_with_room", [0, 1, 3], ids=["nothing", "the-teacher", "the-first-checkpoint"])
def test_distill_refuses_a_disk_without_room_before_torch_save(model, tmp_path, monkeypatch, capsys,
                                                               checks_with_room):
    """torch.save aborts the process on a full disk: distill checks the free space for the teacher targets, before
    training and before each checkpoint (the disk may fill up meanwhile; the CLI: one error line, exit status 2). A
    refusal leaves every file written before it whole, no temporary file, and no new directory before the first."""
    import collections

    import kvtransform.models as models
    import kvtransform.utils as kvt_utils

    usage = collections.namedtuple("usage", "total used free")
    calls = []

    def disk_usage(p):  # room at the first `checks_with_room` checks only (the disk fills up meanwhile)
        calls.append(p)
        return usage(1 << 40, 0, 1 << 40 if len(calls) <= checks_with_room else 0)

    monkeypatch.setattr(kvt_utils.shutil, "disk_usage", disk_usage)
    what = "the teacher targets" if checks_with_room == 0 else "the checkpoint"
    with pytest.raises(OSError, match=rf"needs at least \d+ MiB \({what} and 64 MiB of room\) .*choose out= on "):
        distill(_cfg(tmp_path / "h"), model, _CharTokenizer(), log=lambda m: None)
    if checks_with_room == 0:
        assert not (tmp_path / "h").exists()
    else:
        left = sorted(f.name for f in (tmp_path / "h").iterdir())
        assert left == (["teacher.pt"] if checks_with_room == 1 else ["checkpoint.pt", "teacher.pt"]), left
        if checks_with_room == 3:  # the checkpoint of step 1, whole
            assert torch.load(tmp_path / "h" / "checkpoint.pt", weights_only=False)["step"] == 1
    calls.clear()
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (model, _CharTokenizer()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["distill-retrieval-head", f"out={tmp_path / 'h2'}", "files=[typing.py]", "topics_chunks=0",
              "length=64", "positions=8", "steps=2", "checkpoint_every=1", "window=2", "dim=16", "progress=false"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and err.count("error:") == 1 and what in err, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_distill_on_cuda_resumes_and_loads_on_cpu(model, tmp_path):
    """device=cuda runs the teacher and the training on the GPU (a CPU model is moved there); its checkpoint resumes
    on the CPU and its head directory loads there."""
    import copy

    out = tmp_path / "h"
    res = distill(_cfg(out, device="cuda"), copy.deepcopy(model), _CharTokenizer(), log=lambda m: None)
    assert res["steps"] == 2 and res["loss"] == res["loss"]
    block, _ = load_head_dir(out, model)
    assert all(p.device.type == "cpu" for p in block.parameters())
    logs = []
    assert distill(_cfg(out, device="cpu"), model, _CharTokenizer(), log=logs.append)["steps"] == 2
    assert any("resumed from" in m for m in logs), logs
