"""The tray icon: a gauge of GPU memory and the actions that help, over the HTTP API."""
