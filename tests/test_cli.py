"""The shared command line and the user mistakes it must turn into one `error:` line and exit 2."""
from __future__ import annotations

import argparse
import http.server
import re
import shutil
import tarfile
import threading

import pytest
import torch
from conftest import FAST, REPO, SAMPLE, call_main, copy_sample, launcher_cmd, run_cli, user_error

import train_multi_gpu_using_launch
import train_multi_gpu_using_spawn
import train_single_gpu
import utils
from multi_train_utils.config import DEFAULT_EPOCHS, get_args_parser
from speed import image_cache


def parse(*argv: str):
    return get_args_parser("test").parse_args(list(argv))


def test_boolean_flags_are_real_switches():
    assert parse().sync_bn is False
    assert parse("--sync-bn").sync_bn is True
    assert parse("--syncBN").sync_bn is True
    assert parse("--syncBN", "False").sync_bn is False  # the original scripts' type=bool made this True
    assert parse("--syncBN", "true").sync_bn is True
    assert parse("--sync-bn", "--no-sync-bn").sync_bn is False
    assert parse("--no-freeze-layers").freeze_layers is False
    assert parse("--freeze-layers", "--epochs", "3").freeze_layers is True
    with pytest.raises(SystemExit):
        parse("--syncBN", "maybe")


def test_aliases_and_defaults():
    args = parse("--num_classes", "5")
    assert args.num_classes == 5
    assert args.data_path == "dataset/flower_photos" and args.val_rate == 0.2 and args.img_size == 224
    # What a default run leaves out, each an option: the pictures, the report, the scaling
    # summary, the start-up decoding of every image.
    assert (args.plots, args.report, args.scaling, args.check_images) == (False, False, False, False)
    assert parse("--plots").plots and parse("--report").report and parse("--scaling").scaling
    assert parse("--check-images").check_images and parse("--plots", "--no-plots").plots is False


def test_every_launcher_documents_the_same_options(capsys):
    scripts = {"single": train_single_gpu, "launch": train_multi_gpu_using_launch,
               "spawn": train_multi_gpu_using_spawn}
    for launcher, script in scripts.items():
        try:
            call_main(script.main, ["--help"])  # the script's own main(), in this process
        except SystemExit as e:
            assert e.code == 0
        else:
            assert launcher == "launch"  # torch's @record returns where an exit would be 0
        text = capsys.readouterr().out
        options = set(re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", text))  # whole options: --lrf is not --lr
        wanted = {"--data-path", "--download", "--val-rate", "--num-classes", "--epochs", "--batch-size",
                  "--lr", "--lrf", "--momentum", "--weight-decay", "--warmup-epochs", "--label-smoothing",
                  "--weights", "--freeze-layers", "--sync-bn", "--img-size", "--workers", "--seed",
                  "--output-dir", "--resume", "--eval-only", "--backend", "--device", "--num_classes", "--syncBN",
                  "--plots", "--report", "--scaling", "--check-images"}
        assert wanted <= options, (launcher, wanted - options)
        assert "the original scripts' spellings" in text
        assert ("--world-size" in options) == (launcher != "single")
        assert ("--dist-url" in options) == (launcher != "single")


@pytest.fixture
def broken_files(tmp_path):
    (tmp_path / "notes.pth").write_text("not a checkpoint")
    torch.save({"step": 3}, tmp_path / "no_tensors.pth")
    return tmp_path


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data-path", "/nonexistent/flowers"], "does not exist"),
        (["--data-path", str(SAMPLE), "--num-classes", "3"], "--num-classes is 3"),
        (["--data-path", str(SAMPLE), "--weights", "/nonexistent.pth"], "does not exist"),
        (["--data-path", str(SAMPLE), "--weights", "{tmp}/notes.pth"], "not a PyTorch file"),
        (["--data-path", str(SAMPLE), "--weights", "{tmp}/no_tensors.pth"], "no state dict"),
        (["--data-path", str(SAMPLE), "--resume", "{tmp}/no_tensors.pth"], "not a training checkpoint"),
        (["--data-path", str(SAMPLE), "--val-rate", "0"], "--val-rate"),
        (["--data-path", str(SAMPLE), "--val-rate", "1.5"], "--val-rate"),
        (["--data-path", str(SAMPLE), "--eval-only"], "--eval-only needs"),
        (["--data-path", str(SAMPLE), "--resume", "auto"], "needs --output-dir"),
        (["--data-path", str(SAMPLE), "--device", "cuda"] if not torch.cuda.is_available() else
         ["--data-path", str(SAMPLE), "--device", f"cuda:{torch.cuda.device_count()}"], "GPU"),
    ],
)
def test_user_mistakes_single(argv, message, broken_files, capsys):
    argv = [a.replace("{tmp}", str(broken_files)) for a in argv]
    assert message in user_error(train_single_gpu.main, argv, capsys)


