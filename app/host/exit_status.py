"""The server's exit statuses that mean something to whoever started it (the tray, a
service manager): the one place they are written down.

A lost graphics card has a status of its own because a process cannot use the card
again once its CUDA context is broken (a driver reset, a driver update, a hybrid-GPU
switch): only a new process can, so a supervisor starts one, and it is not a crash.
"""

STARTUP_FAILURE = 3  # uvicorn's own: the server could not start (its port, say)
GPU_LOST = 4  # the graphics card stopped working: start a new server process
