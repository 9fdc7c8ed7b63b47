"""Checkpoint files: written with a checksum, verified when read, committed by two renames.

[Note: checkpoint crash safety]
A save writes everything into `<path>.tmp/`. Each file goes to `<name>.partial`, is fsynced and
renamed; its size and SHA-256 are taken from the bytes as they are written. Rank 0 writes
`metadata.json` last, once every rank has reported its file's record, with a checksum of its own.
A directory is *complete* when its metadata.json is present and passes that checksum: every file
it lists was written and fsynced before it. Rank 0 then commits: `<path>` -> `<path>.old`,
`<path>.tmp` -> `<path>`, remove `<path>.old` (directory fsynced after each rename).
`find_checkpoint(path)` (used by every loader) picks the directory to read:
1. `<path>` if it exists. A damaged committed checkpoint raises; it never falls back silently to
   an older one;
2. else `<path>.old` if complete: a save was interrupted between its two renames, and `.old` is
   the last committed checkpoint (the interrupted save never returned, so its complete
   `<path>.tmp` is ignored: the caller never learnt it existed);
3. else `<path>.tmp` if complete: the first save to `<path>` was interrupted after writing
   everything, before its only rename.
So at every instant of a save a loader reads the checkpoint committed before it (1, 2), or for a
first save either nothing (mid-write: an error saying so) or the complete new one (3).
Integrity: every file is verified (size, then SHA-256) before it is unpickled; a missing,
truncated or altered file raises naming the file and the rank that wrote it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

FORMAT = "megabuf-checkpoint-v2"
METADATA = "metadata.json"
DCP_METADATA = ".metadata"
_READ_NBYTES = 1 << 24
FileRecord = dict[str, Any]  # {"file": name, "rank": writer, "nbytes": int, "sha256": hex}


class _HashingWriter:
    """A file object for torch.save that hashes and counts the bytes it passes on."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.sha256 = hashlib.sha256()
        self.nbytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.nbytes += view.nbytes
        return int(self.f.write(view))

    def flush(self) -> None:
        self.f.flush()


def sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def write_file(obj: Any, target: Path, rank: int) -> FileRecord:
    """torch.save `obj` to `target` atomically and durably; its record for metadata.json."""
    partial = sibling(target, ".partial")
    with open(partial, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(obj, writer)  # type: ignore[arg-type]  # torch only calls write()
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, target)
    return {
        "file": target.name, "rank": rank, "nbytes": writer.nbytes,
        "sha256": writer.sha256.hexdigest(),
    }  # fmt: skip


def hash_written(root: Path, rank: int) -> list[FileRecord]:
    """Records of the files DCP wrote for `rank` (its data files; rank 0 also DCP's .metadata)."""
    paths = sorted(root.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        paths.append(root / DCP_METADATA)
    return [
        {"file": p.name, "rank": rank, "nbytes": p.stat().st_size, "sha256": _digest(p)}
        for p in paths
    ]


def _digest(path: Path) -> str:
    sha256 = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_NBYTES):
            sha256.update(chunk)
    return sha256.hexdigest()


def verify_file(root: Path, record: FileRecord) -> Path:
    """Raise naming the file and its writer unless it is exactly the file that was saved."""
    path = root / record["file"]
    who = f"megabuf: checkpoint file {path} (written by rank {record['rank']})"
    advice = "restore it from a copy, or load an earlier checkpoint"
    if not path.is_file():
        raise ValueError(f"{who} is missing; {advice}")
    nbytes = path.stat().st_size
    if nbytes != record["nbytes"]:
        raise ValueError(
            f"{who} is {nbytes} bytes, {METADATA} records {record['nbytes']}: it is truncated "
            f"or was replaced after the save; {advice}"
        )
    if _digest(path) != record["sha256"]:
        raise ValueError(
            f"{who} fails its SHA-256 check: its bytes changed after the save (disk or copy "
            f"corruption); {advice}"
        )
    return path


def read_file(root: Path, record: FileRecord, *, weights_only: bool = True) -> Any:
    """Verify, then load (memory-mapped) one file of the checkpoint."""
    path = verify_file(root, record)
    try:
        return torch.load(path, mmap=True, weights_only=weights_only)
    except Exception as exc:  # verified bytes that still do not load: name the file
        raise ValueError(
            f"megabuf: checkpoint file {path} (written by rank {record['rank']}) passed its "
            f"checksum but cannot be loaded: {exc}"
        ) from exc


def _meta_checksum(meta: dict[str, Any]) -> str:
    body = json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def write_metadata(root: Path, meta: dict[str, Any]) -> None:
    """Rank 0, last file of a save: the index, with a checksum of itself."""
    meta = {"format": FORMAT, **meta}
    meta["checksum"] = _meta_checksum(meta)
    partial = root / (METADATA + ".partial")
    with open(partial, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, root / METADATA)


def read_metadata(root: Path) -> dict[str, Any]:
    """The verified index of the checkpoint in `root`; raises naming metadata.json."""
    meta_path = root / METADATA
    who = f"megabuf: {meta_path} (written by rank 0)"
    if not meta_path.is_file():
        raise ValueError(
            f"megabuf: {root} has no {METADATA}: not a megabuf checkpoint, or its save was "
            "interrupted (a save is complete only once its metadata.json is written)"
        )
    try:
        meta: dict[str, Any] = json.loads(meta_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{who} is not valid JSON ({exc}): it is truncated or corrupted; restore it from "
            "a copy, or load an earlier checkpoint"
        ) from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{who} has format {found!r}, not {FORMAT!r}")
    if meta.get("checksum") != _meta_checksum(meta):
        raise ValueError(
            f"{who} fails its checksum: it was edited or corrupted after the save; restore it "
            "from a copy, or load an earlier checkpoint"
        )
    return meta


def _complete(root: Path) -> bool:
    try:
        read_metadata(root)
    except ValueError:
        return False
    return True


def find_checkpoint(path: Path) -> Path:
    """The directory to load for `path`: see [Note: checkpoint crash safety]."""
    if path.exists():
        return path
    for candidate in (sibling(path, ".old"), sibling(path, ".tmp")):
        if candidate.is_dir() and _complete(candidate):
            return candidate
    partial = sibling(path, ".tmp")
    hint = (
        f"; {partial} holds a save interrupted before it finished writing"
        if partial.exists()
        else ""
    )
    raise ValueError(f"megabuf: no checkpoint at {path} (no metadata.json){hint}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare_tmp(final: Path) -> Path:
    """Rank 0, before a save: an empty `<path>.tmp/` (what an interrupted save left is dropped)."""
    tmp = sibling(final, ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, final: Path) -> None:
    """Rank 0, after metadata.json: the two renames of [Note: checkpoint crash safety]."""
    old = sibling(final, ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        _fsync_dir(final.parent)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
