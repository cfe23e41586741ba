"""Build the FlashInfer bundle that the ``decode`` suite's ``flashinfer`` method needs on a GPU machine without network
access. Run it (on a machine with network access) before timing the ``flashinfer`` baseline there.

What can be copied to such a machine may be limited (to 64 MiB per run, say), and FlashInfer 0.7.4's wheel is
101 MB. The bundle (~20 MB) holds:

- ``flashinfer_python-0.7.4-trimmed.tar.xz``: the wheel's files minus the CUDA sources of features the decode method
  does not build (every sub-directory of ``flashinfer/data/csrc/``, the ``.cu`` files outside ``flashinfer/data``, the
  wheel's stray build scripts). Every Python file, header tree and the top-level ``csrc`` templates (decode, prefill,
  page, ...) stay, and no code is changed: a feature whose sources were dropped fails at its JIT build, loudly.
- ``apache_tvm_ffi-*.whl`` (FlashInfer's binding layer, the one missing dependency there) and ``typing_extensions``
  (installed only where the machine's copy is older than tvm-ffi needs).
- ``install.sh``, ``fi_env.sh`` and ``smoke_test.py`` from this folder.

Usage, here (pip downloads from PyPI)::

    python tools/flashinfer_bundle/make.py .fi        # then: echo /.fi/ >> .git/info/exclude

and on the GPU machine (with ``.whl/`` and ``.fi/`` copied next to the checkout)::

    source tools/device_env.sh && (cd .fi && bash install.sh) && source .fi/fi_env.sh && python3 .fi/smoke_test.py

FlashInfer then JIT-compiles its decode modules with the machine's nvcc on first use (seconds to a minute; cached
under ``$FLASHINFER_WORKSPACE_BASE``). The bundle is written to a temporary folder and renamed into place, so a
failed build leaves nothing half-written.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
FLASHINFER = ("flashinfer-python", "0.7.4")
DEPS = [("apache-tvm-ffi", "0.1.15.post2"), ("typing_extensions", "4.16.0")]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
SCRIPTS = ["install.sh", "fi_env.sh", "smoke_test.py"]
MARKER = "KVT_FLASHINFER_BUNDLE"  # written into every bundle: only such a folder (or an empty one) is replaced


def keep(name: str) -> bool:
    """Whether a wheel member goes into the trimmed package (see the module docstring)."""
    if name in ("build_backend.py", "build_utils.py"):
        return False
    if name.startswith("flashinfer/data/csrc/") and name.count("/") > 3:
        return False
    return not (name.endswith(".cu") and not name.startswith("flashinfer/data/"))


def download(name: str, version: str, dest: Path) -> Path:
    """The cp312 x86-64 wheel of ``name==version`` in ``dest``: one already there is used as it is (no index query,
    so a second build works offline), else pip downloads it."""
    stem = name.replace("-", "_").lower() + "-" + version + "-"
    found = [w for w in dest.glob("*.whl") if w.name.lower().startswith(stem)]
    if len(found) == 1:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "-d", str(dest), f"{name}=={version}"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd, check=True)
    found = [w for w in dest.glob("*.whl") if w.name.lower().startswith(stem)]
    if len(found) != 1:
        raise RuntimeError(f"expected one wheel of {name}=={version} in {dest}, found {[w.name for w in found]}")
    return found[0]


def trim(wheel: Path, out: Path) -> int:
    """Write the kept members of ``wheel`` to ``out`` (tar.xz), with the dist-info RECORD listing exactly them;
    returns the number of files."""
    with zipfile.ZipFile(wheel) as z:
        members = [i for i in z.infolist() if not i.is_dir() and keep(i.filename)]
        record = next(i.filename for i in members if i.filename.endswith(".dist-info/RECORD"))
        rows = []
        with tarfile.open(out, "w:xz") as tar:
            for info in members:
                if info.filename == record:
                    continue
                data = z.read(info)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                rows.append(f"{info.filename},sha256={digest},{len(data)}")
                _add(tar, info.filename, data, 0o755 if (info.external_attr >> 16) & 0o111 else 0o644)
            rows.append(f"{record},,")
            _add(tar, record, ("\n".join(rows) + "\n").encode(), 0o644)
    return len(rows)


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode = len(data), mode
    tar.addfile(ti, io.BytesIO(data))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the bundle folder to write (replaced if it exists), e.g. .fi")
    ap.add_argument("--download-dir", default=str(Path.home() / ".cache" / "kvtransform" / "flashinfer_bundle"),
                    help="where the wheels are downloaded (kept: a second build downloads nothing)")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).exists())):
        raise SystemExit(f"{out} exists and is not a bundle this tool wrote (no {MARKER} in it): choose a new or "
                         f"empty folder, or remove it yourself")
    dl = Path(a.download_dir)
    dl.mkdir(parents=True, exist_ok=True)
    wheel = download(*FLASHINFER, dl)
    deps = [download(n, v, dl) for n, v in DEPS]
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        n = trim(wheel, tmp / f"flashinfer_python-{FLASHINFER[1]}-trimmed.tar.xz")
        for w in deps:
            shutil.copy2(w, tmp / w.name)
        for s in SCRIPTS:
            shutil.copy2(HERE / s, tmp / s)
        (tmp / MARKER).write_text(f"FlashInfer {FLASHINFER[1]} bundle written by tools/flashinfer_bundle/make.py\n")
        tmp.chmod(0o755)
        old = None
        if out.exists():  # the old bundle moves aside first, so a failure never leaves it half-deleted
            old = Path(tempfile.mkdtemp(prefix=out.name + ".old.", dir=out.parent))
            os.replace(out, old / "bundle")
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out}: FlashInfer {FLASHINFER[1]} trimmed to {n} files, {size / 2 ** 20:.1f} MiB in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
