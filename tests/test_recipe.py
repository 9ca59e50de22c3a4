"""The training recipe's options: the model by name, the weight average, augmentation and
batch mixing, gradient clipping, progressive resizing, the evaluation size and mirror averaging."""
from __future__ import annotations

import json

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel
import torch.distributed as dist
import torchvision
from conftest import FAST, SAMPLE, args_for, metrics, ok, sample_batch, train, train_here, user_error
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader
from torchvision.transforms import v2

import predict
import train_single_gpu
from model import BlurConv2d, batch_norm_statistics, classifier, create_model, freeze_backbone
from multi_train_utils.checkpoint import load_checkpoint, model_from_checkpoint
from multi_train_utils.distributed_utils import DistContext, ShardSampler, job_precision
from multi_train_utils.train_eval_utils import (
    Progress,
    build_optimizer,
    evaluate,
    global_batch,
    learning_rate,
    model_input,
    train_one_epoch,
)
from my_dataset import (Augmentation, CropDraws, MyDataSet, SizeSchedule, build_transform, eval_img_size,
                        train_and_val_sets, train_transforms)
from outputs.report import predictions
from recipe.ema import WeightAverage
from recipe.mixing import build_mix
from recipe.recalibrate import BatchNormRecalibration
from utils import DataSplit, UserError, list_images

CPU = torch.device("cpu")


@pytest.mark.parametrize("argv, message", [
    (["--model", "resnet-34"], "--model 'resnet-34' is not a torchvision classification model"),
    (["--min-img-size", "64", "--img-size", "32"], "--min-img-size 64 is above --img-size 32"),
    (["--min-img-size", "16", "--img-size", "32"], "--min-img-size needs --ramp-epochs 2 or more"),
    (["--min-img-size", "8", "--ramp-epochs", "3"], "--min-img-size must be a multiple of 16 (16, 32, 48, ...), not 8"),
    (["--min-img-size", "40", "--ramp-epochs", "3"], "--min-img-size must be a multiple of 16 (16, 32, 48, ...), not 40"),
    (["--val-img-size", "0"], "--val-img-size must be at least 1"),
    (["--random-erase", "1.5"], "--random-erase is a probability"),
    (["--crop-scale", "0"], "--crop-scale is a share of the picture's area"),
    (["--crop-scale", "1.5"], "--crop-scale is a share of the picture's area"),
    (["--mixup-alpha", "-1"], "--mixup-alpha cannot be negative"),
    (["--cutmix-alpha", "-0.5"], "--cutmix-alpha cannot be negative"),
    (["--ema", "--ema-decay", "1"], "--ema-decay must be between 0 and 1"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm must be positive"),
    (["--device-augment", "--auto-augment", "ra"], "--device-augment crops and flips on the device"),
    (["--model", "mobilenet_v3_small", "--zero-init-residual"], "--zero-init-residual is for torchvision's ResNets"),
])
def test_recipe_mistakes_are_one_clear_error(argv, message, tmp_path, capsys):
    line = user_error(train_single_gpu.main, ["--data-path", str(SAMPLE), "--output-dir", str(tmp_path), *argv], capsys)
    assert message in line


def test_progressive_sizes_ramp_in_multiples_of_16_then_hold():
    sizes = [SizeSchedule(64, 128, 15)(epoch) for epoch in range(1, 21)]
    assert sizes[0] == 64 and sizes[14:] == [128] * 6
    assert sizes == sorted(sizes) and all(s % 16 == 0 for s in sizes) and len(set(sizes)) == 5
    assert [SizeSchedule(128, 128, 0)(e) for e in (1, 20)] == [128, 128]  # no ramp: the full size throughout


def test_each_epoch_trains_at_its_size_with_the_asked_augmentation():
    args = args_for("--img-size", "64", "--min-img-size", "32", "--ramp-epochs", "3", "--auto-augment", "ta_wide",
                    "--random-erase", "0.5")
    transforms = train_transforms(vars(args))
    _, samples = list_images(str(SAMPLE))
    dataset = MyDataSet(samples[:3], transforms, 64, seed=1)
    assert [dataset[(epoch, 0)][0].shape[-1] for epoch in (1, 2, 3, 9)] == [32, 48, 64, 64]
    steps = [type(t) for t in transforms(1).transforms]
    assert v2.TrivialAugmentWide in steps and v2.RandomErasing in steps
    image = dataset[(2, 1)][0]
    assert image.dtype == torch.uint8 and torch.equal(image, dataset[(2, 1)][0])  # seeded per (epoch, index)


@pytest.mark.parametrize("policy", ["ra", "augmix"])
def test_the_other_policies_run_on_uint8_pixels(policy):
    transform = build_transform(32, train=True, augmentation=Augmentation(policy))
    assert transform(sample_batch(1, 48)[0][0]).shape == (3, 32, 32)


def test_mixing_is_torchvisions_and_repeats_with_the_batch():
    mix = build_mix(args_for("--mixup-alpha", "0.4", "--cutmix-alpha", "1.0"), create_model(5))
    assert isinstance(mix.transform, v2.RandomChoice)
    images, labels = sample_batch(4)
    images = images.float()
    a, targets = mix(images, labels, batch=7)
    b, again = mix(images, labels, batch=7)
    assert torch.equal(a, b) and torch.equal(targets, again)
    assert targets.shape == (4, 5) and torch.allclose(targets.sum(1), torch.ones(4))
    assert not torch.equal(a, images)  # the batch was mixed
    assert any(not torch.equal(mix(images, labels, batch)[0], a) for batch in range(8, 12))


def test_clipping_bounds_the_first_step():
    """SGD's first step with Nesterov momentum m moves the weights by lr * (1 + m) * gradient:
    with the gradient clipped to norm c the step's norm is lr * (1 + m) * c exactly."""
    torch.manual_seed(0)
    before = [p.detach().clone() for p in create_model(5).parameters()]  # what one_step starts from
    model, args = one_step(["--clip-grad-norm", "0.01"], [sample_batch(4)])
    moved = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.detach() - b)
                                                  for p, b in zip(model.parameters(), before)]))
    assert moved.item() == pytest.approx(first_lr(args) * 1.9 * 0.01, rel=1e-3)


