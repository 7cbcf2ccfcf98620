"""Tests of the GPU kit (``tools/gpu/``: the carry, ``prepare.py``, ``session.py``), whose scripts
import their siblings by plain name: loaded by file (``tests.scripts.load_scripts``)."""

from __future__ import annotations

from tests.scripts import ROOT, load_scripts

KIT = ROOT / "tools" / "gpu"
attention_probe, carry_manifest, session_report, session_steps, session, prepare = load_scripts(
    KIT, "attention_probe", "carry_manifest", "session_report", "session_steps", "session", "prepare"
)
