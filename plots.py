"""Pictures of a training run: learning curves, the class balance, and what augmentation feeds the net.

    python plots.py runs/single-20240101-120000                 # redraw its PNGs in the run folder
    python plots.py runs/single-a runs/launch-b --out plots/    # each run's PNGs, plus plots/compare.png

A run folder gets curves.png, class_distribution.png and augmented_samples.png, and from its
evaluation report confusion_matrix.png and mistakes.png. A training run draws them in a process
beside it (outputs/plotter.py: the data's pictures once its split is recorded, the
rest at its end), and this command redraws them from the run's metrics.jsonl, split.json and
report.json. Without matplotlib the plots are skipped with a message and training is unaffected.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from my_dataset import MyDataSet, train_transforms
from utils import (
    CONFIG_FILE,
    METRICS_FILE,
    REPORT_FILE,
    SPLIT_FILE,
    DataSplit,
    UserError,
    exit_on_error,
    load_rgb,
    load_split,
    read_json,
    read_metrics,
)

MISSING_MATPLOTLIB = "matplotlib is not installed: plots skipped (pip install matplotlib)"
MAX_SAMPLES = 16
Log = Callable[[str], None]


def figure_class() -> Any:
    """matplotlib's Figure, or None. Figures made without pyplot render with Agg, need no
    display and leave the process's global backend alone (this may run inside training)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure


def save_png(fig: Any, path: Path) -> None:
    # zlib's fastest level: photos barely compress (mistakes.png: 1.6 MB against 1.4 MB at the
    # default level 6, written in a fifth of the time), and the line plots stay small either way.
    fig.savefig(path, dpi=100, pil_kwargs={"compress_level": 1})


def plot_curves(records: list[dict[str, Any]], path: Path) -> None:
    Figure = figure_class()
    epochs = [r["epoch"] for r in records]
    fig = Figure(figsize=(15, 4.2), layout="constrained")
    loss, acc, lr = fig.subplots(1, 3)
    # A one-epoch run is one point per line: markers keep it visible.
    loss.plot(epochs, [r["train_loss"] for r in records], "o-", label="train (label-smoothed)")
    loss.plot(epochs, [r["val_loss"] for r in records], "o-", label="val")
    loss.set(title="loss", xlabel="epoch", yscale="log")  # an early val_loss spike would flatten the rest
    acc.plot(epochs, [r["train_acc"] for r in records], "o-", label="train")
    acc.plot(epochs, [r["val_acc"] for r in records], "o-", label="val")
    acc.set(title="accuracy", xlabel="epoch", ylim=(0, 1.02))
    lr.plot(epochs, [r["lr"] for r in records], "o-", color="tab:green")
    lr.set(title="learning rate at the end of each epoch", xlabel="epoch")
    lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    for ax in (loss, acc, lr):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    loss.legend()
    acc.legend()
    save_png(fig, path)


def plot_class_distribution(split: DataSplit, path: Path) -> None:
    Figure = figure_class()
    names = split.class_names
    x = list(range(len(names)))
    width = 0.4
    fig = Figure(figsize=(max(6.0, 0.9 * len(names) + 2), 4.5), layout="constrained")
    ax = fig.subplots()
    for offset, (label, samples) in zip((-width / 2, width / 2), (("train", split.train), ("val", split.val))):
        counts = [0] * len(names)
        for _, class_index in samples:
            counts[class_index] += 1
        bars = ax.bar([i + offset for i in x], counts, width, label=f"{label} ({len(samples)})")
        ax.bar_label(bars, fontsize=8)
    ax.set_xticks(x, names, rotation=30 if len(names) > 8 else 0, ha="right" if len(names) > 8 else "center")
    ax.set(title="images per class", ylabel="images")
    ax.margins(y=0.2)  # room for the counts and the legend above the tallest bar
    ax.legend(loc="upper center", ncols=2)
    save_png(fig, path)


