"""What a model replica reports to Ray Serve's controller for autoscaling (read there by
``relay_serve/app/autoscaling.py``): kept in a module of its own, so that the controller imports
nothing else of the replica."""

ENGINE_LOAD = "engine_load"  # segments running or queued in the replica's engine
