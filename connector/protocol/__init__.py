"""What the scheduler side and the workers agree on: the config both read (``config``), the messages
between them (each step's metadata and the workers' reports, ``metadata``; the lookup and
management sockets, ``lookup`` and ``manage``), what names a chunk (``identity``, and the KV cache
groups' parts of it, ``groups``) and the counters both report (``stats``).

Nothing here moves a byte or decides what to load or store: that is :mod:`..scheduler` (decides)
and :mod:`..worker` (moves).
"""
