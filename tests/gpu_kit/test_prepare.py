"""``tools/gpu/prepare.py``'s limits and its device call (the carry itself is built and checked by
running prepare.py, which downloads and compiles: BENCHMARKS.md "GPU session" says when)."""

from __future__ import annotations

import subprocess

import pytest

from tests.gpu_kit import carry_manifest, prepare, session_steps


def test_a_carry_over_its_limit_is_refused(tmp_path):
    with open(tmp_path / "big.whl", "wb") as file:  # sparse: no disk used
        file.truncate(carry_manifest.MAX_CARRY_BYTES + 1)
    with pytest.raises(SystemExit, match="the carry is 60.0 MiB, over 60 MiB"):
        prepare.check_sizes(tmp_path)
    (tmp_path / "big.whl").unlink()
    with open(tmp_path / "fits.whl", "wb") as file:
        file.truncate(carry_manifest.MAX_CARRY_BYTES)
    carried, tree = prepare.check_sizes(tmp_path)
    assert carried == carry_manifest.MAX_CARRY_BYTES and 0 < tree < carry_manifest.MAX_CALL_BYTES - carried


def test_the_device_call_runs_the_session_on_the_carry():
    """The call names the checkout's commit: the device copies the tree without git, and the
    report's header would otherwise name only the commit the carry was made at."""
    call = prepare.device_call(prepare.ROOT / ".gpu-carry")
    commit = session_steps.checkout_commit()
    assert call == (
        f'run(command="python3 tools/gpu/session.py --carry .gpu-carry --commit {commit} --out $OUT", '
        f'carry=[".gpu-carry"], timeout_s={prepare.SESSION_TIMEOUT_S})'
    )
    ignored = subprocess.run(["git", "check-ignore", "-q", ".gpu-carry/wheels/x.whl"], cwd=prepare.ROOT)
    assert ignored.returncode == 0  # carried to the device, never committed
    assert session_steps.GPU.budget_s < prepare.SESSION_TIMEOUT_S


def test_a_pinned_requirement_is_downloaded_as_pinned_into_its_own_folder(tmp_path, monkeypatch):
    """``download("numpy<2.4", ...)`` hands pip the pin (the carry's numpy for Triton 3.6's
    interpreter, ``WHERE_MISSING``) and keeps the wheel in a folder named for the project."""
    commands = []

    def pip(command):
        commands.append(command)
        into = prepare.Path(command[command.index("-d") + 1])
        into.mkdir(parents=True)  # as pip download does
        (into / "numpy-2.3.5-cp312-cp312-manylinux_2_28_x86_64.whl").touch()

    monkeypatch.setattr(prepare, "run", pip)
    wheel = prepare.download("numpy<2.4", tmp_path)
    assert wheel.parent == tmp_path / "numpy" and commands[0][-1] == "numpy<2.4"
