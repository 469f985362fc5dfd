"""Secrets never printed: every tier's secret options, through the real ``kvplug`` command (a
subprocess), tier start-up errors, exceptions and logs.

Each secret is random; the short ones (1 and 2 characters, a password in ``?password=``) are drawn
from letters that never stand alone in kvplug's output, and are looked for as whole tokens (a
one-letter secret is inside every word). Negative control: every secret is in the config file (or
the command line) the command was given, found there by the same search.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shlex
import string
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from kvplug.backends.local_cpu import LocalCPUBackend
from kvplug.errors import KVPlugError
from kvplug.redact import Redactor, redact_argv, redact_data, scrub

from tests.support.engine_processes import run_console_script

RNG = random.SystemRandom()


def _long(prefix: str) -> str:
    return prefix + "".join(RNG.choice(string.ascii_letters + string.digits) for _ in range(20))


def _short(n: int) -> str:
    return "".join(RNG.choice("QXZJ") for _ in range(n))


class Secrets:
    """One run's random secrets, by what they are."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        # the two-letter ones are 16 strings: drawn again until no two secrets are equal (one in
        # 16 runs drew resp2_password == url_password, found under both names)
        while len(set(self.values.values())) < len(self.values) or not self.values:
            self.values = self._draw()

    @staticmethod
    def _draw() -> dict[str, str]:
        return {
            "resp_url_password": _long("rp"), "resp_user": _long("ru"),
            "resp_query_password": _short(1), "resp2_password": _short(2),
            "resp_env_password": _long("re"), "tls_key_pem": _long("pem"),
            "s3_key": _long("AKIA"), "s3_secret": _long("sk"), "s3_token": _long("st"),
            "aws_access_key_id": _long("ak"), "aws_secret_access_key": _long("as"),
            "aws_session_token": _long("at"), "endpoint_password": _long("ep"),
            "nested_secret": _long("ns"), "url_password": _short(2),
            "mooncake_password": _long("mp"), "mooncake_token": _long("mt"),
            "api_key": _long("api"),
        }

    def found_in(self, text: str) -> list[str]:
        """The names of the secrets ``text`` holds (short ones: as whole tokens)."""
        out = []
        for name, value in self.values.items():
            pattern = re.escape(value) if len(value) > 2 else \
                rf"(?<![A-Za-z0-9]){re.escape(value)}(?![A-Za-z0-9])"
            if re.search(pattern, text):
                out.append(name)
        return out

    def __getattr__(self, name: str) -> str:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None


@pytest.fixture
def sec() -> Secrets:
    return Secrets()


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120, fresh: bool = False
         ) -> subprocess.CompletedProcess[str]:
    """``kvplug ARGS`` in a process of its own: forked (torch and kvplug already imported;
    tests/support/engine_processes.py), or with ``fresh`` a new interpreter (``python -m kvplug.cli``)."""
    import os

    full = {**os.environ, "COLUMNS": "250", **(env or {})}
    if not fresh:
        return run_console_script(list(args), full, None, timeout)
    return subprocess.run([sys.executable, "-m", "kvplug.cli", *args], capture_output=True,
                          text=True, env=full, timeout=timeout)


def _tiers(s: Secrets, tmp_path: Path) -> tuple[list[dict], Path]:
    """A tier of each remote family, every secret option set."""
    key = tmp_path / "client.key"
    key.write_text(f"-----BEGIN PRIVATE KEY-----\n{s.tls_key_pem}\n-----END PRIVATE KEY-----\n")
    return [
        {"backend": "resp", "name": "valkey", "options": {
            "url": f"redis://{s.resp_user}:{s.resp_url_password}@127.0.0.1:1/0"}},
        {"backend": "resp", "name": "valkey_q", "options": {
            "url": f"redis://127.0.0.1:1/0?password={s.resp_query_password}&db=0"}},
        {"backend": "resp", "name": "valkey_short", "options": {
            "url": f"redis://:{s.resp2_password}@127.0.0.1:1/0", "password_env": "KVT_PW"}},
        {"backend": "fsspec", "name": "bucket", "options": {
            "url": f"s3://bucket/prefix?token={s.url_password}",
            "storage_options": {
                "key": s.s3_key, "secret": s.s3_secret, "token": s.s3_token,
                "client_kwargs": {
                    "endpoint_url": f"http://minio:{s.endpoint_password}@127.0.0.1:9000",
                    "aws_access_key_id": s.aws_access_key_id,
                    "aws_secret_access_key": s.aws_secret_access_key,
                    "aws_session_token": s.aws_session_token},
                "config_kwargs": {"s3": {"credentials": {"secret": s.nested_secret}}}}}},
        {"backend": "mooncake", "name": "mc", "options": {
            "master": "127.0.0.1:50051",
            "metadata_server": f"http://u:{s.mooncake_password}@etcd:2379/?token="
                               f"{s.mooncake_token}"}},
    ], key


