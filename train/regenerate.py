"""Regenerate a dataset with the target: the answers become the target's own (train/regeneration/run.py).

    accelerate launch train/regenerate.py --model M --dataset D --output_dir OUT [--temperature T] \\
        [--backend transformers|vllm]
"""

from __future__ import annotations

from selfspec.heads.errors import run_main
from selfspec.train.loop.config import load_config
from selfspec.train.regeneration.config import RegenerateConfig
from selfspec.train.regeneration.run import run


def main(argv: list[str] | None = None) -> None:
    """Options from the command line; a user error ends in one line (exit 2)."""
    run_main(lambda args: run(load_config(RegenerateConfig, args)), argv, prog="train/regenerate.py")


if __name__ == "__main__":
    main()
