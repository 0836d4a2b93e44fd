"""The OpenAI Batch API (files, batches, the runner), its state kept in Redis."""