def test_the_weight_average_follows_its_warmed_up_decay():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    average = WeightAverage(model, decay=0.5)
    start = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight.add_(1.0)
        model[1].num_batches_tracked.fill_(7)
    average.update(steps=1)  # warm-up: decay min(0.5, 2/11)
    assert torch.allclose(average.module[0].weight, start + (1 - 2 / 11))
    assert average.module[1].num_batches_tracked.item() == 7
    average.update(steps=100)  # decay 0.5 from here
    assert torch.allclose(average.module[0].weight, start + 1 - 0.5 * (2 / 11))
    assert not average.module[0].weight.requires_grad


def test_mirror_averaging_is_the_mean_of_both_logits():
    """--tta: the report's logits, and the loss evaluate() counts, are those of the mean logits
    of each validation image and its mirror."""
    torch.manual_seed(0)
    model = create_model(5).eval()
    _, samples = list_images(str(SAMPLE))
    ctx = DistContext.single()
    dataset = MyDataSet(samples[::40], build_transform(32, train=False), 32)
    loader = DataLoader(dataset, batch_size=len(dataset), sampler=ShardSampler(len(dataset), ctx))
    images, labels = next(iter(loader))
    with torch.no_grad():
        x = model_input(images, CPU)
        mean = (model(x) + model(x.flip(3))) / 2
        [(mirrored, _, indices)] = list(predictions(model, loader, args_for("--tta"), ctx))
        [(plain, _, _)] = list(predictions(model, loader, args_for(), ctx))
    assert indices == list(range(len(dataset)))
    torch.testing.assert_close(mirrored, mean)
    assert not torch.allclose(plain, mirrored)
    loss = torch.nn.functional.cross_entropy(mean, labels).item()
    assert evaluate(model, loader, args_for("--tta"), ctx).val["val_loss"] == pytest.approx(loss, rel=1e-5)
    assert evaluate(model, loader, args_for(), ctx).val["val_loss"] != pytest.approx(loss, rel=1e-5)


def test_any_torchvision_model_by_name_with_its_head_from_the_folders():
    model = create_model(5, "mobilenet_v3_small")
    name, head = classifier(model)
    assert (name, head.out_features) == ("classifier.3", 5)
    freeze_backbone(model)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"classifier.3.weight", "classifier.3.bias"}
    assert classifier(create_model(5))[0] == "fc"


def test_zero_init_residual_starts_each_block_as_the_identity():
    torch.manual_seed(0)
    model = create_model(5, "resnet18", zero_init_residual=True)
    blocks = [m for m in model.modules() if isinstance(m, torchvision.models.resnet.BasicBlock)]
    assert len(blocks) == 8 and all(not b.bn2.weight.any() for b in blocks)
    assert create_model(5, "resnet18").layer1[0].bn2.weight.all()  # torchvision's default: ones
    with torch.no_grad():
        x = torch.randn(2, 64, 8, 8)
        block = blocks[0].eval()
        assert torch.equal(block(x), torch.relu(x))  # the residual branch adds nothing


