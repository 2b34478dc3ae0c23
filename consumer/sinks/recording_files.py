"""The backend's recordings on local disk: find them safely, read them, delete what was sent.

Every path comes from a database row, so it is treated as untrusted: it must resolve, without
leaving through `..` or a symlink, to a file in a folder strictly inside RECORDINGS_DIR. Nothing
outside that directory is ever read or deleted. Refusals raise a DeliveryError that is not
retryable, so the event is parked with a code saying why.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import orjson

from consumer.core.events import DeliveryError

META_NAME = "meta.json"
# meta.json is a small description of the call; anything bigger is not one.
MAX_META_BYTES = 1024 * 1024


# What identifies the files as they are now: (device, inode, size, mtime_ns) of audio and meta.
FilesState = tuple[tuple[int, int, int, int], ...]


@dataclass(frozen=True)
class LocalRecording:
    """Where one recording's files are."""

    # The <callId>/ folder: deleted once the last of its recordings is uploaded.
    folder: Path
    audio: Path
    meta: Path

    def state(self) -> FilesState | None:
        """The files' identity and version now (blocking); None if one cannot be looked at."""
        try:
            found = [os.stat(path) for path in (self.audio, self.meta)]
        except OSError:
            return None
        return tuple((s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns) for s in found)


@dataclass(frozen=True)
class PreparedUpload:
    """A recording checked and fingerprinted, ready to stream."""

    audio_size: int
    audio_sha256: str
    meta_json: bytes
    meta_sha256: str


def _refuse(code: str, message: str) -> DeliveryError:
    return DeliveryError(message, retryable=False, code=code)


