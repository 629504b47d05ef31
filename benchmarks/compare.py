"""The side-by-side study of methods x densities x seeds: `barter compare` as a script (see
`barter.training.compare` for what it runs and writes; an interrupted study resumes where it stopped).

    .venv/bin/python benchmarks/compare.py --quick
    .venv/bin/python benchmarks/compare.py --preset cct_cifar100 --data-dir DATA --seeds 0 1 2
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from barter.training.compare import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
