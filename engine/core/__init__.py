"""The engine's core loop, no torch: sequences, the scheduler, the KV block pool and its manager, swap-space bookkeeping, step counters."""
