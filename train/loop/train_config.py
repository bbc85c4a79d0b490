"""The options every drafter recipe shares (TrainConfig, which MedusaConfig and EagleConfig extend), each
value checked when the config is built, before any model loads."""

from __future__ import annotations

import dataclasses

import torch

from selfspec.train.loop.config import ConfigError, check_at_least, check_finite, option
from selfspec.train.loop.precision import resolve_precision

REPORTERS = ("none", "wandb", "tensorboard")
PRECISIONS = ("auto", "no", "bf16", "fp16")


@dataclasses.dataclass
class TrainConfig:
    """Options every drafter recipe shares; the defaults train on the demo target on CPU."""

    model: str = option("demo", "any HF causal LM name or path; `demo` is the shipped target")
    dataset: str = option("stdlib", "stdlib | file.txt | folder | file.json(l) | a datasets name")
    eval_dataset: str | None = option(None, "default: the stdlib validation split, or a held-out slice")
    eval_fraction: float = option(
        0.02,
        "the held-out slice of `dataset` used for validation when no eval_dataset",
    )
    max_train_examples: int = option(0, "> 0: use only this many (seeded random) training examples")
    self_distill: bool = option(
        False,
        "train on the target's own answers (train/regenerate.py), generated before step 1 for every "
        "training item (max_train_examples bounds them), whatever max_steps; cached",
    )
    distill_prompt_tokens: int = option(
        32,
        "with self_distill: tokens of each text window kept as its prompt",
    )
    distill_temperature: float = option(
        0.0,
        "with self_distill: the target's sampling temperature (0: greedy)",
    )
    output_dir: str = option(
        "outputs/medusa-demo",
        "where the drafter, its checkpoints and training_args.json go",
    )
    overwrite_output_dir: bool = option(
        False,
        "delete checkpoints another run left in output_dir (else: refuse to start)",
    )
    max_steps: int = option(-1, "optimizer steps; -1 means num_epochs")
    num_epochs: float = option(1.0, "epochs over the training data when max_steps is -1")
    max_minutes: float = option(0.0, "> 0: stop (and save) when this wall-clock budget is spent")
    learning_rate: float = option(1e-3, "peak AdamW learning rate (cosine decay after warmup)")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.999, "AdamW beta2")
    warmup_ratio: float = option(0.05, "fraction of the steps spent warming the learning rate up linearly")
    weight_decay: float = option(0.0, "AdamW weight decay")
    max_grad_norm: float = option(1.0, "clip the gradient norm to this (0: no clipping)")
    per_device_train_batch_size: int = option(8, "examples per process per micro-batch")
    per_device_eval_batch_size: int = option(8, "examples per process per validation batch")
    gradient_accumulation_steps: int = option(1, "micro-batches per optimizer step")
    max_length: int = option(512, "tokens per example: text is packed into blocks of this, chats cut to it")
    packing: bool = option(
        False,
        "pack training examples into rows of up to max_length, attention kept within each example",
    )
    mixed_precision: str = option(
        "auto",
        "auto (bf16 on a GPU with bf16 or a CPU with AMX, else float32) | no | bf16 | fp16",
    )
    seed: int = option(0, "seeds data order, subsets, initialisation and noise")
    save_steps: int = option(500, "write a resumable checkpoint every this many steps (and at the end)")
    save_total_limit: int = option(2, "checkpoints of this run kept (older ones deleted; 0 keeps all)")
    eval_steps: int = option(100, "validate every this many steps (and at the start and the end)")
    eval_batches: int = option(16, "cap on validation batches per evaluation")
    logging_steps: int = option(10, "log the training loss every this many steps")
    resume: str | None = option(None, "`latest` (in output_dir) or a checkpoint folder")
    resume_allow_changes: bool = option(
        False,
        "resume although batch size, data or model differ from the checkpoint's",
    )
    report_to: str = option("none", "none | wandb | tensorboard")
    run_name: str | None = option(None, "the tracker's run name (default: output_dir's name)")
    shard_target: bool = option(
        False,
        "shard the frozen target over the ranks (ZeRO-3 or FSDP2) when it does not fit one device",
    )
    ddp_timeout_minutes: float = option(
        360.0,
        "how long ranks wait for each other (data preparation, tree fitting on rank 0)",
    )

    @property
    def precision(self) -> str:
        """The mixed precision this machine runs: `auto` resolved (train/loop/precision.py), else as given."""
        return resolve_precision(self.mixed_precision)

    @property
    def target_dtype(self) -> torch.dtype:
        """The frozen target needs no fp32 master weights: keep it in the mixed-precision dtype."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision, torch.float32)

    def __post_init__(self) -> None:
        check_finite(self)
        if self.report_to not in REPORTERS:
            raise ConfigError(f"--report_to must be one of {', '.join(REPORTERS)}, got {self.report_to!r}")
        if self.mixed_precision not in PRECISIONS:
            raise ConfigError(
                f"--mixed_precision must be one of {', '.join(PRECISIONS)}, got {self.mixed_precision!r}"
            )
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(
                f"--max_steps must be > 0, or -1 to train num_epochs epochs; got {self.max_steps}"
            )
        if self.max_steps == -1 and self.num_epochs <= 0:
            raise ConfigError(f"--num_epochs must be > 0 when max_steps is -1, got {self.num_epochs}")
        check_at_least(
            self,
            (
                "save_steps",
                "eval_steps",
                "logging_steps",
                "gradient_accumulation_steps",
                "per_device_train_batch_size",
                "per_device_eval_batch_size",
                "eval_batches",
                "max_length",
                "distill_prompt_tokens",
            ),
            1,
        )
        check_at_least(
            self,
            (
                "max_train_examples",
                "save_total_limit",
                "max_minutes",
                "weight_decay",
                "max_grad_norm",
                "distill_temperature",
            ),
            0,
        )
        if self.ddp_timeout_minutes <= 0:
            raise ConfigError(f"--ddp_timeout_minutes must be > 0, got {self.ddp_timeout_minutes}")
        if self.learning_rate <= 0:
            raise ConfigError(f"--learning_rate must be > 0, got {self.learning_rate}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"--warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0 < self.eval_fraction < 1:
            raise ConfigError(f"--eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.self_distill and self.distill_prompt_tokens >= self.max_length:
            raise ConfigError(
                f"--distill_prompt_tokens ({self.distill_prompt_tokens}) must be below max_length "
                f"({self.max_length}): the rest of each example is what the target writes"
            )
