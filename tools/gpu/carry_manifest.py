"""The carry: the folder ``prepare.py`` fills on a CPU machine and ``session.py`` installs from on
the GPU machine, with what the GPU image lacks (it has Python 3.12 and a CUDA build of torch, no
network).

    <carry>/manifest.json    what is carried, for which commit, image and Python
    <carry>/wheels/*.whl     the wheels

Each carried wheel says when the session installs it: ``always`` (the exact version the session
needs: megatron-core, TransformerEngine's three wheels) or ``missing`` (only where the image has
no distribution of that name: numpy, pyyaml, tqdm, TransformerEngine's pydantic).  The session
installs with ``pip --no-index --no-deps --target``, after checking every wheel's SHA-256.

Standard library only: the session reads this before anything is installed.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST = "manifest.json"
WHEELS = "wheels"
MAX_CARRY_BYTES = 60 * 2**20
"""The carry's size limit: the device call takes at most 64 MiB, working tree included."""
MAX_CALL_BYTES = 64 * 2**20
"""What one device call may take along: the working tree and the carry together."""
INSTALL_WHEN = ("always", "missing")


class CarryError(Exception):
    """A carry folder that cannot be used (missing, incomplete, altered); the message says which."""


@dataclass(frozen=True)
class CarriedWheel:
    """One wheel of the carry."""

    distribution: str
    """The distribution's name, as ``importlib.metadata`` knows it (``megatron-core``)."""
    version: str
    wheel: str
    """The file name under ``wheels/``."""
    sha256: str
    size: int
    """Bytes."""
    install: str
    """``always`` or ``missing`` (only where the image lacks the distribution)."""
    needed_by: str
    """What needs it: ``megatron-core``, ``lime_megatron`` or ``transformer-engine`` (the wheels a
    CPU must leave out: TransformerEngine breaks megatron-core there)."""


@dataclass
class Manifest:
    """What a carry holds and what it was made for."""

    commit: str
    """The commit of the checkout ``prepare.py`` ran in (``+dirty`` when it had changes)."""
    made: str
    """When (UTC, ISO 8601)."""
    python: str
    """The Python the wheels are for (``3.12``)."""
    torch: str
    """The image's torch that compiled parts (TransformerEngine's extension) were built against."""
    wheels: list[CarriedWheel] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)
    """What ``prepare.py`` checked of the carry (TransformerEngine's kept architectures...)."""

    def write(self, folder: Path) -> None:
        (folder / MANIFEST).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        """The manifest of ``folder``; CarryError when there is none or it is malformed."""
        path = folder / MANIFEST
        if not path.is_file():
            raise CarryError(f"{folder} is not a carry: no {MANIFEST} (make one with python tools/gpu/prepare.py)")
        try:
            data = json.loads(path.read_text())
            wheels = [CarriedWheel(**wheel) for wheel in data.pop("wheels")]
            return cls(**data, wheels=wheels)
        except (ValueError, TypeError, KeyError) as error:
            raise CarryError(f"{path} is malformed ({error}): make the carry again with prepare.py") from None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


WHEEL_NAME = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


def wheel_distribution(filename: str) -> tuple[str, str]:
    """(distribution, version) of a wheel file name (``pyyaml-6.0.2-cp312-...whl`` -> ``pyyaml``,
    ``6.0.2``; a build tag is allowed); ValueError for a name that is not a wheel's."""
    match = WHEEL_NAME.match(filename)
    if not match:
        raise ValueError(f"{filename} is not a wheel file name")
    return match["name"].replace("_", "-").lower(), match["version"]


def carried_wheel(path: Path, install: str, needed_by: str) -> CarriedWheel:
    """The manifest entry of the wheel at ``path``."""
    if install not in INSTALL_WHEN:
        raise ValueError(f"install must be one of {INSTALL_WHEN}, got {install!r}")
    distribution, version = wheel_distribution(path.name)
    return CarriedWheel(distribution, version, path.name, sha256_of(path), path.stat().st_size, install, needed_by)


def verify(folder: Path, manifest: Manifest) -> None:
    """CarryError naming every wheel of ``manifest`` missing from ``folder`` or altered since."""
    problems = []
    for wheel in manifest.wheels:
        path = folder / WHEELS / wheel.wheel
        if not path.is_file():
            problems.append(f"{wheel.wheel} is missing")
        elif sha256_of(path) != wheel.sha256:
            problems.append(f"{wheel.wheel} differs from the manifest (SHA-256)")
    if problems:
        raise CarryError(f"carry {folder}: " + "; ".join(problems))


def folder_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder``."""
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