def plot_augmented_samples(split: DataSplit, config: Mapping[str, Any], path: Path) -> None:
    """Training images exactly as epoch 1 fed them to the net, with the run's configuration
    (`config`: its crop sizes, its augmentation and seed): the (epoch, index) keys seed the
    augmentation as the training loop does, so the picture is deterministic."""
    Figure = figure_class()
    transforms = train_transforms(config)
    dataset = MyDataSet(split.train, transforms, config["img_size"], config.get("seed", 0))
    count = min(MAX_SAMPLES, len(dataset))
    # Evenly spaced through the (class-sorted) training list, so every class shows up.
    indices = [i * len(dataset) // count for i in range(count)]
    columns = min(4, count)
    rows = -(-count // columns)
    fig = Figure(figsize=(2.2 * columns, 2.4 * rows), layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).flat
    for ax, index in zip(axes, indices):
        image, label = dataset[(1, index)]  # uint8 pixels: normalising happens later, on the device
        ax.imshow(image.permute(1, 2, 0).numpy())
        ax.set_title(split.class_names[label], fontsize=9)
    for ax in fig.axes:
        ax.axis("off")
    fig.suptitle(f"augmented training images, epoch 1 ({transforms.sizes(1)} px)")
    save_png(fig, path)


def plot_confusion_matrix(report: dict[str, Any], path: Path) -> None:
    """Counts, and the same rows normalised (each row: where that class's images went)."""
    Figure = figure_class()
    names, counts = report["class_names"], report["confusion_matrix"]
    rates = [[c / max(1, sum(row)) for c in row] for row in counts]
    side = max(4.5, 0.6 * len(names) + 2.5)
    fig = Figure(figsize=(2 * side, side), layout="constrained")
    for ax, values, title, text in zip(fig.subplots(1, 2), (counts, rates), ("images", "share of the true class"),
                                       ("{:d}", "{:.2f}")):
        ax.imshow(values, cmap="Blues", vmin=0)
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
        ax.set_yticks(range(len(names)), names)
        ax.set(xlabel="predicted", ylabel="true", title=title)
        peak = max(max(row) for row in values) or 1
        if len(names) <= 20:  # beyond that the numbers would not fit their cells
            for i, row in enumerate(values):
                for j, value in enumerate(row):
                    ax.text(j, i, text.format(value), ha="center", va="center", fontsize=8,
                            color="white" if value > peak / 2 else "black")
    fig.suptitle(f"{report['weights']}: accuracy {report['accuracy']:.3f}, macro F1 {report['macro_f1']:.3f}",
                 fontsize=9)
    save_png(fig, path)


def plot_mistakes(report: dict[str, Any], path: Path) -> None:
    """The most confidently wrong validation images, each with its true and predicted class."""
    Figure = figure_class()
    mistakes = report["mistakes"]
    columns = max(1, min(4, len(mistakes)))
    rows = max(1, -(-len(mistakes) // columns))
    fig = Figure(figsize=(2.6 * columns, 2.9 * rows), layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).flat
    for ax, mistake in zip(axes, mistakes):
        image = load_rgb(mistake["path"], min_size=128)
        image.thumbnail((256, 256))
        ax.imshow(image)
        ax.set_title(f"true: {mistake['true']}\npredicted: {mistake['predicted']} ({mistake['probability']:.2f})",
                     fontsize=8)
    for ax in fig.axes:
        ax.axis("off")
    if not mistakes:
        fig.axes[0].text(0.5, 0.5, "no validation image was misclassified", ha="center", va="center")
    fig.suptitle(f"most confidently wrong: {report['weights']}", fontsize=9)
    save_png(fig, path)


def save_report_plots(run_dir: Path, log: Log = print, out_dir: Path | None = None) -> list[Path]:
    """confusion_matrix.png and mistakes.png from the run's report.json, if it has one; never raises."""
    if figure_class() is None:
        log(MISSING_MATPLOTLIB)
        return []
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir
    try:
        report = read_json(run_dir / REPORT_FILE)
    except (OSError, ValueError) as e:
        log(f"warning: cannot read {run_dir / REPORT_FILE}: {type(e).__name__}: {e}")
        return []
    if not report:
        return []
    return [path for path in (draw(out_dir / "confusion_matrix.png", plot_confusion_matrix, report, log=log),
                              draw(out_dir / "mistakes.png", plot_mistakes, report, log=log)) if path]


def draw(path: Path, plot: Callable[..., None], *args: Any, log: Log) -> Path | None:
    """`plot(*args, path)`, or a logged warning: a picture must never fail the run that draws it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        plot(*args, path)
    except Exception as e:  # noqa: BLE001
        log(f"warning: could not draw {path}: {type(e).__name__}: {e}")
        return None
    return path


def save_run_plots(
    run_dir: Path,
    split: DataSplit | None = None,
    img_size: int | None = None,
    seed: int = 0,
    log: Log = print,
    out_dir: Path | None = None,
) -> list[Path]:
    """Draw curves.png, class_distribution.png and augmented_samples.png, and the report's
    pictures where the run has a report.json, into `out_dir` (default: `run_dir`); return the
    files written.

    Without `split`, the split, image size and seed are the run's own, from its split.json and
    config.json. Never raises for a plot: a failure is logged and the other plots are still
    drawn, so a training run cannot fail because of a picture.
    """
    if figure_class() is None:
        log(MISSING_MATPLOTLIB)
        return []
    return (save_curves(run_dir, log, out_dir) + save_data_plots(run_dir, split, img_size, seed, log, out_dir)
            + save_report_plots(run_dir, log, out_dir))


def save_curves(run_dir: Path, log: Log = print, out_dir: Path | None = None) -> list[Path]:
    """curves.png from the run's metrics.jsonl; never raises."""
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir
    try:
        records = read_metrics(run_dir)
    except (OSError, ValueError, KeyError, TypeError) as e:
        log(f"warning: no curves for {run_dir}: {type(e).__name__}: {e}")
        return []
    if not records:
        log(f"{run_dir / METRICS_FILE} holds no epoch yet: curves.png skipped")
        return []
    return [path for path in (draw(out_dir / "curves.png", plot_curves, records, log=log),) if path]


def save_data_plots(run_dir: Path, split: DataSplit | None = None, img_size: int | None = None, seed: int = 0,
                    log: Log = print, out_dir: Path | None = None) -> list[Path]:
    """class_distribution.png and augmented_samples.png: what the run trains on, known before
    its first step. Without `split`, the run's split.json and config.json; never raises."""
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        config = read_json(run_dir / CONFIG_FILE)
        if split is None and (run_dir / SPLIT_FILE).is_file():
            split = load_split(run_dir / SPLIT_FILE)
    except (OSError, ValueError, KeyError, TypeError) as e:
        log(f"warning: no plots of the data for {run_dir}: {type(e).__name__}: {e}")
        return []
    if split is None:
        log(f"{run_dir / SPLIT_FILE} is missing: class_distribution.png and augmented_samples.png skipped")
        return []
    written = [draw(out_dir / "class_distribution.png", plot_class_distribution, split, log=log)]
    img_size = img_size or config.get("img_size")
    missing = next((p for p, _ in split.train if not Path(p).is_file()), None)
    if missing is not None:
        where = "" if Path(missing).is_absolute() else f" (relative to {Path.cwd()})"
        log(f"training image {missing!r}{where} of {run_dir} is not there: augmented_samples.png skipped")
    elif img_size:
        written.append(draw(out_dir / "augmented_samples.png", plot_augmented_samples, split,
                            {**config, "img_size": img_size, "seed": config.get("seed", seed)}, log=log))
    return [path for path in written if path]


def run_label(run_dir: Path) -> str:
    config = read_json(run_dir / CONFIG_FILE)
    if "launcher" not in config:
        return run_dir.name
    return f"{run_dir.name} ({config['launcher']}, world size {config.get('world_size', '?')})"


def plot_compare(run_dirs: list[Path], path: Path) -> None:
    """val_acc and train/val loss per epoch, one colour per run."""
    Figure = figure_class()
    fig = Figure(figsize=(13, 4.8), layout="constrained")
    acc, loss = fig.subplots(1, 2)
    for i, run_dir in enumerate(run_dirs):
        records = read_metrics(run_dir)
        epochs = [r["epoch"] for r in records]
        color = f"C{i % 10}"
        label = run_label(run_dir)
        acc.plot(epochs, [r["val_acc"] for r in records], "o-", color=color, label=label)
        loss.plot(epochs, [r["val_loss"] for r in records], "o-", color=color, label=f"{label} val")
        loss.plot(epochs, [r["train_loss"] for r in records], "o--", color=color, alpha=0.6, label=f"{label} train")
    acc.set(title="validation accuracy", xlabel="epoch", ylim=(0, 1.02))
    loss.set(title="loss (solid: val, dashed: train, label-smoothed)", xlabel="epoch", yscale="log")
    for ax in (acc, loss):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=8)
    save_png(fig, path)


@exit_on_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="training run folders")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="folder for the PNGs (one run) or for compare.png (several; default: the first run)")
    args = parser.parse_args()
    for run_dir in args.runs:
        try:
            records = read_metrics(run_dir)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read {str(run_dir / METRICS_FILE)!r}: {e}") from None
        if not records:
            raise UserError(f"{str(run_dir)!r} is not a training run folder (no epochs in metrics.jsonl)")
    if figure_class() is None:
        raise UserError(MISSING_MATPLOTLIB)
    single = len(args.runs) == 1
    for run_dir in args.runs:
        for path in save_run_plots(run_dir, out_dir=args.out if single else None):
            print(f"wrote {path}")
    if not single:
        out = args.out or args.runs[0]
        out.mkdir(parents=True, exist_ok=True)
        plot_compare(args.runs, out / "compare.png")
        print(f"wrote {out / 'compare.png'}")


if __name__ == "__main__":
    main()