def _write(path: Path, cfg: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(cfg))
    return path


def _check_outputs(s: Secrets, cfg_file: Path, *extra: str, env: dict | None = None
                   ) -> tuple[str, list[subprocess.CompletedProcess[str]]]:
    """Every output of ``config check`` (table and JSON) on ``cfg_file``; the file itself holds
    every secret of ``s`` it was written with (the negative control)."""
    runs = [_cli("config", "check", str(cfg_file), *extra, env=env),
            _cli("config", "check", str(cfg_file), "--json", *extra, env=env)]
    return "\n".join(r.stdout + r.stderr for r in runs), runs


def test_config_check_of_a_valid_config_prints_no_secret(sec, tmp_path):
    tiers, _ = _tiers(sec, tmp_path)
    cfg = _write(tmp_path / "ok.yaml", {"tiers": [{"backend": "local_cpu"}, *tiers]})
    text, runs = _check_outputs(sec, cfg, env={"KVT_PW": sec.resp_env_password})
    assert runs[0].returncode == 0, runs[0].stdout + runs[0].stderr
    in_file = set(sec.found_in(cfg.read_text()))
    assert in_file >= set(sec.values) - {"resp_env_password", "tls_key_pem", "api_key"}
    assert not (leaked := sec.found_in(text)), leaked
    data = json.loads(runs[1].stdout)
    shown = {t["name"]: t["options"] for t in data["tiers"]}
    # what is not secret is still shown
    assert shown["valkey"]["url"] == "redis://***@127.0.0.1:1/0"
    assert shown["valkey_short"]["password_env"] == "KVT_PW"
    assert shown["bucket"]["storage_options"]["key"] == "***"
    assert shown["bucket"]["url"].startswith("s3://bucket/prefix")
    assert shown["mc"]["master"] == "127.0.0.1:50051"


def test_config_check_of_a_bad_config_prints_no_secret(sec, tmp_path):
    """Option errors name the bad value; pydantic's error echoes the input: neither may carry a
    secret (the URL was redacted in the message, then echoed raw after it)."""
    tiers, key = _tiers(sec, tmp_path)
    tiers[0]["options"]["url"] = f"http://{sec.resp_user}:{sec.resp_url_password}@h/?password=" \
                                 f"{sec.resp_query_password}"  # not a Valkey URL
    tiers[1]["options"]["max_connections"] = 1  # below its bound
    tiers[2]["options"].update(ssl_keyfile=str(key))  # TLS files without rediss://
    tiers[3]["options"]["storage_options"]["client_kwargs"]["verify"] = "yes"
    tiers[3]["options"]["timeout_s"] = f"http://u:{sec.endpoint_password}@x"  # not a number
    tiers[4]["options"]["metadata_server"] = {"url": tiers[4]["options"]["metadata_server"],
                                              "secret": sec.mooncake_token}  # not a string
    cfg = _write(tmp_path / "bad.yaml", {"tiers": tiers})
    text, runs = _check_outputs(sec, cfg)
    assert runs[0].returncode == 1 and "problem(s)" in runs[0].stderr
    assert "is not a Valkey/Redis URL" in text and "max_connections" in text
    assert "does not use TLS" in text and "metadata_server" in text and "timeout_s" in text
    assert set(sec.found_in(cfg.read_text())) >= {"resp_url_password", "resp_query_password",
                                                  "mooncake_token", "endpoint_password"}
    assert not (leaked := sec.found_in(text)), leaked
    # a key of the config itself with a bad value: load_config's own error
    cfg = _write(tmp_path / "bad2.yaml", {"tiers": [{"backend": "local_cpu", "timeout_s":
                                                     f"redis://:{sec.resp2_password}@h"}]})
    text, runs = _check_outputs(sec, cfg)
    assert runs[0].returncode == 1 and "timeout_s" in text
    assert sec.found_in(cfg.read_text()) == ["resp2_password"]
    assert not (leaked := sec.found_in(text)), leaked


