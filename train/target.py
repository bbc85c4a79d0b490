"""Pretrain the shipped demo models (train/recipes/demo_models.py).

python train/target.py --config configs/target/demo-target.yaml
"""

from __future__ import annotations

from selfspec.heads.errors import run_main
from selfspec.train.loop.config import load_config
from selfspec.train.recipes.demo_models import TargetConfig, train_target


def main(argv: list[str] | None = None) -> None:
    """The script: options from the command line; a user error ends in one line (exit 2)."""
    run_main(
        lambda args: train_target(load_config(TargetConfig, args, prog="python train/target.py"), args),
        argv,
        prog="train/target.py",
    )


if __name__ == "__main__":
    main()
