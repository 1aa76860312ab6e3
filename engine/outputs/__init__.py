"""Results out: request outputs, incremental detokenization and stop checks, logprob tokens."""
