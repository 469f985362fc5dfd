"""What the tests and the benchmarks share, never a test itself: real servers (redis, moto's S3,
Mooncake), engine and process helpers, harnesses, fault children and test-only tiers. Import as
``tests.support.NAME`` from the repository root (pytest puts it on ``sys.path``; the benchmarks run
as ``python -m benchmarks.NAME``)."""