def test_no_images_and_single_class(tmp_path, capsys):
    (tmp_path / "empty" / "a").mkdir(parents=True)
    (tmp_path / "empty" / "b").mkdir(parents=True)
    assert "no images" in user_error(train_single_gpu.main, ["--data-path", str(tmp_path / "empty")], capsys)
    one = copy_sample(tmp_path / "one", classes=["roses"], per_class=3)
    assert "only one class" in user_error(train_single_gpu.main, ["--data-path", str(one)], capsys)


def test_unwritable_output_dir(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    line = user_error(train_single_gpu.main, ["--data-path", str(SAMPLE), "--output-dir", str(blocker / "run")], capsys)
    assert "cannot write to the output folder" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_spawn_without_gpus_needs_world_size(capsys):
    line = user_error(train_multi_gpu_using_spawn.main, ["--data-path", str(SAMPLE)], capsys)
    assert "--world-size" in line


@pytest.mark.slow
def test_under_torchrun_every_worker_reports_and_exits_2(tmp_path):
    # torchrun ends the other workers once it sees one fail; looking every 20 s instead of every
    # 0.1 s lets a worker that started late (a loaded machine: 5 s was once too little on 2
    # cores) print its own line first. Both failing sooner, torchrun's next look ends the job.
    cmd = launcher_cmd("launch", 2)
    cmd.insert(cmd.index("--standalone"), "--monitor-interval=20")
    result = run_cli(cmd + ["--data-path", str(tmp_path / "missing")], timeout=120)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and all("does not exist" in e for e in errors), result.stderr
    assert "exitcode  : 2" in result.stderr or "exit code 2" in result.stderr.lower() or "exitcode: 2" in result.stderr


def test_download_offline_is_a_clear_error(tmp_path, monkeypatch, capsys):
    # Port 9 on loopback: nothing listens, the connection is refused at once.
    monkeypatch.setattr(utils, "FLOWERS_URL", "http://127.0.0.1:9/flower_photos.tgz")
    line = user_error(train_single_gpu.main, ["--data-path", str(tmp_path / "flower_photos"), "--download"], capsys)
    assert "could not download flower_photos" in line


def test_download_verifies_and_unpacks(tmp_path, monkeypatch):
    """--download against a real HTTP server on loopback serving a small flower_photos.tgz."""
    served = tmp_path / "served"
    copy_sample(served / "flower_photos", classes=["daisy", "tulips"], per_class=2)
    shutil.copy(SAMPLE / "LICENSE.txt", served / "flower_photos" / "LICENSE.txt")
    with tarfile.open(served / "flower_photos.tgz", "w:gz") as tar:
        tar.add(served / "flower_photos", arcname="flower_photos")

    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(served))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(utils, "FLOWERS_URL", f"http://127.0.0.1:{server.server_port}/flower_photos.tgz")
        monkeypatch.setattr(utils, "FLOWERS_SHA256", "0" * 64)
        with pytest.raises(utils.UserError, match="SHA-256"):
            utils.download_flower_photos(str(tmp_path / "bad" / "flowers"), log=lambda _: None)
        assert not (tmp_path / "bad" / "flowers").exists()

        monkeypatch.setattr(utils, "FLOWERS_SHA256", utils._sha256(served / "flower_photos.tgz"))
        target = tmp_path / "datasets" / "my_flowers"
        utils.download_flower_photos(str(target), log=lambda _: None)
    finally:
        server.shutdown()
    names, samples = utils.list_images(str(target))
    assert names == ["daisy", "tulips"] and len(samples) == 4
    assert (target / "LICENSE.txt").exists() and not (target.parent / "flower_photos.tgz").exists()


