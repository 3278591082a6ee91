"""The cue store: cue sets in an object store, addressed by URI (file://, s3://, gs://, through fsspec).

Layout under the store's prefix:

    versions/<version>.json   one CueSet document per version, never rewritten
    reports/<version>/        the calibration run's report.json and margins.png
    LATEST                    the version readers should use
    PINNED                    present after a rollback: the pinned version (online publishing pauses)
    online/stats.json         online calibration's shared statistics (online/cue_stats.py)

    moves/<sequence>.json     every move of LATEST, in order: {version, previous, at}

``publish`` writes the version first and moves ``LATEST`` last, so a reader sees either the old
set or the new one, never half of one. A move is a conditional write: the next move's file is
created only if it does not exist (``O_EXCL`` on file://, ``If-None-Match: *`` on s3, generation
0 on gs), so of two publishers that read the same head (the offline job and the online actor) one
wins and the other finds out: the online actor (``expect_latest``) gives up and decides again on
the new set, the offline job moves on top of it. No move is lost and the log is the history;
``LATEST`` is its copy for readers, rewritten until it names the newest move. On a local file system ``LATEST`` is
written under a
temporary name and renamed over the old one (a rename is atomic; a rewrite in place can be read
empty); object stores replace an object whole. Every path is built here from a validated version name:
nothing outside the prefix is ever written.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from datetime import UTC, datetime
from typing import Any, Final

import fsspec

from relay_serve.calibration.cues import CueSet

_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class StoreError(RuntimeError):
    """The store could not be read or written."""


class CorruptCueSet(StoreError):
    """The store holds something that is not a valid cue set."""


class PublishConflict(StoreError):
    """LATEST moved since the publisher read it (another publisher won the move)."""


class _Any:
    def __repr__(self) -> str:
        return "ANY"


ANY: Final = _Any()  # publish over whatever LATEST names by then
MAX_MOVE_TRIES = 20


def check_version(version: str) -> str:
    if not _VERSION.match(version) or ".." in version:
        raise ValueError(f"invalid cue set version {version!r}: letters, digits, '.', '_', '-' only")
    return version


class CueStore:
    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None) -> None:
        self.uri = uri.rstrip("/")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.uri, **(storage_options or {}))
        except Exception as e:  # noqa: BLE001 - an unknown protocol or missing driver
            raise StoreError(f"cannot open cue store {uri!r}: {e}") from e
        self.root = self.root.rstrip("/")

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def publish(self, cue_set: CueSet, expect_latest: str | None | _Any = ANY) -> str:
        """Write ``cue_set`` as a new version, then move ``LATEST`` to it: from ``expect_latest``
        (None: from no set) or, by default, from whatever it names by then. Returns its URI; a
        ``PublishConflict`` (and no version written) when ``LATEST`` no longer names ``expect_latest``."""
        version = check_version(cue_set.version)
        path = self._path("versions", f"{version}.json")
        try:
            if expect_latest is not ANY and self.head()[1] != expect_latest:
                raise PublishConflict(f"LATEST is {self.head()[1]}, not {expect_latest}")
            if self.fs.exists(path):
                raise StoreError(f"version {version} already exists in {self.uri}")
            self.fs.makedirs(self._path("versions"), exist_ok=True)
            self.fs.pipe_file(path, cue_set.model_dump_json(indent=2).encode())
            try:
                self._move(version, expect_latest)
            except PublishConflict:
                self.fs.rm(path)  # it never became LATEST: no trace of it
                raise
        except StoreError:
            raise
        except Exception as e:  # noqa: BLE001 - any driver error is a store error
            raise StoreError(f"cannot write to cue store {self.uri}: {type(e).__name__}: {e}") from e
        return f"{self.uri}/versions/{version}.json"

    def head(self) -> tuple[int, str | None]:
        """The newest move of ``LATEST``: its sequence number and version (a store from before the
        move log: 0 and what ``LATEST`` names)."""
        folder = self._path("moves")
        self.fs.invalidate_cache(folder)  # other publishers (other processes) moved it: never a cached listing
        try:
            names = self.fs.ls(folder, detail=False)
        except FileNotFoundError:
            names = []
        seqs = sorted(
            int(stem)
            for n in names
            if n.endswith(".json") and (stem := n.rsplit("/", 1)[-1].removesuffix(".json")).isdigit()
        )
        if not seqs:
            return 0, self.latest_version()
        return seqs[-1], check_version(json.loads(self.fs.cat_file(self._move_path(seqs[-1])))["version"])

    def moves(self) -> list[dict[str, Any]]:
        """Every move of ``LATEST``, oldest first: {version, previous, at}."""
        try:
            names = sorted(n for n in self.fs.ls(self._path("moves"), detail=False) if n.endswith(".json"))
        except FileNotFoundError:
            return []
        return [json.loads(self.fs.cat_file(n)) for n in names]

    def _move_path(self, seq: int) -> str:
        return self._path("moves", f"{seq:010d}.json")

    def _move(self, version: str, expect: str | None | _Any) -> None:
        for _ in range(MAX_MOVE_TRIES):
            seq, current = self.head()
            if expect is not ANY and current != expect:
                raise PublishConflict(f"LATEST moved to {current} (expected {expect})")
            move = {"version": version, "previous": current, "at": datetime.now(UTC).isoformat()}
            path = self._move_path(seq + 1)
            self.fs.makedirs(self._path("moves"), exist_ok=True)
            try:
                self._create(path, json.dumps(move).encode())  # exclusive: the conditional write
            except Exception:
                self.fs.invalidate_cache(self._path("moves"))
                if not self.fs.exists(path):
                    raise  # not a lost race: a store error
                if expect is not ANY:
                    raise PublishConflict(f"another publisher moved LATEST first (move {seq + 1})") from None
                continue  # the default: on top of the winner
            self._settle_latest()
            return
        raise StoreError(f"could not move LATEST in {self.uri}: {MAX_MOVE_TRIES} publishers moved it first")

    def _local(self) -> bool:
        return "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    def _create(self, path: str, data: bytes) -> None:
        """Write ``path`` whole if it does not exist yet; FileExistsError (or the object store's
        precondition error) if it does. On a local file system the content goes under another name
        first and is linked in (``link`` fails on an existing name): a reader never sees it half written."""
        if not self._local():
            self.fs.pipe_file(path, data, mode="create")  # s3: If-None-Match *, gs: generation 0, whole objects
            return
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        self.fs.pipe_file(tmp, data)
        try:
            os.link(tmp, path)
        finally:
            os.unlink(tmp)

    def _settle_latest(self) -> None:
        """``LATEST`` names the newest move (rewritten until it does: a slower publisher's copy
        never stays over a newer one)."""
        written = None
        for _ in range(MAX_MOVE_TRIES):
            version = self.head()[1]
            if version is None or version == written:
                return
            self._replace(self._path("LATEST"), version.encode())
            written = version

    def _replace(self, path: str, data: bytes) -> None:
        """Write ``path`` whole: readers see the old content or the new, never a part."""
        if not self._local():
            self.fs.pipe_file(path, data)  # an object store replaces the object in one request
            return
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, path)

    def put_report(self, version: str, files: list[str]) -> str:
        """Copy a run's report files next to its version: ``reports/<version>/<name>``."""
        base = self._path("reports", check_version(version))
        try:
            self.fs.makedirs(base, exist_ok=True)
            for f in files:
                name = f.replace("\\", "/").rsplit("/", 1)[-1]
                with open(f, "rb") as src:
                    self.fs.pipe_file(f"{base}/{name}", src.read())
        except Exception as e:  # noqa: BLE001
            raise StoreError(f"cannot write the report to {self.uri}: {type(e).__name__}: {e}") from e
        return f"{self.uri}/reports/{version}"

    def set_latest(self, version: str) -> None:
        """Point ``LATEST`` at an existing version."""
        self.load(version)  # it exists and is a valid set
        try:
            self._move(check_version(version), ANY)
        except StoreError:
            raise
        except Exception as e:  # noqa: BLE001
            raise StoreError(f"cannot write {self.uri}/LATEST: {type(e).__name__}: {e}") from e

    def rollback(self, version: str) -> None:
        """``LATEST`` back to ``version``, pinned: online publishing pauses until :meth:`unpin`."""
        self.set_latest(version)
        self._write("PINNED", check_version(version).encode())

    def unpin(self) -> None:
        try:
            if self.fs.exists(self._path("PINNED")):
                self.fs.rm(self._path("PINNED"))
        except Exception as e:  # noqa: BLE001
            raise StoreError(f"cannot remove {self.uri}/PINNED: {type(e).__name__}: {e}") from e

    def pinned(self) -> str | None:
        """The version a rollback pinned, or None."""
        raw = self._read("PINNED")
        return None if raw is None else raw.decode().strip()

    def _write(self, name: str, data: bytes) -> None:
        try:
            self._replace(self._path(name), data)
        except Exception as e:  # noqa: BLE001
            raise StoreError(f"cannot write {self.uri}/{name}: {type(e).__name__}: {e}") from e

    def _read(self, name: str) -> bytes | None:
        try:
            return self.fs.cat_file(self._path(name))
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001
            raise StoreError(f"cannot read {self.uri}/{name}: {type(e).__name__}: {e}") from e

    def put_online_stats(self, data: bytes) -> None:
        self.fs.makedirs(self._path("online"), exist_ok=True)
        self._write("online/stats.json", data)

    def online_stats(self) -> bytes | None:
        return self._read("online/stats.json")

    def history(self) -> list[CueSet]:
        """Every version, oldest first (by creation time)."""
        return sorted((self.load(v) for v in self.versions()), key=lambda c: c.created_at)

    def latest_version(self) -> str | None:
        path = self._path("LATEST")
        try:
            if not self.fs.exists(path):
                return None
            raw = self.fs.cat_file(path).decode().strip()
        except Exception as e:  # noqa: BLE001
            raise StoreError(f"cannot read {self.uri}/LATEST: {type(e).__name__}: {e}") from e
        try:
            return check_version(raw)
        except ValueError as e:
            raise CorruptCueSet(f"{self.uri}/LATEST: {e}") from e

    def load(self, version: str) -> CueSet:
        path = self._path("versions", f"{check_version(version)}.json")
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError as e:
            raise CorruptCueSet(f"{self.uri}: LATEST names {version}, which does not exist") from e
        except Exception as e:  # noqa: BLE001
            raise StoreError(f"cannot read {path}: {type(e).__name__}: {e}") from e
        try:
            return CueSet.model_validate(json.loads(raw))
        except Exception as e:  # noqa: BLE001 - invalid JSON or schema
            raise CorruptCueSet(f"{self.uri}: version {version} is not a valid cue set: {e}") from e

    def load_latest(self) -> CueSet | None:
        version = self.latest_version()
        return None if version is None else self.load(version)

    def versions(self) -> list[str]:
        try:
            names = self.fs.ls(self._path("versions"), detail=False)
        except FileNotFoundError:
            return []
        return sorted(n.rsplit("/", 1)[-1].removesuffix(".json") for n in names if n.endswith(".json"))
