"""``python -m kvplug.cli``: the same as the ``kvplug`` console script."""

from .main import main

if __name__ == "__main__":  # pragma: no cover - run by `python -m kvplug.cli`
    main()
