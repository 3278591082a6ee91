"""relay-serve's Ray jobs that are part of the package: batch inference (``batch.py``). The
calibration job is the top-level ``calibration_jobs`` package (``ray job submit ... python -m
calibration_jobs.calibrate``)."""
