"""Train a P-EAGLE drafter (parallel EAGLE, heads/peagle.py) on a frozen causal LM.

    accelerate launch train/peagle.py                        # demo target, its own answers, CPU, about 20 min
    accelerate launch train/peagle.py --config configs/peagle/demo.yaml

The drafter is EAGLE-3's body; one forward drafts `depths` tokens: depth 0 from the pairs (fused target
features, next token), depths 1 .. K - 1 from parallel slots reading a learned mask embedding and hidden
state. Training runs every depth over whole sequences in one pass (PEagleDraft.parallel), with the depth
subsampling of P-EAGLE's recipe (speculators' "COD"): depth 0 trains at every position, depth d at a random
max(ratio^d, min_ratio) of the positions depth d - 1 kept, so deep depths cost a fraction of a full pass.
Depth d at position t learns the target's distribution for x_{t+2+d}, restricted to the draft vocabulary
(train/methods/step_loss.py, weights 0.8^d). At the end the chain or tree (depth, top_k, total_tokens) is
fitted to this machine by decoding validation prompts.
"""

from __future__ import annotations

from selfspec.heads.errors import run_main
from selfspec.train.loop.config import load_config
from selfspec.train.methods.peagle import PEagleMethod
from selfspec.train.recipes.feature_run import run_feature_drafter
from selfspec.train.recipes.peagle import PEagleConfig, build_drafter


def run(cfg: PEagleConfig) -> dict:
    """Set up, train and save; returns the target, the trained drafter and the validation history."""
    return run_feature_drafter(
        cfg,
        lambda target, tokenizer, data: build_drafter(cfg, target, tokenizer, data),
        lambda target, draft, prompts: PEagleMethod(cfg, target, draft, prompts),
    )


def main(argv: list[str] | None = None) -> None:
    """The script: options from the command line; a user error ends in one line (exit 2)."""
    run_main(lambda args: run(load_config(PEagleConfig, args)), argv, prog="train/peagle.py")


if __name__ == "__main__":
    main()
