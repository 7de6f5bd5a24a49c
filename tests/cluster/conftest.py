"""Fixtures of the cluster tier."""

import pytest

# A real Redis for each test that asks for it (started on a free port, always stopped);
# defined with its server in support/redis_fixture.py.
from redis_fixture import redis_server as redis_server

# Ray Serve's deadlines for its proxy, sized for a starved 2-core machine (docs/scaling.md,
# "On a small or busy machine"). Serve gives a starting proxy 5 s to answer its ready
# check, three times, then kills it and starts another; under two CPU hogs the proxy's
# own start-up (importing Serve, uvicorn and the middleware) took 14 s, so it was killed
# and the fixture starting the cluster erred. Ray's processes read these when they start:
# they go in the environment before ray.init or serve run.
# The router (in the proxy) asks each replica its queue length before it sends a request,
# waiting 0.1 s at first; a starved replica answers later, the router then sends the
# request to whichever answered, and a burst went to one replica (the shared-limit and
# paused-replica tests saw no request reach the other).
RAY_DEADLINES = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1",
    "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "5",
}


@pytest.fixture(scope="session")
def ray_deadlines() -> dict[str, str]:
    """The environment a test's Ray starts with (Serve's deadlines above)."""
    return dict(RAY_DEADLINES)
