"""The `tokenloom` command line: the composition root, the one place that wires engine, store, worker and API."""
