"""What goes wrong on purpose, no vLLM engine: crashes, full disks, corruption, fuzzed and hostile
bytes, attackers, servers that die (marker ``faults``; tests/README.md)."""
