"""The receiver's recording store on disk (RECORDINGS_STORE_DIR): <callLogId>/<recordingId>.wav
and <recordingId>.meta.json, and .incoming, where uploads stream before they are renamed into
place. Every function here blocks: the handlers call them through asyncio.to_thread.

Nothing below the store directory is reached through a symlink, to write or to serve: every
folder and file under it is opened without following one (O_NOFOLLOW), relative to the open
folder above it (dir_fd), as the consumer does with RECORDINGS_DIR (sinks/local_recordings.py).
The store directory itself may be a symlink: that is the operator's choice.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from pathlib import Path
from secrets import token_hex

log = logging.getLogger("serversync.receiver")

# Bytes read from a request body or from a kept file at once.
CHUNK_BYTES = 256 * 1024
# Uploads stream here first: the same filesystem as their final place, so the last step is an
# atomic rename.
INCOMING = ".incoming"
# A temp file in .incoming this old belongs to no upload in progress.
STALE_PART_SEC = 3600
# A folder below the store, opened without following a symlink.
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW_FOLDER = _FOLDER | os.O_NOFOLLOW
# A file or folder that is not there, or not what it must be (a symlink: ELOOP; a symlink or a
# file where a folder must be: ENOTDIR).
_NOT_THERE = frozenset({errno.ENOENT, errno.ELOOP, errno.ENOTDIR})


def open_root(root: Path) -> int:
    """The store directory, open (following a symlink only here)."""
    return os.open(root, _FOLDER)


def open_folder(name: str, parent: int) -> int | None:
    """A folder of an open folder, opened without following a symlink; None when it is not
    there, or is a symlink or a file."""
    try:
        return os.open(name, _NOFOLLOW_FOLDER, dir_fd=parent)
    except OSError as exc:
        if exc.errno in _NOT_THERE:
            return None
        raise


def open_incoming(root: Path) -> int | None:
    """.incoming, open; None when it is a symlink, not a folder, or missing."""
    folder = open_root(root)
    try:
        return open_folder(INCOMING, folder)
    finally:
        os.close(folder)


def prepare(root: Path) -> None:
    """Create the directories, and remove what uploads cut off by a crash left in .incoming (at
    start). Only old leftovers: another receiver sharing the store may be writing the young ones
    right now. OSError if .incoming is a symlink or not a folder."""
    root.mkdir(parents=True, exist_ok=True)
    folder = open_root(root)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(INCOMING, dir_fd=folder)
        incoming = open_folder(INCOMING, folder)
    finally:
        os.close(folder)
    if incoming is None:
        raise NotADirectoryError(
            errno.ENOTDIR, f"{root / INCOMING} is a symlink or not a folder; it is not followed"
        )
    try:
        cutoff = time.time() - STALE_PART_SEC
        for name in os.listdir(incoming):
            if not name.endswith(".part"):
                continue
            with contextlib.suppress(FileNotFoundError):
                if os.stat(name, dir_fd=incoming, follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(name, dir_fd=incoming)
                    log.info("removed %s, left by an upload cut off by a crash", name)
    finally:
        os.close(incoming)


def free_bytes(root: Path) -> int:
    """Bytes free for this user on the store's filesystem."""
    found = os.statvfs(root)
    return found.f_bavail * found.f_frsize


def create_part(incoming: int, prefix: str) -> tuple[int, str]:
    """A new temporary file in .incoming, open for writing: its descriptor and name. Never an
    existing file or a symlink (O_EXCL)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        name = f"{prefix}{token_hex(8)}.part"
        with contextlib.suppress(FileExistsError):
            return os.open(name, flags, 0o600, dir_fd=incoming), name


def remove_part(incoming: int, name: str) -> None:
    """Delete a temporary file of .incoming if it is still there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=incoming)


def _is_file(name: str, folder: int) -> bool:
    """Whether a regular file (not a symlink) of that name is in the open folder."""
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def open_call_folder(root: Path, call_log_id: str) -> int | None:
    """The call's folder in the store, created if need be and open; None when it is a symlink
    or a file."""
    folder = open_root(root)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(call_log_id, dir_fd=folder)
        return open_folder(call_log_id, folder)
    finally:
        os.close(folder)


def move_into_place(
    incoming: int, audio_part: str, meta_json: bytes, folder: int, recording_id: str
) -> bool:
    """Write the meta, then rename it and the audio's temporary file `audio_part` into the
    call's open folder; True if the recording is new. A symlink in the way is replaced, never
    written through (rename does not follow one)."""
    audio, meta = f"{recording_id}.wav", f"{recording_id}.meta.json"
    created = not _is_file(audio, folder)
    handle, meta_part = create_part(incoming, "meta-")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(meta_json)
            out.flush()
            os.fsync(out.fileno())
        # meta first: once the audio is in place, everything about the recording is.
        os.replace(meta_part, meta, src_dir_fd=incoming, dst_dir_fd=folder)
    except BaseException:
        remove_part(incoming, meta_part)
        raise
    os.replace(audio_part, audio, src_dir_fd=incoming, dst_dir_fd=folder)
    return created


def open_recording(
    root: Path, call_log_id: str, recording_id: str
) -> tuple[int, os.stat_result] | None:
    """A kept recording's audio, open for reading, and its stat; None when there is none: no
    such file, or a symlink (the folder or the file), or not a regular file."""
    try:
        top = open_root(root)
    except FileNotFoundError:
        return None
    try:
        folder = open_folder(call_log_id, top)
    finally:
        os.close(top)
    if folder is None:
        return None
    try:
        # O_NONBLOCK: a FIFO planted there is opened at once (and refused below), not waited on.
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(f"{recording_id}.wav", flags, dir_fd=folder)
    except OSError as exc:
        if exc.errno in _NOT_THERE:
            return None
        raise
    finally:
        os.close(folder)
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode):
        os.close(fd)
        return None
    return fd, found
