"""The REST API: jobs and OpenAI-compatible completions over the job queue (FastAPI).

Thin edges: routes validate and translate, rows go to Postgres and messages to Redis through
`worker/`, and live tokens come back from each job's Redis Stream. The API never loads weights;
it loads the tokenizer only, to refuse prompts that cannot run before they are queued.
"""
