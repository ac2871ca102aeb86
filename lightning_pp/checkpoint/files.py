"""Checkpoints on disk as wholes: a sharded checkpoint's folder written beside its path and renamed into place once
every rank has written (so a killed rank or a full disk leaves the previous checkpoint, never a torn one), and the
checks that name a checkpoint's missing or cut-short parts before anything reads them.

A sharded save to ``path`` writes ``path.tmp-<token>``; global rank 0 then renames ``path`` to ``path.old-<token>``,
the new folder to ``path``, and removes the old one. Neither name ends in ``.ckpt``, so Lightning's ``ModelCheckpoint``
never takes one for a checkpoint (``ckpt_path="last"`` included), and a load reads ``path`` only.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pickle
import shutil
import uuid
import zipfile
from collections.abc import Callable
from typing import Any, TypeVar

from lightning_pp._compat import distributed_checkpoint_extents
from lightning_pp.errors import PipelineCheckpointError, PipelineConfigError

__all__ = ["check_sharded_folder", "interrupted_replacement", "new_folder_token", "read_whole", "replace_folder",
           "temporary_folder"]

T = TypeVar("T")
_TEMPORARY, _OLD = ".tmp-", ".old-"
METADATA, TRAINER_STATE = ".metadata", "checkpoint.pt"  # a sharded folder's: torch's index, the rest of the checkpoint
_ANOTHER = "Resume from another checkpoint (a sharded save replaces a folder only once every rank has written it)."


def temporary_folder(path: str, token: str) -> str:
    """Where a sharded save to ``path`` writes before :func:`replace_folder` moves it into place."""
    return f"{path}{_TEMPORARY}{token}"


def _siblings(path: str, mark: str) -> list[str]:
    return sorted(glob.glob(f"{glob.escape(path)}{mark}*"))


def _remove(path: str) -> None:
    """Remove a file, a link (not what it points to) or a folder; nothing if it is gone."""
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def new_folder_token(path: str) -> str:
    """On global rank 0, before a sharded save to ``path``: tidy what earlier saves left beside it and return a new
    token for :func:`temporary_folder`. Temporary folders are unfinished saves: removed. A save killed between its
    two renames left ``path`` missing and the previous checkpoint at ``path.old-*``: moved back."""
    for leftover in _siblings(path, _TEMPORARY):
        with contextlib.suppress(OSError):
            _remove(leftover)
    old = _siblings(path, _OLD)
    if not os.path.lexists(path) and len(old) == 1:
        with contextlib.suppress(OSError):
            os.rename(old.pop(), path)
    if os.path.lexists(path):  # else the only copies of an earlier checkpoint: kept for the user
        for leftover in old:
            with contextlib.suppress(OSError):
                _remove(leftover)
    return uuid.uuid4().hex[:12]


def replace_folder(new: str, path: str, token: str) -> None:
    """Move the whole checkpoint ``new`` to ``path`` (a folder, a file or a link there is replaced), on global rank 0
    once every rank has written. A failed rename puts the previous checkpoint back."""
    old = f"{path}{_OLD}{token}"
    replacing = os.path.lexists(path)
    if replacing:
        os.rename(path, old)  # a folder cannot be renamed over a non-empty one: two renames, then the removal
    try:
        os.rename(new, path)
    except OSError:
        if replacing:
            os.rename(old, path)
        raise
    if replacing:
        with contextlib.suppress(OSError):  # the new checkpoint is in place; the next save retries the removal
            _remove(old)


def interrupted_replacement(path: str) -> PipelineCheckpointError | None:
    """Where ``path`` does not exist but a save to it was killed between its two renames: the error naming the
    previous checkpoint and how to take it back."""
    old = _siblings(path, _OLD)
    if os.path.lexists(path) or not old:
        return None
    return PipelineCheckpointError(
        f"{path} does not exist: a sharded save to it was stopped between moving the previous checkpoint away (to "
        f"{old[-1]}) and the new one in. Rename {old[-1]} to {path} to resume from the previous checkpoint (the next "
        f"save to {path} does so itself).")


def _cut_short(path: str) -> str | None:
    """Why ``path`` (a file torch.save wrote: a zip archive) is not whole, or None where it is."""
    size = os.path.getsize(path)
    try:
        with zipfile.ZipFile(path) as archive:
            end = max((info.header_offset + info.compress_size for info in archive.infolist()), default=0)
    except zipfile.BadZipFile:
        return f"it has {size} bytes and no zip index at its end (torch.save writes the index last)"
    return f"it has {size} bytes but its index places data up to byte {end}" if end > size else None


def read_whole(path: str, load: Callable[[], T]) -> T:
    """``load()`` (which reads ``path``, a file torch.save wrote); where it fails on a file cut short (the save
    killed, the disk full), :class:`PipelineCheckpointError` naming the file."""
    try:
        return load()
    except (EOFError, RuntimeError, OSError, ValueError, pickle.UnpicklingError) as error:
        if isinstance(error, FileNotFoundError) or not os.path.isfile(path) or (why := _cut_short(path)) is None:
            raise
        raise PipelineCheckpointError(f"{path} is not a whole checkpoint: {why}; torch.load says: {error}. A save "
                                      f"cut short leaves such a file. {_ANOTHER}") from error


def check_sharded_folder(folder: str, read_metadata: Callable[[], Any]) -> Any:
    """The ``.metadata`` of the sharded checkpoint ``folder`` (``read_metadata()`` reads it), after checking that
    every file the checkpoint needs is there, at least as long as its index says.

    Raises:
        PipelineCheckpointError: ``.metadata``, ``checkpoint.pt`` or a shard file is missing or cut short, naming it.
        PipelineConfigError: ``folder`` is not a distributed checkpoint at all (an earlier lightning_pp's format).
    """
    names = set(os.listdir(folder))
    if METADATA not in names:
        if TRAINER_STATE in names or any(name.endswith(".distcp") for name in names):
            raise PipelineCheckpointError(
                f"{folder} has no `{METADATA}` (torch's distributed checkpoint writes it last, once every rank has "
                f"written its shards): the save that wrote it did not finish. {_ANOTHER}")
        raise PipelineConfigError(
            f"{folder} is not a sharded checkpoint of this version (torch's distributed checkpoint: a `{METADATA}` "
            f"file beside `{TRAINER_STATE}`); folders of per-stage files come from an earlier lightning_pp. Load it "
            f"with that version and save it with state_dict_type='full'.")
    try:
        metadata = read_metadata()
    except Exception as error:  # unpickling a file cut short raises whatever the missing bytes lead to
        raise PipelineCheckpointError(f"{os.path.join(folder, METADATA)} could not be read ({type(error).__name__}: "
                                      f"{error}): it was cut short or is not torch's. {_ANOTHER}") from error
    needed = {TRAINER_STATE: 1, **distributed_checkpoint_extents(metadata)}
    missing = sorted(name for name in needed if name not in names)
    if missing:
        raise PipelineCheckpointError(
            f"{folder} lacks {', '.join(missing)}, which its `{METADATA}` needs (each rank writes its own shard file, "
            f"global rank 0 `{TRAINER_STATE}`): the folder is incomplete. {_ANOTHER}")
    for name, end in sorted(needed.items()):
        size = os.path.getsize(os.path.join(folder, name))
        if size < end:
            raise PipelineCheckpointError(
                f"{os.path.join(folder, name)} has {size} bytes but the checkpoint's `{METADATA}` places data up to "
                f"byte {end}: the file was cut short. {_ANOTHER}")
    return metadata
