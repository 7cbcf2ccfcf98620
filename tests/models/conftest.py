"""Fixtures shared by the model tests."""

from __future__ import annotations

import pytest

from tests.models import te_stand_ins


@pytest.fixture
def transformer_engine_stand_ins(monkeypatch):
    """megatron's TransformerEngine spec on CPU (see ``te_stand_ins.install``)."""
    te_stand_ins.install(monkeypatch)
