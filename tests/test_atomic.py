"""qtk.atomic: an output is there whole or not at all, and a failure leaves what was there before
(the callers' own tests: test_checkpoint, test_gates_input)."""
from __future__ import annotations

import pytest

from qtk.atomic import write_dir, write_file, write_files


def test_a_file_is_replaced_whole_and_a_failed_write_leaves_the_old_one(tmp_path, monkeypatch):
    f = tmp_path / "a" / "b.json"
    write_file(f, "one")
    write_file(f, b"two")
    assert f.read_text() == "two" and [p.name for p in f.parent.iterdir()] == ["b.json"]

    def full_disk(self, data):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(type(f), "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_file(f, "three")
    assert f.read_text() == "two" and [p.name for p in f.parent.iterdir()] == ["b.json"]


def test_a_folder_takes_its_name_only_once_written(tmp_path):
    target = tmp_path / "x" / "y" / "out"
    with pytest.raises(RuntimeError):
        with write_dir(target) as tmp:
            (tmp / "half").write_text("")
            raise RuntimeError("cut short")
    assert list(tmp_path.iterdir()) == []  # neither the output nor the folders made for it
    with write_dir(target) as tmp:
        (tmp / "new").write_text("")
    assert [p.name for p in target.iterdir()] == ["new"] and oct(target.stat().st_mode & 0o777) == "0o755"
    with write_dir(target) as tmp:  # replace: the old folder is moved aside, then removed
        (tmp / "newer").write_text("")
    assert [p.name for p in target.iterdir()] == ["newer"] and [p.name for p in target.parent.iterdir()] == ["out"]
    with pytest.raises(OSError):  # without replace, a folder that appeared meanwhile is kept
        with write_dir(target, replace=False) as tmp:
            (tmp / "mine").write_text("")
    assert [p.name for p in target.iterdir()] == ["newer"] and [p.name for p in target.parent.iterdir()] == ["out"]


def test_files_move_into_a_folder_together(tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    (out / "mine.txt").write_text("the user's")
    (out / "b").write_text("old b")
    with write_files(out, ("a", "b")) as staging:
        (staging / "a").write_text("new a")
    assert sorted(p.name for p in out.iterdir()) == ["a", "mine.txt"]  # b not written this time: removed
    with pytest.raises(RuntimeError):
        with write_files(out, ("a", "b")) as staging:
            (staging / "a").write_text("newer a")
            raise RuntimeError("cut short")
    assert (out / "a").read_text() == "new a" and sorted(p.name for p in out.iterdir()) == ["a", "mine.txt"]
