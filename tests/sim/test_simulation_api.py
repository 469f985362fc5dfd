"""The simulation for a third party's backend (``kvplug simulate``, ``kvplug.testing``): a
backend generated from the template passes it; the same backend made to answer with another
key's chunk fails it, with a replay command that reproduces the failure."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("cookiecutter")

from cookiecutter.main import cookiecutter  # noqa: E402
from kvplug.cli.main import template_dir  # noqa: E402

SEEDS = 4

BROKEN = '''
from kvplug_simstore.backend import SimstoreBackend


class Broken(SimstoreBackend):
    """Answers a key it holds with the oldest chunk it holds (a store that mixes up names)."""

    def _verified(self, key):
        entry = super()._verified(key)
        return entry if entry is None else next(iter(self._entries.values()))
'''


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("tpl")
    pkg = Path(cookiecutter(str(template_dir()), no_input=True, output_dir=str(out),
                            extra_context={"backend_name": "simstore"}, default_config=True))
    (pkg / "src" / "broken_simstore.py").write_text(BROKEN)
    sys.path.insert(0, str(pkg / "src"))
    yield pkg
    sys.path.remove(str(pkg / "src"))


def test_a_generated_backend_passes_and_a_broken_one_fails_with_a_replay(generated, capsys):
    from kvplug.connector.sim.__main__ import main
    from kvplug.testing import simulate

    good = simulate("kvplug_simstore.backend:SimstoreBackend", {"capacity": "64MiB"}, SEEDS)
    assert good.schedules == SEEDS and good.events > 20 * SEEDS
    assert good.ok, good.failures
    assert good.counts["tier objects checked"] > 0  # the tier's answers reached the oracle

    bad = simulate("broken_simstore:Broken", {"capacity": "64MiB"}, SEEDS)
    assert bad.failures, "a backend answering with another key's chunk passed the simulation"
    seed, what = bad.failures[0]
    assert what.startswith("I1"), what
    capsys.readouterr()
    rc = main(["--backend", "broken_simstore:Broken", "--options", '{"capacity": "64MiB"}',
               "--seeds", "1", "--start", str(seed)])
    out = capsys.readouterr().out
    assert rc == 1 and f"seed {seed}: I1" in out, out
    line = next(ln for ln in out.splitlines() if "replay:" in ln).split("replay: ", 1)[1]
    assert line.startswith("kvplug simulate --backend broken_simstore:Broken --options ")
    args = __import__("shlex").split(line)[2:]
    assert main(args) == 1  # the printed command replays the failure
    assert f"seed {seed}: I1" in capsys.readouterr().out


@pytest.mark.parametrize("lower", ["posix", "values"])
def test_tiers_start_no_thread_of_their_own_under_the_simulation(lower, monkeypatch):
    """Every thread, pool and wait of posix (writers, start-up scan, reaper), of the value
    tiers (writers) and of L1's pool (its prefault ticker) comes from ``TierContext.runtime``:
    under the simulation none is real, so the simulation orders all of their work (a seed
    replays). Every thread started is recorded, short-lived ones too."""
    import threading

    from kvplug.connector.sim.engine import SimConfig
    from kvplug.connector.sim.world import World

    started: list[str] = []
    real_start = threading.Thread.start

    def start(self):
        started.append(self.name)
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    w = World(SimConfig(hybrid=False, lower=lower, codec="lossless"))
    try:
        for rank in range(2):
            w.arrive(tuple(range(100, 124)), (rank,), 1)
        for _ in range(4):
            w.step()
        w.quiesce()
        assert not [n for n in started if n.startswith("kvplug")], started
        assert w.runtime.ran > 0 and w.counts["saves"] > 0
        st = w.workers[0].storage.stats()
        written = st["values"]["written"] if lower == "values" else st["posix"]["writes"]
        assert written > 0, st  # the tier's writers ran (as simulation tasks)
    finally:
        w.close()
