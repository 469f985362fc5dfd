"""The ``kvplug`` command line: a sub-package of its own, so the core never imports click or rich.

:mod:`.main` holds the click group and the small commands (``backends``, ``new-backend``,
``demo``); :mod:`.config` is ``config check``, :mod:`.inspect` is ``inspect``, :mod:`.serve` is
``serve``, :mod:`.common` the consoles and helpers they share. The console script is ``kvplug = "kvplug.cli:main"``.
"""

from .main import main

__all__ = ["main"]
