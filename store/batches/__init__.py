"""The batch aggregate: batch queries and finalization (output and error files)."""
