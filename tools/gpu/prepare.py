"""Prepare a GPU session on a CPU machine: fill the carry (an ignored folder of at most 60 MiB with
what the GPU image lacks), check it, and print the device call that runs the session.

    python tools/gpu/prepare.py --build-te --check        # first time: about 10 minutes
    python tools/gpu/prepare.py --te-wheels DIR --check   # TransformerEngine wheels built before

The GPU image has Python 3.12, torch 2.11.0+cu130 with its nvidia wheels, ``IMAGE_PACKAGES``
(numpy, packaging, einops, onnx, onnxscript), and no network.
The carry (``carry_manifest.py``) holds:

- megatron-core 0.19.2 (installed always);
- TransformerEngine 2.20.2 for Hopper, built here by ``te_carry/build.sh``: its core library cut to
  the sm_90 cubins, its torch extension compiled against torch 2.11.0 (installed always), with
  pydantic and its dependencies (installed where missing);
- numpy (below 2.4), packaging, pyyaml, tqdm: what the project imports at its top levels (installed where
  missing).

``--check`` then, in a clean Python 3.12 venv holding torch 2.11.0+cu130 and ``IMAGE_PACKAGES``
(as the image; ``--check-python``, or one made under ``--work``):

1. installs the carry with the session's own code and runs the session's environment step:
   Python, torch, megatron-core and ``import transformer_engine.pytorch`` must come out as the GPU
   will see them (the FP8 row needs a GPU);
2. runs the session's rehearsal (every step at tiny shapes on the CPU) with the carry's wheels but
   TransformerEngine's, which cannot run on a CPU: the steps' code on the image's torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from carry_manifest import MAX_CALL_BYTES, MAX_CARRY_BYTES, WHEELS, Manifest, carried_wheel, folder_bytes
from session_steps import ROOT, checkout_commit

IMAGE_PYTHON = "3.12"
IMAGE_TORCH = "2.11.0+cu130"
IMAGE_PACKAGES = ("numpy", "packaging", "einops", "onnx", "onnxscript")
"""What the lent GPU image holds beside torch and its nvidia wheels, as recorded when the
TransformerEngine carry was first made; TransformerEngine imports onnx and onnxscript (megatron-core
imports TransformerEngine when it is there), so ``--check``'s clean venv holds them too."""
MEGATRON = "megatron-core==0.19.2"
WHERE_MISSING = ("numpy<2.4", "packaging", "pyyaml", "tqdm")
"""What the project imports at its top levels besides torch and megatron (installed where missing).
numpy below 2.4: the image's torch pins Triton 3.6, whose CPU interpreter (the rehearsal's routing
kernels) takes a loop bound with ``int()`` of a one-element array, an error since numpy 2.4; the
image has its own numpy, which the compiled kernels never hand to Triton this way."""
TE = "transformer-engine"
TE_ALWAYS = ("transformer_engine",)
"""Wheel-name prefixes of TransformerEngine's own wheels (installed always); the rest of the
TransformerEngine build's wheels (pydantic and its dependencies) are installed where missing."""
PLATFORM = "--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 " + (
    "--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --implementation cp"
)
SESSION_TIMEOUT_S = 570
"""The device call's limit: the session's 540 s budget and the time to write its report."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu-carry", help="the carry (default .gpu-carry)")
    te = parser.add_mutually_exclusive_group(required=True)
    te.add_argument(
        "--te-wheels", type=Path, help="a folder of TransformerEngine wheels (te_carry/build.sh OUT/wheels)"
    )
    te.add_argument("--build-te", action="store_true", help="build them now with te_carry/build.sh")
    parser.add_argument("--work", type=Path, default=Path("/tmp/lime-gpu-prepare"), help="downloads, builds, venvs")
    parser.add_argument("--check", action="store_true", help="install the carry into a clean 3.12 venv and probe it")
    parser.add_argument("--check-python", type=Path, help="the venv Python of --check (default: one made in --work)")
    parser.add_argument("--python312", default=str(Path.home() / ".pyenv/versions/3.12.1/bin/python"))
    return parser.parse_args(argv)


def run(command: list[str], **kwargs) -> None:
    """Run ``command``, printing it; exit with its status when it fails."""
    print("$", " ".join(command), flush=True)
    completed = subprocess.run(command, **kwargs)
    if completed.returncode:
        raise SystemExit(f"prepare: {command[0]} exited {completed.returncode}")


def download(requirement: str, downloads: Path) -> Path:
    """The wheel of ``requirement`` for the image's Python (no dependencies), downloaded into a
    folder of its own under ``downloads``."""
    into = downloads / re.split("[<=>]", requirement)[0]
    shutil.rmtree(into, ignore_errors=True)
    run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM.split(), "-d", str(into), requirement])
    [wheel] = into.glob("*.whl")
    return wheel


def te_wheels(args: argparse.Namespace) -> list[Path]:
    """TransformerEngine's wheels (and pydantic's), built now with ``--build-te`` or taken as given."""
    folder = args.te_wheels
    if args.build_te:
        run(["bash", str(Path(__file__).parent / "te_carry" / "build.sh"), str(args.work / "te")])
        folder = args.work / "te" / "wheels"
    wheels = sorted(folder.glob("*.whl"))
    if not any(wheel.name.startswith(TE_ALWAYS) for wheel in wheels):
        raise SystemExit(f"prepare: no TransformerEngine wheels in {folder} (te_carry/build.sh OUT makes OUT/wheels)")
    return wheels


def fill(args: argparse.Namespace) -> Manifest:
    """The carry at ``args.out``, made anew, and its manifest."""
    shutil.rmtree(args.out, ignore_errors=True)
    (args.out / WHEELS).mkdir(parents=True)
    megatron = download(MEGATRON, args.work / "downloads")
    missing = [download(name, args.work / "downloads") for name in WHERE_MISSING]
    te = te_wheels(args)
    made = datetime.now(timezone.utc).isoformat(timespec="seconds")
    manifest = Manifest(commit=checkout_commit(), made=made, python=IMAGE_PYTHON, torch=IMAGE_TORCH)
    needs = [(megatron, "megatron-core")] + [(w, "lime_megatron") for w in missing] + [(w, TE) for w in te]
    for wheel, needed_by in needs:
        install = "always" if wheel == megatron or wheel.name.startswith(TE_ALWAYS) else "missing"
        shutil.copy2(wheel, args.out / WHEELS / wheel.name)
        manifest.wheels.append(carried_wheel(args.out / WHEELS / wheel.name, install, needed_by))
    manifest.write(args.out)
    return manifest


def tree_bytes() -> int:
    """Bytes of what the device call copies of the checkout: tracked and untracked, not ignored."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True)
    paths = [ROOT / name for name in listed.stdout.decode().split("\0") if name]
    return sum(path.stat().st_size for path in paths if path.is_file())


