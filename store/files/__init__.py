"""The file aggregate: file queries and the chunked storage of file bytes."""