def test_blurpool_blurs_the_strided_convolutions_and_keeps_their_weights():
    torch.manual_seed(0)
    plain = create_model(5)
    torch.manual_seed(0)
    blurred = create_model(5, blurpool=True)
    names = [name for name, m in blurred.named_modules() if isinstance(m, BlurConv2d)]
    assert names == [f"layer{i}.0.{conv}" for i in (2, 3, 4) for conv in ("conv1", "downsample.0")]
    assert blurred.state_dict().keys() == plain.state_dict().keys()  # the blur is no weight
    assert all(torch.equal(a, b) for a, b in zip(blurred.state_dict().values(), plain.state_dict().values()))
    conv, blur = plain.layer2[0].conv1, blurred.layer2[0].conv1
    with torch.no_grad():
        flat = torch.ones(1, 64, 12, 12)
        assert torch.allclose(blur(flat)[..., 1:-1, 1:-1], conv(flat)[..., 1:-1, 1:-1])  # away from the zero padding
        # The finest pattern, which a stride of 2 would alias, is filtered out.
        rows, cols = torch.meshgrid(torch.arange(12), torch.arange(12), indexing="ij")
        checkerboard = ((rows + cols) % 2 * 2 - 1).float().expand(1, 64, 12, 12)
        assert blur(checkerboard)[..., 1:-1, 1:-1].abs().max() < 1e-5 < conv(checkerboard).abs().max()
    with pytest.raises(UserError, match="vit_b_16 has none"):  # its only strided convolution reads the 3 colours
        create_model(5, "vit_b_16", blurpool=True)


@pytest.mark.slow
def test_a_run_with_another_model_an_average_and_mirror_evaluation(tmp_path, capsys):
    """resnet18 with --ema and --blurpool: the checkpoint names the model and holds both weight
    sets; best.pth says which one scored better and holds it; predict.py and --eval-only rebuild
    that model; resuming it as another model is refused."""
    out = tmp_path / "run"
    recipe = ["--model", "resnet18", "--blurpool", "--ema", "--ema-decay", "0.9", "--tta", "--val-img-size", "40"]
    # --report: best.pth's weights evaluated again at the end, named. --eval-only: the seed of split.json.
    result = ok(train_here(out, "--epochs", "2", "--seed", "3", "--report", *recipe))
    ckpt = load_checkpoint(out / "best.pth")
    assert ckpt["args"]["model"] == "resnet18" and ckpt["better"] in ("model", "ema")
    assert not torch.equal(ckpt["ema"]["conv1.weight"], ckpt["model"]["conv1.weight"])
    records = metrics(out)
    best = max(records, key=lambda r: max(r["val_acc"], r["ema_val_acc"]))
    assert ckpt["epoch"] == best["epoch"]
    assert ckpt["better"] == ("ema" if best["ema_val_acc"] > best["val_acc"] else "model")
    assert f"report on {out / 'best.pth'} (epoch {ckpt['epoch']}" \
           f"{' weight average' if ckpt['better'] == 'ema' else ''}): 25 images" in result.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["accuracy"] == max(best["val_acc"], best["ema_val_acc"])  # the shipped weights' evaluation again
    rebuilt = model_from_checkpoint(ckpt)
    assert sum(p.numel() for p in rebuilt.parameters()) < 12_000_000  # resnet18, not 34
    assert isinstance(rebuilt.layer2[0].conv1, BlurConv2d)
    # --eval-only gives the count the run logged for the weights best.pth ships, on the run's own
    # validation images (its split.json), not a split drawn again with the default seed
    shipped = f"{'ema_' if ckpt['better'] == 'ema' else ''}val_correct"
    ok(train_here(tmp_path / "eval", "--eval-only", "--resume", str(out / "best.pth"), *recipe))
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["val_correct"] == best[shipped]
    assert eval_img_size(ckpt["args"]) == 40 and predict.load_classifier(str(out / "best.pth"), CPU).img_size == 40
    line = user_error(train_single_gpu.main, ["--data-path", str(SAMPLE), "--output-dir", str(tmp_path / "other"),
                                              "--resume", str(out / "last.pth"), *FAST], capsys)
    assert "holds a resnet18, not the --model resnet34 asked for" in line
    line = user_error(train_single_gpu.main, ["--data-path", str(SAMPLE), "--output-dir", str(tmp_path / "other"),
                                              "--resume", str(out / "last.pth"), "--model", "resnet18", *FAST], capsys)
    assert "was trained with --blurpool" in line



