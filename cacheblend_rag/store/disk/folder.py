"""Which folders the disk tier opens: a new or empty one (it becomes a store), or a store it made before.

The tier writes `cache.db` and value folders `00/` .. `ff/` straight into its folder and evicts by deleting what
its index names, so a folder that holds anything else (a home, `/etc`, a documents folder, the filesystem root)
is refused at open with a `ConfigError` that names the folder, the reason and the fix. A store is marked by
`cacheblend-store.json`, written when the tier first opens the folder. A folder without the marker is accepted
only when it holds nothing but diskcache's own files (a store written by a version that did not mark it yet);
it gets its marker once its index has been checked. In any store, diskcache's names must be what diskcache
makes: `cache.db*` regular files, value folders real folders; a symlink at one of them is refused, because a
write through it would land outside the folder.
"""

from __future__ import annotations

import json
import os
import re

from ...errors import ConfigError

MARKER = "cacheblend-store.json"
_MARKER_BODY = {
    "format": "cacheblend-rag disk tier",
    "version": 1,
    "layout": "diskcache: index cache.db, values in ab/cd/<28 hex digits>.val",
}
_DB_FILES = ("cache.db", "cache.db-wal", "cache.db-shm", "cache.db-journal")
_VALUE_FOLDER = re.compile(r"[0-9a-f]{2}")
_MARKER_TMP = re.compile(re.escape(MARKER) + r"\.\d+\.tmp")  # another process writing the marker right now
_NOT_CONTENT = {"lost+found"}  # what a freshly made filesystem holds: its root still counts as empty
# The codec calibrations the engine keeps beside the tier's entries (`engine.chunks.calibrate`), written before the
# tier first opens the folder: ours, not a stranger's content.
CALIBRATION_FOLDER = "calibration"
_FIX = "give the disk tier an empty or new folder (it creates a missing one)"


def claim_folder(directory: str) -> bool:
    """Check that `directory` may be the disk tier's folder, creating it if missing.

    -> True when the marker still has to be written (a new or empty folder, or an unmarked store); ConfigError
    when the folder is not a store.
    """
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"the disk tier folder {directory!r} cannot be used: it is a file; give a folder path")
    try:
        os.makedirs(directory, 0o755, exist_ok=True)
        entries = {entry.name: entry for entry in os.scandir(directory)}
    except OSError as exc:
        raise ConfigError(
            f"the disk tier folder {directory!r} cannot be used ({exc}): make it writable by this user, "
            "or give another folder"
        ) from exc
    for name, entry in entries.items():
        _check_diskcache_name(directory, name, entry)
    if MARKER in entries:
        _check_marker(directory, entries[MARKER])
        return False
    others = sorted(n for n in entries if not _is_diskcache_name(n) and n not in _NOT_CONTENT | {CALIBRATION_FOLDER})
    others = [n for n in others if not _MARKER_TMP.fullmatch(n)]
    if others:
        shown = ", ".join(repr(n) for n in others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise ConfigError(
            f"the disk tier folder {directory!r} is not a cacheblend-rag store: it holds {shown} and no {MARKER}, "
            f"and the tier writes its index and value folders into the folder it is given and deletes what its "
            f"index names; {_FIX}, e.g. {os.path.join(directory, 'cacheblend-kv')!r}"
        )
    return True


def write_marker(directory: str) -> None:
    """Mark `directory` as a store (atomically: a reader sees the whole marker or none)."""
    tmp = os.path.join(directory, f"{MARKER}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "w") as out:
            json.dump(_MARKER_BODY, out)
        os.replace(tmp, os.path.join(directory, MARKER))
    except OSError as exc:
        raise ConfigError(
            f"the disk tier folder {directory!r} cannot be used ({exc}): make it writable by this user, "
            "or give another folder"
        ) from exc


def _is_diskcache_name(name: str) -> bool:
    return name in _DB_FILES or _VALUE_FOLDER.fullmatch(name) is not None


def _check_diskcache_name(directory: str, name: str, entry: os.DirEntry) -> None:
    """A name diskcache uses must be what diskcache makes there: a regular file (`cache.db*`) or a folder."""
    if not _is_diskcache_name(name) and name != MARKER:
        return
    want_folder = _VALUE_FOLDER.fullmatch(name) is not None
    if entry.is_symlink():
        problem = "is a symlink"
    elif want_folder and not entry.is_dir(follow_symlinks=False):
        problem = "is not a folder"
    elif not want_folder and not entry.is_file(follow_symlinks=False):
        problem = "is not a regular file"
    else:
        return
    raise ConfigError(
        f"the disk tier folder {directory!r} cannot be used: {name!r} {problem}, which the tier never makes "
        "(reads and writes through it could leave the folder); remove it, or give another folder"
    )


def _check_marker(directory: str, entry: os.DirEntry) -> None:
    """The marker (a regular file by now) must be this tier's, of a format version this code reads."""
    try:
        with open(entry.path, "rb") as f:
            body = json.loads(f.read(4096))
    except (OSError, ValueError):
        body = None
    if not isinstance(body, dict) or body.get("format") != _MARKER_BODY["format"]:
        raise ConfigError(
            f"the disk tier folder {directory!r} cannot be used: its {MARKER} is not one this tier writes; {_FIX}"
        )
    if body.get("version") != _MARKER_BODY["version"]:
        raise ConfigError(
            f"the disk tier folder {directory!r} holds a store of format version {body.get('version')!r}, which "
            f"this version cannot read; delete the folder (it holds only a cache) or {_FIX}"
        )
