"""The backend conformance suite against the fsspec tier: on moto's S3 server and on memory://."""

from __future__ import annotations

import uuid

import fsspec
import pytest
from kvplug.testing import BackendConformance

from tests.support.s3_server import moto_server, s3  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(120)

FAST = {"timeout_s": 5.0, "negative_cache_s": 0.0, "io_threads": 4}


def _corrupt_bytes(fs, path: str) -> None:
    data = bytearray(fs.cat_file(path))
    data[-100] ^= 0xFF  # inside the last layer
    fs.pipe_file(path, bytes(data))


class TestFsspecS3(BackendConformance):
    persistent = True

    @pytest.fixture
    def make_tiers(self, s3):  # noqa: F811 - fixture
        prefix = f"conf-{uuid.uuid4().hex[:8]}"

        def tiers(capacity: int) -> list[dict]:
            return [{"backend": "fsspec", "options": {
                "url": s3.url(prefix), "storage_options": s3.storage_options,
                "capacity": capacity, **FAST,
            }}]

        return tiers

    @pytest.fixture
    def corrupt_entry(self, s3):  # noqa: F811 - fixture
        def corrupt(manager, key) -> None:
            backend = manager.backend(0)
            _corrupt_bytes(s3.filesystem(), backend.path_of(key))

        return corrupt


class TestFsspecMemory(BackendConformance):
    persistent = True

    @pytest.fixture(autouse=True)
    def _clear_memory_fs(self):
        fs = fsspec.filesystem("memory")
        fs.store.clear()
        fs.pseudo_dirs.clear()
        fs.pseudo_dirs.append("")
        yield
        fs.store.clear()
        fs.pseudo_dirs.clear()
        fs.pseudo_dirs.append("")

    @pytest.fixture
    def make_tiers(self):
        return lambda capacity: [{"backend": "fsspec", "options": {
            "url": "memory://kvplug-conf", "capacity": capacity, **FAST}}]

    @pytest.fixture
    def corrupt_entry(self):
        def corrupt(manager, key) -> None:
            _corrupt_bytes(fsspec.filesystem("memory"), manager.backend(0).path_of(key))

        return corrupt
