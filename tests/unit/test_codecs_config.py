"""Codecs by configuration: config errors, third-party codecs found through the
``kvplug.codecs`` entry-point group (real distributions on sys.path), and the command line
(``inspect``, ``config check``) naming a tier's codec.
"""

from __future__ import annotations

import logging
import os
import textwrap
import threading
from contextlib import contextmanager

import pytest
import torch
from kvplug.codecs import load_codec_class, parse_frame
from kvplug.codecs.registry import clear_cache
from kvplug.errors import ConfigError
from kvplug.testing import make_key

from tests.support.codec_helpers import files, header_of, kv_obj, manager, posix, stored


# -- config errors ----------------------------------------------------------------------------
def test_unknown_codec_is_a_config_error_naming_the_installed_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"codec 'zfp' is not installed; installed codecs: .*fp8.*"
                                          r"lossless"):
        manager(posix(tmp_path, "zfp"))


def test_codec_on_l1_and_bad_codec_options_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="never blocks"):
        manager({"backend": "local_cpu", "codec": "lossless"})
    with pytest.raises(ConfigError, match="num_kv_heads"):
        manager(posix(tmp_path, "fp8"))
    with pytest.raises(ConfigError, match="clevel"):
        manager(posix(tmp_path, "lossless", {"clevel": 42}))
    with pytest.raises(ConfigError, match="codec_options given without a codec"):
        manager({**posix(tmp_path), "codec_options": {"clevel": 1}})


def _tier_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kvplug-")}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _ended(threads: set[threading.Thread]) -> set[str]:
    """The names of ``threads`` still running once each was given 30 s to end (a hang caught)."""
    for t in threads:
        t.join(timeout=30)
    return {t.name for t in threads if t.is_alive()}


@contextmanager
def _nothing_left_running():
    """Asserts that no ``kvplug-*`` thread started inside the block runs on after it, and that
    as many descriptors are open as before."""
    threads, fds = _tier_threads(), _open_fds()
    yield
    assert _ended(_tier_threads() - threads) == set()
    assert _open_fds() == fds


BAD_AFTER_START = {  # tiers whose backend starts (threads, descriptors, a pool), then a config error
    "posix, unknown codec": lambda p: posix(p, "zfp"),
    "posix, bad codec options": lambda p: posix(p, "lossless", {"clevel": 42}),
    "local_cpu with a codec": lambda p: {"backend": "local_cpu", "codec": "lossless",
                                         "options": {"capacity": "64MiB"}},
}


@pytest.mark.parametrize("tier", list(BAD_AFTER_START))
def test_a_tier_refused_after_its_backend_started_leaves_nothing_running(tmp_path, tier):
    """A tier whose backend had started when its codec was refused is closed before the error
    reaches the caller: no thread of it runs on, no descriptor stays open (a process that goes
    on after a bad config — a test run, a management server — would otherwise keep them)."""
    with _nothing_left_running(), pytest.raises(ConfigError):
        manager(BAD_AFTER_START[tier](tmp_path))


def test_a_tier_whose_encoder_cannot_start_leaves_nothing_running(tmp_path, monkeypatch):
    """The same once the tier is built and registered: its encoder thread fails to start (the
    process is out of threads: a fault a test cannot cause for real, so it is raised here)."""
    from kvplug.tier_calls import Tier

    def no_thread(self) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(Tier, "start_encoder", no_thread)
    with _nothing_left_running(), pytest.raises(RuntimeError, match="can't start new thread"):
        manager(posix(tmp_path, "lossless"))


@pytest.mark.parametrize("tier", list(BAD_AFTER_START))
def test_control_the_same_tier_without_its_codec_runs_threads_until_closed(tmp_path, tier):
    """The check above could pass vacuously if these backends started nothing: without the codec
    the same tier has threads (and descriptors) of its own until it is closed."""
    cfg = {k: v for k, v in BAD_AFTER_START[tier](tmp_path).items()
           if k not in ("codec", "codec_options")}
    with _nothing_left_running():
        threads = _tier_threads()
        mgr = manager(cfg)
        assert _tier_threads() - threads, \
            "the tier started no thread: the leak check above would be vacuous"
        mgr.close()


# -- third-party codecs through the entry-point group ----------------------------------------
XOR_CODEC = '''
import torch
from kvplug.codecs import Codec

class XorCodec(Codec):
    """Toy codec: every byte xor 0x5A (proves the bytes pass through the third party's code)."""

    def encode_layer(self, pages, spec):
        return (pages.contiguous() ^ 0x5A).numpy().tobytes(), {"xor": 90}

    @classmethod
    def decode_layer(cls, payload, params, out, spec):
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        out.view(torch.uint8).reshape(-1).copy_(data ^ params["xor"])
'''