def one_step(argv: list[str], batches: list, ctx: DistContext = DistContext.single()):
    """A fresh, seeded model trained on `batches` (one epoch) with the options in `argv`; and the options."""
    args = args_for("--amp", "off", "--warmup-epochs", "0", "--weight-decay", "0", *argv)
    torch.manual_seed(0)
    model = create_model(5)
    if args.freeze_layers:
        freeze_backbone(model)
    amp_dtype = placed(model, args)
    optimizer, scaler = build_optimizer(model, args, amp_dtype)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    train_one_epoch(model, criterion, optimizer, scaler, batches, 1, Progress(), amp_dtype, args, ctx)
    return model, args


def placed(model: torch.nn.Module, args) -> torch.dtype | None:
    """`model` on the CPU in the layout --channels-last asks, and the precision, as the launchers do."""
    model.to(CPU, memory_format=torch.channels_last if args.channels_last else torch.contiguous_format)
    return job_precision(args.amp, DistContext.single())


def first_lr(args, ctx: DistContext = DistContext.single()) -> float:
    """The learning rate of a run's first step (an epoch of one step)."""
    return learning_rate(0, 1, Progress().last_epoch, args, ctx)


def test_accumulating_two_batches_of_4_is_one_batch_of_8():
    """Only the head trains (--freeze-layers keeps BatchNorm in eval mode, so a batch's
    statistics do not depend on how it is split): one optimizer step over 2 x 4 images moves
    the weights as one step over the same 8 images does, at the learning rate of a batch of 8."""
    images, labels = sample_batch(8)
    whole, whole_args = one_step(["--freeze-layers", "--batch-size", "8"], [(images, labels)])
    halves, halves_args = one_step(["--freeze-layers", "--batch-size", "4", "--accum-steps", "2"],
                                   [(images[:4], labels[:4]), (images[4:], labels[4:])])
    single = DistContext.single()
    assert global_batch(halves_args, single) == global_batch(whole_args, single) == 8
    assert first_lr(halves_args) == first_lr(whole_args)
    torch.testing.assert_close(halves.fc.weight, whole.fc.weight, rtol=1e-5, atol=1e-7)
    apart, _ = one_step(["--freeze-layers", "--batch-size", "4"], [(images[:4], labels[:4]), (images[4:], labels[4:])])
    assert not torch.allclose(apart.fc.weight, whole.fc.weight, atol=1e-6)


