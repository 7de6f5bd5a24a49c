"""The server: its assembly, state, connections, request counts, the live feed, the
OpenAPI file, and the request scope that the gates and the metrics share."""
