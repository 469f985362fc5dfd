"""``kvplug warm``'s choice of engine, without one: --url or --model, and the in-process
options refused where they cannot apply (each with a message that says what to give)."""

from __future__ import annotations

import json

from click.testing import CliRunner
from kvplug.cli.warm import parse_engine_args, warm_cmd


def prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hello"}) + "\n")
    return str(f)


def test_warm_needs_a_url_or_a_model(tmp_path):
    out = CliRunner().invoke(warm_cmd, ["--prompts", prompts(tmp_path)])
    assert out.exit_code != 0 and "--url" in out.output and "--model" in out.output


def test_in_process_options_are_refused_with_a_url(tmp_path):
    cfg = tmp_path / "k.yaml"
    cfg.write_text("chunk_size: 256\n")
    out = CliRunner().invoke(warm_cmd, ["--url", "http://127.0.0.1:9", "--prompts",
                                        prompts(tmp_path), "--kvplug-config", str(cfg)])
    said = " ".join(out.output.split())  # the console wraps to the terminal's width
    assert out.exit_code != 0 and "--model without --url" in said


def test_engine_args_are_yaml_values_and_a_bad_pair_is_named(tmp_path):
    assert parse_engine_args(("max_model_len=4096", "enforce_eager=true", "dtype=bfloat16",
                              "max-num-seqs=4")) == {
        "max_model_len": 4096, "enforce_eager": True, "dtype": "bfloat16", "max_num_seqs": 4}
    out = CliRunner().invoke(warm_cmd, ["--model", "m", "--prompts", prompts(tmp_path),
                                        "--engine-arg", "no-equals-sign"])
    assert out.exit_code != 0 and "'no-equals-sign'" in out.output and "KEY=VALUE" in out.output
