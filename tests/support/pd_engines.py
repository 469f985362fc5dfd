"""A prefill engine and a decode engine for disaggregated-prefill tests, each a real vLLM engine in
its own process, asked one request at a time over a ZeroMQ socket, so a test can send the
decode request the moment the prefill's answer arrives (as a P/D proxy does) and kill an engine
between two requests.

:class:`EngineProcess` starts one (``engine_processes.run_python`` on a thread: a fork of the
suite's forkserver) and asks it (:meth:`EngineProcess.ask`); the process runs :func:`_serve`.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from tests.support.vllm_helpers import REPO, run_script

#: how long the test waits for an engine to start or answer (a hang, not a speed check)
WAIT_S = 600.0


def _generate(llm: Any, msg: dict[str, Any]) -> dict[str, Any]:
    """One greedy request: tokens, logprobs, the kv_transfer_params vLLM returned, seconds."""
    from vllm import SamplingParams, TokensPrompt

    params = msg.get("params")
    sp = SamplingParams(temperature=0.0, max_tokens=msg["max_tokens"], logprobs=0,
                        ignore_eos=True,
                        extra_args={"kv_transfer_params": params} if params else None)
    prompt = TokensPrompt(prompt_token_ids=msg["prompt"])
    if msg.get("cache_salt"):
        prompt["cache_salt"] = msg["cache_salt"]
    t0 = time.perf_counter()
    (o,) = llm.generate([prompt], sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    c = o.outputs[0]
    return {"tokens": list(c.token_ids),
            "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)],
            "params": o.kv_transfer_params, "seconds": seconds}


def _serve(spec: dict[str, Any]) -> dict[str, Any]:
    """The engine process: build the engine, then answer requests until told to stop."""
    import zmq

    from tests.support import vllm_helpers as h

    llm = h.make_llm(spec["model"], spec["kv"], **spec["engine"])
    sock = zmq.Context().socket(zmq.REP)
    sock.bind(spec["endpoint"])
    served = 0
    while True:
        msg = json.loads(sock.recv())
        if msg.get("stop"):
            sock.send(b"{}")
            return {"served": served}
        if msg.get("hello"):
            sock.send(json.dumps({"pid": os.getpid()}).encode())
            continue
        sock.send(json.dumps(_generate(llm, msg)).encode())
        served += 1


class EngineProcess:
    """One engine process (``kv``: its kv_transfer_config dict; ``engine``: more ``LLM``
    arguments), asked over an ``ipc://`` socket in ``workdir``."""

    def __init__(self, name: str, model: str, kv: dict[str, Any], engine: dict[str, Any],
                 workdir: Path) -> None:
        import zmq

        self.name = name
        endpoint = f"ipc://{workdir}/{name}-{uuid.uuid4().hex[:6]}.sock"
        spec = {"model": model, "kv": kv, "engine": engine, "endpoint": endpoint}
        code = (f"import json, sys; sys.path.insert(0, {str(REPO)!r}); "
                "from tests.support import vllm_helpers as h; "
                "from tests.support.pd_engines import _serve; "
                f"print(h.RESULT + json.dumps(_serve(json.loads({json.dumps(spec)!r}))), "
                "flush=True)")
        self.result: Any = None
        self._thread = threading.Thread(target=self._run, args=(code,), daemon=True)
        self._thread.start()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REQ)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self.pid = self._call({"hello": True})["pid"]
        self.killed = False

    def _run(self, code: str) -> None:
        try:
            self.result = run_script(code, timeout=WAIT_S * 3)
        except BaseException as exc:  # noqa: BLE001 - read by the test (a kill ends it so)
            self.result = exc

    def _call(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._sock.send(json.dumps(msg).encode())
        deadline = time.monotonic() + WAIT_S
        while not self._sock.poll(200):
            if not self._thread.is_alive():
                raise RuntimeError(f"engine {self.name} exited: {self.result}")
            assert time.monotonic() < deadline, f"engine {self.name} did not answer in {WAIT_S} s"
        return json.loads(self._sock.recv())

    def ask(self, prompt: list[int], max_tokens: int, params: dict[str, Any] | None = None,
            cache_salt: str | None = None) -> dict[str, Any]:
        return self._call({"prompt": prompt, "max_tokens": max_tokens, "params": params,
                           "cache_salt": cache_salt})

    def kill(self) -> None:
        """SIGKILL the engine (whatever its threads are storing)."""
        os.kill(self.pid, signal.SIGKILL)
        self.killed = True
        self._thread.join(WAIT_S)

    def close(self) -> Any:
        """Stop the engine (if alive); what its process returned."""
        if not self.killed and self._thread.is_alive():
            self._call({"stop": True})
        self._thread.join(WAIT_S)
        self._sock.close(0)
        self._ctx.term()
        return self.result