@pytest.mark.slow
def test_accumulation_all_reduces_once_per_optimizer_step():
    """In a real (one-rank, gloo) process group: DDP's gradient hook runs for the batch that
    closes an optimizer step, not for the ones before it (no_sync)."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        ctx = DistContext(0, 0, 1, 1, CPU, distributed=True)
        counts = {}
        for k in (1, 2):
            args = args_for("--amp", "off", "--batch-size", "2", "--accum-steps", str(k))
            model = create_model(5)
            amp_dtype = placed(model, args)
            optimizer, scaler = build_optimizer(model, args, amp_dtype)
            ddp = DistributedDataParallel(model)
            calls = []

            def hook(state, bucket):
                calls.append(bucket.index())
                return default_hooks.allreduce_hook(state, bucket)

            ddp.register_comm_hook(None, hook)
            images, labels = sample_batch(8)
            train_one_epoch(ddp, torch.nn.CrossEntropyLoss(), optimizer, scaler,
                            [(images[i:i + 2], labels[i:i + 2]) for i in range(0, 8, 2)], 1, Progress(), amp_dtype,
                            args, ctx)
            counts[k] = calls.count(0)  # bucket 0 is all-reduced once per synchronised backward
        assert counts == {1: 4, 2: 2}
    finally:
        dist.destroy_process_group()


class OnePicture:
    """A PixelCache that gives every path the same square picture, left half dark: a crop of
    the whole square shows plainly whether it was mirrored."""

    def __init__(self, side: int = 32):
        self.picture = torch.zeros(3, side, side, dtype=torch.uint8)
        self.picture[..., side // 2:] = 255

    def get(self, path: str) -> torch.Tensor:
        return self.picture


def test_alternating_flip_mirrors_each_image_in_every_other_epoch():
    """--flip alternate: epoch 1 mirrors about half the images, each later epoch exactly the
    ones the epoch before did not; the loader's pixels and --device-augment's draws agree."""
    frames = [(32, 32)] * 200
    samples = [("x.jpg", 0)] * len(frames)
    draws = CropDraws(samples, frames, seed=3, flip="alternate")
    flips = torch.tensor([[draws[(epoch, i)][0][5].item() for i in range(len(frames))] for epoch in range(1, 6)])
    assert 0.35 < flips[0].float().mean() < 0.65
    assert torch.equal(flips[1:], 1 - flips[:-1])
    assert not torch.equal(flips[0], torch.tensor([CropDraws(samples, frames, seed=4, flip="alternate")[(1, i)][0][5]
                                                   for i in range(len(frames))]))  # the seed's coins
    cache = OnePicture()
    # The training set as the launchers build it for --flip alternate, its pictures all the one above.
    loader_set, _ = train_and_val_sets(DataSplit(["a"], samples[:20], samples[:1]),
                                       args_for("--img-size", "32", "--crop-scale", "1", "--flip", "alternate",
                                                "--seed", "3"))
    loader_set.cache = cache
    for epoch in (1, 2, 3):
        for i in range(20):
            image = loader_set[(epoch, i)][0]  # the whole square: a crop of all its area and ratio 1
            assert torch.equal(image, cache.picture.flip(-1) if flips[epoch - 1, i] else cache.picture)
    assert v2.RandomHorizontalFlip in [type(t) for t in train_transforms({"img_size": 32})(1).transforms]
    assert v2.RandomHorizontalFlip not in [type(t) for t in train_transforms({"img_size": 32, "flip": "alternate"})(1).transforms]


def test_recalibration_recomputes_batchnorm_statistics_on_a_copy():
    """--bn-recalibrate: each BatchNorm's running mean becomes the average of its batch means
    over the given batches (here the first one's, checked directly); the trained model keeps
    its own statistics, and recalibrating twice gives the same ones."""
    torch.manual_seed(0)
    model = create_model(5)
    placed(model, args_for("--amp", "off"))
    before = batch_norm_statistics(model)
    batches = list(sample_batch(12, 48)[0].split(4))
    recalibrate = BatchNormRecalibration(lambda: batches)
    copy = recalibrate(model, DistContext.single())
    assert not copy.training and copy is not model
    with torch.no_grad():
        means = [model.conv1(model_input(b, CPU)).mean((0, 2, 3)) for b in batches]
    torch.testing.assert_close(copy.bn1.running_mean, torch.stack(means).mean(0), rtol=1e-4, atol=1e-5)
    assert copy.bn1.num_batches_tracked.item() == 3
    after = batch_norm_statistics(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    again = batch_norm_statistics(recalibrate(copy, DistContext.single()))
    assert all(torch.equal(v, again[k]) for k, v in batch_norm_statistics(copy).items())
    assert set(before) == {k for k in model.state_dict() if k.split(".")[-1] in
                           ("running_mean", "running_var", "num_batches_tracked")}


@pytest.mark.slow
def test_recalibrated_statistics_are_what_the_checkpoint_ships(tmp_path):
    """A run with --bn-recalibrate and --flip alternate: best.pth ships the statistics its
    evaluation recomputed, so --eval-only (as shipped in 1 process, recomputed in 2) and
    predict.py's model count what the run logged;
    the weights it trains on keep their own: they end as those of the same run without it, and
    the checkpoint holds those, which a resumed run goes on from."""
    recipe = ["--bn-recalibrate", "24", "--val-img-size", "40", "--flip", "alternate"]
    whole, plain, rest = tmp_path / "whole", tmp_path / "plain", tmp_path / "eval"
    ok(train_here(whole, "--epochs", "1", *recipe))
    ckpt = load_checkpoint(whole / "best.pth")
    stats = ckpt["evaluated_bn"]
    assert stats and not torch.equal(stats["bn1.running_mean"], ckpt["model"]["bn1.running_mean"])
    rebuilt = model_from_checkpoint(ckpt)
    assert torch.equal(rebuilt.bn1.running_mean, stats["bn1.running_mean"])
    best = next(r for r in metrics(whole) if r["epoch"] == ckpt["epoch"])
    # The shipped statistics as they are in one process, and recomputed in two: the same count.
    # In one process without --val-img-size: --eval-only evaluates at the size the run was trained for, and says so.
    for again, launcher, nproc in (([], "single", 1), (recipe, "spawn", 2)):
        result = ok(train(launcher, rest, "--eval-only", "--resume", str(whole / "best.pth"), *again, nproc=nproc))
        assert json.loads((rest / "eval.json").read_text())["val_correct"] == best["val_correct"]
        said = (f"--eval-only: {whole / 'best.pth'} was trained with --img-size 32 --val-img-size 40: evaluating at "
                "that size")
        assert (said in result.stdout) == (not again), result.stdout[-2000:]
    ok(train_here(plain, "--epochs", "1", *recipe[2:]))
    trained, recalibrated = load_checkpoint(plain / "last.pth"), load_checkpoint(whole / "last.pth")
    assert "evaluated_bn" not in trained
    assert all(torch.equal(v, recalibrated["model"][k]) for k, v in trained["model"].items())
