"""``kvplug warm --model``: an engine in this process, for warming tiers without a server.

It starts ``vllm.LLM`` on the model with kvplug's connector (the same ``kv_transfer_config`` as
``kvplug serve``: :func:`kvplug.cli.serve.transfer_config`) and answers the two questions
``kvplug warm`` asks of an engine: the lookup (the management API's own code,
:class:`.api.Engine`, over the workers' management sockets: what ``/kvplug/v1/lookup`` answers)
and a prefill-only request (``max_tokens=1``, the prompt's ``cache_salt`` kept).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class LocalEngine:
    """A vLLM engine in this process with kvplug's tiers; ``engine_args`` go to ``vllm.LLM``."""

    def __init__(self, model: str, kvplug_config: Path | None, engine_args: dict[str, Any]
                 ) -> None:
        from kvplug.cli.serve import transfer_config
        from vllm import LLM
        from vllm.config import KVTransferConfig

        from .api import Engine
        from .protocol.config import load_connector_config

        args: dict[str, Any] = {"enable_prefix_caching": False, "disable_log_stats": True,
                                **engine_args}
        self.llm = LLM(model=model, kv_transfer_config=KVTransferConfig(
            **transfer_config(kvplug_config)), **args)
        vllm_config = self.llm.llm_engine.vllm_config
        config = load_connector_config(
            dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {}))
        self.engine = Engine(vllm_config, self.llm.get_tokenizer(), config)

    def lookup(self, p: dict[str, Any]) -> dict[str, Any]:
        """What ``/kvplug/v1/lookup`` answers for ``{"prompt", "cache_salt"?}``."""
        ids = list(self.engine.tokenizer.encode(p["prompt"]))
        return self.engine.lookup(ids, p.get("cache_salt")).model_dump()

    def prefill(self, p: dict[str, Any]) -> None:
        """One prefill-only request of the prompt (its KV stored in every tier)."""
        from vllm import SamplingParams

        prompt: dict[str, Any] = {"prompt": p["prompt"]}
        if p.get("cache_salt"):
            prompt["cache_salt"] = p["cache_salt"]
        self.llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0),
                          use_tqdm=False)
