"""The cue science, one package for the offline job and online calibration alike: the cue set
document and the pair's fingerprint (``cues.py``), the versioned store (``store.py``), the
candidate pool (``candidates.py``), margins of a trace (``margins.py``), the selection rule
(``select.py``) and the job's report (``report.py``). It runs in whichever process calls it and
starts nothing: the Ray job over it is ``calibration_jobs/calibrate.py``, the online side
``relay_serve/router/shadow.py`` and ``relay_serve/online/``."""
