"""A disaggregated-prefill proxy for two `kvplug serve` engines: each request goes to the prefill
engine (``kv_role: kv_producer``) with ``max_tokens=1``, then at once to the decode engine
(``kv_consumer``) with the ``kv_transfer_params`` the prefill answered (kvplug's hand-off: what
the producer stores; the decode engine waits for it in the background, then loads it), and the
decode engine's answer (streamed or not) goes back to the client. As vLLM's own P/D proxy
examples do; those work with kvplug unchanged.

    python scripts/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        [--host 127.0.0.1] [--port 8000]

Routes (FastAPI reads their annotations at run time: no ``from __future__ import annotations``
here): ``POST /v1/completions``, ``POST /v1/chat/completions`` (the client's
``Authorization`` header is passed on to both engines), ``GET /v1/models`` and ``GET /health``
(the decode engine's). Needs fastapi, uvicorn and httpx (vLLM's own dependencies).
"""

import argparse
import copy
from collections.abc import AsyncIterator
from typing import Any

#: what the prefill request asks for: one token, no stream, and that its KV is handed on
PREFILL_ONLY = {"max_tokens": 1, "stream": False}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill engine's request: the client's, for one token, not streamed; the client's
    own ``kv_transfer_params`` kept, ``do_remote_decode`` added (the ``cache_salt``, a
    request's tenant, is part of the body: both engines get it)."""
    out = copy.deepcopy(body)
    out.update(PREFILL_ONLY)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    out["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}),
                                 "do_remote_decode": True}
    return out


def decode_body(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any]:
    """The decode engine's request: the client's, with the ``kv_transfer_params`` the prefill
    engine answered (kvplug's hand-off) over the client's own."""
    out = copy.deepcopy(body)
    handed = prefill_answer.get("kv_transfer_params") or {}
    if handed or body.get("kv_transfer_params"):
        out["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}), **handed}
    return out


def build_app(prefill: str, decode: str, timeout_s: float = 600.0) -> Any:
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="kvplug P/D proxy")
    client = httpx.AsyncClient(timeout=timeout_s)

    def headers(request: Request) -> dict[str, str]:
        auth = request.headers.get("authorization")
        return {"Authorization": auth} if auth else {}

    async def relay(request: Request, path: str) -> Response:
        body = await request.json()
        pre = await client.post(prefill + path, json=prefill_body(body), headers=headers(request))
        if pre.status_code != 200:
            return Response(pre.content, pre.status_code, media_type="application/json")
        dec_body = decode_body(body, pre.json())
        if not body.get("stream"):
            dec = await client.post(decode + path, json=dec_body, headers=headers(request))
            return Response(dec.content, dec.status_code, media_type="application/json")
        req = client.build_request("POST", decode + path, json=dec_body, headers=headers(request))
        dec = await client.send(req, stream=True)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for part in dec.aiter_raw():
                    yield part
            finally:
                await dec.aclose()

        return StreamingResponse(chunks(), status_code=dec.status_code,
                                 media_type=dec.headers.get("content-type", "text/event-stream"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await relay(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await relay(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        r = await client.get(decode + "/v1/models", headers=headers(request))
        return Response(r.content, r.status_code, media_type="application/json")

    async def healthy(url: str) -> bool:
        try:
            return (await client.get(url + "/health")).status_code == 200
        except httpx.HTTPError:
            return False

    @app.get("/health")
    async def health() -> Response:
        ok = [await healthy(u) for u in (prefill, decode)]
        return JSONResponse({"prefill": ok[0], "decode": ok[1]}, 200 if all(ok) else 503)

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", required=True, help="the prefill engine's URL (kv_producer)")
    ap.add_argument("--decode", required=True, help="the decode engine's URL (kv_consumer)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    import uvicorn

    uvicorn.run(build_app(args.prefill.rstrip("/"), args.decode.rstrip("/")), host=args.host,
                port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
