"""Repack an unpacked wheel after editing its files: a fresh RECORD (SHA-256, size), zipped at
deflate level 9, the WHEEL file's build tag set to the one in the new file name.

    python repack_wheel.py SRC_DIR OUT_DIR WHEEL_FILENAME

SRC_DIR holds the wheel's top-level packages and its ``NAME-VERSION.dist-info/``.
"""

from __future__ import annotations

import base64
import hashlib
import os
import sys
import zipfile
from pathlib import Path

FIXED_TIME = (2026, 1, 1, 0, 0, 0)
"""Every member's time stamp: the same sources give the same wheel."""


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def set_build_tag(dist_info: Path, filename: str) -> None:
    """The WHEEL file's ``Build:`` line: the tag of ``filename`` (``NAME-VER-TAG-PY-ABI-PLAT.whl``)."""
    parts = filename[: -len(".whl")].split("-")
    wheel = dist_info / "WHEEL"
    lines = [line for line in wheel.read_text().splitlines() if not line.startswith("Build:")]
    if len(parts) == 6:
        lines.insert(1, f"Build: {parts[2]}")
    wheel.write_text("\n".join(lines) + "\n")


def member(archive: zipfile.ZipFile, name: str, data: bytes, executable: bool) -> None:
    info = zipfile.ZipInfo(name, date_time=FIXED_TIME)
    info.external_attr = ((0o755 if executable else 0o644) | 0o100000) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    archive.writestr(info, data, compresslevel=9)


def repack(source: Path, out_dir: Path, filename: str) -> Path:
    dist_info = next(path for path in source.iterdir() if path.name.endswith(".dist-info"))
    set_build_tag(dist_info, filename)
    record = dist_info / "RECORD"
    files = sorted(path for path in source.rglob("*") if path.is_file() and path != record)
    files.sort(key=lambda path: (path.is_relative_to(dist_info), str(path)))  # dist-info last, as wheel tools do
    rows = []
    out = out_dir / filename
    with zipfile.ZipFile(out, "w") as archive:
        for path in files:
            name, data = path.relative_to(source).as_posix(), path.read_bytes()
            rows.append(f"{name},{record_hash(data)},{len(data)}")
            member(archive, name, data, os.access(path, os.X_OK))
        rows.append(f"{record.relative_to(source).as_posix()},,")
        text = "\n".join(rows) + "\n"
        record.write_text(text)
        member(archive, record.relative_to(source).as_posix(), text.encode(), False)
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB")
    return out


if __name__ == "__main__":
    repack(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