def test_serve_never_echoes_the_api_key(sec, tmp_path):
    """``--print-command`` and the ``starting:`` line show ``--api-key ***``; vLLM still gets the
    key (a stand-in ``vllm`` package on ``PYTHONPATH`` records the argv it was started with)."""
    tiers, _ = _tiers(sec, tmp_path)
    cfg = _write(tmp_path / "k.yaml", {"tiers": [{"backend": "local_cpu"}, tiers[0]]})
    for form in (["--api-key", sec.api_key], [f"--api-key={sec.api_key}"]):
        out = _cli("serve", "m", "--kvplug-config", str(cfg), "--port", "1", *form,
                   "--print-command")
        assert out.returncode == 0, out.stderr
        assert not (leaked := sec.found_in(out.stdout + out.stderr)), leaked
        argv = shlex.split(out.stdout)
        assert "--api-key" in argv and argv[argv.index("--api-key") + 1] == "***"
    fake = tmp_path / "fake"
    server = fake / "vllm" / "entrypoints" / "openai"
    server.mkdir(parents=True)
    for d in (fake / "vllm", fake / "vllm" / "entrypoints", server):
        (d / "__init__.py").write_text("")
    (server / "api_server.py").write_text(
        "import json, sys\n"
        f"open({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(sys.argv))\n")
    import os

    env = {"PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])}
    # a new interpreter: the stand-in vllm on PYTHONPATH, not the forkserver's real one
    out = _cli("serve", "m", "--kvplug-config", str(cfg), "--api-key", sec.api_key, env=env,
               fresh=True)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stderr.splitlines() if ln.startswith("starting: python"))
    shown = shlex.split(line)
    assert shown[shown.index("--api-key") + 1] == "***"
    assert not (leaked := sec.found_in(out.stdout + out.stderr)), leaked
    got = json.loads((tmp_path / "argv.json").read_text())
    assert got[got.index("--api-key") + 1] == sec.api_key  # vLLM was given the real key


def test_serve_and_inspect_errors_print_no_secret(sec, tmp_path):
    """``kvplug serve`` refusing a bad config before vLLM starts, and ``kvplug inspect`` of a URL
    with credentials that holds nothing."""
    tiers, _ = _tiers(sec, tmp_path)
    tiers[0]["options"]["url"] = f"http://{sec.resp_user}:{sec.resp_url_password}@h/"
    cfg = _write(tmp_path / "bad.yaml", {"tiers": [{"backend": "local_cpu"}, *tiers]})
    out = _cli("serve", "m", "--kvplug-config", str(cfg), "--api-key", sec.api_key)
    assert out.returncode == 1 and "not a Valkey/Redis URL" in out.stderr
    assert not (leaked := sec.found_in(out.stdout + out.stderr)), leaked
    url = f"memory://{sec.resp_user}:{sec.resp2_password}@kvt/none?token={sec.s3_token}"
    out = _cli("inspect", url, "-s", f"key={sec.s3_key}", "-s", f"secret={sec.s3_secret}")
    assert "0 chunks" in out.stdout, out.stderr
    assert not (leaked := sec.found_in(out.stdout + out.stderr)), leaked
    bad = _cli("inspect", url, "-s", f"key={sec.s3_key}", "-s", f"secret={sec.s3_secret}",
               "-s", f"nonsense-{sec.nested_secret}")
    assert bad.returncode == 1 and "KEY=VALUE" in bad.stderr
    assert not (leaked := sec.found_in(bad.stdout + bad.stderr)), leaked


class LeakyBackend(LocalCPUBackend):
    """A third-party backend whose start-up error names its URL, credentials included."""

    def __init__(self, ctx) -> None:  # noqa: ANN001 - the hook spec's TierContext
        raise ConnectionError(f"cannot reach {ctx.options['url']} with token "
                              f"{ctx.options['token']}")