def check_sizes(carry: Path) -> tuple[int, int]:
    """(carry bytes, working tree bytes); exits when either limit is passed."""
    carried, tree = folder_bytes(carry), tree_bytes()
    if carried > MAX_CARRY_BYTES:
        raise SystemExit(f"prepare: the carry is {carried / 2**20:.1f} MiB, over {MAX_CARRY_BYTES / 2**20:.0f} MiB")
    if carried + tree > MAX_CALL_BYTES:
        raise SystemExit(f"prepare: carry + working tree {(carried + tree) / 2**20:.1f} MiB, over the call's 64 MiB")
    return carried, tree


def check_install(args: argparse.Namespace, python: Path) -> dict:
    """Install the carry with the session's own code into a clean 3.12 venv with the image's torch
    and run the session's environment step there (``import transformer_engine.pytorch`` and
    ``import megatron.core`` included); its rows by name."""
    out, site = args.work / "check", args.work / "check-site"
    for folder in (out, site):
        shutil.rmtree(folder, ignore_errors=True)
    session = str(Path(__file__).parent / "session.py")
    command = [str(python), session, "--carry", str(args.out), "--site", str(site), "--steps", "environment"]
    subprocess.run(command + ["--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    return {row["name"]: row for row in results["steps"][0]["rows"]}


def rehearse_on_image_torch(args: argparse.Namespace, python: Path, manifest: Manifest) -> None:
    """The session's rehearsal (every step, tiny shapes, CPU) in the clean venv with the carry's
    wheels but TransformerEngine's (which cannot run on a CPU): every step's code on the image's
    torch and megatron-core 0.19.2; exits when a row has a problem."""
    site, out = args.work / "rehearsal-site", args.work / "rehearsal"
    for folder in (site, out):
        shutil.rmtree(folder, ignore_errors=True)
    wheels = [str(args.out / WHEELS / wheel.wheel) for wheel in manifest.wheels if wheel.needed_by != TE]
    run([str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site), *wheels])
    session = [str(python), str(Path(__file__).parent / "session.py"), "--rehearse", "--out", str(out)]
    completed = subprocess.run(session, env=dict(os.environ, PYTHONPATH=str(site)))
    if completed.returncode:
        raise SystemExit(f"prepare: the rehearsal on the image's torch has problems: {out / 'report.md'}")


def clean_venv(args: argparse.Namespace) -> Path:
    """A Python 3.12 venv with the image's torch and ``IMAGE_PACKAGES``, made once in ``--work``."""
    venv = args.work / "venv312"
    python = venv / "bin" / "python"
    if not (venv / ".ready").is_file():
        shutil.rmtree(venv, ignore_errors=True)
        run([args.python312, "-m", "venv", str(venv)])
        run([str(python), "-m", "pip", "install", "-q", f"torch=={IMAGE_TORCH.split('+')[0]}", *IMAGE_PACKAGES])
        (venv / ".ready").touch()
    return python


def device_call(carry: Path) -> str:
    relative = carry.resolve().relative_to(ROOT)
    command = f"python3 tools/gpu/session.py --carry {relative} --commit {checkout_commit()} --out $OUT"
    return f'run(command="{command}", carry=["{relative}"], timeout_s={SESSION_TIMEOUT_S})'


def main(argv=None) -> int:
    args = parse_args(argv)
    manifest = fill(args)
    carried, tree = check_sizes(args.out)
    size = f"{carried / 2**20:.1f} MiB (+ working tree {tree / 2**20:.1f} MiB)"
    print(f"\ncarry {args.out}: {len(manifest.wheels)} wheels, {size}")
    for wheel in manifest.wheels:
        print(f"  {wheel.size / 2**20:6.2f} MiB  {wheel.install:7s}  {wheel.wheel}")
    if args.check:
        python = args.check_python or clean_venv(args)
        rows = check_install(args, python)
        print("\ncheck in a clean Python 3.12 venv with torch 2.11.0+cu130 (no GPU here):")
        for name, row in rows.items():
            print(f"  {name}: {row['value'] or ''} {row['status']} {row['note']}")
        wanted = ("python", "torch", "megatron-core", "TransformerEngine")
        if any(rows[name]["value"] is None for name in wanted):
            raise SystemExit("prepare: the carry did not install as the GPU needs it (rows above)")
        print("\nthe rehearsal on the image's torch and megatron-core 0.19.2 (TransformerEngine left out):")
        rehearse_on_image_torch(args, python, manifest)
    print("\nthe device call (one NVIDIA H100 or H200):\n  " + device_call(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
