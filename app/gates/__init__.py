"""The HTTP gates in front of the model: Host and Origin checks, per-client rate limits,
body-size limits, and the admin token and dashboard sessions that admin calls need."""