@pytest.mark.parametrize("option, message", [
    ("--cache", "error: --cache needs "),
    ("--device-augment", "error: --device-augment keeps the training images on cpu: "),
])
def test_a_launcher_refuses_to_keep_images_where_there_is_no_room(option, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(image_cache, "memory_available", lambda: 1024)
    line = user_error(train_single_gpu.main, ["--data-path", str(SAMPLE), "--output-dir", str(tmp_path),
                                              "--device", "cpu", *FAST, option], capsys)
    assert line.startswith(message)


@pytest.mark.parametrize("launcher", ["single", "launch", "spawn"])
def test_every_option_has_help_and_a_line_in_the_options_page(launcher):
    """`--help` explains every option (with its default, where it has one), and docs/options.md
    names every option a launcher takes."""
    parser = get_args_parser("test", launcher)
    page = (REPO / "docs" / "options.md").read_text()
    for action in parser._actions:
        names = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
        if not names or action.help == argparse.SUPPRESS and names[0] != "--local-rank":
            continue
        if action.help != argparse.SUPPRESS:
            assert action.help, f"{names[0]} has no help"
        assert any(f"`{name}`" in page or f"`{name} " in page for name in names), f"{names[0]} is not in docs/options.md"
    help_text = " ".join(parser.format_help().split())
    for option, default in (("--momentum", "0.9"), ("--label-smoothing", "0.1"), ("--ema-decay", "0.995"),
                            ("--flip", "random"), ("--plots", "False"), ("--report", "False"),
                            ("--check-images", "False")):
        after = help_text[help_text.index(f" {option} "):]
        assert f"(default: {default})" in after[:400], option


def stated_defaults(page: str) -> dict[str, str]:
    """docs/options.md's default for each row that names one option (its aliases aside)."""
    found = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`--"):
            continue
        names = re.findall(r"`(--[\w-]+)", cells[0].split("(")[0])
        names = [n for n in names if not n.startswith("--no-")]
        if len(names) == 1:
            found[names[0]] = cells[1]
    return found


def test_the_options_page_states_each_default_the_parser_has():

    """Where a row's default is a plain value (a number, `a name`, off, none), it is the parser's."""
    parser = get_args_parser("test", "spawn")
    defaults = {o: a.default for a in parser._actions for o in a.option_strings}
    checked = 0
    for option, stated in stated_defaults((REPO / "docs" / "options.md").read_text()).items():
        default = defaults[option]
        if option == "--epochs":  # None in the parser: --time-budget alone decides; else DEFAULT_EPOCHS
            default = DEFAULT_EPOCHS
        if "<" in stated:  # a default made at run time (the run folder's name)
            continue
        if stated == "off":
            assert default in (False, None, 0), (option, default)
        elif stated == "on":
            assert default is True, (option, default)
        elif stated == "none":
            assert default is None, (option, default)
        elif re.fullmatch(r"`[^`]+`", stated):
            assert str(default) == stated.strip("`"), (option, stated, default)
        elif re.fullmatch(r"[\d.e+-]+", stated):
            assert float(default) == float(stated), (option, stated, default)
        else:
            continue
        checked += 1
    assert checked >= 25, checked
