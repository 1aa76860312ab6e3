"""Prompts in: text or chat messages to token ids, and the fit of a request in max_model_len."""