def test_tier_start_errors_and_logs_hold_no_secret(sec, tmp_path, caplog, monkeypatch):
    """Building a StorageManager: a bad option of each tier, a backend that fails to start, and
    the log lines of tiers that start and fail their first calls. The exception's whole
    traceback (chained causes too) and the logs are searched."""
    from kvplug.storage_manager import StorageManager

    monkeypatch.setenv("KVT_PW", sec.resp_env_password)
    caplog.set_level(logging.INFO)  # what a deployment logs; kvplug's own lines at every level
    caplog.set_level(logging.DEBUG, logger="kvplug")
    tiers, key = _tiers(sec, tmp_path)
    bad = [
        {**tiers[0], "options": {"url": f"http://{sec.resp_user}:{sec.resp_url_password}@h/"
                                        f"?password={sec.resp_query_password}"}},
        {**tiers[2], "options": {**tiers[2]["options"], "max_connections": 0}},
        {**tiers[3], "options": {**tiers[3]["options"], "timeout_s": f"{sec.url_password}"}},
        {**tiers[4], "options": {**tiers[4]["options"], "protocol": "carrier-pigeon"}},
        {"backend": "fsspec", "options": {"url": f"nosuch://u:{sec.endpoint_password}@h/x",
                                          "storage_options": {"secret": sec.s3_secret}}},
        {"backend": f"{__name__}:LeakyBackend", "options": {
            "url": f"https://u:{sec.nested_secret}@h/?password={sec.resp2_password}",
            "token": sec.s3_token}},
    ]
    texts = []
    for tier in bad:
        with pytest.raises(KVPlugError) as info:
            StorageManager({"tiers": [{"backend": "local_cpu"}, tier]})
        texts.append("".join(traceback.format_exception(info.value)))
    assert "carrier-pigeon" in "".join(texts)  # the errors do name the bad values
    # tiers that start, then fail their calls (nothing listens on port 1)
    sm = StorageManager({"tiers": [{"backend": "local_cpu"}, tiers[0], tiers[1], tiers[2],
                                   {"backend": "fsspec", "options": {
                                       "url": f"memory://u:{sec.url_password}@kvt/x",
                                       "storage_options": tiers[3]["options"]["storage_options"]}}
                                   ]})
    try:
        from kvplug.testing import make_key

        keys = [make_key(i) for i in range(3)]
        sm.lookup_prefix(keys)
        sm.batched_get(keys)
        texts.append(json.dumps(sm.stats(), default=str))
    finally:
        sm.close()
    texts.append(caplog.text)
    texts.append("\n".join(str(r.args) for r in caplog.records))
    assert sec.found_in(json.dumps(bad)) != []  # the negative control
    assert not (leaked := sec.found_in("\n".join(texts))), leaked


# -- the rule itself -----------------------------------------------------------------------------
def test_scrub_covers_userinfo_query_and_short_passwords():
    assert scrub("redis://:a@h:1/0") == "redis://***@h:1/0"
    assert scrub("redis://u:ab@h/0?password=x&db=0") == "redis://***@h/0?password=***&db=0"
    assert scrub("s3://b/p?X-Amz-Signature=abc&x-amz-security-token=t&region=eu") == \
        "s3://b/p?X-Amz-Signature=***&x-amz-security-token=***&region=eu"
    assert scrub("see http://h/?token=abc.d and") == "see http://h/?token=*** and"
    assert scrub("max_connections=16, chunk_size=256") == "max_connections=16, chunk_size=256"


def test_redactor_replaces_known_values_short_ones_as_whole_tokens():
    r = Redactor("redis://alice:Q@h/0", {"secret": "ZX", "client_kwargs": {"aws_secret_access_key":
                                                                          "longsecretvalue"}})
    assert r("input_value='Q', got Q; QUIT ZXY 'ZX' xlongsecretvaluex") == \
        "input_value='***', got ***; QUIT ZXY '***' x***x"
    assert r.error(ValueError("login alice failed")) == "ValueError: login *** failed"


