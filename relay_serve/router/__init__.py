"""Runs in a router replica (the ``router`` deployment, the app's HTTP ingress): the OpenAI API,
generations and their handoffs, the transport to the model replicas (the request router Serve
runs in the caller's process, ``affinity.py``, included), the live cue set, the router's metrics
and online calibration's scoring side."""
