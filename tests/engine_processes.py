"""Fresh engine processes without paying for ``import vllm`` each time.

Every engine scenario in the suite runs in a process of its own (a fresh engine, a restart that
reads what another process stored). A new interpreter spends ~6.5 s of a 2-core machine importing
torch and vLLM before the engine even starts. Here the processes come from multiprocessing's
*forkserver*, whose server imports torch, vLLM and kvplug once per test session
(``set_forkserver_preload``); each scenario is a fork of that server: a real, separate process,
with its own environment, working directory and output files, that exits like an interpreter
(``atexit`` handlers run, so engines shut down as after ``python -c``).

vLLM's own child processes (engine core, TP/PP workers) are still started by vLLM with ``spawn``,
exactly as in production. ``KVPLUG_TEST_FRESH_INTERPRETER=1`` falls back to ``python -c`` (to
rule the fork out when a test behaves differently).
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

_PRELOAD = ["torch", "vllm", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "kvplug",
            "kvplug.connector"]
_context: multiprocessing.context.BaseContext | None = None


@dataclass
class Finished:
    """What ``subprocess.run`` would report: exit status and the two streams."""

    returncode: int
    stdout: str
    stderr: str


class StillRunning(Exception):
    """The process outlived its timeout and was killed; ``stdout``/``stderr`` hold its output."""

    def __init__(self, timeout: float, stdout: str, stderr: str) -> None:
        super().__init__(f"still running after {timeout} s (killed)")
        self.timeout, self.stdout, self.stderr = timeout, stdout, stderr


def run_python(code: str, env: dict[str, str], cwd: str, timeout: float) -> Finished:
    """Run ``code`` as a fresh Python process would (``python -c code``) with ``env`` as its
    whole environment and ``cwd`` as its directory; raise ``StillRunning`` after ``timeout``."""
    if os.environ.get("KVPLUG_TEST_FRESH_INTERPRETER") == "1":
        return _run_interpreter(code, env, cwd, timeout)
    with tempfile.TemporaryDirectory(prefix="kvplug-engine-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = _forkserver().Process(target=_child, args=(code, env, cwd, out, err))
        proc.start()
        proc.join(timeout)
        killed = proc.exitcode is None
        if killed:
            proc.kill()
            proc.join()
        result = Finished(proc.exitcode, _read(out), _read(err))
        proc.close()
    if killed:
        raise StillRunning(timeout, result.stdout, result.stderr)
    return result


def _forkserver() -> multiprocessing.context.BaseContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _child(code: str, env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In the forked process: become ``python -c code`` in ``env`` and ``cwd``."""
    os.environ.clear()
    os.environ.update(env)
    for path in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "<string>", "exec"), namespace)
    finally:  # an interpreter's exit: drop the script's objects, then the atexit handlers
        namespace.clear()
        gc.collect()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


def _run_interpreter(code: str, env: dict[str, str], cwd: str, timeout: float) -> Finished:
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired as exc:
        raise StillRunning(timeout, _text(exc.stdout), _text(exc.stderr)) from exc
    return Finished(proc.returncode, proc.stdout, proc.stderr)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except FileNotFoundError:
        return ""


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else b or ""
