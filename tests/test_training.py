"""The training core in one process: weights, freezing, precision, the schedule, and whether it learns."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from conftest import FAST, SAMPLE, args_for, call_main, metrics, sample_batch

import train_single_gpu
from model import create_model, freeze_backbone
from multi_train_utils.checkpoint import load_weights, make_checkpoint
from multi_train_utils.config import get_args_parser
from multi_train_utils.distributed_utils import DistContext, autocast_dtype, job_precision
from multi_train_utils.resume import restore_training
from multi_train_utils.train_eval_utils import Extras, Progress, build_optimizer, learning_rate, train_one_epoch

CPU = torch.device("cpu")


def placed(model: torch.nn.Module, args) -> torch.dtype | None:
    """`model` on the CPU in the layout --channels-last asks, as the launchers place it; the
    precision the launchers then choose (job_precision, one process)."""
    model.to(CPU, memory_format=torch.channels_last if args.channels_last else torch.contiguous_format)
    return job_precision(args.amp, DistContext.single())


def schedule(args, steps_per_epoch: int, epochs: int | None = None):
    """The learning rate of each step, as train_one_epoch asks for it, for one process."""
    return lambda step: learning_rate(step, steps_per_epoch, epochs or args.epochs, args, DistContext.single())


def saved_weights(tmp_path, name: str, state: dict) -> str:
    path = tmp_path / name
    torch.save(state, path)
    return str(path)


def test_weights_with_another_head_are_skipped_and_reported(tmp_path):
    """An ImageNet-style file: the 1000-class head does not fit five classes, the rest loads."""
    donor = create_model(1000)
    path = saved_weights(tmp_path, "imagenet_like.pth", donor.state_dict())
    model = create_model(5)
    head_before = model.fc.weight.detach().clone()
    messages: list[str] = []
    load_weights(model, path, messages.append)
    assert torch.equal(model.conv1.weight, donor.conv1.weight)
    assert torch.equal(model.layer4[2].bn2.running_var, donor.layer4[2].bn2.running_var)
    assert torch.equal(model.fc.weight, head_before)  # kept its own initial values
    assert len(messages) == 1 and "skipped 2 (fc.bias, fc.weight)" in messages[0]
    assert "kept initial values for fc.bias, fc.weight" in messages[0]


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "_orig_mod.module."])
def test_weights_saved_from_ddp_or_a_compiled_model_load(tmp_path, prefix):
    donor = create_model(5)
    state = {prefix + k: v for k, v in donor.state_dict().items()}
    model = create_model(5)
    messages: list[str] = []
    load_weights(model, saved_weights(tmp_path, "wrapped.pth", {"model": state}), messages.append)
    for key, value in donor.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert "skipped 0" in messages[0] and "kept initial values" not in messages[0]


def test_frozen_backbone_keeps_its_batchnorm_statistics():
    """--freeze-layers: only the classifier learns, and the backbone's BatchNorm layers stay in
    eval mode, so a training step leaves their running statistics exactly as they were."""
    torch.manual_seed(0)
    model = create_model(5)
    freeze_backbone(model)
    args = args_for("--freeze-layers", "--amp", "off", "--epochs", "1")
    amp_dtype = placed(model, args)
    optimizer, scaler = build_optimizer(model, args, amp_dtype)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["fc.weight", "fc.bias"]
    stats = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    frozen = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("fc.")}
    head = model.fc.weight.detach().clone()
    train_one_epoch(model, torch.nn.CrossEntropyLoss(), optimizer, scaler, [sample_batch(8)] * 2, 1, Progress(),
                    amp_dtype, args, DistContext.single())
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns and not any(m.training for m in bns) and model.fc.training
    for key, value in model.state_dict().items():
        if key in stats or key in frozen:
            assert torch.equal(value, frozen.get(key, stats.get(key))), key
    assert not torch.equal(model.fc.weight, head), "the classifier should have learned"


@pytest.mark.parametrize("choice, expected", [("off", None), ("bf16", torch.bfloat16),
                                              pytest.param("fp16", torch.float16, marks=pytest.mark.slow)])
def test_amp_choices_train_in_that_precision(choice, expected, capsys):
    """Each explicit --amp value gives its autocast dtype, fp16 with a loss scaler, and trains
    in it: the first convolution's output, during the training step, has that dtype. The job's
    precision is said once."""
    assert autocast_dtype(choice, CPU) == expected
    args = args_for("--amp", choice, "--epochs", "1")
    torch.manual_seed(0)
    model = create_model(5)
    amp_dtype = placed(model, args)
    said = {"off": "fp32", "bf16": "bfloat16 autocast", "fp16": "float16 autocast"}[choice]
    assert capsys.readouterr().out == f"precision: {said}\n"
    optimizer, scaler = build_optimizer(model, args, amp_dtype)
    assert amp_dtype == expected and scaler.is_enabled() == (choice == "fp16")
    conv_dtypes = []
    first_conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    first_conv.register_forward_hook(lambda _module, _input, output: conv_dtypes.append(output.dtype))
    result = train_one_epoch(model, torch.nn.CrossEntropyLoss(), optimizer, scaler, [sample_batch(4)], 1, Progress(),
                             amp_dtype, args, DistContext.single())
    assert torch.isfinite(torch.tensor(result.train_loss))
    assert conv_dtypes == [expected or torch.float32]


def test_an_overflowed_first_fp16_step_leaves_sgd_as_if_it_never_ran():
    """fused SGD skips a step whose fp16 gradients overflowed but makes its momentum buffers
    first, uninitialised; they must start as zeros, so that the first step that does run is
    SGD's own first step (the buffer its gradient) and not one from whatever memory held."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    args = args_for("--amp", "off")
    optimizer, _ = build_optimizer(model, args, autocast_dtype(args.amp, CPU))
    assert all(torch.equal(optimizer.state[p]["momentum_buffer"], torch.zeros_like(p)) for p in model.parameters())
    reference = torch.nn.Linear(8, 3)
    reference.load_state_dict(model.state_dict())
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=args.momentum, nesterov=True, foreach=False)
    for group in optimizer.param_groups:
        group["lr"] = 0.1
    inputs = torch.randn(4, 8) * 100
    for net, opt in ((model, optimizer), (reference, plain)):
        # A scale that overflows the first step; after it, one that does not.
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, backoff_factor=2.0**-110)
        for _ in range(3):
            scaler.scale(net(inputs).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        assert scaler.get_scale() == 2.0**17  # one step skipped, two taken
    for fused, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(fused, expected)


def test_amp_auto_follows_the_hardware(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert autocast_dtype("auto", CPU) is None  # emulated bf16 would be slower than fp32
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert autocast_dtype("auto", CPU) == torch.bfloat16
    # The instructions are there, but the kernels are held below them: they would emulate bf16.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert autocast_dtype("auto", CPU) is None
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert autocast_dtype("auto", CPU) == torch.bfloat16
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # ATEN_CPU_CAPABILITY=avx2
    assert autocast_dtype("auto", CPU) is None
    with pytest.raises(SystemExit):
        get_args_parser("test").parse_args(["--amp", "fp8"])


def test_schedule_is_a_function_of_the_step():
    """Linear warm-up to the peak, a cosine down to lrf x peak by the last step, and nothing
    else: a resumed run at any world size asks the same function for the same step."""
    # A peak of 0.4: --lr 0.4 per 256 images, a global batch of 256.
    lr = schedule(args_for("--epochs", "10", "--warmup-epochs", "1", "--lrf", "0.01", "--lr", "0.4",
                           "--batch-size", "256"), 20)
    warmup = [lr(s) for s in range(20)]  # 20 steps: one epoch
    assert warmup == sorted(warmup) and warmup[0] == pytest.approx(0.4 / 21)
    assert lr(20) == pytest.approx(0.4)
    decay = [lr(s) for s in range(20, 201)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert lr(110) == pytest.approx(0.4 * (0.01 + 0.99 * 0.5))  # half way through the cosine
    assert lr(200) == pytest.approx(0.004) and lr(10_000) == pytest.approx(0.004)
    no_warmup = schedule(args_for("--epochs", "1", "--warmup-epochs", "0", "--lr", "0.1", "--batch-size", "256"), 5)
    assert no_warmup(0) == pytest.approx(0.1)
    # The linear scaling rule: the peak follows the global batch (2 processes of 64 images).
    two = DistContext(0, 0, 2, 2, CPU, distributed=False)
    args = args_for("--epochs", "1", "--warmup-epochs", "0", "--lr", "0.4", "--batch-size", "64")
    assert learning_rate(0, 5, 1, args, two) == pytest.approx(0.4 * 128 / 256)


def test_a_linear_decay_falls_in_a_straight_line_to_its_end():
    peak = ("--lr", "0.4", "--batch-size", "256")
    lr = schedule(args_for("--epochs", "10", "--lr-decay", "linear", "--lrf", "0", *peak), 20)
    assert lr(20) == pytest.approx(0.4)
    assert lr(110) == pytest.approx(0.2) and lr(155) == pytest.approx(0.1)
    assert lr(200) == 0 and lr(10_000) == 0
    cosine = schedule(args_for("--epochs", "10", "--lrf", "0", *peak), 20)
    assert cosine(155) == pytest.approx(0.4 * 0.5 * (1 + math.cos(math.pi * 0.75)))  # below the line there


@pytest.mark.slow
def test_it_learns():
    """A handful of steps on eight photos drive the training loss well down: the step, the
    loss, the optimizer and the schedule are wired together as they should be."""
    args = args_for("--epochs", "1", "--lr", "0.1", "--warmup-epochs", "0", "--lrf", "1", "--amp", "off")
    torch.manual_seed(0)
    model = create_model(5)
    amp_dtype = placed(model, args)
    optimizer, scaler = build_optimizer(model, args, amp_dtype)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    batch = sample_batch(8)
    losses = [train_one_epoch(model, criterion, optimizer, scaler, [batch], 1, Progress(), amp_dtype, args,
                              DistContext.single()).train_loss for _ in range(10)]
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.slow
@pytest.mark.parametrize("option", ["--channels-last", "--no-channels-last"])
def test_a_resumed_step_is_the_same_step_whatever_layout_the_checkpoint_holds(option):
    """A GPU run's epoch checkpoint holds the momentum buffers in NCHW (pinned host copies are
    contiguous) while its model trains in channels_last; a channels_last run resumed with
    --no-channels-last meets the other mismatch. The step resumed from buffers in the other
    layout must be the step resumed from buffers in the run's own."""
    args = args_for("--epochs", "2", "--amp", "off", option)
    torch.manual_seed(0)
    model = create_model(5)
    amp_dtype = placed(model, args)
    optimizer, scaler = build_optimizer(model, args, amp_dtype)
    batch, ctx = sample_batch(8, 64), DistContext.single()
    criterion = torch.nn.CrossEntropyLoss()
    train_one_epoch(model, criterion, optimizer, scaler, [batch], 1, Progress(last_epoch=2), amp_dtype, args, ctx)
    # A copy, as a file holds it: the state dict shares the live buffers.
    own = copy.deepcopy(make_checkpoint(model, optimizer, scaler, Progress(epoch=1), args, ["a"] * 5, 1))
    own["loaded_from"] = "last.pth"
    other = copy.deepcopy(own)
    layout = torch.contiguous_format if args.channels_last else torch.channels_last
    for state in other["optimizer"]["state"].values():
        if state["momentum_buffer"].dim() == 4:
            state["momentum_buffer"] = state["momentum_buffer"].contiguous(memory_format=layout)
    stepped = []
    for checkpoint in (own, other):
        resumed = copy.deepcopy(model)
        resumed_optimizer, resumed_scaler = build_optimizer(resumed, args, amp_dtype)
        progress = restore_training(checkpoint, Progress(last_epoch=2), resumed_optimizer, resumed_scaler, Extras(),
                                    [batch], False, args, ctx)
        assert progress.epoch == 1
        train_one_epoch(resumed, criterion, resumed_optimizer, resumed_scaler, [batch], 2, progress, amp_dtype, args,
                        ctx)
        stepped.append(list(resumed.parameters()))
    for (name, _), a, b in zip(model.named_parameters(), *stepped, strict=True):
        assert torch.equal(a, b), f"{name}: the step resumed from the other layout differs"


@pytest.mark.slow
def test_eval_only_with_weights(tmp_path, capsys):
    """--eval-only --weights: the validation split scored with a plain state dict, no training."""
    torch.manual_seed(3)
    weights = saved_weights(tmp_path, "plain.pth", create_model(5).state_dict())
    out = tmp_path / "run"
    call_main(train_single_gpu.main, ["--data-path", str(SAMPLE), "--output-dir", str(out), *FAST,
                                      "--eval-only", "--weights", weights, "--plots"])
    result = json.loads((out / "eval.json").read_text())
    assert result["val_total"] == 25 and result["weights"] == weights and 0 <= result["val_correct"] <= 25
    assert f"eval {weights}: acc" in capsys.readouterr().out
    assert not (out / "last.pth").exists() and not (out / "metrics.jsonl").exists()
    report = json.loads((out / "report.json").read_text())
    assert report["weights"] == weights and report["images"] == 25
    assert sum(map(sum, report["confusion_matrix"])) == 25 and report["accuracy"] == result["val_acc"]
    assert (out / "confusion_matrix.csv").is_file() and (out / "confusion_matrix.png").is_file()


@pytest.mark.slow
def test_your_own_photos_fine_tuned_from_a_torchvision_state_dict_then_predicted(tmp_path, capsys):
    """The README's path for one's own photos, from ImageNet weights: a state dict in the layout
    of torchvision's ResNet34 file (1000-class head), saved locally since these machines cannot
    download the real one. The backbone loads and, with --freeze-layers, stays exactly as the
    file has it (BatchNorm statistics too); the new 5-class head is what trains; predict.py
    then classifies new photos with the run's best checkpoint."""
    import predict
    import torchvision
    from multi_train_utils.checkpoint import load_checkpoint

    torch.manual_seed(1)
    donor = torchvision.models.resnet34().state_dict()  # torchvision's names and shapes
    weights = saved_weights(tmp_path, "resnet34-imagenet-layout.pth", donor)
    out = tmp_path / "run"
    call_main(train_single_gpu.main, ["--data-path", str(SAMPLE), "--output-dir", str(out), *FAST, "--epochs", "2",
                                      "--weights", weights, "--freeze-layers"])
    printed = capsys.readouterr().out
    assert f"weights from {weights}: loaded {len(donor) - 2} tensors, skipped 2 (fc.bias, fc.weight)" in printed
    trained = load_checkpoint(out / "best.pth")["model"]
    backbone = [k for k in donor if not k.startswith("fc.")]
    assert all(torch.equal(trained[k].cpu(), donor[k]) for k in backbone), "a frozen layer changed"
    assert trained["fc.weight"].shape == (5, 512)
    assert [r["epoch"] for r in metrics(out)] == [1, 2]
    photos = sorted(SAMPLE.glob("tulips/*"))[:3]
    with pytest.raises(SystemExit) as ended:
        call_main(predict.main, ["--checkpoint", str(out / "best.pth"), *map(str, photos), "--json"])
    assert ended.value.code == 0
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    classes = {"daisy", "dandelion", "roses", "sunflowers", "tulips"}
    assert len(answers) == 3 and all(a["top"][0]["class"] in classes for a in answers)
