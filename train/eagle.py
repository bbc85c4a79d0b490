"""Train an EAGLE draft model (EAGLE-1/2, or EAGLE-3 with --version 3) on a frozen causal LM.

    accelerate launch train/eagle.py                        # demo target, stdlib corpus, CPU, < 15 min
    accelerate launch train/eagle.py --version 3            # EAGLE-3 on the demo, about 20 min
                                                              (heads/eagle3.py, train/methods/step_loss.py)
    accelerate launch train/eagle.py --config configs/eagle/llama3-8b-sharegpt.yaml

The frozen target computes features f (its last hidden states, what its lm_head reads) online,
without gradients. The drafter reads (f_t + noise, embedding of x_{t+1}) and predicts f_{t+1}:
loss = SmoothL1(prediction, f_{t+1}) + w_cls * cross-entropy of its token distribution against the
target's distribution at t+1 (soft labels), on loss-mask positions. At the end the dynamic tree
(depth, top_k, total_tokens) is fitted to this machine by decoding validation prompts.
"""

from __future__ import annotations

from selfspec.heads.errors import run_main
from selfspec.train.loop.config import load_config
from selfspec.train.methods.eagle import Eagle3Method, EagleMethod
from selfspec.train.recipes.eagle import EagleConfig, build_drafter
from selfspec.train.recipes.feature_run import run_feature_drafter


def run(cfg: EagleConfig) -> dict:
    """Set up, train and save; returns the target, the trained drafter and the validation history."""
    method = Eagle3Method if cfg.version == 3 else EagleMethod
    return run_feature_drafter(
        cfg,
        lambda target, tokenizer, data: build_drafter(cfg, target, data),
        lambda target, draft, prompts: method(cfg, target, draft, prompts),
    )


def main(argv: list[str] | None = None) -> None:
    """The script: options from the command line; a user error ends in one line (exit 2)."""
    run_main(lambda args: run(load_config(EagleConfig, args)), argv, prog="train/eagle.py")


if __name__ == "__main__":
    main()
