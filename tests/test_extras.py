"""Serving installs serve: with the eval extra's libraries (matplotlib, math-verify) absent, every
module a served app runs imports and the app builds; grading then fails with an error that names
the extra. Run in a subprocess whose import system refuses those libraries."""

from __future__ import annotations

import json
import subprocess
import sys

BLOCKED = ("matplotlib", "math_verify")
SERVING = [
    "relay_serve.app",
    "relay_serve.router.ingress",
    "relay_serve.router.shadow",
    "relay_serve.replica.model_server",
    "relay_serve.online.cue_stats",
    "relay_serve.calibration.select",
    "relay_serve.cli",
]

PROGRAM = """
import importlib, importlib.abc, json, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Refuse())
for module in SERVING:
    importlib.import_module(module)
from relay_serve.app import app_builder

app = app_builder({})
from relay_serve.eval.grading import is_correct
from relay_serve.extras import MissingExtra

try:
    is_correct("The answer is 4.", "4")
    error = None
except MissingExtra as e:
    error = str(e)
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
print(json.dumps({"app": type(app).__name__, "error": error, "loaded": loaded}))
"""


def test_a_served_app_needs_no_eval_extra():
    program = f"BLOCKED = {BLOCKED!r}\nSERVING = {SERVING!r}\n{PROGRAM}"
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["app"] == "Application"
    assert out["loaded"] == []
    assert out["error"] is not None and "relay-serve[eval]" in out["error"] and "math_verify" in out["error"]
