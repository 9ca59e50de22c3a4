"""docs/how-it-works.md cannot rot: what it names exists, and what it tells a reader to run
parses (the page's conventions, and the checks that enforce them: tests/tour_checks.py)."""
from __future__ import annotations

import re

import pytest
from command_checks import LAUNCHERS, blocks, commands, launcher_call, parse_problem
from conftest import REPO
from tour_checks import (
    DEFAULT_RUN,
    IN_FILE,
    PAGE,
    Code,
    _slug,
    default_run_rows,
    name_problem,
    named,
    problems_of,
    prose,
    sections,
    source_files,
)

from multi_train_utils.config import get_args_parser


@pytest.fixture(scope="module")
def code() -> Code:
    return Code()


@pytest.fixture(scope="module")
def page() -> str:
    return PAGE.read_text()


def test_the_page_is_true_of_the_code(page, code):
    assert problems_of(page, code) == []


def test_the_page_names_enough_to_be_a_tour(page, code):
    functions = {s for s in named(page) if s.endswith("()") and not s.startswith("torch.") and
                 name_problem(s, code) is None}
    launches = [w for w in commands(page) if (call := launcher_call(w)) and call[2] in LAUNCHERS]
    assert len(functions) >= 20, sorted(functions)
    assert len(launches) >= 8, launches
    assert len(IN_FILE.findall(prose(page))) >= 15  # "`name()` in `file.py`" is how the page says where
    for section in re.split(r"^## (?=\d+\. )", page, flags=re.M)[1:]:
        assert blocks(section, "bash"), f"the stop '{section.splitlines()[0]}' ends without a command to run"


def test_the_page_opens_with_what_a_default_run_executes(page):
    """What following one run costs is what a default run executes: the opening's table, whose
    figures tests/test_default_run.py measures, within the project's limits (at most 1,000 lines
    in at most 10 files), the launcher among them, and the command it measures."""
    assert sections(page)[0][0] == DEFAULT_RUN, "the page's first section says what a default run executes"
    rows, total = default_run_rows(page)
    assert total and total[0] <= 10 and total[1] <= 1000, total
    assert "train_multi_gpu_using_launch.py" in rows, rows
    opening = sections(page)[0][1]
    assert [launcher_call(w)[2] for w in commands(opening) if launcher_call(w)] == ["train_multi_gpu_using_launch.py"]


def test_the_nine_stops_follow_the_opening_in_at_most_275_lines(page):
    """After the opening, the run's stops, 1 to 9 in order, in at most 275 lines; the reference
    (skeleton, rule, meeting points, map) follows them."""
    headings = [(n, line) for n, line in enumerate(page.splitlines()) if line.startswith("## ")]
    stops = [(n, line) for n, line in headings if re.match(r"## \d\. ", line)]
    assert [line[3] for _, line in stops] == [str(i) for i in range(1, 10)]
    assert headings[0][1] == f"## {DEFAULT_RUN}" and headings[1:10] == stops, \
        "the opening, then the stops, before every other section"
    assert headings[10][0] - stops[0][0] <= 275, headings[10][0] - stops[0][0]


def test_readme_links_the_page_on_its_first_screen():
    first_screen = REPO.joinpath("README.md").read_text().split("\n## ", 1)[0]
    assert "(docs/how-it-works.md)" in first_screen
    skeleton = re.search(r"\(docs/how-it-works\.md#([\w-]+)\)", first_screen)
    assert skeleton and skeleton[1] in {_slug(h) for h in re.findall(r"^#+ (.+)$", PAGE.read_text(), flags=re.M)}
    assert "skeleton" in skeleton[1]


