"""Runs where the app is defined and started: the driver (``relay-serve serve``, eval, bench, the
batch job) and Ray Serve's controller, which imports the app builder of a Serve config file
(``import_path: relay_serve.app:app_builder``) and calls the autoscaling policy."""

from relay_serve.app.builder import app_builder, build_app

__all__ = ["app_builder", "build_app"]
