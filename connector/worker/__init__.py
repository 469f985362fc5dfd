"""The worker side of the connector (one per vLLM worker process): the tiers, the lookup pins and
every transfer between the paged KV cache and the tiers (``side``: ``WorkerSide``)."""
