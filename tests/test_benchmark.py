"""python -m benchmarks run for real, tiny: every subcommand on the bundled photos, its JSON and its PNG."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from conftest import SAMPLE, check_png, ok, run_cli

from benchmarks import accuracy, endtoend, instruments, ours_recipe, profile, startup, throughput_report
from utils import UserError, list_images

TINY = ["--data-path", str(SAMPLE), "--img-size", "32"]
BENCHMARKS = [sys.executable, "-m", "benchmarks"]
THROUGHPUT = [*BENCHMARKS, "throughput", *TINY, "--steps", "2", "--warmup", "1", "--repeats", "1"]
MEASUREMENT_KEYS = {"config", "world_size", "input", "images_per_sec", "median_step_seconds", "step_seconds",
                    "first_step_seconds", "first_batch_seconds", "warmup_excess_seconds", "setup_seconds",
                    "steps_timed", "vm_hwm_mb_per_rank", "peak_pss_mb", "steady_peak_pss_mb", "repeat",
                    "load_average"}


def summary_row(result: dict, config: str, world_size: int, kind: str) -> dict:
    return next(r for r in result["summary"] if (r["config"], r["world_size"], r["input"]) == (config, world_size, kind))


@pytest.mark.slow
def test_throughput_one_process(tmp_path):
    out = tmp_path / "throughput.json"
    result = ok(run_cli([*THROUGHPUT, "--configs", "seed", "ours", "--world-sizes", "1", "--out", str(out)]))
    assert "| seed | 1 | " in result.stdout and "| ours | 1 | " in result.stdout  # the markdown table
    data = json.loads(out.read_text())
    assert data["command"].startswith("python -m benchmarks throughput")
    machine = data["machine"]
    assert machine["cores"] >= 1 and machine["torch"] and machine["torchvision"] and "cpu_model" in machine
    assert len(data["load_average"]["start"]) == 3 and len(data["load_average"]["end"]) == 3
    assert data["settings"]["img_size"] == 32 and data["settings"]["train_images"] == 95
    assert len(data["measurements"]) == 4  # seed and ours, synthetic and real, one repetition
    for m in data["measurements"]:
        assert "error" not in m, m
        assert MEASUREMENT_KEYS <= m.keys()
        assert m["images_per_sec"] > 0 and m["peak_pss_mb"] > 100
        assert len(m["step_seconds"]) == 1 and len(m["step_seconds"][0]) == 3  # warm-up + timed steps
    for config in ("seed", "ours"):
        real = summary_row(data, config, 1, "real")
        assert real["loader_images_per_sec"] > 0 and real["epoch_seconds_extrapolated"] > 0
        assert summary_row(data, config, 1, "synthetic")["images_per_sec"] > 0
    ours = summary_row(data, "ours", 1, "real")
    # vs_seed comes from unrounded rates; the rates in the summary are rounded
    assert ours["vs_seed"] == pytest.approx(ours["images_per_sec"] / summary_row(data, "seed", 1, "real")["images_per_sec"],
                                            rel=1e-2)
    check_png(out.with_suffix(".png"))


@pytest.mark.slow
def test_throughput_two_processes(tmp_path):
    """With the pixels on the device (--device-augment), whose loader is not a DataLoader."""
    out = tmp_path / "throughput.json"
    ok(run_cli([*THROUGHPUT, "--configs", "ours-device", "--world-sizes", "2", "--no-synthetic", "--images", "150",
                "--out", str(out)]))
    data = json.loads(out.read_text())
    # A folder of 150 pictures, hard links to the sample's 120: 24 training pictures per class.
    assert data["settings"]["images"] == 150 and data["settings"]["train_images"] == 120
    (m,) = data["measurements"]
    assert "error" not in m, m
    assert m["world_size"] == 2 and m["threads_per_process"] >= 1
    assert len(m["step_seconds"]) == 2 and len(m["vm_hwm_mb_per_rank"]) == 2  # rank 0 collected both
    # 60 images per process make 3 batches of 16: all of one epoch, warm-up included.
    assert m["steps_timed"] == 2
    per_rank = [16 * 2 / sum(steps[1:]) for steps in m["step_seconds"]]
    assert abs(m["images_per_sec"] - sum(per_rank)) < 1e-6 * m["images_per_sec"]
    check_png(out.with_suffix(".png"))


@pytest.mark.slow
def test_profile_takes_a_step_apart(tmp_path):
    out = tmp_path / "profile.json"
    result = ok(run_cli([*BENCHMARKS, "profile", *TINY, "--device", "cpu", "--batch-size", "8", "--steps", "2",
                         "--warmup", "1", "--out", str(out)]))
    data = json.loads(out.read_text())
    assert "| convolution |" in result.stdout
    # ResNet34 at 32 px: 3.6 GFLOP of multiply-adds forward at 224 px, x (32/224)^2, x 2 for
    # multiply and add, about x 3 with the backward pass.
    assert 0.3e9 < data["flop_per_image"] < 0.8e9
    assert data["images_per_sec"] > 0 and data["achieved_tflops"] >= 0
    # The bulk of ResNet's arithmetic. In fp32 at 32 px (a CPU without bf16), channels_last's copies of each
    # weight's gradient into the weight's layout can take longer still: among the two largest kinds.
    assert "convolution" in sorted(data["kinds"], key=data["kinds"].get, reverse=True)[:2], data["kinds"]
    # The operators that took longest, longest first; which ones depends on the CPU's kernels (AVX2's
    # fp32 or AVX-512's bf16 rank them differently), a convolution among them on any.
    times = [t["ms_per_step"] for t in data["top"]]
    assert times == sorted(times, reverse=True)
    assert any(profile.kind_of(t["name"]) == "convolution" for t in data["top"]), data["top"]


def test_a_result_without_a_successful_measurement_is_written_without_a_picture(tmp_path, capsys):
    """Every measurement failed: the JSON keeps their errors, and no picture, not an earlier one, goes beside it."""
    out = tmp_path / "throughput.json"
    out.with_suffix(".png").write_bytes(b"an earlier result's picture")
    result = {"summary": [{"config": "ours", "world_size": 1, "input": "real", "repeats": 0, "failed": 1}]}
    instruments.write_result(result, str(out), "| table |", throughput_report.plot_throughput)
    assert json.loads(out.read_text()) == result and not out.with_suffix(".png").exists()
    assert capsys.readouterr().out.splitlines()[-2:] == ["| table |", f"wrote {out}"]


def test_kernels_and_operators_are_sorted_into_kinds():
    assert profile.kind_of("aten::native_batch_norm_backward") == "batch norm"
    assert profile.kind_of("aten::mkldnn_convolution") == "convolution"
    assert profile.kind_of("aten::convolution_backward") == "convolution"
    assert profile.kind_of("aten::_fused_sgd_") == "optimizer"
    assert profile.kind_of("aten::clamp_min_") == "elementwise"  # ReLU
    assert profile.kind_of("aten::max_pool2d_with_indices_backward") == "pooling"
    assert profile.kind_of("aten::empty") == "other"


def test_missing_option_is_skipped_with_a_reason(monkeypatch):
    monkeypatch.setitem(ours_recipe.OURS_OPTIONS, "ours-future", ["--no-such-option"])
    assert "--no-such-option" in ours_recipe.missing_option("ours-future")
    assert ours_recipe.missing_option("ours") is None and ours_recipe.missing_option("seed") is None


@pytest.mark.slow
def test_data_paths(tmp_path):
    out = tmp_path / "data.json"
    result = ok(run_cli([*BENCHMARKS, "data", *TINY, "--images", "10", "--repeats", "1",
                         "--out", str(out)]))
    data = json.loads(out.read_text())
    assert data["settings"]["images"] == 10
    names = [p["path"] for p in data["paths"]]
    assert "decode() + v2 on uint8 tensor (ours)" in names and "PIL + v2 on PIL" in names
    assert all(p["images_per_sec"] > 0 for p in data["paths"])
    assert data["fastest"] in names and not data["fastest"].startswith("decode:")
    assert f"fastest decode + transform: {data['fastest']}" in result.stdout


def test_time_to_accuracy_counts_training_and_evaluation_and_judges_the_average():
    seed = [{"epoch_seconds": 10.0, "eval_seconds": 1.0, "val_acc": a} for a in (0.3, 0.5, 0.6)]
    ours = [{"epoch_seconds": 4.0, "eval_seconds": 1.0, "val_acc": 0.9, "ema_val_acc": a} for a in (0.4, 0.6, 0.7)]
    assert accuracy.curve(seed) == [(11.0, 0.3), (22.0, 0.5), (33.0, 0.6)]
    assert accuracy.curve(ours) == [(5.0, 0.4), (10.0, 0.6), (15.0, 0.7)]  # the average's accuracy, not the best
    slow = [{"epoch_seconds": 30.0, "eval_seconds": 1.0, "val_acc": a} for a in (0.1, 0.2, 0.3)]
    summary = accuracy.summarise({"seed": {0: {"curve": accuracy.curve(seed)}},
                                  "ours": {0: {"curve": accuracy.curve(ours)}},
                                  "slow": {0: {"curve": accuracy.curve(slow)}}})
    assert summary["ours"]["points_above_seed"]["mean"] == pytest.approx(10.0)
    assert summary["ours"]["time_to_seed_accuracy_share"]["mean"] == pytest.approx(10.0 / 33.0)
    assert summary["slow"]["time_to_seed_accuracy_share"] is None
    assert summary["slow"]["seeds_never_reaching_seed_accuracy"] == 1
    assert summary["seed"]["final_val_acc"]["mean"] == 0.6 and "points_above_seed" not in summary["seed"]


def test_a_folder_of_any_size_keeps_the_class_proportions(tmp_path):
    names, samples = list_images(str(SAMPLE))
    pictures, repeats = instruments.sized_folder(str(SAMPLE), 300, tmp_path)
    assert (pictures, repeats) == (120, 3)
    made_names, made = list_images(str(tmp_path))
    assert made_names == names and len(made) == 300
    for c in range(len(names)):
        share = sum(label == c for _, label in samples) / len(samples)
        assert abs(sum(label == c for _, label in made) - 300 * share) <= 1
    assert all(Path(p).stat().st_nlink >= 2 for p, _ in made)  # links, not copies


@pytest.mark.slow
def test_end_to_end_times_a_whole_command(tmp_path):
    """A whole train_single_gpu.py run, with the pixels on the device (the launcher's side of --device-augment)."""
    out = tmp_path / "endtoend.json"
    result = ok(run_cli([*BENCHMARKS, "endtoend", *TINY, "--images", "60", "--epochs", "2", "--repeats", "1",
                         "--variant", "--workers 0 --device-augment", "--variant=--no-such-option",
                         "--out", str(out)]))
    assert "| `--workers 0 --device-augment` |" in result.stdout
    assert "| `--no-such-option` | no run succeeded |" in result.stdout  # and the other's numbers are kept
    data = json.loads(out.read_text())
    seed, m, failed = data["measurements"]
    assert "unrecognized arguments: --no-such-option" in failed["error"]
    # The seed recipe trained beside ours, as a command of its own: its final accuracy is the target.
    assert seed["options"] == endtoend.SEED and seed["epochs"] == 2 and data["target_val_acc"] == seed["final_val_acc"]
    assert f"target: the seed recipe's final validation accuracy, {seed['final_val_acc']:.4f}" in result.stdout
    for run in (seed, m):
        (t1, _), (t2, final) = run["curve"]
        assert 0 < t1 < t2 < run["wall_seconds"] and final == run["final_val_acc"]
        assert run["to_target_seconds"] == accuracy.first_reach(run["curve"], data["target_val_acc"])
    assert seed["to_target_seconds"] is not None  # the seed recipe reaches its own final accuracy
    assert m["startup_lines"][0].startswith("device augment: 50 training images")  # 12 per class, 2 held out
    assert m["epochs"] == 2 and 0 < m["epochs_seconds"] < m["to_last_checkpoint_seconds"] < m["wall_seconds"]
    assert m["outside_epochs_seconds"] == pytest.approx(m["wall_seconds"] - m["epochs_seconds"], abs=0.02)
    assert 0 <= m["data_wait_share"] < 1


def test_time_to_the_seed_recipes_accuracy_is_to_the_line_of_the_first_epoch_that_reaches_it():
    def stamped(prefix, seconds):  # a command's stdout: its epoch lines, when they came out, among others
        return [(0.5, "config: {...}")] + [(t, f"{prefix}epoch {e}/3: ...") for e, t in enumerate(seconds, 1)]

    seed_records = [{"epoch": e, "epoch_seconds": 2.0, "eval_seconds": 1.0, "val_acc": a}
                    for e, a in enumerate((0.2, 0.4, 0.5), 1)]
    seed_curve = endtoend.epoch_curve(stamped("seed ", (8.0, 11.0, 14.0)), seed_records)
    assert seed_curve == [[8.0, 0.2], [11.0, 0.4], [14.0, 0.5]]
    # An --ema run is judged by the average, as the accuracy experiment judges it.
    ours_records = [{"epoch": e, "epoch_seconds": 1.0, "eval_seconds": 0.5, "val_acc": 0.9, "ema_val_acc": a}
                    for e, a in enumerate((0.3, 0.55, 0.7), 1)]
    ours_curve = endtoend.epoch_curve(stamped("", (6.0, 7.5, 9.0)), ours_records)
    assert ours_curve == [[6.0, 0.3], [7.5, 0.55], [9.0, 0.7]]
    measurements = [
        {"options": endtoend.SEED, "curve": seed_curve, "final_val_acc": 0.5},
        {"options": "", "curve": ours_curve, "final_val_acc": 0.7},
        {"options": "--slow", "curve": [[20.0, 0.1], [40.0, 0.45]], "final_val_acc": 0.45},
        {"options": "--broken", "error": "RuntimeError: exit 2"},
    ]
    assert endtoend.mark_time_to_target(measurements) == 0.5  # the seed recipe's final accuracy
    seed, ours, slow, broken = measurements
    assert seed["to_target_seconds"] == 14.0  # its own last epoch
    assert ours["to_target_seconds"] == 7.5  # epoch 2 reached 0.55 >= 0.5, from the command's start
    assert slow["to_target_seconds"] is None and "to_target_seconds" not in broken
    row = endtoend.summarise("--slow", [slow], 0.5)
    assert row["runs_not_reaching_target"] == 1 and endtoend.to_target_cell(row) == "not reached"
    assert endtoend.to_target_cell(endtoend.summarise("", [ours, {**ours, "to_target_seconds": None}], 0.5)) == \
        "7.5 (not reached in 1 of 2)"
    # Without the seed recipe (--no-seed-recipe) there is no target, and no run is marked.
    alone = [{"options": "", "curve": ours_curve, "final_val_acc": 0.7}]
    assert endtoend.mark_time_to_target(alone) is None and "to_target_seconds" not in alone[0]
    assert endtoend.to_target_cell(endtoend.summarise("", alone, None)) == "–"


@pytest.mark.slow
def test_startup_times_a_new_run_and_its_resume(tmp_path):
    out = tmp_path / "startup.json"
    result = ok(run_cli([*BENCHMARKS, "startup", *TINY, "--images", "120", "150", "--options", "--workers 0",
                         "--out", str(out)]))
    data = json.loads(out.read_text())
    assert [r["images"] for r in data["rows"]] == [120, 150]
    for row in data["rows"]:
        assert not row["new"]["resumed"] and row["resume"]["resumed"]
        for kind in ("new", "resume"):
            assert 0 < row[kind]["seconds_to_first_step"] < 60 and row[kind]["peak_rss_mb"] > 100
    assert set(data["per_10000_images"]) == {"new", "resume"}
    assert "| per 10,000 more |" in result.stdout


def test_the_start_up_experiment_stops_a_run_only_once_it_takes_sigterm_as_a_request():
    """A launcher sets its SIGTERM handler after the 'training:' line; a SIGTERM before it ends the
    run unsaved, and the resume would have nothing to start from: the experiment waits for it."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert not startup.catches_sigterm(os.getpid())
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        assert startup.catches_sigterm(os.getpid())
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_budgets_are_shares_of_the_seed_recipes_time_for_ours_and_its_variants():
    args = argparse.Namespace(budgets=[0.2, 1.0], variant_budgets=[0.2])
    runs = accuracy.budgeted([("ours", []), ("ours --crop-scale 0.35", ["--crop-scale", "0.35"])], args, 600.0)
    assert runs == [("ours @0.2", ["--time-budget", "120.0"], 0.2), ("ours @1", ["--time-budget", "600.0"], 1.0),
                    ("ours --crop-scale 0.35 @0.2", ["--crop-scale", "0.35", "--time-budget", "120.0"], 0.2)]
    plain = argparse.Namespace(budgets=[], variant_budgets=[])
    assert accuracy.budgeted([("ours", [])], plain, 600.0) == [("ours", [], None)]


def test_recorded_seed_runs_must_come_from_the_same_settings(tmp_path):
    settings = {"img_size": 128, "epochs": 30, "batch_size": 16, "val_rate": 0.2, "train_images": 640,
                "val_images": 160}
    run = {"command": "python -m benchmarks accuracy ...", "curve": [[600.0, 0.6]], "epochs": []}
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"settings": settings, "machine": {"git_commit": "abcdef0123"},
                                   "runs": {"seed": {"0": run}}}))
    recorded = accuracy.recorded_seed_run(str(earlier), {**settings, "data_path": "elsewhere"}, 0)
    assert recorded["curve"] == run["curve"] and recorded["recorded_in"] == f"{earlier} (git abcdef0)"
    assert accuracy.recorded_seed_run(str(earlier), settings, 1) is None  # a seed it lacks is trained
    with pytest.raises(UserError, match=r"epochs 30 \(here 20\), train_images 640 \(here 95\)"):
        accuracy.recorded_seed_run(str(earlier), {**settings, "epochs": 20, "train_images": 95}, 0)


@pytest.mark.slow
def test_accuracy_against_wall_time_and_under_time_budgets(tmp_path):
    """The real experiment, tiny, in its budget mode: the seed recipe in-process times the
    budget; ours and a variant train through the launcher under --time-budget alone (no
    --epochs), given that time, on the seed recipe's split. (The arithmetic over seeds, the
    shares and the names are the tests above.)"""
    out = tmp_path / "budgets.json"
    ok(run_cli([*BENCHMARKS, "accuracy", *TINY, "--epochs", "1", "--out", str(out), "--batch-size", "8",
                "--seeds", "3", "--budgets", "1", "--variant", "--ema --tta", "--runs-dir", str(tmp_path / "runs")],
               timeout=600))
    data = json.loads(out.read_text())
    assert data["settings"]["batch_size"] == 8 and data["settings"]["seeds"] == [3]
    assert data["settings"]["train_images"] == 95 and data["settings"]["val_images"] == 25
    assert set(data["runs"]) == set(data["summary"]) == {"seed", "ours @1", "ours --ema --tta @1"}
    seed_seconds = data["runs"]["seed"]["3"]["curve"][-1][0]
    run = data["runs"]["ours @1"]["3"]
    assert "--epochs" not in run["command"] and run["budget_share"] == 1.0
    config = json.loads((tmp_path / "runs" / "ours-1-seed3" / "config.json").read_text())
    assert config["time_budget"] == f"{seed_seconds:.1f}" and config["epochs"] is None
    assert data["summary"]["ours @1"]["seeds_ending_at_or_above_seed"] in (0, 1)
    variant = json.loads((tmp_path / "runs" / "ours_ema_tta-1-seed3" / "config.json").read_text())
    assert variant["batch_size"] == 8 and variant["seed"] == 3 and variant["ema"] and variant["tta"]
    records = data["runs"]["ours --ema --tta @1"]["3"]["epochs"]
    assert {r["val_total"] for r in records} == {25}  # the same split as the seed recipe's
    # The curve: training + evaluation seconds so far, the average's accuracy.
    curve = data["runs"]["ours --ema --tta @1"]["3"]["curve"]
    assert curve[0] == [round(records[0]["epoch_seconds"] + records[0]["eval_seconds"], 1), records[0]["ema_val_acc"]]
    check_png(out.with_suffix(".png"))
    # Screening: the seed recipe's run read back from that result, not trained again.
    again = tmp_path / "again.json"
    screened = ok(run_cli([*BENCHMARKS, "accuracy", *TINY, "--epochs", "1", "--out", str(again), "--batch-size", "8",
                           "--seeds", "3", "--budgets", "0.5", "--seed-runs", str(out),
                           "--runs-dir", str(tmp_path / "again")], timeout=600))
    assert "seed epoch" not in screened.stdout
    reread = json.loads(again.read_text())
    assert reread["runs"]["seed"]["3"]["curve"] == data["runs"]["seed"]["3"]["curve"]
    assert reread["runs"]["seed"]["3"]["recorded_in"].startswith(str(out))
    assert json.loads((tmp_path / "again" / "ours-0.5-seed3" / "config.json").read_text())["time_budget"] == \
        f"{0.5 * seed_seconds:.1f}"


def test_the_compiled_configuration_is_compiled_as_the_launchers_compile(monkeypatch):
    """ours-compile assembles the model as the launchers do, torch.compile last (it once lost
    the call when compiling moved into the launchers, and measured the eager step under its name)."""
    from benchmarks import throughput
    from multi_train_utils.distributed_utils import DistContext

    compiled = []
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: compiled.append(model) or model)
    ctx = DistContext.single(torch.device("cpu"))
    for config, expected in (("ours", 0), ("ours-compile", 1)):
        plan = ours_recipe.ours_plan(str(SAMPLE), 32, 2, ours_recipe.OURS_OPTIONS[config])
        job = throughput.Job(config, 1, "synthetic", plan, ours_recipe.ours_split(plan), 1, 1, "", "fork")
        throughput.build_trainer(job, ctx)
        assert len(compiled) == expected, config
