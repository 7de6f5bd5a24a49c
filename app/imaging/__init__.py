"""Images on the CPU: the CPU pool, the result cache, the decode processes, structure
checks, decoding and pixels. Nothing here may import torch at package level: the decode
workers import this package."""