@pytest.mark.parametrize("change, complaint", [
    # A function renamed in the code but not on the page, and the other ways a page goes stale.
    (("`env_ranks()`", "`environment_ranks()`"), "`environment_ranks()`: defined nowhere"),
    (("`ShardSampler`", "`ShardedSampler`"), "`ShardedSampler`: defined nowhere"),
    (("`DistContext` (same file)", "`DistContext.world` (same file)"), "`DistContext.world`: no such member"),
    (("`train_eval_utils.CHECK_EVERY`", "`train_eval_utils.CHECK_EVERY_STEPS`"), "not defined at the top"),
    (("`torch.optim.SGD`", "`torch.optim.SGDM`"), "not in torch"),
    (("`outputs/report.py`", "`multi_train_utils/reports.py`"), "no such file"),
    (("`tests/default_run/count.py`", "`tests/default_run/counts.py`"), "no such file"),
    (("`save_checkpoint()` in `multi_train_utils/checkpoint.py` writes",
      "`save_checkpoint()` in `multi_train_utils/run_folder.py` writes"),
     "`save_checkpoint()` is not defined in `multi_train_utils/run_folder.py`"),
    (("create_run_folder()             multi_train_utils/run_folder.py         the folder",
      "create_run_folder()             multi_train_utils/checkpoint.py         the folder"),
     "map: create_run_folder() is in none of multi_train_utils/checkpoint.py"),
    (("--img-size 32 --output-dir runs/tour\n", "--img-sise 32 --output-dir runs/tour\n"),
     "unrecognized arguments: --img-sise"),
    (("--world-size 2 --dist-url", "--world-sizes 2 --dist-url"), "unrecognized arguments: --world-sizes"),
    (("data/flower_photos_sample --epochs 1 --img-size 32 --lr", "data/flower_photos --epochs 1 --img-size 32 --lr"),
     "--data-path data/flower_photos: not a folder"),
    (("spawn.py --world-size 2 --device cpu", "spawn.py --world-size 2 --device cuda"), "only with --device cpu"),
    (("torchrun --nproc_per_node=2 --no-python", "torchrun --nproc-per-nodes=2 --no-python"), "torch.distributed.run"),
    # The opening's command is the measured default run: it runs on PHOTOS, on the default device, but it parses,
    (("--data-path PHOTOS --epochs 2 --img-size 64", "--data-path PHOTOS --epochs 2 --img-sise 64"),
     "unrecognized arguments: --img-sise"),
    # and its table adds up.
    (("| total (10 files) | 993 |", "| total (10 files) | 979 |"), "the rows add up to 10 files, 993 lines"),
    (("| model.py | 20 |", "| models.py | 20 |"), "`models.py`: no such file"),
    (("process group: backend=gloo, world_size=2, threads",
      "process group joined: backend=gloo, world_size=2, threads"), "printed by nothing in the code"),
    # An f-string whose label is short: the constants of its field are matched too.
    (("precision: bfloat16 autocast", "precision: bfloat16 mixed"), "printed by nothing in the code"),
    (("(multi-node.md#slurm)", "(multi-node.md#slurm-jobs)"), "no such heading"),
    # The map in another order than the code's: the launcher joins the group before it makes the run folder,
    (("  torch.distributed.init_process_group()\n"
      "  create_run_folder()             multi_train_utils/run_folder.py         the folder\n",
      "  create_run_folder()             multi_train_utils/run_folder.py         the folder\n"
      "  torch.distributed.init_process_group()\n"),
     "map: main() does not call torch.distributed.init_process_group() after create_run_folder()"),
    # and swaps in SyncBatchNorm and wraps the model in DDP before the optimizer is built, not after;
    (("    torch.nn.parallel.DistributedDataParallel()                           the wrap\n"
      "    build_optimizer()             multi_train_utils/train_eval_utils.py   after the swap\n",
      "    build_optimizer()             multi_train_utils/train_eval_utils.py   after the swap\n"
      "    torch.nn.parallel.DistributedDataParallel()                           the wrap\n"),
     "map: train() does not call torch.nn.parallel.DistributedDataParallel() after build_optimizer()"),
    # a call said to be made where it is not (the optimizer's step is train_one_epoch's, not evaluate's).
    (("      all_reduce_sum()            multi_train_utils/distributed_utils.py  one all-reduce\n",
      "      all_reduce_sum()            multi_train_utils/distributed_utils.py  one all-reduce\n"
      "      torch.amp.GradScaler.step()\n"), "map: evaluate() does not call torch.amp.GradScaler.step()"),
    # A skeleton call put in a function that does not make it.
    (("| `torch.nn.parallel.DistributedDataParallel.no_sync()` | `train_one_epoch()`",
      "| `torch.nn.parallel.DistributedDataParallel.no_sync()` | `evaluate()`"),
     "skeleton: `torch.nn.parallel.DistributedDataParallel.no_sync()` is not called in `evaluate()`"),
    (("| `torch.utils.data.DistributedSampler.set_epoch()` | `train()` in `train_multi_gpu_using_launch.py`",
      "| `torch.utils.data.DistributedSampler.set_epoch()` | `train_one_epoch()` in `multi_train_utils/train_eval_utils.py`"),
     "skeleton: `torch.utils.data.DistributedSampler.set_epoch()` is not called in `train_one_epoch()`"),
    (("| `torch.save()` | `save_atomic()` in `multi_train_utils/checkpoint.py`",
      "| `torch.save()` | `save_checkpoint()` in `multi_train_utils/checkpoint.py`"),
     "skeleton: `torch.save()` is not called in `save_checkpoint()`"),
    # An output block that drops the config: line without saying so.
    (("threads per process=1\n...\nlaunch:", "threads per process=1\nlaunch:"),
     "output block cut without a `...` line between: process group"),
    # A name given without its file, in either way of saying "same file", and a "(same file)" after the wrong file.
    (("`image_seed()` in `my_dataset.py`", "`image_seed()`"), "`image_seed` is never given with its file"),
    (("(`write_epoch()`, same file)", "(`write_epoch()`)"), "`write_epoch` is never given with its file"),
    (("`loader_options()` (same file)", "`loader_options()` in `multi_train_utils/resume.py`"),
     "`loader_options()` is not defined in `multi_train_utils/resume.py`"),
    (("`cpu_sync_batchnorm()` in `model.py` swaps in `CPUSyncBatchNorm` (same file)",
      "`cpu_sync_batchnorm()` in `utils.py` swaps in `CPUSyncBatchNorm` (same file)"),
     "`CPUSyncBatchNorm` is not defined in `utils.py`"),
    # ", same file" is the file named last before it: here, without train_one_epoch's, stop 6's speed/cuda_graph.py.
    (("In `train_one_epoch()` (`multi_train_utils/train_eval_utils.py`) the loss", "In `train_one_epoch()` the loss"),
     "`next_look()` is not defined in `speed/cuda_graph.py`"),
])
def test_a_stale_page_is_caught(page, code, change, complaint):
    old, new = change
    assert old in page, f"the page no longer holds {old!r}: pick another example"
    problems = problems_of(page.replace(old, new, 1), code)
    assert any(complaint in p for p in problems), problems


