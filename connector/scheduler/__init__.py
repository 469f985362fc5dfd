"""The scheduler side of the connector (vLLM's engine-core process): which tokens of each request
are loaded and stored, sent to the workers in each step's metadata (``side``: ``SchedulerSide``).
It never touches a tier or a block."""
