"""Fixtures of the cluster tier."""

# A real Redis for each test that asks for it (started on a free port, always stopped);
# defined with its server in support/redis_fixture.py.
from redis_fixture import redis_server as redis_server
