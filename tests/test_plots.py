"""plots.py on real training runs: the PNGs of one run, the overlay of two, and life without matplotlib."""
from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
from conftest import SAMPLE, ok, run_cli, train
from PIL import Image

import plots
from utils import list_images, split_samples

RUN_PLOTS = ("curves.png", "class_distribution.png", "augmented_samples.png")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A two-epoch single-process run and a one-epoch run with another seed."""
    root = tmp_path_factory.mktemp("runs")
    ok(train("single", root / "two_epochs", "--epochs", "2"))
    ok(train("single", root / "seed_1", "--epochs", "1", "--seed", "1"))
    return root / "two_epochs", root / "seed_1"


def check_png(path, min_width: int = 400, min_height: int = 300) -> np.ndarray:
    with Image.open(path) as img:
        assert img.format == "PNG"
        assert min_width <= img.width <= 3000 and min_height <= img.height <= 3000, (path, img.size)
        pixels = np.asarray(img.convert("RGB"))
    assert pixels.std() > 10, f"{path} looks blank"
    return pixels


def plots_main(argv: list[str]) -> None:
    """plots.main() in this process: no interpreter start-up."""
    old = sys.argv
    sys.argv = ["plots.py", *argv]
    try:
        plots.main()
    finally:
        sys.argv = old


def test_cli_redraws_the_plots_of_a_run(runs):
    run_dir, _ = runs
    result = ok(run_cli([sys.executable, "plots.py", str(run_dir)]))
    assert result.stdout.splitlines() == [f"wrote {run_dir / name}" for name in RUN_PLOTS]
    check_png(run_dir / "curves.png", min_width=1000)
    check_png(run_dir / "class_distribution.png")
    check_png(run_dir / "augmented_samples.png", min_width=600, min_height=600)  # a 4 x 4 grid


def test_overlay_of_two_runs(runs, tmp_path, capsys):
    plots_main([str(runs[0]), str(runs[1]), "--out", str(tmp_path / "out")])
    assert f"wrote {tmp_path / 'out' / 'compare.png'}" in capsys.readouterr().out
    check_png(tmp_path / "out" / "compare.png", min_width=800)
    assert all((run_dir / name).is_file() for run_dir in runs for name in RUN_PLOTS)


def test_one_run_into_another_folder(runs, tmp_path):
    plots_main([str(runs[1]), "--out", str(tmp_path / "elsewhere")])
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == sorted(RUN_PLOTS)


def test_the_call_training_makes_is_deterministic(runs, tmp_path):
    """save_run_plots(output_dir, split, img_size, seed) as rank 0 calls it: the augmented
    samples are keyed by (epoch, index), so drawing twice gives the same pixels."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(runs[0] / "metrics.jsonl", run_dir)
    class_names, samples = list_images(str(SAMPLE))
    split = split_samples(samples, class_names, 0.2, 0)
    messages: list[str] = []
    first = plots.save_run_plots(run_dir, split, 32, 0, log=messages.append)
    pixels = check_png(run_dir / "augmented_samples.png")
    second = plots.save_run_plots(run_dir, split, 32, 0, log=messages.append)
    assert first == second == [run_dir / name for name in RUN_PLOTS] and messages == []
    assert np.array_equal(pixels, check_png(run_dir / "augmented_samples.png"))


def test_without_the_data_folder_only_curves_are_drawn(runs, tmp_path):
    run_dir = tmp_path / "moved"
    run_dir.mkdir()
    shutil.copy(runs[0] / "metrics.jsonl", run_dir)
    config = json.loads((runs[0] / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, "data_path": str(tmp_path / "gone")}))
    messages: list[str] = []
    assert plots.save_run_plots(run_dir, log=messages.append) == [run_dir / "curves.png"]
    assert len(messages) == 1 and "is not there" in messages[0] and "skipped" in messages[0]
    check_png(run_dir / "curves.png")


def test_without_matplotlib_plots_are_skipped(runs):
    script = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from pathlib import Path\n"
        "import plots\n"
        "print(plots.save_run_plots(Path(sys.argv[1])))\n"
        "sys.argv = ['plots.py', sys.argv[1]]\n"
        "plots.main()\n"
    )
    run_dir = runs[1]
    before = {p: p.stat().st_mtime_ns for p in run_dir.iterdir()}
    result = run_cli([sys.executable, "-c", script, str(run_dir)])
    assert result.stdout.splitlines() == [plots.MISSING_MATPLOTLIB, "[]"]
    assert result.returncode == 2 and result.stderr == f"error: {plots.MISSING_MATPLOTLIB}\n"
    assert {p: p.stat().st_mtime_ns for p in run_dir.iterdir()} == before  # nothing written


def test_bad_run_folders(tmp_path, capsys):
    for argv in ([str(tmp_path / "missing")], [str(tmp_path)]):
        with pytest.raises(SystemExit) as exit_info:
            plots_main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
        assert "not a training run folder" in err