def install_codec(site, dist: str, module: str, entry: str, body: str) -> None:
    (site / f"{module}.py").write_text(textwrap.dedent(body))
    info = site / f"{dist.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[kvplug.codecs]\n{entry}\n")


def test_third_party_codec_is_found_used_and_missing_is_a_miss_naming_it(tmp_path, monkeypatch,
                                                                        caplog):
    site = tmp_path / "site"
    site.mkdir()
    install_codec(site, "kvplug-xor", "kvplug_xor", "xor = kvplug_xor:XorCodec", XOR_CODEC)
    with monkeypatch.context() as m:
        m.syspath_prepend(str(site))
        clear_cache()
        cls, info = load_codec_class("xor")
        assert (info.package, info.version) == ("kvplug-xor", "0.1.0")
        mgr = manager(posix(tmp_path / "d", "xor"))
        o = kv_obj(7)
        stored(mgr, make_key(0), o)
        got = mgr.get(make_key(0))
        assert torch.equal(got.tensor, o.tensor)
        got.ref_down()
        mgr.close()
    path = files(tmp_path / "d")[0]
    head = header_of(path)
    assert head.codec_info["package"] == "kvplug-xor"
    slot = path.read_bytes()[head.data_offsets[0] :][: head.layer_nbytes]
    frame = parse_frame(slot)
    assert bytes(frame.payload[:16]) == bytes((o.tensor[0, 0, :16] ^ 0x5A).tolist())
    clear_cache()  # the distribution is gone from sys.path now
    mgr = manager(posix(tmp_path / "d", "lossless"))
    with caplog.at_level(logging.WARNING, logger="kvplug.codecs"):
        assert mgr.get(make_key(0)) is None
    assert "codec 'xor' (package kvplug-xor 0.1.0)" in caplog.text
    assert "install kvplug-xor" in caplog.text
    assert mgr.stats()["disk"]["codec_missing"] == 1
    mgr.close()
    clear_cache()


# -- the command line -------------------------------------------------------------------------
def test_inspect_table_names_the_codec(tmp_path, monkeypatch):
    from click.testing import CliRunner
    from kvplug.cli import main
    from kvplug.cli.common import console

    monkeypatch.setattr(console, "width", 250)  # wide enough for any tmp path (xdist's are long)

    for codec, sub in ((None, "a"), ("lossless", "b")):
        mgr = manager(posix(tmp_path / sub, codec))
        stored(mgr, make_key(0), kv_obj(0))
        mgr.close()
    raw = CliRunner().invoke(main, ["inspect", str(tmp_path / "a")])
    enc = CliRunner().invoke(main, ["inspect", str(tmp_path / "b")])
    assert raw.exit_code == 0 and enc.exit_code == 0
    assert "lossless" in enc.output and "lossless" not in raw.output


def test_config_check_resolves_codecs_and_names_unknown_ones(tmp_path):
    import yaml
    from click.testing import CliRunner
    from kvplug.cli import main

    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({"tiers": [
        {"backend": "local_cpu"},
        {**posix(tmp_path / "d", "fp8", {"num_kv_heads": 8})}]}))
    out = CliRunner().invoke(main, ["config", "check", "--json", str(good)])
    assert out.exit_code == 0, out.output
    assert '"lossy": true' in out.output and '"num_kv_heads": 8' in out.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"tiers": [posix(tmp_path / "d", "zfp")]}))
    out = CliRunner().invoke(main, ["config", "check", str(bad)])
    assert out.exit_code != 0 and "codec 'zfp' is not installed" in out.output
    assert "lossless" in out.output


def test_a_codec_missing_a_method_cannot_be_constructed_and_its_defaults_are_declared():
    """``encode_layer`` and ``decode_layer`` are abstract: a codec without one fails when it is
    built, naming it, not when the first chunk is stored; ``lossy`` and ``Options`` default."""
    from kvplug.codecs import Codec

    class DecodeOnly(Codec):
        @classmethod
        def decode_layer(cls, payload, params, out, spec):
            out.view(-1).copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    with pytest.raises(TypeError, match="DecodeOnly.*encode_layer"):
        DecodeOnly()
    assert Codec.__abstractmethods__ == {"encode_layer", "decode_layer"}
    assert (DecodeOnly.lossy, DecodeOnly.Options) == (False, None)
