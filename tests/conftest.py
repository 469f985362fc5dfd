"""Suite-wide isolation: no test reads the user's kvplug config or writes to ~/.cache."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _isolated_kvplug_env(monkeypatch, tmp_path_factory):
    for name in list(os.environ):
        if name.startswith("KVPLUG_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVPLUG_CACHE_DIR", str(tmp_path_factory.mktemp("kvplug-cache")))
