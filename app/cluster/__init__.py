"""The cluster mode's code (issue 17): the same engine served as Ray Serve replicas, with
rate limits shared through Redis. It needs the ``cluster`` extra (ray, redis); the
desktop appliance never imports this package, nor ray or redis, so its bundle and its
start-up stay as they are."""
