"""Check kvplug's connector against a vLLM source tree's connector base classes.

    python scripts/check_vllm_api.py PATH

PATH holds ``vllm/`` (an unpacked wheel: ``pip download --no-deps vllm==0.33.0`` then unzip, or
a source checkout). The tree is read, never imported (it may need another torch or a GPU); the
installed kvplug (with its installed vLLM) supplies ``KVPlugConnector``. Exit status 1 when an
abstract method is not implemented or an override cannot be called as that vLLM calls it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    from kvplug.connector import KVPlugConnector
    from kvplug.connector.compat import BASE_FILE, api_problems, tree_api, vllm_version

    root = Path(argv[0])
    api = tree_api(root)
    version = "?"
    init = root / "vllm" / "_version.py"
    if init.is_file() and (m := re.search(r"version = ['\"]([^'\"]+)", init.read_text())):
        version = m.group(1)
    problems, notes = api_problems(KVPlugConnector, api)
    n = sum(len(m) for m in api.values())
    abstract = sorted(f"{b}.{k}" for b, m in api.items() for k, s in m.items() if s.abstract)
    print(f"vLLM tree {root} (version {version}): {BASE_FILE}")
    print(f"KVPlugConnector from the installed kvplug (installed vLLM {vllm_version()})")
    print(f"{n} methods in {', '.join(api)}; abstract: {', '.join(abstract)}")
    for note in notes:
        print(f"note: {note}")
    for p in problems:
        print(f"PROBLEM: {p}")
    print("OK: every abstract method implemented, every override compatible" if not problems
          else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
