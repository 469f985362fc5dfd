"""How far a lossy hit's generation is from the exact one: greedy-token agreement and mean
|Δlogprob| (used by tests/engine/test_codecs_engine.py and benchmarks/bench_codecs.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def agreement(ref: Sequence[dict[str, Any]], out: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Over pairs of generations (``generate_full`` dicts) of the same prompts:

    * ``agreement``: generated tokens equal to the reference's before the first divergence,
      as a fraction of all generated tokens (greedy: after a divergence the contexts differ);
    * ``mean_abs_dlogprob``: mean |logprob - reference logprob| of the chosen tokens over those
      agreeing positions (the drift before any token flips);
    * ``first_token_agreement``: prompts whose first generated token matches.
    """
    same = total = first = 0
    dl: list[float] = []
    for r, o in zip(ref, out, strict=True):
        total += len(r["tokens"])
        first += int(r["tokens"][:1] == o["tokens"][:1])
        for tr, to, lr, lo in zip(r["tokens"], o["tokens"], r["logprobs"], o["logprobs"]):
            if tr != to:
                break
            same += 1
            dl.append(abs(lr - lo))
    return {"agreement": same / total if total else 0.0,
            "mean_abs_dlogprob": sum(dl) / len(dl) if dl else float("nan"),
            "first_token_agreement": first / len(ref) if ref else 0.0,
            "prompts": len(ref), "tokens": total}
