"""Fixtures the unit modules share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny demo model's config and tokenizer, without weights (a scheduler side, a
    ``VllmConfig``): built once per session in the shared base folder, reused by every module."""
    from kvplug.connector.demo.model import make_model

    return make_model("tiny", weights=False, root=tmp_path_factory.getbasetemp() / "models")
