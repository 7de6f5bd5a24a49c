"""The GPU check: one run on a lent GPU that answers every open question about vramguard's
CUDA paths (``python -m bench.gpu_check``; ``__main__`` says how to run it).

``plan`` is the table of steps and the run's sizes; ``runner`` wraps, times and limits
each step and rewrites the JSON before and after it; ``state`` is what the steps share;
one module per group of steps (``device``, ``memory``, ``speed``, ``oom``, ``server_path``,
and ``models`` with ``model_loads``, ``model_watch`` and ``load_oom``); ``prepare`` brings
the wheels the GPU machine lacks. Nothing imported here needs torch or the app, so the
imports step can say which one is missing.
"""
