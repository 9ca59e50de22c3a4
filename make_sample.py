"""Make a small training sample from a folder of photos: N photos per class, shrunk.

    python make_sample.py SOURCE DEST --per-class N --short-side S [--seed 0] [--quality 90]

SOURCE holds one sub-folder per class (as `--data-path` does). From each class, N photos are
chosen reproducibly: the file names are sorted and a random choice seeded by `--seed` and the
class's name picks N of them, so the same command always picks the same photos, and one class's
choice does not depend on the others. Each photo is turned upright (EXIF), made RGB, shrunk so
that its short side is S px (never enlarged) and written as DEST/<class>/<name>.jpg (JPEG,
quality 90). DEST must not exist yet, or be empty; it is written whole or not at all.

Attribution: if SOURCE has a LICENSE.txt in the form of `flower_photos`' (a header, then one
line per photo, `class/file.jpg CC-BY by NAME - URL`), DEST/LICENSE.txt gets the same header and
the line of every photo kept, renamed where the file was. A photo the source's LICENSE.txt does
not credit is an error. Without a LICENSE.txt in SOURCE none is written, and the command says
so: crediting the photos is then up to you.

Lists and decodes photos as training does (utils.image_files, utils.load_rgb). The quick-start sample, data/flower_photos_quick/,
was made from 800 development photos of `flower_photos` (160 per class; short sides 143
to 425 px) with:

    python make_sample.py DEV_PHOTOS data/flower_photos_quick --per-class 100 --short-side 72

where DEV_PHOTOS is that folder of 800 originals (not part of this repository; any folder of
class sub-folders with a flower_photos LICENSE.txt works the same way).
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import sys
import tempfile
from pathlib import Path

from PIL import Image

from utils import IMG_EXTENSIONS, image_files, load_rgb

LICENSE_FILE = "LICENSE.txt"
# A credit line starts with the photo's path below the data folder: `class/file.ext ...`.
CREDIT_LINE = re.compile(r"^(\S+/\S+\.\w+)(\s.*)$")


class SampleError(Exception):
    """A problem with what was asked: reported on one line, exit code 2."""


def class_photos(source: Path) -> dict[str, list[str]]:
    """Class name -> the photos below its folder (paths relative to it, '/'-separated), sorted.
    Hidden files and folders, and files that are not images by extension, are skipped."""
    if not source.is_dir():
        raise SampleError(f"source folder {str(source)!r} does not exist or is not a folder")
    classes = sorted(d.name for d in source.iterdir() if d.is_dir() and not d.name.startswith("."))
    photos: dict[str, list[str]] = {}
    for name in classes:
        found = [Path(p).relative_to(source / name).as_posix() for p in image_files(source / name)]
        if found:
            photos[name] = sorted(found)
    if not photos:
        raise SampleError(f"no images found in {str(source)!r}: expected one sub-folder per class "
                          f"holding {', '.join(IMG_EXTENSIONS)} files")
    return photos


def choose(files: list[str], per_class: int, seed: int, class_name: str) -> list[str]:
    """`per_class` of `files`, the same for the same seed and class whatever the other classes."""
    return sorted(random.Random(f"{seed}:{class_name}").sample(files, per_class))


def read_license(path: Path) -> tuple[list[str], dict[str, str]]:
    """The header lines (up to the first credit line) and each credited path's line."""
    header: list[str] = []
    credits: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        match = CREDIT_LINE.match(line)
        if match:
            credits[match.group(1)] = line
        elif not credits:
            header.append(line)
    return header, credits


def output_names(chosen: list[str]) -> dict[str, str]:
    """Source path -> output path, always .jpg: `a.png` becomes `a.jpg`, or `a_png.jpg` where
    another chosen file already takes `a.jpg`."""
    names: dict[str, str] = {}
    taken: set[str] = set()
    plain = [f for f in chosen if f.lower().endswith((".jpg", ".jpeg"))]
    for f in plain + [f for f in chosen if f not in plain]:
        stem, ext = os.path.splitext(f)
        out = stem + ".jpg"
        if out in taken:
            out = f"{stem}_{ext[1:].lower()}.jpg"
        if out in taken:
            raise SampleError(f"two photos would both be written as {out!r}: rename one")
        taken.add(out)
        names[f] = out
    return names


