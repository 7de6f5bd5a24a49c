"""Prometheus: the metric registry, which imports nothing of the app, and the collector,
which reads the engine's view and the server's counts at scrape time."""
