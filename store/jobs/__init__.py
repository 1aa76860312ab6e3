"""The job aggregate: claims and results (job_store), queries, submit/cancel (job_service),
stats and trigger-kept aggregates, and the Redis Stream of a job's events."""
