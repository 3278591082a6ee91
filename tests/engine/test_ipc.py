"""An engine's folder for vLLM's IPC sockets: named after its process, the variable vLLM reads set
only while the engine starts, removed on a failed start, and swept once its process is gone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from relay_serve.engine.ipc import ENV, PREFIX, own_ipc_dir, remove, sweep


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_folders_of_processes_that_no_longer_run_are_swept(tmp_path):
    gone = tmp_path / f"{PREFIX}{dead_pid()}-abc"
    mine = tmp_path / f"{PREFIX}{os.getpid()}-def"
    other = tmp_path / "not-ours-1"
    for folder in (gone, mine, other):
        folder.mkdir()
        (folder / "socket").touch()
    assert sweep(str(tmp_path)) == [gone]
    assert not gone.exists() and mine.exists() and other.exists()


@pytest.mark.parametrize("before", [None, "/somewhere"])
def test_the_variable_names_the_folder_only_while_the_engine_starts(tmp_path, monkeypatch, before):
    if before is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, before)
    with own_ipc_dir(str(tmp_path)) as folder:
        assert os.environ[ENV] == str(folder) and folder.is_dir() and folder.parent == tmp_path
        assert folder.name.startswith(f"{PREFIX}{os.getpid()}-")
    assert os.environ.get(ENV) == before and folder.is_dir()  # the engine runs: its sockets stay
    remove(folder)
    assert not folder.exists()


def test_a_failed_start_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(RuntimeError), own_ipc_dir(str(tmp_path)):
        raise RuntimeError("the engine did not start")
    assert list(tmp_path.iterdir()) == [] and ENV not in os.environ
