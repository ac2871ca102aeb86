"""Single-process tier: a sharded checkpoint's folder replaced whole, and the checks naming a checkpoint's missing or
cut-short parts (``lightning_pp.checkpoint.files``); the multi-process checks are in ``test_checkpoints.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_pp.checkpoint.files import (
    check_sharded_folder,
    interrupted_replacement,
    new_folder_token,
    read_whole,
    replace_folder,
    temporary_folder,
)
from lightning_pp.errors import PipelineCheckpointError


def _folder(path: Path, marker: str) -> Path:
    path.mkdir()
    (path / "checkpoint.pt").write_text(marker)
    return path


def test_a_new_folder_replaces_a_folder_a_file_or_a_link_and_nothing_stays_beside(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    for previous in ("folder", "file", "link", None):
        if previous == "folder":
            _folder(target, "previous")
        elif previous == "file":
            target.write_text("previous")
        elif previous == "link":
            target.symlink_to(_folder(tmp_path / "epoch=1.ckpt", "kept"))
        token = new_folder_token(str(target))
        replace_folder(str(_folder(Path(temporary_folder(str(target), token)), token)), str(target), token)
        assert (target / "checkpoint.pt").read_text() == token and not target.is_symlink(), previous
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("last")) == ["last.ckpt"], previous
        if previous == "link":  # the link went, not what it pointed to
            assert (tmp_path / "epoch=1.ckpt" / "checkpoint.pt").read_text() == "kept"
        (target / "checkpoint.pt").unlink()
        target.rmdir()


def test_the_next_save_tidies_what_a_killed_save_left(tmp_path: Path) -> None:
    target = str(tmp_path / "last.ckpt")
    _folder(Path(target), "whole")
    _folder(Path(temporary_folder(target, "dead")), "torn")  # a save killed while writing
    new_folder_token(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    # killed between its two renames: the previous checkpoint moved aside, the path gone
    os.rename(target, f"{target}.old-dead")
    error = interrupted_replacement(target)
    assert error is not None and f"Rename {target}.old-dead to {target}" in str(error)
    new_folder_token(target)  # the next save moves it back first
    assert (Path(target) / "checkpoint.pt").read_text() == "whole" and interrupted_replacement(target) is None


def test_a_file_cut_short_is_named_and_other_errors_pass_through(tmp_path: Path) -> None:
    path = tmp_path / "full.ckpt"
    torch.save({"state_dict": {"w": torch.randn(100)}}, path)
    data = path.read_bytes()
    assert read_whole(str(path), lambda: torch.load(path, weights_only=True))["state_dict"]["w"].shape == (100,)
    for keep in (0, 10, len(data) // 2, len(data) - 20):
        path.write_bytes(data[:keep])
        with pytest.raises(PipelineCheckpointError, match=f"{path} is not a whole checkpoint"):
            read_whole(str(path), lambda: torch.load(path, weights_only=True))
    path.write_bytes(data)

    def refuses() -> None:
        raise RuntimeError("not about the file")

    with pytest.raises(RuntimeError, match="not about the file"):  # a whole file: the error as it was
        read_whole(str(path), refuses)


def test_a_sharded_folder_missing_a_part_is_named(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    folder = tmp_path / "sharded.ckpt"
    dcp.save({"w": torch.randn(1000)}, checkpoint_id=str(folder), no_dist=True)
    torch.save({}, folder / "checkpoint.pt")
    shard = next(folder.glob("*.distcp"))

    def check() -> object:
        return check_sharded_folder(str(folder), FileSystemReader(str(folder)).read_metadata)

    assert "w" in check().state_dict_metadata  # type: ignore[attr-defined]
    data = shard.read_bytes()
    shard.write_bytes(data[:100])
    with pytest.raises(PipelineCheckpointError, match=f"{shard} has 100 bytes .* cut short"):
        check()
    shard.unlink()
    with pytest.raises(PipelineCheckpointError, match=f"lacks {shard.name}"):
        check()
    shard.write_bytes(data)
    metadata = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(metadata[:len(metadata) // 2])
    with pytest.raises(PipelineCheckpointError, match="could not be read"):
        check()
    (folder / ".metadata").unlink()
    with pytest.raises(PipelineCheckpointError, match="did not finish"):
        check()
