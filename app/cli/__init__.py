"""The command line: the parser and ``main``, ``classify``, ``doctor``, and starting and
stopping the server and the tray."""
