"""Benchmarks: vramguard against a naive server and the offline limit, in one run."""
