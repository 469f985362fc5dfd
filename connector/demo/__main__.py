"""``python -m kvplug.connector.demo``: run the demo (see :mod:`kvplug.connector.demo.run`)."""

from .run import main

if __name__ == "__main__":
    raise SystemExit(main())
