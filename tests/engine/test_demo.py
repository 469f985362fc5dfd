"""The demo's model builder (a locally trained tokenizer, deterministic) and the demo's screen."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from kvplug.connector.demo import tokenizer


def test_tokenizer_is_deterministic_and_covers_the_vocab():
    a, b = tokenizer.train(4096), tokenizer.train(4096)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 4096
    assert [a.token_to_id(t) for t in tokenizer.SPECIAL] == [0, 1, 2]
    text = next(tokenizer.sentences(3, 1)) + " Any text, even ünïcode."
    assert a.decode(a.encode(text).ids) == text
    big = tokenizer.train(12000)  # more ids than the corpus fills: padded with unused tokens
    assert big.get_vocab_size() == 12000 and big.id_to_token(11999).startswith("<unused")


def test_make_model_writes_the_tokenizer_and_adds_it_to_an_old_model(tmp_path):
    from kvplug.connector.demo.model import make_model

    out = make_model("tiny", weights=False, root=tmp_path)
    conf = json.loads((out / "tokenizer_config.json").read_text())
    assert conf["eos_token"] == "</s>" and "chat_template" in conf
    first = (out / "tokenizer.json").read_bytes()
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a model built before tokenizers
        (out / name).unlink()
    assert make_model("tiny", weights=False, root=tmp_path) == out
    assert (out / "tokenizer.json").read_bytes() == first
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "tokenizer.json",
                                                     "tokenizer_config.json"]  # no temp left


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_demo_shows_tables_and_keeps_vllm_logs_in_a_file(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLUG_")}
    env.update(KVPLUG_CACHE_DIR=str(tmp_path), VLLM_CPU_KVCACHE_SPACE="1", COLUMNS="200")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the user's default layout, not the tests'

    out = subprocess.run([sys.executable, "-m", "kvplug.connector.demo", "--model", "tiny",
                          "--prompts", "1", "--shared", "300", "--unique", "300"],
                         capture_output=True, text=True, env=env, timeout=800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    log = tmp_path / "demo-vllm.log"
    assert f"vLLM's logs: {log}" in out.stdout
    assert "INFO" not in out.stdout + out.stderr and "Traceback" not in out.stdout + out.stderr
    assert "Initializing a V1 LLM engine" in log.read_text()
    assert "Traceback" not in log.read_text()
    rows = [[c.strip() for c in ln.split("│")] for ln in out.stdout.splitlines() if "│" in ln]
    tiers = {r[1]: r for r in rows if r[1] in ("local_cpu", "posix")}
    assert len(tiers) == 2  # one line per tier
    chunks = list((tmp_path / "chunks").rglob("*.safetensors"))
    assert tiers["posix"][3] == str(len(chunks)) != "0"  # chunks it holds: what is on disk
    assert tiers["posix"][6] == str(tmp_path / "chunks")  # the disk cache's path
