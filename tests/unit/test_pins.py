"""An operator's pins on real tiers (RAM in front of a posix directory), no engine: pinned chunks
survive eviction and clears, ``max_pinned_fraction`` refuses a pin past it (naming the setting),
posix keeps pins across a restart in a private file, and a forged or malformed pins file is
ignored with its reason logged, never choosing a path or a size."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import stat
import subprocess
import threading

import pytest
from kvplug.management import clear_tiers, pin_keys
from kvplug.storage_manager import StorageManager
from kvplug.testing import fill_random, make_key

from tests.support.tiers_for_tests import DictTier

CHUNK = 16 << 10  # fill_random's chunks


def config(tmp_path, ram: int = 8 << 20, disk: int = 64 << 20, fraction: float = 0.5,
           lower: dict | None = None) -> dict:
    tiers = [{"backend": "local_cpu", "name": "ram", "options": {"capacity": ram},
              "max_pinned_fraction": fraction},
             {"backend": "posix", "name": "disk", "max_pinned_fraction": fraction,
              "options": {"path": str(tmp_path / "chunks"), "capacity": disk}}]
    return {"chunk_size": 16, "tiers": tiers + ([lower] if lower else [])}


def store(mgr: StorageManager, ids: list[int]) -> None:
    for i in ids:
        obj = fill_random(mgr, seed=i)
        mgr.batched_put([make_key(i)], [obj])
        obj.ref_down()
        assert mgr.flush(30)  # the disk's writer holds L1's objects until written


def keys(ids: list[int]) -> list:
    return [make_key(i) for i in ids]


def test_pinned_chunks_outlive_eviction_and_clears_until_unpinned(tmp_path):
    ids = random.Random(3).sample(range(10_000), 40)
    pinned, rest = ids[:4], ids[4:]
    # 16 chunks fit each tier: storing 40 evicts, pinned ones never
    with StorageManager(config(tmp_path, ram=16 * CHUNK, disk=16 * CHUNK)) as mgr:
        store(mgr, pinned)
        res = pin_keys(mgr, keys(pinned))
        for tier in ("ram", "disk"):
            assert res[tier] == {**res[tier], "pinned": 4, "absent": 0, "refused": 0,
                                 "complete": True}
            assert res[tier]["pinned_bytes"] >= 4 * CHUNK  # a file adds its header
        assert res["ram"]["pinned_bytes"] == 4 * CHUNK
        assert pin_keys(mgr, keys(pinned))["ram"]["pinned_bytes"] == 4 * CHUNK  # no 2nd count
        store(mgr, rest)
        for tier in ("ram", "disk"):
            assert mgr.holds(tier, keys(pinned)) == [True] * 4, f"{tier} evicted a pinned chunk"
            assert not all(mgr.holds(tier, keys(rest))), "nothing was evicted: the test is void"
        cleared = clear_tiers(mgr)
        assert cleared["ram"]["remaining"] == 4 and "unpin" in cleared["ram"]["note"]
        assert cleared["disk"]["remaining"] == 4 and not cleared["disk"]["complete"]
        undone = pin_keys(mgr, keys(pinned[:3] + [99_999]), pin=False)
        assert undone["ram"] == {**undone["ram"], "unpinned": 3, "not_pinned": 1}
        clear_tiers(mgr)
        assert mgr.holds("ram", keys(pinned)) == [False, False, False, True]
        assert mgr.holds("disk", keys(pinned)) == [False, False, False, True]


def test_a_pin_past_max_pinned_fraction_is_refused_naming_the_setting(tmp_path):
    with StorageManager(config(tmp_path, ram=10 * CHUNK, disk=10 * CHUNK,
                               fraction=0.25)) as mgr:
        store(mgr, list(range(6)))
        res = pin_keys(mgr, keys(list(range(6))))
        for tier in ("ram", "disk"):  # 0.25 x 10 chunks: 2 fit
            assert res[tier]["pinned"] == 2 and res[tier]["refused"] == 4
            assert not res[tier]["complete"]
            assert "max_pinned_fraction 0.25" in res[tier]["error"]
            assert res[tier]["limit_bytes"] == int(0.25 * 10 * CHUNK)
        absent = pin_keys(mgr, [make_key(500)])["ram"]
        assert absent["absent"] == 1 and not absent["complete"] and "not held" in absent["note"]


def test_a_tier_that_cannot_pin_says_so(tmp_path):
    lower = {"backend": "tests.support.tiers_for_tests:DictTier", "name": "remote"}
    with StorageManager(config(tmp_path, lower=lower)) as mgr:
        store(mgr, [1])
        res = pin_keys(mgr, [make_key(1)])
        assert res["ram"]["complete"] and res["disk"]["complete"]
        assert res["remote"]["available"] is False and not res["remote"]["complete"]
        assert "cannot pin" in res["remote"]["error"]
    assert DictTier  # the tier above is that class


def pin_file(tmp_path):
    return tmp_path / "chunks" / "kvplug-pins.json"


def test_posix_pins_hold_across_a_restart_in_a_private_file(tmp_path):
    ids = random.Random(11).sample(range(10_000), 30)
    cfg = config(tmp_path, ram=64 * CHUNK, disk=12 * CHUNK)
    with StorageManager(cfg) as mgr:
        store(mgr, ids[:3])
        assert pin_keys(mgr, keys(ids[:3]), ["disk"])["disk"]["pinned"] == 3
    mode = stat.S_IMODE(os.stat(pin_file(tmp_path)).st_mode)
    assert mode == 0o600, f"pins file mode {mode:o}"
    with StorageManager(cfg) as mgr:  # restarted: pins restored before anything is evicted
        assert mgr.backend("disk").wait_indexed(30)
        assert mgr.stats()["disk"]["operator_pinned"] == 3
        store(mgr, ids[3:])
        assert mgr.holds("disk", keys(ids[:3])) == [True] * 3, "a restored pin was evicted"
        assert pin_keys(mgr, keys(ids[:1]), ["disk"], pin=False)["disk"]["unpinned"] == 1
    assert len(json.loads(pin_file(tmp_path).read_text())["pins"]) == 2
    with StorageManager(cfg) as mgr:
        assert mgr.backend("disk").wait_indexed(30)
        assert mgr.stats()["disk"]["operator_pinned"] == 2


@pytest.mark.parametrize("forged", [
    "not json {", json.dumps({"version": 1, "pins": ["../../outside.safetensors"]}),
    json.dumps({"version": 1, "pins": ["/etc/passwd"]}), json.dumps({"version": 2, "pins": []}),
    json.dumps({"version": 1, "pins": [{"rel": "00/a.safetensors", "size": 1 << 40}]}),
    "symlink",
])
def test_a_forged_pins_file_is_ignored_with_its_reason(tmp_path, caplog, forged):
    cfg = config(tmp_path, disk=12 * CHUNK)
    with StorageManager(cfg) as mgr:
        store(mgr, [1, 2])
        pin_keys(mgr, keys([1, 2]), ["disk"])
    outside = tmp_path / "outside.safetensors"
    outside.write_text("keep me")
    path = pin_file(tmp_path)
    path.unlink()
    if forged == "symlink":  # a link to a pins file elsewhere is never followed
        target = tmp_path / "elsewhere.json"
        target.write_text(json.dumps({"version": 1, "pins": []}))
        path.symlink_to(target)
    else:
        path.write_text(forged)
    with caplog.at_level(logging.WARNING, logger="kvplug.backends.posix"), \
            StorageManager(cfg) as mgr:
        assert mgr.backend("disk").wait_indexed(30)
        assert mgr.stats()["disk"]["operator_pinned"] == 0
        assert mgr.holds("disk", keys([1, 2])) == [True, True]
    assert "pins file" in caplog.text and "ignored" in caplog.text
    assert outside.read_text() == "keep me"


def test_a_pins_file_naming_missing_files_restores_only_what_exists(tmp_path):
    cfg = config(tmp_path, disk=12 * CHUNK)
    with StorageManager(cfg) as mgr:
        store(mgr, [1])
        pin_keys(mgr, keys([1]), ["disk"])
    body = json.loads(pin_file(tmp_path).read_text())
    body["pins"].append("ab/not-there.safetensors")
    pin_file(tmp_path).write_text(json.dumps(body))
    with StorageManager(cfg) as mgr:
        assert mgr.backend("disk").wait_indexed(30)
        assert mgr.stats()["disk"]["operator_pinned"] == 1
    assert json.loads(pin_file(tmp_path).read_text())["pins"] == body["pins"][:1]


def test_a_restore_keeps_within_max_pinned_fraction(tmp_path):
    """A pins file listing more than the setting allows (lowered since, or forged) restores only
    what fits; the rest stay listed (another process sharing the directory may hold them)."""
    with StorageManager(config(tmp_path, disk=12 * CHUNK, fraction=1.0)) as mgr:
        store(mgr, list(range(6)))
        assert pin_keys(mgr, keys(list(range(6))), ["disk"])["disk"]["pinned"] == 6
    with StorageManager(config(tmp_path, disk=12 * CHUNK, fraction=0.25)) as mgr:
        assert mgr.backend("disk").wait_indexed(30)
        s = mgr.stats()["disk"]
        assert 0 < s["operator_pinned"] < 6
        assert s["operator_pinned_bytes"] <= 0.25 * 12 * CHUNK
    assert len(json.loads(pin_file(tmp_path).read_text())["pins"]) == 6


class _SharedLock:
    """Another real process holding ``flock -s`` on ``path`` (what any member of a group-shared
    root's group, 0750, can do, for as long as it likes) until the block ends: ``flock`` and the
    command it runs, in a process group of their own, killed together."""

    def __init__(self, path) -> None:
        self.proc = subprocess.Popen(["flock", "-s", str(path), "-c", "echo locked; sleep 300"],
                                     stdout=subprocess.PIPE, start_new_session=True)
        assert self.proc.stdout.readline() == b"locked\n"

    def __enter__(self) -> _SharedLock:
        return self

    def __exit__(self, *exc: object) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc.stdout.close()


def _in_thread(fn, bound_s: float = 30.0):
    """``fn()`` on a thread; its result, or ``None`` if it still ran after ``bound_s`` (a hang,
    not a duration: the wait it must not do is forever)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(bound_s)
    return None if t.is_alive() else out[0]


@pytest.fixture
def short_lock_wait(monkeypatch):
    """The wait for the root's lock shortened (the tests are about it ending, not its length)."""
    from kvplug.backends.posix import pin_store

    monkeypatch.setattr(pin_store, "LOCK_WAIT_S", 0.5, raising=False)


def test_a_lock_held_on_the_root_never_holds_a_pin_thread(tmp_path, short_lock_wait):
    with StorageManager(config(tmp_path, disk=12 * CHUNK)) as mgr:
        store(mgr, [1, 2])
        with _SharedLock(tmp_path / "chunks"):
            res = _in_thread(lambda: pin_keys(mgr, keys([1]), ["disk"]))
            assert res is not None, "an operator pin waited for the root's lock for good"
            disk = res["disk"]
            assert disk.get("pinned") == 1 and not disk["complete"], disk
            assert "pins file could not be updated" in disk["error"]
            assert mgr.stats()["disk"]["pins_not_saved"] == 1
        again = pin_keys(mgr, keys([2]), ["disk"])["disk"]  # the control: the lock is free now
        assert again["complete"], again
        assert mgr.stats()["disk"]["pins_not_saved"] == 1
        rel = mgr.backend("disk")._rel(make_key(2))
    assert json.loads(pin_file(tmp_path).read_text())["pins"] == [rel]


def test_a_lock_held_on_the_root_never_stops_the_startup_scan(tmp_path, short_lock_wait):
    """A restart with a pinned file gone (the scan drops it from the pins file, under the lock):
    the scan still ends, and stores are written."""
    cfg = config(tmp_path, disk=12 * CHUNK)
    with StorageManager(cfg) as mgr:
        store(mgr, [1, 2])
        assert pin_keys(mgr, keys([1, 2]), ["disk"])["disk"]["complete"]
        gone = tmp_path / "chunks" / mgr.backend("disk")._rel(make_key(2))
    gone.unlink()
    with _SharedLock(tmp_path / "chunks"), StorageManager(cfg) as mgr:
        indexed = _in_thread(lambda: mgr.backend("disk").wait_indexed(30), 40)
        assert indexed, "the start-up scan waited for the root's lock"
        assert mgr.stats()["disk"]["operator_pinned"] == 1
        store(mgr, [3])
        assert mgr.holds("disk", keys([1, 3])) == [True, True]
        assert mgr.stats()["disk"]["pins_not_saved"] == 1


def _disk_bytes(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.safetensors"))


def test_a_deeply_nested_pins_file_is_ignored_and_the_scan_trims(tmp_path, caplog):
    """A pins file of 200,000 ``[``: ignored whole with its reason; the start-up scan still
    indexes and trims the directory to a capacity lowered since, and pins work."""
    with StorageManager(config(tmp_path, disk=64 * CHUNK)) as mgr:
        store(mgr, list(range(20)))
    root = tmp_path / "chunks"
    pin_file(tmp_path).write_text("[" * 200_000)
    with caplog.at_level(logging.WARNING, logger="kvplug.backends.posix"), \
            StorageManager(config(tmp_path, disk=8 * CHUNK)) as mgr:
        assert mgr.backend("disk").wait_indexed(30)
        s = mgr.stats()["disk"]
        assert s["entries"] > 0 and s["bytes"] <= 8 * CHUNK, s
        mgr.backend("disk").directory.reaper.drain(30)
        assert _disk_bytes(root) <= 8 * CHUNK
        store(mgr, [100])
        assert pin_keys(mgr, keys([100]), ["disk"])["disk"]["complete"]
    assert "pins file" in caplog.text and "ignored" in caplog.text


def test_junk_pins_never_crowd_out_the_operators_own(tmp_path, caplog):
    """A well-formed pins file listing twelve junk files named like chunks (what any writer of
    the directory can make): ignored whole, reason logged; none is held; the operator's pin is
    taken, not refused over_limit."""
    cfg = config(tmp_path, disk=32 * CHUNK)
    with StorageManager(cfg) as mgr:
        store(mgr, [1])
    root = tmp_path / "chunks"
    junk = []
    for i in range(12):
        rel = f"{i:02x}/junk-{i}.safetensors"
        (root / rel).parent.mkdir(exist_ok=True)
        (root / rel).write_bytes(os.urandom(2 * CHUNK))
        junk.append(rel)
    pin_file(tmp_path).write_text(json.dumps({"version": 1, "pins": junk}))
    with caplog.at_level(logging.WARNING, logger="kvplug.backends.posix"), \
            StorageManager(cfg) as mgr:
        assert mgr.backend("disk").wait_indexed(30)
        assert mgr.stats()["disk"]["operator_pinned"] == 0
        res = pin_keys(mgr, keys([1]), ["disk"])["disk"]
        assert res["pinned"] == 1 and res["refused"] == 0 and res["complete"], res
    assert "pins file" in caplog.text and "not a chunk" in caplog.text


def test_with_auth_a_pins_file_not_sealed_by_the_deployment_is_ignored(tmp_path, monkeypatch,
                                                                        caplog):
    """With ``auth_key_env`` the pins file is sealed with the deployment's key: a restart
    restores it (the control); the same names written by someone without the key (real chunk
    names: all a reader of the directory sees) are ignored whole."""
    from tests.support.auth_attacks import KEY_A, set_secrets

    set_secrets(monkeypatch.setenv)
    cfg = {**config(tmp_path, disk=32 * CHUNK), "auth_key_env": KEY_A}
    with StorageManager(cfg) as mgr:
        store(mgr, [1, 2, 3])
        assert pin_keys(mgr, keys([1, 2]), ["disk"])["disk"]["complete"]
    sealed = pin_file(tmp_path).read_text()
    with StorageManager(cfg) as mgr:
        assert mgr.backend("disk").wait_indexed(30)
        assert mgr.stats()["disk"]["operator_pinned"] == 2
    names = [str(p.relative_to(tmp_path / "chunks"))
             for p in (tmp_path / "chunks").rglob("*.safetensors")]
    assert len(names) == 3
    for forged in ({"version": 1, "pins": names},
                   {**json.loads(sealed), "pins": names}):  # another list, the old seal
        pin_file(tmp_path).write_text(json.dumps(forged))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvplug.backends.posix"), \
                StorageManager(cfg) as mgr:
            assert mgr.backend("disk").wait_indexed(30)
            assert mgr.stats()["disk"]["operator_pinned"] == 0
        assert "pins file" in caplog.text and "deployment" in caplog.text
