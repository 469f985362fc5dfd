"""The fuzz campaign on stored bytes, short run: every target of
:mod:`stored_bytes_fuzz` (chunk-file header, codec frames, the posix, fsspec and value tiers'
reads, the resp reply parser; headers built to cost a parser; posix pins files) fed mutated and
hostile inputs by hypothesis, derandomized (the same examples every run) and bounded. No
exception escapes, nothing is imported, no read makes a tensor past the engine's geometry or
reads a header past its bound, and nothing but the valid chunk (the sealed pins) is accepted.

The long campaign (more examples, counts printed): ``python -m benchmarks.fuzz_stored_bytes``.
"""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.support.stored_bytes_fuzz import TARGETS, Campaign  # noqa: E402

EXAMPLES = {"header": 120, "frame": 60, "posix": 40, "fsspec": 40, "value": 60, "resp": 80,
            "bounds": 40, "pins": 64}
OPS = st.lists(st.integers(0, 6), min_size=1, max_size=3)


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    c = Campaign(tmp_path_factory.mktemp("fuzz"))
    yield c
    c.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", TARGETS)
def test_stored_bytes_fuzz(campaign, target):
    @settings(max_examples=EXAMPLES[target], derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**32 - 1), encoded=st.booleans(), ops=OPS)
    def example(seed, encoded, ops):
        campaign.run(target, seed, encoded, ops)

    example()
    c = campaign.counts
    assert c.runs[target] >= EXAMPLES[target]
    assert c.misses[target] > 0, f"{target}: no mutation was ever a miss ({c})"
