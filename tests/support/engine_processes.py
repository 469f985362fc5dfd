"""Fresh Python processes without paying for ``import torch, vllm`` each time.

Every engine scenario in the suite runs in a process of its own (a fresh engine, a restart that
reads what another process stored); CLI commands (:func:`run_console_script`) and the crash
campaign's storing children (:func:`start_python`) are processes of their own too. A new
interpreter spends ~6.5 s of a 2-core machine importing torch and vLLM before the engine even
starts (~2 s for torch alone before a CLI command). Here the processes come from
multiprocessing's *forkserver*, whose server imports torch, vLLM and kvplug once per test session
(``set_forkserver_preload``); each process is a fork of that server: a real, separate process,
with its own environment, working directory and output files, that exits like an interpreter
(``atexit`` handlers run, so engines shut down as after ``python -c``).

vLLM's own child processes (engine core, TP/PP workers) are still started by vLLM with ``spawn``,
exactly as in production. ``KVPLUG_TEST_FRESH_INTERPRETER=1`` falls back to ``python -c`` (to
rule the fork out when a test behaves differently). What depends on a fresh interpreter's own
imports (a module made unimportable through ``PYTHONPATH``; the installed console script itself)
keeps ``subprocess``.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import select
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

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


def run_console_script(args: list[str], env: dict[str, str], cwd: str | os.PathLike[str] | None,
                       timeout: float, script: str = "kvplug") -> Finished:
    """Run the console script ``script`` (``kvplug``: ``kvplug.cli:main``) with ``args`` as the
    installed script does (``sys.argv[0]`` its path, ``sys.exit(main())``); ``subprocess.run``'s
    ``TimeoutExpired`` after ``timeout``, like the ``subprocess.run`` it stands in for. The CLI
    itself is imported in the process (not preloaded): its consoles read ``COLUMNS`` then."""
    path = str(Path(sys.executable).with_name(script))
    code = ("import sys; from kvplug.cli import main; "
            f"sys.argv = {[path, *args]!r}; sys.exit(main())")
    try:
        return run_python(code, env, str(cwd or os.getcwd()), timeout)
    except StillRunning as exc:
        raise subprocess.TimeoutExpired([path, *args], timeout, exc.stdout, exc.stderr) from exc


class Started:
    """A process from :func:`start_python`, used as a ``subprocess.Popen`` with
    ``stdout=PIPE`` is: ``stdout`` (binary, unbuffered), ``pid``, ``send_signal``, ``kill``,
    ``wait``, ``communicate``."""

    def __init__(self, proc: multiprocessing.process.BaseProcess, stdout_fd: int) -> None:
        self._proc = proc
        self.pid = proc.pid
        self.stdout = os.fdopen(stdout_fd, "rb", buffering=0)
        self.returncode: int | None = None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self._proc.kill()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._proc.join(timeout)
            if self._proc.exitcode is None:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            self.returncode = self._proc.exitcode
            self._proc.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[bytes, None]:
        """The rest of stdout until the process closes it, then its exit status."""
        end = None if timeout is None else time.monotonic() + timeout
        parts = []
        fd = self.stdout.fileno()
        while True:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            data = os.read(fd, 1 << 16)
            if not data:
                break
            parts.append(data)
        self.wait(None if end is None else max(0.0, end - time.monotonic()))
        self.stdout.close()
        return b"".join(parts), None


def start_python(code: str, env: dict[str, str], cwd: str) -> Started | subprocess.Popen:
    """Start ``code`` as ``subprocess.Popen([python, "-c", code], stdout=PIPE)`` would, from the
    forkserver (stderr is this process's)."""
    if os.environ.get("KVPLUG_TEST_FRESH_INTERPRETER") == "1":
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env,
                                cwd=cwd)
    r, w = os.pipe()
    write_end = Connection(w)  # pickled as a descriptor that the forkserver hands to the child
    try:
        proc = _forkserver().Process(target=_piped_child, args=(code, env, cwd, write_end))
        proc.start()
    except BaseException:
        os.close(r)
        raise
    finally:
        write_end.close()  # the child holds the only write end: its exit is EOF here
    return Started(proc, r)


def _piped_child(code: str, env: dict[str, str], cwd: str, out: Connection) -> None:
    os.dup2(out.fileno(), 1)
    out.close()
    _child(code, env, cwd, None, None)


def _forkserver() -> multiprocessing.context.BaseContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _child(code: str, env: dict[str, str], cwd: str, out: str | None, err: str | None) -> None:
    """In the forked process: become ``python -c code`` in ``env`` and ``cwd`` (its stdout and
    stderr to the files ``out`` and ``err``; None: left as they are)."""
    os.environ.clear()
    os.environ.update(env)
    for path in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        if path is None:
            continue
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
