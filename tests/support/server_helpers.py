"""Start, wait for and stop a real vLLM OpenAI server (``kvplug serve`` or plain vLLM) on 127.0.0.1.

Shared by the server tests: each server runs in its own process group (the server and its engine
processes), logs to a file, and is torn down with SIGTERM then SIGKILL.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STARTUP_DEADLINE_S = 600
#: vLLM server flags every test server shares: the tiny model, small, eager, prefix cache off (so
#: every cached token a request reports was loaded by kvplug).
TINY_SERVER_ARGS = ("--host", "127.0.0.1", "--no-enable-prefix-caching",
                    "--enable-prompt-tokens-details", "--enforce-eager", "--dtype", "bfloat16",
                    "--block-size", "128",
                    "--max-model-len", "4096", "--max-num-seqs", "4")


def kvplug_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvplug.cli", *args]


def vllm_server(model: str, *args: str) -> list[str]:
    """Plain vLLM's OpenAI server (no connector), the way ``kvplug serve`` starts it."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(base: Path) -> dict[str, str]:
    """The environment without the caller's KVPLUG_* settings (but the suite's tenant key: the
    server's tenant ids are the test's), with a small CPU KV cache."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVPLUG_") or k == "KVPLUG_TENANT_KEY_FILE"}
    env.update(KVPLUG_CACHE_DIR=str(base / "cache"), VLLM_CPU_KVCACHE_SPACE="1",
               TOKENIZERS_PARALLELISM="false",
               VLLM_ENABLE_V1_MULTIPROCESSING="1")  # a server's real layout (engine_env's is 0)
    return env


def wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)  # a start-up is seconds: a long poll only adds latency
    raise RuntimeError(f"no healthy server after {STARTUP_DEADLINE_S} s:\n{log.read_text()[-6000:]}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (the server and its engine processes), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    try:  # engine processes left behind in the group
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextmanager
def running_server(argv: list[str], base: Path, port: int) -> Iterator[tuple[str, Path]]:
    """Run ``argv`` (a server listening on ``port``); yield (base URL, log file) once healthy."""
    log = base / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=server_env(base),
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        yield url, log
    finally:
        stop(proc)
