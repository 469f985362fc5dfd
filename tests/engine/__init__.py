"""Tests that start a real vLLM engine or server (marker ``engine``; run them under the engine
lock; tests/README.md)."""
