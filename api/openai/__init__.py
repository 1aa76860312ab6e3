"""The OpenAI-compatible endpoints: chat + completions (routes.py) and tokenize/detokenize
(tokenizer.py), their request schemas, SSE chunks and the relay of a job's Redis Stream."""