def shrink(path: Path, short_side: int) -> Image.Image:
    """The photo upright, in RGB, its short side `short_side` px (smaller photos kept as they are)."""
    img = load_rgb(str(path))  # as training decodes it: upright, 16-bit grey scaled, transparency on white
    width, height = img.size
    if min(width, height) > short_side:
        scale = short_side / min(width, height)
        size = (short_side, max(1, round(height * scale))) if width <= height else \
               (max(1, round(width * scale)), short_side)
        img = img.resize(size, Image.Resampling.LANCZOS)
    return img


def make_sample(source: str | Path, dest: str | Path, per_class: int, short_side: int,
                seed: int = 0, quality: int = 90, log=print) -> dict[str, list[str]]:
    """Write the sample; return class name -> the output paths written (relative to the class)."""
    source, dest = Path(source), Path(dest)
    if per_class < 1 or short_side < 1:
        raise SampleError("--per-class and --short-side must be at least 1")
    if not 1 <= quality <= 100:
        raise SampleError("--quality must be between 1 and 100")
    photos = class_photos(source)
    if dest.resolve() == source.resolve() or source.resolve() in dest.resolve().parents:
        raise SampleError(f"destination {str(dest)!r} is inside the source folder: it would become a class")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise SampleError(f"destination {str(dest)!r} already exists and is not an empty folder")
    short = {name: len(files) for name, files in photos.items() if len(files) < per_class}
    if short:
        raise SampleError(f"fewer than {per_class} photos in "
                          + ", ".join(f"{name} ({n})" for name, n in short.items()))
    chosen = {name: choose(files, per_class, seed, name) for name, files in photos.items()}
    names = {name: output_names(files) for name, files in chosen.items()}

    license_path = source / LICENSE_FILE
    credit_lines: list[str] | None = None
    if license_path.is_file():
        header, credits = read_license(license_path)
        missing = [f"{name}/{f}" for name, files in chosen.items() for f in files if f"{name}/{f}" not in credits]
        if missing:
            raise SampleError(f"{license_path} credits no one for {len(missing)} chosen photo(s): "
                              f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        credit_lines = header + [
            credits[f"{name}/{f}"].replace(f"{name}/{f}", f"{name}/{names[name][f]}", 1)
            for name, files in chosen.items() for f in files]

    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        kept_small = 0
        for name, files in chosen.items():
            for f in files:
                try:
                    img = shrink(source / name / f, short_side)
                except (OSError, ValueError, Image.DecompressionBombError) as exc:
                    raise SampleError(f"cannot read {source / name / f}: {exc}") from None
                kept_small += min(img.size) < short_side
                out = work / name / names[name][f]
                out.parent.mkdir(parents=True, exist_ok=True)
                img.save(out, "JPEG", quality=quality, optimize=True)
        if credit_lines is not None:
            (work / LICENSE_FILE).write_text("\n".join(credit_lines) + "\n", encoding="utf-8")
        if dest.exists():
            dest.rmdir()  # empty, checked above
        os.replace(work, dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    total = sum(len(files) for files in chosen.values())
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    log(f"wrote {total} photos ({per_class} per class, {len(chosen)} classes, short side {short_side} px, "
        f"{size / 1e6:.1f} MB) to {dest}")
    if kept_small:
        log(f"note: {kept_small} photo(s) were smaller than {short_side} px on the short side and kept at their size")
    if credit_lines is None:
        log(f"note: {source} has no {LICENSE_FILE}, so none was written: crediting the photos is up to you")
    else:
        log(f"{dest / LICENSE_FILE} credits the author of each of the {total} photos")
    return {name: [names[name][f] for f in files] for name, files in chosen.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make_sample.py", description=__doc__.split("\n\n")[0],
        epilog="Example: python make_sample.py my_images my_sample --per-class 100 --short-side 72")
    parser.add_argument("source", help="a folder with one sub-folder of photos per class")
    parser.add_argument("dest", help="the sample's folder, written as DEST/<class>/<name>.jpg (must be new or empty)")
    parser.add_argument("--per-class", type=int, required=True, help="photos taken from each class")
    parser.add_argument("--short-side", type=int, required=True, help="each photo's short side after shrinking, px")
    parser.add_argument("--seed", type=int, default=0, help="seeds the choice of photos (default 0)")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality (default 90)")
    args = parser.parse_args(argv)
    try:
        make_sample(args.source, args.dest, args.per_class, args.short_side, args.seed, args.quality)
    except SampleError as exc:
        print(f"make_sample.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
