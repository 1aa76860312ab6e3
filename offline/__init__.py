"""`tokenloom run`: a JSONL file through one engine, and its ledger of finished lines."""
