"""Train a DFlash block-parallel drafter on a frozen causal LM.

    accelerate launch train/dflash.py                       # demo target, self-distilled stdlib, CPU, ~20 min
    accelerate launch train/dflash.py --config configs/dflash/qwen3-8b-dflash.yaml

The frozen target computes its fused layers (target_layer_ids) online, without gradients. Each sequence
gives `anchors` random blocks [x_a, MASK...], all drafted in one masked attention pass (heads.dflash
DFlashDraft.packed); the loss is position-weighted (train/methods/dflash_loss.py). Validation drafts a block
at every position and reports each block position's top-1 agreement with the target and the tokens per step of
a teacher-forced chain decoding over the sequences (`sim_accept`), and the checkpoint
with the best one is what is saved. At the end the chain/tree (depth, top_k, total_tokens) is fitted to this
machine by decoding validation prompts.
"""

from __future__ import annotations

from selfspec.heads.errors import run_main
from selfspec.train.loop.config import load_config
from selfspec.train.methods.dflash import DFlashMethod
from selfspec.train.recipes.dflash import DFlashConfig, build_drafter
from selfspec.train.recipes.feature_run import run_feature_drafter


def run(cfg: DFlashConfig) -> dict:
    """Set up, train and save; returns the target, the trained drafter and the validation history."""
    return run_feature_drafter(
        cfg,
        lambda target, tokenizer, data: build_drafter(cfg, target, tokenizer, data),
        lambda target, draft, prompts: DFlashMethod(cfg, target, draft, prompts),
    )


def main(argv: list[str] | None = None) -> None:
    """The script: options from the command line; a user error ends in one line (exit 2)."""
    run_main(lambda args: run(load_config(DFlashConfig, args)), argv, prog="train/dflash.py")


if __name__ == "__main__":
    main()
