"""The conformance suite against the posix tier alone and behind local_cpu (promotion into L1)."""

from __future__ import annotations

import os

import pytest
from kvplug import chunkfile as cf
from kvplug.testing import BackendConformance


def _flip_layer_byte(root):
    def corrupt(manager, key):
        path = cf.chunk_path(root, key)
        with open(path, "r+b") as f:
            head = cf.decode_header(f.read(cf.HEADER_PROBE), os.fstat(f.fileno()).st_size)
            f.seek(head.data_offsets[-1] + head.layer_nbytes // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x01]))
        others = [t for t in manager.tier_names if t != "posix"]
        if others:  # drop the copy in L1 so the disk is read
            manager.evict([key], tiers=others)
        assert path.exists()

    return corrupt


class TestPosixConformance(BackendConformance):
    persistent = True

    @pytest.fixture
    def make_tiers(self, tmp_path):
        return lambda capacity: [
            {"backend": "posix", "options": {"path": str(tmp_path / "c"), "capacity": capacity}}
        ]

    @pytest.fixture
    def corrupt_entry(self, tmp_path):
        return _flip_layer_byte(tmp_path / "c")


class TestLocalCpuOverPosix(BackendConformance):
    persistent = True

    @pytest.fixture
    def make_tiers(self, tmp_path):
        return lambda capacity: [
            {"backend": "local_cpu", "options": {"capacity": capacity}},
            {"backend": "posix", "options": {"path": str(tmp_path / "c"), "capacity": capacity}},
        ]

    @pytest.fixture
    def corrupt_entry(self, tmp_path):
        return _flip_layer_byte(tmp_path / "c")