def test_redact_data_masks_secret_keys_keeps_env_names():
    out = redact_data({"password_env": "REDIS_PW", "storage_options": {"key": "k", "anon": False,
                       "client_kwargs": {"endpoint_url": "http://u:p@h"}}, "ssl_keyfile": "/k",
                       "url": "redis://u:p@h?password=p", "token": 7, "use_auth": True})
    assert out == {"password_env": "REDIS_PW", "storage_options": {
        "key": "***", "anon": False, "client_kwargs": {"endpoint_url": "http://***@h"}},
        "ssl_keyfile": "/k", "url": "redis://***@h?password=***", "token": "***", "use_auth": True}


def test_redact_argv():
    assert redact_argv(["x", "--api-key", "s", "--api-key=t", "--port", "1", "--hf-token", "h"]) \
        == ["x", "--api-key", "***", "--api-key", "***", "--port", "1", "--hf-token", "***"]


# -- every shape a secret takes (one test per shape, one `config check` run for them all) -------
def _random(prefix: str, middle: str = "") -> str:
    """A random secret, with ``middle`` (a quote, an ``@``) inside it."""
    return _long(prefix)[:12] + middle + _long("")[:12]


class Shapes:
    """One run's secrets, one per shape the redaction rule must cover."""

    def __init__(self) -> None:
        self.quote_pw = _random("vq", "'")  # a Valkey password holding a quote
        self.at_pw = _random("va", "@")  # ... and one holding an @
        self.upper_aws = _random("UA")  # upper-case AWS_SECRET_ACCESS_KEY
        self.authorization = _random("AZ")  # an Authorization header
        self.passphrase = _random("pp")  # a key file's passphrase
        self.pasted = "K" + _long("")[:39]  # a key pasted where management_key_env's NAME goes
        self.api_key = _random("ak")
        self.hf_token = _random("hf")

    def all(self) -> dict[str, str]:
        return dict(vars(self))

    def leaked(self, text: str, names: list[str] | None = None) -> list[str]:
        return [n for n, v in self.all().items() if (names is None or n in names) and v in text]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Shapes:
    return Shapes()


@pytest.fixture(scope="module")
def shapes_config(shapes, tmp_path_factory) -> tuple[Path, str]:
    """A config holding every shape, and every output of ``config check`` on it."""
    tmp = tmp_path_factory.mktemp("shapes")
    cfg = _write(tmp / "shapes.yaml", {
        "management_key_env": shapes.pasted,
        "tiers": [{"backend": "local_cpu"},
                  {"backend": "resp", "name": "quoted", "options": {
                      "url": f"redis://kv:{shapes.quote_pw}@127.0.0.1:1/0"}},
                  {"backend": "resp", "name": "at", "options": {
                      "url": f"redis://:{shapes.at_pw}@127.0.0.1:1/0"}},
                  {"backend": "fsspec", "name": "bucket", "options": {
                      "url": "memory://shapes/x", "storage_options": {
                          "AWS_SECRET_ACCESS_KEY": shapes.upper_aws,
                          "passphrase": shapes.passphrase,
                          "client_kwargs": {"headers": {
                              "Authorization": f"Bearer {shapes.authorization}"}}}}}]})
    text, runs = _check_outputs(Secrets(), cfg)
    return cfg, text + "\n" + json.dumps([r.returncode for r in runs])


def test_shape_valkey_password_holding_a_quote_or_an_at(shapes, shapes_config, caplog):
    cfg, checked = shapes_config
    names = ["quote_pw", "at_pw"]
    assert shapes.leaked(cfg.read_text(), names) == names  # the negative control
    assert not (leaked := shapes.leaked(checked, names)), leaked
    from kvplug.storage_manager import StorageManager
    from kvplug.testing import make_key

    caplog.set_level(logging.DEBUG, logger="kvplug")
    for pw in (shapes.quote_pw, shapes.at_pw):
        url = f"redis://kv:{pw}@127.0.0.1:1/0"
        shown = [scrub(url), Redactor({"url": url})(f"cannot reach {url!r}"),
                 json.dumps(redact_data({"url": url}))]
        with StorageManager({"tiers": [{"backend": "resp", "options": {
                "url": url, "timeout_s": 0.3}}]}) as sm:
            sm.lookup_prefix([make_key(1)])
            shown.append(json.dumps(sm.stats(), default=str))
        shown.append(caplog.text)
        assert not (leaked := shapes.leaked("\n".join(shown), names)), leaked


