"""Guards in front of the model: request size limits (and later rate limits, host checks)."""