def test_renaming_a_function_in_the_code_fails_the_page(page, tmp_path):
    """The real page against a copy of the code in which env_ranks() has a new name."""
    for path in source_files(REPO):
        copy = tmp_path / path.relative_to(REPO)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text().replace("def env_ranks(", "def ranks_from_environment("))
    problems = problems_of(page, Code(tmp_path))
    assert "`env_ranks()`: defined nowhere in the project" in problems, problems
    assert "map: env_ranks() is in none of multi_train_utils/distributed_utils.py" in problems, problems


def test_commands_are_split_as_a_shell_splits_them():
    text = ("```bash\n"
            "for r in 0 1; do RANK=$r python train_single_gpu.py --epochs 1 & done; wait\n"
            "X=1 torchrun --nnodes 1 --nproc_per_node=2 train_multi_gpu_using_launch.py \\\n"
            "    --epochs 2 2>&1 | grep -E 'a|b'  # a comment\n"
            "python -m torch.distributed.launch --nproc_per_node=2 --use_env train_multi_gpu_using_launch.py --sync-bn\n"
            "```\n")
    calls = [launcher_call(w) for w in commands(text)]
    assert [c for c in calls if c] == [
        (None, [], "train_single_gpu.py", ["--epochs", "1"]),
        ("torch.distributed.run", ["--nnodes", "1", "--nproc_per_node=2"], "train_multi_gpu_using_launch.py",
         ["--epochs", "2"]),
        ("torch.distributed.launch", ["--nproc_per_node=2", "--use_env"], "train_multi_gpu_using_launch.py",
         ["--sync-bn"]),
    ]


def test_the_readmes_launcher_commands_parse():
    """The README's commands (the quick start first) are not a tour's, run on a laptop: they
    may name GPUs and the full dataset. Their options must still exist."""
    readme = REPO.joinpath("README.md").read_text()
    launches = [(w, call) for w in commands(readme) if (call := launcher_call(w)) and call[2] in LAUNCHERS]
    assert len(launches) >= 4, launches
    for words, (_, _, script, options) in launches:
        parser = get_args_parser("readme", launcher=LAUNCHERS[script])
        _, problem = parse_problem(parser.parse_args, options, " ".join(words))
        assert problem is None, problem
    quick_start = launches[0][1][3]
    assert "data/flower_photos_quick" in quick_start and (REPO / "data" / "flower_photos_quick").is_dir()
