"""Runs in a model replica (the ``large`` and ``small`` deployments): one engine behind Ray Serve,
and the segment channel's server."""
