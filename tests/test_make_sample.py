"""make_sample.py: N photos per class chosen reproducibly, shrunk, their credits kept. Tiny
generated photos, no training; and the bundled quick-start sample is what its docstring says."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO
from PIL import Image

import make_sample

HEADER = ["All images in this archive are licensed under the Creative Commons By-Attribution License, available at:",
          "https://creativecommons.org/licenses/by/2.0/",
          "The photographers are listed below, thanks to all of them for making their work available, "
          "and please be sure to credit them for any use as per the license.",
          ""]
QUICK = REPO / "data" / "flower_photos_quick"


def credit(path: str) -> str:
    return f"{path} CC-BY by Author of {path} - https://www.flickr.com/photos/x/{abs(hash(path)) % 10**6}/"


def photo_folder(root, classes=("cats", "dogs", "owls"), per_class=6, license=True):
    """Each class: JPEGs of several shapes (landscape, portrait, one smaller than any short side
    asked for below), one RGBA PNG, a hidden file and a text file that are not photos."""
    root.mkdir()
    lines = list(HEADER)
    for c, name in enumerate(classes):
        (root / name).mkdir()
        for i in range(per_class):
            size = [(60, 40), (40, 70), (50, 50), (12, 9)][i % 4]
            Image.new("RGB", size, (40 * c, 20 * i, 90)).save(root / name / f"{i:03d}_{name}.jpg", quality=95)
            lines.append(credit(f"{name}/{i:03d}_{name}.jpg"))
        Image.new("RGBA", (45, 30), (200, 10, 10, 0)).save(root / name / "zz_clear.png")
        lines.append(credit(f"{name}/zz_clear.png"))
        (root / name / ".hidden.jpg").write_bytes(b"not looked at")
        (root / name / "notes.txt").write_text("not a photo")
    if license:
        (root / "LICENSE.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def written(dest):
    return {p.relative_to(dest).as_posix() for p in dest.rglob("*.jpg")}


def test_counts_sizes_and_format(tmp_path):
    src = photo_folder(tmp_path / "src")
    chosen = make_sample.make_sample(src, tmp_path / "out", per_class=4, short_side=20, log=lambda _: None)
    assert sorted(chosen) == ["cats", "dogs", "owls"]
    assert all(len(files) == 4 for files in chosen.values())
    assert written(tmp_path / "out") == {f"{c}/{f}" for c, files in chosen.items() for f in files}
    for path in (tmp_path / "out").rglob("*.jpg"):
        with Image.open(path) as img:
            assert img.format == "JPEG" and img.mode == "RGB"
            # the names tell the shape: 000 landscape, 001 portrait, 002 square, 003 small; the PNG landscape
            kind = int(path.name[:3]) % 4 if path.name[:3].isdigit() else "png"
            expected = {0: (30, 20), 1: (20, 35), 2: (20, 20), 3: (12, 9), "png": (30, 20)}[kind]
            assert img.size == expected, (path, img.size)


def test_other_formats_become_jpegs_under_names_of_their_own(tmp_path):
    src = photo_folder(tmp_path / "src", per_class=2)
    for name in ("cats", "dogs", "owls"):  # a grayscale PNG named as a JPEG is
        Image.new("L", (30, 40), 128).save(src / name / f"000_{name}.png")
        (src / "LICENSE.txt").write_text((src / "LICENSE.txt").read_text() + credit(f"{name}/000_{name}.png") + "\n")
    every = make_sample.make_sample(src, tmp_path / "all", per_class=4, short_side=20, log=lambda _: None)
    assert sorted(every["owls"]) == ["000_owls.jpg", "000_owls_png.jpg", "001_owls.jpg", "zz_clear.jpg"]
    with Image.open(tmp_path / "all" / "owls" / "000_owls_png.jpg") as img:
        assert img.mode == "RGB" and img.size == (20, 27)  # grayscale made RGB, 40 * 20 / 30 rounded
    for name in every:  # a transparent PNG lands on white, not on the black its invisible pixels hold
        with Image.open(tmp_path / "all" / name / "zz_clear.jpg") as img:
            assert min(img.getpixel((5, 5))) > 240
    credited = (tmp_path / "all" / "LICENSE.txt").read_text().splitlines()
    assert credit("owls/000_owls.png").replace("owls/000_owls.png", "owls/000_owls_png.jpg", 1) in credited


def test_the_license_keeps_each_kept_photos_line_and_the_header(tmp_path):
    src = photo_folder(tmp_path / "src")
    make_sample.make_sample(src, tmp_path / "out", per_class=5, short_side=20, log=lambda _: None)
    lines = (tmp_path / "out" / "LICENSE.txt").read_text(encoding="utf-8").splitlines()
    assert lines[:len(HEADER)] == HEADER and "creativecommons.org/licenses/by/2.0" in lines[1]
    credits = lines[len(HEADER):]
    files = written(tmp_path / "out")
    assert len(credits) == len(files) == 15
    assert {line.split()[0] for line in credits} == files
    for line in credits:
        path = line.split()[0]
        original = path.replace("zz_clear.jpg", "zz_clear.png")
        assert line == credit(original).replace(original, path, 1)  # the photographer, renamed where the file was


def test_the_same_command_makes_the_same_sample(tmp_path):
    src = photo_folder(tmp_path / "src", per_class=9)
    a = make_sample.make_sample(src, tmp_path / "a", per_class=3, short_side=16, log=lambda _: None)
    b = make_sample.make_sample(src, tmp_path / "b", per_class=3, short_side=16, log=lambda _: None)
    assert a == b
    for rel in written(tmp_path / "a"):
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()
    assert (tmp_path / "a" / "LICENSE.txt").read_bytes() == (tmp_path / "b" / "LICENSE.txt").read_bytes()
    # Another seed picks other photos; one class's choice does not depend on the other classes.
    other = make_sample.make_sample(src, tmp_path / "c", per_class=3, short_side=16, seed=1, log=lambda _: None)
    assert other != a
    (tmp_path / "src" / "owls" / "000_owls.jpg").unlink()
    fewer = make_sample.make_sample(src, tmp_path / "d", per_class=3, short_side=16, log=lambda _: None)
    assert fewer["cats"] == a["cats"] and fewer["dogs"] == a["dogs"]


def test_without_a_license_none_is_written_and_the_command_says_so(tmp_path):
    src = photo_folder(tmp_path / "src", license=False)
    said = []
    make_sample.make_sample(src, tmp_path / "out", per_class=2, short_side=16, log=said.append)
    assert not (tmp_path / "out" / "LICENSE.txt").exists()
    assert len(written(tmp_path / "out")) == 6
    assert any("no LICENSE.txt" in line and "none was written" in line for line in said), said


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("no classes", "no images found"),
    ("too few", "fewer than 8 photos in cats (7), dogs (7), owls (7)"),
    ("dest not empty", "already exists and is not an empty folder"),
    ("dest inside source", "inside the source folder"),
    ("uncredited", "credits no one for 3 chosen photo(s): dogs/"),
    ("unreadable", "cannot read"),
])
def test_a_bad_folder_is_an_error_and_leaves_nothing_behind(tmp_path, case, message):
    src = photo_folder(tmp_path / "src")
    dest, per_class = tmp_path / "out", 3
    if case == "missing":
        src = tmp_path / "nowhere"
    elif case == "no classes":
        src = tmp_path / "empty"
        (src / "cats").mkdir(parents=True)
        (src / "cats" / "notes.txt").write_text("no photos")
    elif case == "too few":
        per_class = 8
    elif case == "dest not empty":
        dest.mkdir()
        (dest / "keep.txt").write_text("mine")
    elif case == "dest inside source":
        dest = src / "sample"
    elif case == "uncredited":
        text = (src / "LICENSE.txt").read_text(encoding="utf-8")
        (src / "LICENSE.txt").write_text("\n".join(line for line in text.splitlines() if not line.startswith("dogs/")))
    elif case == "unreadable":
        per_class = 7
        (src / "owls" / "zz_clear.png").write_bytes(b"not an image")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(make_sample.SampleError, match=re.escape(message)):
        make_sample.make_sample(src, dest, per_class=per_class, short_side=16, log=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no half-written folder, no temporary one
    if case == "dest not empty":
        assert [p.name for p in dest.iterdir()] == ["keep.txt"]


def test_the_command_line(tmp_path):
    src = photo_folder(tmp_path / "src")
    ok = subprocess.run([sys.executable, str(REPO / "make_sample.py"), str(src), str(tmp_path / "out"),
                         "--per-class", "2", "--short-side", "16"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "wrote 6 photos (2 per class, 3 classes, short side 16 px" in ok.stdout
    bad = subprocess.run([sys.executable, str(REPO / "make_sample.py"), str(tmp_path / "nowhere"),
                          str(tmp_path / "out2"), "--per-class", "2", "--short-side", "16"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("make_sample.py: error: ") and "Traceback" not in bad.stderr


def test_the_bundled_quick_start_sample_is_what_the_docstring_says():
    command = re.search(r"python make_sample.py \S+ (\S+) --per-class (\d+) --short-side (\d+)",
                        make_sample.__doc__)
    assert command, make_sample.__doc__
    dest, per_class, short_side = REPO / command[1], int(command[2]), int(command[3])
    assert dest == QUICK
    classes = sorted(d.name for d in QUICK.iterdir() if d.is_dir())
    assert classes == ["daisy", "dandelion", "roses", "sunflowers", "tulips"]
    files = written(QUICK)
    assert len(files) == per_class * len(classes)
    for rel in files:
        with Image.open(QUICK / rel) as img:
            assert min(img.size) == short_side, rel
    lines = (QUICK / "LICENSE.txt").read_text(encoding="utf-8").splitlines()
    assert "creativecommons.org/licenses/by/2.0" in lines[1]
    credited = [line.split()[0] for line in lines if make_sample.CREDIT_LINE.match(line)]
    assert sorted(credited) == sorted(files)
    assert all(line.split()[1] == "CC-BY" for line in lines if make_sample.CREDIT_LINE.match(line))