def open_regular(path: Path) -> io.BufferedReader:
    """Open a regular file for reading (blocking), or refuse (RECORDING_FILE_UNREADABLE).

    Opened without blocking first: a plain open() of a FIFO waits for a writer, forever, in a
    thread nothing can cancel (the batch, and the process's exit, would hang). A FIFO, a
    directory or a device is refused instead. OSError (FileNotFoundError, ...) as open() raises.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _refuse("RECORDING_FILE_UNREADABLE", f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class RecordingsDir:
    """RECORDINGS_DIR: the only directory the recording-upload consumer reads or deletes in."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def check(self) -> str | None:
        """None if the directory can be used, else why not."""
        if not self.root.is_dir():
            return f"RECORDINGS_DIR {self.root} is not a directory"
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            return f"RECORDINGS_DIR {self.root} is not readable and writable by this user"
        return None

    def _raise_if_root_gone(self) -> None:
        """A missing file is the recording's fault only while RECORDINGS_DIR itself is there:
        an unmounted or removed directory is passing trouble, retried, never parked."""
        if not self.root.is_dir():
            raise DeliveryError(
                f"RECORDINGS_DIR {self.root} is not there (unmounted or removed?)",
                code="RECORDINGS_DIR_UNAVAILABLE",
            )

    def locate(self, file_path: str) -> LocalRecording:
        """The files of a row's `file_path`, or a refusal (RECORDING_PATH_REFUSED).

        Only lexical and symlink checks: the files need not exist yet.
        """
        if not file_path or "\x00" in file_path:
            raise _refuse("RECORDING_PATH_REFUSED", f"file_path {file_path!r} is empty or invalid")
        root = Path(os.path.abspath(self.root))
        real_root = Path(os.path.realpath(self.root))
        given = Path(file_path)
        normal = Path(os.path.normpath(given if given.is_absolute() else root / given))
        for base in (root, real_root):
            if normal.is_relative_to(base):
                inside = normal.relative_to(base)
                break
        else:
            raise _refuse(
                "RECORDING_PATH_REFUSED",
                f"file_path {file_path!r} resolves outside RECORDINGS_DIR {self.root}",
            )
        if len(inside.parts) < 2:
            raise _refuse(
                "RECORDING_PATH_REFUSED",
                f"file_path {file_path!r} is not inside a <callId>/ folder of RECORDINGS_DIR",
            )
        folder = real_root / inside.parent
        # No symlink anywhere below RECORDINGS_DIR on the way to the folder: deleting a folder
        # reached through a link could delete somebody else's files.
        if os.path.realpath(folder) != str(folder):
            raise _refuse(
                "RECORDING_PATH_REFUSED",
                f"file_path {file_path!r} passes through a symlink inside RECORDINGS_DIR",
            )
        audio = folder / inside.name
        meta = folder / META_NAME
        for path in (audio, meta):
            if not Path(os.path.realpath(path)).is_relative_to(real_root):
                raise _refuse(
                    "RECORDING_PATH_REFUSED",
                    f"{path.relative_to(real_root)} is a symlink pointing outside RECORDINGS_DIR",
                )
        return LocalRecording(folder=folder, audio=audio, meta=meta)

    def prepare(self, recording: LocalRecording) -> PreparedUpload:
        """Check both files and fingerprint them (blocking: run it in a thread).

        A missing or unreadable file, or a meta.json that is not JSON, is refused.
        """
        try:
            with open_regular(recording.audio) as audio:
                size = os.fstat(audio.fileno()).st_size
                audio_sha256 = hashlib.file_digest(audio, "sha256").hexdigest()
        except FileNotFoundError:
            self._raise_if_root_gone()
            raise _refuse("RECORDING_FILE_MISSING", f"{recording.audio} does not exist") from None
        except OSError as exc:
            raise _refuse(
                "RECORDING_FILE_UNREADABLE",
                f"cannot read {recording.audio}: {exc.strerror or exc}",
            ) from None
        try:
            with open_regular(recording.meta) as meta:
                meta_json = meta.read(MAX_META_BYTES + 1)
        except FileNotFoundError:
            self._raise_if_root_gone()
            raise _refuse("RECORDING_META_MISSING", f"{recording.meta} does not exist") from None
        except OSError as exc:
            raise _refuse(
                "RECORDING_FILE_UNREADABLE", f"cannot read {recording.meta}: {exc.strerror or exc}"
            ) from None
        if len(meta_json) > MAX_META_BYTES:
            raise _refuse(
                "RECORDING_META_INVALID", f"{recording.meta} is over {MAX_META_BYTES} bytes"
            )
        try:
            orjson.loads(meta_json)
        except orjson.JSONDecodeError as exc:
            raise _refuse(
                "RECORDING_META_INVALID", f"{recording.meta} is not JSON: {exc}"
            ) from None
        return PreparedUpload(
            audio_size=size,
            audio_sha256=audio_sha256,
            meta_json=meta_json,
            meta_sha256=hashlib.sha256(meta_json).hexdigest(),
        )

    def remove(self, recording: LocalRecording) -> bool:
        """Delete what was uploaded of the recording (blocking): its audio file, then meta.json
        and the <callId>/ folder once nothing else is left in it. False if none of it was there.

        A call may have several recordings in one folder, sharing its meta.json: each keeps its
        files until its own upload, and meta.json goes with the last. A file that no upload sent
        is never deleted (its folder then stays). The folder is opened without following a
        symlink, and everything is deleted through that handle: a folder swapped for a link
        after locate() is refused (OSError), not followed.
        """
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        try:
            parent = os.open(recording.folder.parent, flags)
        except FileNotFoundError:
            return False
        try:
            try:
                folder = os.open(recording.folder.name, flags | os.O_NOFOLLOW, dir_fd=parent)
            except FileNotFoundError:
                return False
            try:
                removed = _unlink(recording.audio.name, folder)
                left = os.listdir(folder)
                if left and left != [recording.meta.name]:
                    return removed
                if left:
                    _unlink(recording.meta.name, folder)
            finally:
                os.close(folder)
            try:
                os.rmdir(recording.folder.name, dir_fd=parent)
            except FileNotFoundError:
                pass
            except OSError as exc:
                # A file written into the folder meanwhile: the folder stays with it.
                if exc.errno != errno.ENOTEMPTY:
                    raise
            return True
        finally:
            os.close(parent)


def _unlink(name: str, folder: int) -> bool:
    """Delete a file (or a symlink itself) of an open folder; False if it was not there."""
    try:
        os.unlink(name, dir_fd=folder)
    except FileNotFoundError:
        return False
    return True
