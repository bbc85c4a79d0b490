"""Fine-tune a target's own MTP layers (heads/mtp.py) on its data, the trunk frozen; or give a target new
ones.

    accelerate launch train/mtp.py --config configs/mtp/demo.yaml    # the demo target, one new MTP layer, CPU
    accelerate launch train/mtp.py --model zai-org/GLM-4.5-Air --dataset sharegpt.jsonl   # its own MTP layer

The MTP layers start from the target's checkpoint (DeepSeek-V3, GLM-4.5, ... : every config with
num_mtp_layers); a target without them, or `--new_layers N`, gets N new ones (DeepSeek-V3's recipe: each a
decoder layer of the target's own architecture, started from its last decoder layer's weights, with fresh
input norms and projection). The loss is EAGLE-3's training-time test (train/methods/step_loss.py): step i at
t runs MTP layer 0 on step i - 1's output and x_{t+1+i} and learns the target's distribution for x_{t+2+i}, as
decoding reuses the layer at every depth. Validation runs at step 0 too, so the log shows the acceptance
before fine-tuning next to the one after. At the end the dynamic tree (depth, top_k, total_tokens) is fitted
to this machine; `selfspec export --format mtp` writes the target with these layers under its checkpoint's own
names, as the serving engines load them.
"""

from __future__ import annotations

from selfspec.heads.errors import run_main
from selfspec.train.loop.config import load_config
from selfspec.train.methods.mtp import MtpMethod
from selfspec.train.recipes.feature_run import run_feature_drafter
from selfspec.train.recipes.mtp import MtpConfig, build_drafter


def run(cfg: MtpConfig) -> dict:
    """Set up, train and save; returns the target, the trained layers and the validation history."""
    return run_feature_drafter(
        cfg,
        lambda target, tokenizer, data: build_drafter(cfg, target),
        lambda target, draft, prompts: MtpMethod(cfg, target, draft, prompts),
    )


def main(argv: list[str] | None = None) -> None:
    """The script: options from the command line; a user error ends in one line (exit 2)."""
    run_main(lambda args: run(load_config(MtpConfig, args)), argv, prog="train/mtp.py")


if __name__ == "__main__":
    main()
