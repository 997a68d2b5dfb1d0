"""tests/gpu/carried_cudnn.sh without a GPU: a stand-in archive in two parts,
carried one per call, staged, checked and unpacked, and the environment it
exports (its setup and GPU report are off: CARRIED_CUDNN_SETUP=0, CARRIED_CUDNN_REPORT=0)."""

import hashlib
import io
import lzma
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "gpu" / "carried_cudnn.sh"


def _archive(tmp_path):
    """cudnn-9.28.tar.xz.partaa/ab and SHA256SUMS, in folders 1/ and 2/ (one call each)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("nvidia/cudnn/lib/libcudnn.so.9", b"not a library"),
                           ("nvidia/cudnn/include/cudnn.h", b"/* headers */"),
                           ("nvidia/cudnn/CARRIED.txt", b"cuDNN 9.28.1.4 (a stand-in)\n")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    data = lzma.compress(buf.getvalue())
    half = len(data) // 2
    parts = {"cudnn-9.28.tar.xz.partaa": data[:half], "cudnn-9.28.tar.xz.partab": data[half:]}
    sums = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in parts.items())
    for i, (name, part) in enumerate(parts.items(), 1):
        folder = tmp_path / "carry" / str(i)
        folder.mkdir(parents=True)
        (folder / name).write_bytes(part)
        (folder / "SHA256SUMS").write_text(sums)
    site = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    site.mkdir(parents=True)
    (site / "libnvrtc.so.13").write_bytes(b"")
    return tmp_path / "carry"


def _source(tmp_path, *paths):
    env = {"PATH": "/usr/bin:/bin", "CARRIED_CUDNN_STAGE": str(tmp_path / "stage"),
           "CARRIED_CUDNN_ROOT": str(tmp_path / "root"), "CARRIED_CUDNN_REPORT": "0",
           "CARRIED_CUDNN_SETUP": "0",
           "CARRIED_CUDNN_SITE_NVIDIA": str(tmp_path / "site" / "nvidia")}
    cmd = (f". {SCRIPT} {' '.join(map(str, paths))}; rc=$?; echo \"rc=$rc\"; "
           'echo "LD_PRELOAD=$LD_PRELOAD"; echo "PYTHONPATH=$PYTHONPATH"; '
           'echo "SCOREMOD_CUDNN_LIBRARY=$SCOREMOD_CUDNN_LIBRARY"')
    out = subprocess.run(["bash", "-c", cmd], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60).stdout
    return out, dict(line.split("=", 1) for line in out.splitlines() if "=" in line
                     and not line.startswith("carried_cudnn"))


def test_parts_carried_one_per_call_are_staged_then_unpacked(tmp_path):
    carry = _archive(tmp_path)
    out, got = _source(tmp_path, carry / "1")
    assert got["rc"] == "3", out
    assert "1 of 2 parts here (cudnn-9.28.tar.xz.partaa)" in out
    assert "carrying the next: cudnn-9.28.tar.xz.partab" in out
    assert got["LD_PRELOAD"] == ""  # nothing exported until the set is complete

    out, got = _source(tmp_path, carry / "2")  # this call brings the second part only
    lib = tmp_path / "root" / "nvidia" / "cudnn" / "lib"
    assert got["rc"] == "0", out
    assert "WARNING" not in out
    assert (lib / "libcudnn.so.9").read_bytes() == b"not a library"
    assert got["LD_PRELOAD"] == f"{lib}/libcudnn.so.9"
    assert got["PYTHONPATH"] == str(tmp_path / "root")
    assert got["SCOREMOD_CUDNN_LIBRARY"] == f"{lib}/libcudnn.so.9"
    assert (tmp_path / "root" / "nvidia" / "cu13").resolve() == tmp_path / "site" / "nvidia" / "cu13"
    assert not list((tmp_path / "stage").glob("*.part*"))  # the parts are dropped once unpacked

    out, got = _source(tmp_path)  # a later call: unpacked already, no parts needed
    assert got["rc"] == "0", out


def test_a_corrupt_part_is_refused(tmp_path):
    carry = _archive(tmp_path)
    part = carry / "1" / "cudnn-9.28.tar.xz.partaa"
    part.write_bytes(part.read_bytes()[:-1] + b"!")
    out, got = _source(tmp_path, carry / "1")
    assert got["rc"] == "2", out
    assert "cudnn-9.28.tar.xz.partaa fails its checksum" in out
