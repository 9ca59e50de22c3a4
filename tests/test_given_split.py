"""A data folder split already, holding train/ and val/ (or valid/, validation/) with the same
class folders in each, as torchvision's references, ImageNet and Imagenette lay theirs out:
trained on train/ and validated on val/ as given, said in the run's first lines, recorded in
split.json, and kept by a resumed run and by --eval-only. A folder that is neither that nor a
folder of class folders is one clear error."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import SAMPLE, SMALL_MODEL, metrics, ok, train_here, user_error

import train_single_gpu
from utils import given_split, list_images

VALIDATION_PER_CLASS = 5


def split_sample(root: Path, val_name: str = "val") -> Path:
    """The bundled sample laid out split already: per class, the last 5 photos in val/."""
    for class_dir in sorted(p for p in SAMPLE.iterdir() if p.is_dir()):
        photos = sorted(class_dir.glob("*.jpg"))
        for part, chosen in (("train", photos[:-VALIDATION_PER_CLASS]), (val_name, photos[-VALIDATION_PER_CLASS:])):
            (root / part / class_dir.name).mkdir(parents=True)
            for photo in chosen:
                shutil.copy(photo, root / part / class_dir.name / photo.name)
    return root


def files_under(folder: Path) -> set[str]:
    return {str(p) for p in folder.rglob("*.jpg")}


@pytest.mark.slow
def test_a_folder_split_already_trains_on_train_and_validates_on_val(tmp_path):
    data, run = split_sample(tmp_path / "data"), tmp_path / "run"
    # The same photos as class folders would be split by --val-rate's draw instead.
    assert len(list_images(str(SAMPLE))[1]) == len(files_under(data))
    first = ok(train_here(run, "--epochs", "1", *SMALL_MODEL, data=data)).stdout
    assert f"{data} is split already: 95 images in train/ for training, 25 in val/ for validation" in first
    assert "95 for training, 25 for validation (the folder's own split)" in first
    record = json.loads((run / "split.json").read_text())
    assert record["split_by"] == "folders"
    assert {p for p, _ in record["val"]} == files_under(data / "val")
    assert {p for p, _ in record["train"]} == files_under(data / "train")
    assert metrics(run)[0]["val_total"] == 25

    resumed = ok(train_here(run, "--epochs", "2", "--resume", "auto", *SMALL_MODEL, data=data)).stdout
    assert "(the folder's own split)" in resumed
    assert json.loads((run / "split.json").read_text())["val"] == record["val"]
    assert [m["val_total"] for m in metrics(run)] == [25, 25]

    evaluated = tmp_path / "eval"
    ok(train_here(evaluated, "--eval-only", "--resume", str(run / "last.pth"), *SMALL_MODEL, data=data))
    assert json.loads((evaluated / "eval.json").read_text())["val_total"] == 25


@pytest.mark.parametrize("val_name", ["val", "valid", "validation"])
def test_each_name_of_the_validation_folder(tmp_path, val_name):
    data = split_sample(tmp_path / "data", val_name)
    (data / "test").mkdir()  # a test/ folder beside them is left alone
    assert given_split(str(data)) == (data / "train", data / val_name)
    assert given_split(str(SAMPLE)) is None  # class folders


def test_a_train_folder_beside_class_folders_is_an_error(tmp_path, capsys):
    data = split_sample(tmp_path / "data")
    shutil.copytree(SAMPLE / "daisy", data / "daisy")
    line = user_error(train_single_gpu.main, ["--data-path", str(data), "--epochs", "1"], capsys)
    assert "holds train/, val/ beside class folders (daisy)" in line and "rename a class" in line
    shutil.rmtree(data / "val")
    shutil.rmtree(data / "daisy")
    line = user_error(train_single_gpu.main, ["--data-path", str(data), "--epochs", "1"], capsys)
    assert "holds train/:" in line and "val/, valid/, validation/" in line


def test_train_and_val_with_different_classes_are_an_error(tmp_path, capsys):
    data = split_sample(tmp_path / "data")
    shutil.rmtree(data / "val" / "tulips")
    line = user_error(train_single_gpu.main, ["--data-path", str(data), "--epochs", "1"], capsys)
    assert "hold different classes (only in train/: tulips; only in val/: none)" in line
