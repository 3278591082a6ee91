"""What deploys the app elsewhere than a local Ray: a Ray Serve config file (``serve deploy``) and
a KubeRay RayService's ``serveConfigV2`` (``k8s.py``), both rendered from the app config."""
