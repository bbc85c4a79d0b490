"""Fine-tune a target's own MTP layers (heads/mtp.py) on its data, the trunk frozen; or give a target new ones.

    accelerate launch train/mtp.py --config configs/mtp/demo.yaml     # the demo target, one new MTP layer, CPU
    accelerate launch train/mtp.py --model zai-org/GLM-4.5-Air --dataset sharegpt.jsonl   # its own MTP layer

The MTP layers start from the target's checkpoint (DeepSeek-V3, GLM-4.5, ... : every config with num_mtp_layers);
a target without them, or `--new_layers N`, gets N new ones (DeepSeek-V3's recipe: each a decoder layer of the
target's own architecture, started from its last decoder layer's weights, with fresh input norms and projection).
The loss is EAGLE-3's training-time test (train/step_loss.py): step i at t runs MTP layer 0 on step i - 1's output
and x_{t+1+i} and learns the target's distribution for x_{t+2+i}, as decoding reuses the layer at every depth.
Validation runs at step 0 too, so the log shows the acceptance before fine-tuning next to the one after. At the
end the dynamic tree (depth, top_k, total_tokens) is fitted to this machine; `selfspec export --format mtp`
writes the target with these layers under its checkpoint's own names, as the serving engines load them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch

from selfspec.heads.errors import run_main
from selfspec.heads.formats.mtp import load_target_mtp
from selfspec.heads.mtp import MtpDraft, mtp_layer_count
from selfspec.infer.tune import eagle_grid
from selfspec.train.config import ConfigError, check_at_least, load_config
from selfspec.train.eagle_features import batch_features
from selfspec.train.feature_run import run_feature_drafter
from selfspec.train.medusa_method import chunk_rows
from selfspec.train.method import FIRST_STEP, MethodBase, StepContext, StepOutput
from selfspec.train.step_loss import StepLoss, step_metrics
from selfspec.train.train_config import TrainConfig
from selfspec.train.tree_fit import fit_dynamic_tree, save_with_tree


@dataclasses.dataclass
class MtpConfig(TrainConfig):
    """Fine-tune a target's MTP layers, or train new ones (defaults: the demo target, one new layer, CPU)."""

    kind: ClassVar[str] = "mtp"  # the drafter family this recipe trains (heads/families)

    output_dir: str = "outputs/mtp-demo"
    new_layers: int = 0  # 0: the target's own MTP layers (one new layer where it has none); N: N new layers
    max_steps: int = 600  # optimizer steps
    max_minutes: float = 20.0  # stop a slower machine in time
    learning_rate: float = 5e-4
    adam_beta2: float = 0.95
    max_grad_norm: float = 0.5
    warmup_ratio: float = 0.02
    max_length: int = 192
    per_device_train_batch_size: int = 8
    mixed_precision: str = "auto"  # auto: bf16 on a GPU with bf16 or a CPU with AMX, float32 elsewhere
    self_distill: bool = True  # learn what the target itself says (the demos' shared self-distilled set)
    max_train_examples: int = 1024
    eval_steps: int = 200
    save_steps: int = 400
    ttt_steps: int = 3  # draft steps unrolled per sequence (the depths decoding reuses MTP layer 0 for)
    cache_features: bool = False  # compute the target's features once and keep them on disk for every epoch
    feature_shard_examples: int = 0  # with cache_features: examples per shard file (0: about 256 MiB each)
    depth: int = 0  # dynamic tree defaults stored with the drafter; 0 fits all three to this machine
    top_k: int = 0  # frontier width and children per expanded node (0: fit here; 1: the chain)
    total_tokens: int = 0  # drafted nodes kept for verification (0: fit here)
    tune_depths: list[int] = dataclasses.field(default_factory=lambda: [2, 3, 4])  # the grid fitted over
    tune_top_ks: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 4])  # 1: chains
    tune_totals: list[int] = dataclasses.field(default_factory=lambda: [8, 16])  # tree sizes (top_k > 1)
    tune_prompts: int = 6  # validation prompts decoded per tree setting when fitting
    tune_new_tokens: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(self, ("ttt_steps", "tune_prompts", "tune_new_tokens"), 1)
        check_at_least(self, ("new_layers", "depth", "top_k", "total_tokens", "feature_shard_examples"), 0)
        for name in ("tune_depths", "tune_top_ks", "tune_totals"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ConfigError(f"--{name} must list positive numbers (e.g. 2,4,8), got {getattr(self, name)}")
        if self.new_layers > 1:
            raise ConfigError("--new_layers above 1: drafting runs MTP layer 0 at every depth (docs/mtp.md), so "
                              "further new layers would stay untrained; use --new_layers 1")
        given = [self.depth > 0, self.top_k > 0, self.total_tokens > 0]
        if any(given) and not all(given):
            raise ConfigError("set all of depth, top_k and total_tokens (a fixed tree) or none of them (fit here)")

    def grid(self) -> list[tuple[int, int, int]]:
        """The (depth, top_k, total_tokens) settings fitted: chains of each depth and trees of each size."""
        chains = [(d, 1, d) for d in self.tune_depths] if 1 in self.tune_top_ks else []
        wide = [k for k in self.tune_top_ks if k > 1]
        return chains + (eagle_grid(self.tune_depths, wide, self.tune_totals) if wide else [])


class MtpMethod(MethodBase):
    """The MTP layers' loss, validation and save for the shared training loop (train/loop.py)."""

    label = "the MTP layers"
    best_metric = "sim_accept"  # the loop saves the weights of the best validation by this

    def __init__(self, cfg: MtpConfig, target, draft: MtpDraft, tune_prompts: list[torch.Tensor]) -> None:
        self.cfg, self.target, self.trainable, self.tune_prompts = cfg, target, draft, tune_prompts
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.chunk = chunk_rows(self.lm_head.weight.shape[0])

    def _unroll(self, batch: dict[str, torch.Tensor]):
        """The loss object, the MTP outputs per step and the target's last hidden states (B, T, H)."""
        hidden = batch_features(self.target, batch, None, self.timer)
        steps = StepLoss(self.trainable, self.cfg.ttt_steps, self.lm_head, self.chunk, runner=self.module,
                         agree=self.agree)
        return steps, steps.unroll(hidden, batch, self.embed, unroll=self.cfg.ttt_steps), hidden

    def loss(self, batch: dict[str, torch.Tensor], step: StepContext = FIRST_STEP) -> StepOutput:
        steps, outputs, hidden = self._unroll(batch)
        return StepOutput(*steps.loss(outputs, hidden, batch))

    def evaluate(self, batches: list[dict[str, torch.Tensor]],
                 total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """Per step top-1 agreement with the target and "sim_accept", the chain's teacher-forced acceptance length
        (1 + the leading steps whose top-1 is the target's argmax); `total` sums over processes."""
        return step_metrics(batches, self._unroll, self.cfg.ttt_steps, self.lm_head.weight.device, total,
                            lambda i: f"step{i}_top1")

    def save(self, draft: MtpDraft, output_dir: Path, metrics: dict[str, float]) -> None:
        """Fit the dynamic tree here (unless the recipe sets it) and save the layers with their validation."""
        cfg = self.cfg
        draft.bind(self.lm_head)
        fit = (lambda: fit_dynamic_tree(self.target, draft, self.tune_prompts, cfg.grid(), cfg.tune_new_tokens,
                                        "MTP chain/tree")) if self.tune_prompts else None
        chain = {"depth": cfg.ttt_steps, "top_k": 1, "total_tokens": cfg.ttt_steps}
        save_with_tree(draft, output_dir, cfg, metrics, self.summary(metrics), fit, chain)

    def summary(self, metrics: dict[str, float]) -> str:
        per = " / ".join(f"{metrics[f'step{i}_top1']:.3f}" for i in range(self.cfg.ttt_steps))
        return (f"top-1 agreement with the target per depth {per}; simulated acceptance length "
                f"{metrics['sim_accept']:.2f} (chain, teacher-forced)")


def new_layers(cfg: MtpConfig, target, count: int) -> MtpDraft:
    """`count` new MTP layers for `target`: each decoder block starts from the target's last decoder layer where
    the shapes agree (transformers' initialisation elsewhere)."""
    from selfspec.heads.mtp import mtp_config_for

    config = mtp_config_for(target, cfg.model, layers=count, dtype=str(cfg.target_dtype).removeprefix("torch."))
    draft = MtpDraft(config)
    last = target.get_decoder().layers[-1].state_dict()
    for layer in draft.mtp.layers:
        block = layer.mtp_block.state_dict()
        same = {k: v for k, v in last.items() if k in block and block[k].shape == v.shape}
        layer.mtp_block.load_state_dict(same, strict=False)
    return draft


def build_drafter(cfg: MtpConfig, target) -> MtpDraft:
    """The target's own MTP layers, or new ones (see the module docstring), bound to its lm_head."""
    own = mtp_layer_count(target.config)
    if cfg.new_layers or not own:
        count = cfg.new_layers or 1
        if not cfg.new_layers:
            print(f"{cfg.model} has no MTP layers of its own: training {count} new one (--new_layers to choose)")
        draft = new_layers(cfg, target, count)
    else:
        draft = load_target_mtp(target, cfg.model)
    for later in draft.mtp.layers[1:]:  # kept as the checkpoint has them: drafting runs layer 0 at every depth
        later.requires_grad_(False)
    return draft.to(torch.float32).bind(target.get_output_embeddings())


def run(cfg: MtpConfig) -> dict:
    """Set up, train and save; returns the target, the trained layers and the validation history."""
    return run_feature_drafter(cfg, lambda target, tokenizer, data: build_drafter(cfg, target),
                               lambda target, draft, prompts: MtpMethod(cfg, target, draft, prompts))


def main(argv: list[str] | None = None) -> None:
    """The script: options from the command line; a user error ends in one line (exit 2)."""
    run_main(lambda args: run(load_config(MtpConfig, args)), argv, prog="train/mtp.py")


if __name__ == "__main__":
    main()
