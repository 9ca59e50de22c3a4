"""predict.py on a checkpoint from a real training run: table and JSON output, bad files, user mistakes."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import SAMPLE, call_main, copy_sample, metrics, ok, run_cli, train_here, user_error

import predict
from multi_train_utils.checkpoint import load_checkpoint
from utils import list_images, split_samples

pytestmark = pytest.mark.slow  # every test uses a checkpoint from a real training run

CLASSES = ["daisy", "dandelion", "roses", "sunflowers", "tulips"]
A_JPEG = {name: str(min((SAMPLE / name).glob("*.jpg"))) for name in CLASSES}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    ok(train_here(out, "--epochs", "1"))
    return out / "best.pth"


def predict_cli(checkpoint, *argv: str):
    return run_cli([sys.executable, "predict.py", "--checkpoint", str(checkpoint), *argv])


def predict_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """predict.main() in this process (no interpreter start-up): exit code, stdout, stderr."""
    with pytest.raises(SystemExit) as exit_info:
        call_main(predict.main, argv)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def predict_json(checkpoint, capsys, *argv: str) -> list[dict]:
    code, out, err = predict_main(["--checkpoint", str(checkpoint), "--json", "--workers", "0", *argv], capsys)
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


def check_top(top: list[tuple[str, float]], k: int) -> None:
    classes = [c for c, _ in top]
    probs = [p for _, p in top]
    assert len(top) == k and len(set(classes)) == k
    assert set(classes) <= set(CLASSES)
    assert probs == sorted(probs, reverse=True)
    assert all(0 <= p <= 1 for p in probs) and sum(probs) <= 1 + 1e-5


def test_table_for_a_folder_and_single_files(checkpoint):
    daisies = sorted(str(p) for p in (SAMPLE / "daisy").glob("*.jpg"))
    rose = A_JPEG["roses"]
    result = ok(predict_cli(checkpoint, str(SAMPLE / "daisy"), rose, "--workers", "1"))
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == daisies + [rose]  # folder in sorted order, then the file
    for line in lines:
        fields = line.split()[1:]
        check_top([(c, float(p)) for c, p in zip(fields[::2], fields[1::2])], 3)
    # Aligned: every line's first class starts in the same column.
    assert len({len(line) - len(line.split(maxsplit=1)[1]) for line in lines}) == 1
    assert result.stderr == ""


def test_json_lines_for_the_whole_sample(checkpoint, capsys):
    records = predict_json(checkpoint, capsys, str(SAMPLE), "--top-k", "2", "--batch-size", "16")
    _, samples = list_images(str(SAMPLE))
    assert [r["path"] for r in records] == sorted(p for p, _ in samples)  # LICENSE.txt is no image
    for r in records:
        assert set(r) == {"path", "top"} and all(set(t) == {"class", "prob"} for t in r["top"])
        check_top([(t["class"], t["prob"]) for t in r["top"]], 2)


def test_top_k_is_clamped_to_the_classes(checkpoint, capsys):
    (record,) = predict_json(checkpoint, capsys, A_JPEG["tulips"], "--top-k", "50")
    check_top([(t["class"], t["prob"]) for t in record["top"]], len(CLASSES))
    assert sorted(t["class"] for t in record["top"]) == load_checkpoint(checkpoint)["class_names"] == CLASSES
    assert sum(t["prob"] for t in record["top"]) == pytest.approx(1, abs=1e-5)


def test_agrees_with_the_validation_the_run_reported(checkpoint, capsys):
    """Top-1 over the run's validation images, in its order and batch size, gets exactly the
    number right that training reported: same weights, same transform, same eval mode."""
    split = split_samples(*reversed(list_images(str(SAMPLE))), val_rate=0.2, seed=0)
    records = predict_json(checkpoint, capsys, *[p for p, _ in split.val], "--top-k", "1", "--batch-size", "8")
    predicted = [r["top"][0]["class"] for r in records]
    correct = sum(c == split.class_names[label] for c, (_, label) in zip(predicted, split.val))
    assert correct == metrics(checkpoint.parent)[0]["val_correct"]


def test_unreadable_files_are_named_and_the_rest_still_predicted(checkpoint, tmp_path):
    folder = copy_sample(tmp_path / "photos", classes=["daisy", "roses"], per_class=2)
    (folder / "nested" / ".hidden").mkdir(parents=True)
    shutil.copy(A_JPEG["tulips"], folder / "nested" / "TULIP.JPG")  # extensions are case-insensitive
    shutil.copy(A_JPEG["tulips"], folder / "nested" / ".hidden" / "skipped.jpg")
    (folder / "nested" / ".skipped.jpg").write_bytes(b"")
    (folder / "notes.txt").write_text("not an image, not a candidate")
    (folder / "broken.jpg").write_text("this is text, not a JPEG")
    data = Path(A_JPEG["daisy"]).read_bytes()
    (folder / "truncated.jpg").write_bytes(data[: len(data) // 3])
    result = predict_cli(checkpoint, str(folder), str(tmp_path / "missing.jpg"), "--json")
    assert result.returncode == 1, result.stderr
    warnings = result.stderr.splitlines()
    assert len(warnings) == 3 and all(line.startswith("warning: cannot read ") for line in warnings), result.stderr
    assert {line.split()[3].rstrip(":") for line in warnings} == {
        str(tmp_path / "missing.jpg"), str(folder / "broken.jpg"), str(folder / "truncated.jpg")}
    predicted = [json.loads(line)["path"] for line in result.stdout.splitlines()]
    good = [str(p) for p in folder.glob("[dr]*/*.jpg")] + [str(folder / "nested" / "TULIP.JPG")]
    assert sorted(predicted) == sorted(good) and len(good) == 5


def test_user_mistakes(checkpoint, tmp_path, capsys):
    image = A_JPEG["daisy"]
    assert "does not exist" in user_error(predict.main, ["--checkpoint", str(tmp_path / "nope.pth"), image], capsys)
    (tmp_path / "notes.pth").write_text("not a checkpoint")
    assert "cannot read checkpoint" in user_error(predict.main, ["--checkpoint", str(tmp_path / "notes.pth"), image], capsys)
    torch.save({"step": 3}, tmp_path / "other.pth")
    assert "not a training checkpoint" in user_error(predict.main, ["--checkpoint", str(tmp_path / "other.pth"), image], capsys)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no images here")
    assert "no image found" in user_error(predict.main, ["--checkpoint", str(checkpoint), str(tmp_path / "empty")], capsys)
    assert "at least 1" in user_error(predict.main, ["--checkpoint", str(checkpoint), image, "--top-k", "0"], capsys)


@pytest.fixture(scope="module")
def onnx_model(checkpoint, tmp_path_factory):
    output = tmp_path_factory.mktemp("onnx") / "flowers.onnx"
    result = ok(run_cli([sys.executable, "export.py", "--checkpoint", str(checkpoint), "--output", str(output)]))
    return output, result.stdout


@pytest.mark.parametrize("fmt, suffix", [("onnx", ".onnx"), ("export", ".pt2"), ("torchscript", ".torchscript.pt")])
def test_export_writes_a_model_and_its_description(checkpoint, onnx_model, tmp_path, fmt, suffix):
    if fmt == "onnx":
        output, stdout = onnx_model
        tmp_path = output.parent
    else:
        output = tmp_path / f"flowers{suffix}"
        stdout = ok(run_cli([sys.executable, "export.py", "--checkpoint", str(checkpoint), "--format", fmt,
                             "--output", str(output)])).stdout
    assert f"wrote {output} and {output}.json" in stdout
    description = json.loads(Path(f"{output}.json").read_text())
    assert description["format"] == fmt and description["class_names"] == CLASSES and description["img_size"] == 32
    assert description["preprocessing"]["mean"] == [0.485, 0.456, 0.406] and description["input"]["shape"][0] == "batch"
    assert description["check"]["images"] == 16 and description["check"]["largest_relative_difference"] <= 1e-3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([output.name, f"{output.name}.json"])


def test_predict_gives_the_same_top_1_from_the_onnx_model(checkpoint, onnx_model, capsys):
    output, _ = onnx_model
    from_checkpoint = predict_json(checkpoint, capsys, str(SAMPLE), "--top-k", "1")
    from_onnx = predict_json(output, capsys, str(SAMPLE), "--top-k", "1")
    assert len(from_onnx) == 120
    assert [(r["path"], r["top"][0]["class"]) for r in from_onnx] == [(r["path"], r["top"][0]["class"])
                                                                      for r in from_checkpoint]
    for a, b in zip(from_checkpoint, from_onnx):
        assert a["top"][0]["prob"] == pytest.approx(b["top"][0]["prob"], abs=1e-4)


def test_an_export_that_disagrees_is_not_kept(checkpoint, tmp_path):
    """ONNX Runtime's arithmetic differs from PyTorch's in the last bits, so a tolerance of 0
    refuses it: the error names the difference, and no file is left behind."""
    output = tmp_path / "model.onnx"
    result = run_cli([sys.executable, "export.py", "--checkpoint", str(checkpoint), "--output", str(output),
                      "--tolerance", "0"])
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "error: the exported model's logits differ from PyTorch's by up to" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_onnx_without_its_packages_or_description_is_a_clear_error(checkpoint, tmp_path, capsys):
    script = ("import sys; sys.modules['onnxscript'] = sys.modules['onnxruntime'] = None\n"
              "sys.argv = ['export.py', '--checkpoint', sys.argv[1], '--output', sys.argv[2]]\n"
              "import export; export.main()\n")
    result = run_cli([sys.executable, "-c", script, str(checkpoint), str(tmp_path / "model.onnx")])
    assert result.returncode == 2 and "requirements-export.txt" in result.stderr, result.stderr[-2000:]
    (tmp_path / "lonely.onnx").write_bytes(b"")
    line = user_error(predict.main, ["--checkpoint", str(tmp_path / "lonely.onnx"), A_JPEG["daisy"]], capsys)
    assert "needs its description" in line and "lonely.onnx.json" in line
