"""kvplug: pluggable KV-cache storage tiers for vLLM."""