def test_shape_upper_case_secret_names_in_storage_options(shapes, shapes_config):
    cfg, checked = shapes_config
    names = ["upper_aws", "authorization", "passphrase"]
    assert shapes.leaked(cfg.read_text(), names) == names
    assert not (leaked := shapes.leaked(checked, names)), leaked
    options = {"AWS_SECRET_ACCESS_KEY": shapes.upper_aws, "Passphrase": shapes.passphrase,
               "headers": {"Authorization": f"Bearer {shapes.authorization}"}}
    shown = json.dumps(redact_data(options)) + Redactor(options)(json.dumps(options))
    assert not (leaked := shapes.leaked(shown, names)), leaked


def test_shape_a_key_pasted_into_management_key_env(shapes, shapes_config):
    cfg, checked = shapes_config
    assert shapes.leaked(cfg.read_text(), ["pasted"]) == ["pasted"]
    assert not shapes.leaked(checked, ["pasted"]), "config check printed the pasted key"
    from argparse import Namespace

    from kvplug.connector.api import api_keys
    from kvplug.connector.protocol.config import ConnectorConfig

    with pytest.raises(RuntimeError) as err:
        api_keys(Namespace(api_key=None), ConnectorConfig(management_key_env=shapes.pasted), {})
    assert "management_key_env" in str(err.value)
    assert not shapes.leaked(str(err.value), ["pasted"]), "the API's start-up error printed it"
    with pytest.raises(RuntimeError) as err:  # the control: a real name is still named
        api_keys(Namespace(api_key=None), ConnectorConfig(management_key_env="KV_MGMT_KEY"), {})
    assert "KV_MGMT_KEY" in str(err.value)


def test_shape_abbreviated_secret_flags_in_print_command(shapes, tmp_path):
    cfg = _write(tmp_path / "k.yaml", {"tiers": [{"backend": "local_cpu"}]})
    out = _cli("serve", "m", "--kvplug-config", str(cfg), "--port", "1", "--api-k",
               shapes.api_key, f"--hf-tok={shapes.hf_token}", "--print-command")
    assert out.returncode == 0, out.stderr
    assert not (leaked := shapes.leaked(out.stdout + out.stderr)), leaked
    argv = shlex.split(out.stdout)
    assert argv[argv.index("--api-k") + 1] == "***" and argv[argv.index("--hf-tok") + 1] == "***"
    assert redact_argv(["--api_key", "x", "--hf_tok", "y", "--port", "1"]) == [
        "--api_key", "***", "--hf_tok", "***", "--port", "1"]


def test_shape_bench_preflight_error(shapes):
    url = f"redis://kv:{shapes.quote_pw}{shapes.at_pw}@127.0.0.1:1/0"
    out = _cli("bench", "--backend", "resp", "--options",
               json.dumps({"url": url, "timeout_s": 0.3}), "--seconds", "0.05")
    assert out.returncode == 1 and "did not keep a test value" in out.stderr, out.stderr
    assert "127.0.0.1:1" in out.stderr  # where it looked is still said
    assert not (leaked := shapes.leaked(out.stdout + out.stderr, ["quote_pw", "at_pw"])), leaked


def test_shape_repr_of_config_objects(shapes):
    from kvplug.backends.fsspec import FsspecBackend
    from kvplug.config import TierConfig, load_config

    options = {"url": f"s3://b/p?token={shapes.hf_token}",
               "storage_options": {"AWS_SECRET_ACCESS_KEY": shapes.upper_aws,
                                   "key": shapes.api_key}}
    tier = {"backend": "fsspec", "options": options}
    shown = [repr(load_config({"tiers": [tier]})), repr(TierConfig(**tier)),
             repr(FsspecBackend.Options(**options)),
             repr(load_config({"tiers": [{"backend": "resp", "options": {
                 "url": f"redis://:{shapes.quote_pw}@h:1/0"}}]}))]
    assert "AWS_SECRET_ACCESS_KEY" in shown[0]  # the names are still shown
    assert not (leaked := shapes.leaked("\n".join(shown))), leaked
