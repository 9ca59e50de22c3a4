"""plots.py on real training runs: the PNGs of one run, the overlay of two, and life without matplotlib."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import FAST, SAMPLE, SMALL_MODEL, call_main, check_png, ok, run_cli, train

import plots
from outputs.report import draw_plots
from utils import list_images, split_samples

RUN_PLOTS = ("curves.png", "class_distribution.png", "augmented_samples.png")
REPORT_PLOTS = ("confusion_matrix.png", "mistakes.png")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A two-epoch single-process run with --plots and --report, which draws its pictures and its
    report at its end; and a one-epoch run with another seed and the default options, which
    draws neither."""
    root = tmp_path_factory.mktemp("runs")
    drawn, plain = root / "two_epochs", root / "seed_1"
    ok(train("single", drawn, *SMALL_MODEL, "--epochs", "2", "--plots", "--report"))
    ok(train("single", plain, *SMALL_MODEL, "--epochs", "1", "--seed", "1",
             fast=[arg for arg in FAST if arg != "--no-plots"]))
    assert all((drawn / name).is_file() for name in (*RUN_PLOTS, *REPORT_PLOTS, "report.json", "confusion_matrix.csv"))
    assert not list(plain.glob("*.png")) and not (plain / "report.json").exists()
    return drawn, plain


@pytest.mark.slow
def test_cli_redraws_the_plots_of_a_run(runs):
    run_dir, _ = runs
    result = ok(run_cli([sys.executable, "plots.py", str(run_dir)]))
    assert result.stdout.splitlines() == [f"wrote {run_dir / name}" for name in RUN_PLOTS + REPORT_PLOTS]
    check_png(run_dir / "curves.png", min_width=1000)
    check_png(run_dir / "class_distribution.png")
    check_png(run_dir / "augmented_samples.png", min_width=600, min_height=600)  # a 4 x 4 grid
    check_png(run_dir / "confusion_matrix.png", min_width=800)
    check_png(run_dir / "mistakes.png")


@pytest.mark.slow
def test_overlay_of_two_runs(runs, tmp_path, capsys):
    call_main(plots.main, [str(runs[0]), str(runs[1]), "--out", str(tmp_path / "out")])
    assert f"wrote {tmp_path / 'out' / 'compare.png'}" in capsys.readouterr().out
    check_png(tmp_path / "out" / "compare.png", min_width=800)
    # Each run's own pictures, in its folder: the report's where the run has one (--report).
    assert sorted(p.name for p in runs[0].glob("*.png")) == sorted(RUN_PLOTS + REPORT_PLOTS)
    assert sorted(p.name for p in runs[1].glob("*.png")) == sorted(RUN_PLOTS)


@pytest.mark.slow
def test_one_run_into_another_folder(runs, tmp_path):
    call_main(plots.main, [str(runs[0]), "--out", str(tmp_path / "elsewhere")])
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == sorted(RUN_PLOTS + REPORT_PLOTS)
    call_main(plots.main, [str(runs[1]), "--out", str(tmp_path / "no_report")])  # a run without --report
    assert sorted(p.name for p in (tmp_path / "no_report").iterdir()) == sorted(RUN_PLOTS)


@pytest.mark.slow
def test_the_call_training_makes_is_deterministic(runs, tmp_path, capsys):
    """draw_plots(output_dir), as rank 0 calls it at the end of a run with --plots: the augmented
    samples are keyed by (epoch, index), so drawing again from the run's files gives the pixels
    the run drew; so does save_run_plots given the split, size and seed."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("metrics.jsonl", "split.json", "config.json", "report.json"):
        shutil.copy(runs[0] / name, run_dir)
    draw_plots(run_dir)
    assert sorted(p.name for p in run_dir.glob("*.png")) == sorted(RUN_PLOTS + REPORT_PLOTS)
    assert capsys.readouterr().err == ""  # nothing failed
    pixels = check_png(run_dir / "augmented_samples.png")
    assert np.array_equal(pixels, check_png(runs[0] / "augmented_samples.png"))
    class_names, samples = list_images(str(SAMPLE))
    split = split_samples(samples, class_names, 0.2, 0)
    messages: list[str] = []
    again = plots.save_run_plots(run_dir, split, 32, 0, log=messages.append)
    assert again == [run_dir / name for name in RUN_PLOTS + REPORT_PLOTS] and messages == []
    assert np.array_equal(pixels, check_png(run_dir / "augmented_samples.png"))


@pytest.mark.slow
def test_without_the_images_the_split_is_still_drawn(runs, tmp_path):
    """The run folder moved to a machine without its images: split.json still gives the class
    balance; only the augmented samples need the pictures themselves."""
    run_dir = tmp_path / "moved"
    run_dir.mkdir()
    for name in ("metrics.jsonl", "config.json"):
        shutil.copy(runs[0] / name, run_dir)
    split = json.loads((runs[0] / "split.json").read_text())
    gone = {part: [[str(tmp_path / "gone" / Path(p).name), c] for p, c in split[part]] for part in ("train", "val")}
    (run_dir / "split.json").write_text(json.dumps({**split, **gone}))
    messages: list[str] = []
    written = plots.save_run_plots(run_dir, log=messages.append)
    assert written == [run_dir / "curves.png", run_dir / "class_distribution.png"]
    assert len(messages) == 1 and "is not there" in messages[0] and "augmented_samples.png skipped" in messages[0]
    for path in written:
        check_png(path)

    (run_dir / "split.json").unlink()
    messages.clear()
    assert plots.save_run_plots(run_dir, log=messages.append) == [run_dir / "curves.png"]
    assert len(messages) == 1 and "split.json is missing" in messages[0]


@pytest.mark.slow
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
            call_main(plots.main, argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
        assert "not a training run folder" in err
