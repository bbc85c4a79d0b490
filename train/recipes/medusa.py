"""The Medusa recipe's options (MedusaConfig, read by train/medusa.py and the memory planner) and its
freshly initialised heads."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from selfspec.heads.medusa import MedusaHeads
from selfspec.train.loop.config import ConfigError, check_at_least, option
from selfspec.train.loop.train_config import TrainConfig
from selfspec.train.loop.training import heads_config
from selfspec.train.regeneration.run import written_by

# the options only Medusa-2 reads: set on a Medusa-1 run they would be ignored, so they are refused
MEDUSA2_OPTIONS = (
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "head_lr_multiplier",
    "heads_coefficient",
    "heads_schedule",
    "heads_only_steps",
    "backbone_loss",
    "backbone_ce_weight",
    "merge",
    "gradient_checkpointing",
)


SCHEDULES = ("constant", "linear", "sine")  # Medusa-2's heads' weight over the run
BACKBONE_LOSSES = ("auto", "kl", "ce")  # Medusa-2's loss on the adapted target


@dataclasses.dataclass
class MedusaConfig(TrainConfig):
    """Train Medusa heads on a frozen causal LM (defaults: the demo target on CPU, under 10 minutes)."""

    kind: ClassVar[str] = "medusa"  # the drafter family this recipe trains (heads/families)

    max_steps: int = 400
    max_minutes: float = 7.0
    max_length: int = 192
    num_heads: int = option(4, "heads; head k predicts the token k + 2 positions ahead")
    num_layers: int = option(1, "residual blocks per head")
    head_decay: float = option(0.8, "weight of head k's loss is head_decay ** k")
    # Medusa's later format: heads reuse the target's frozen lm_head. On a small target K separate
    # vocabulary projections cost nearly a target forward per draft (memory-bound); one shared is cheap.
    share_lm_head: bool = option(
        True,
        "heads reuse the target's frozen lm_head (else one projection per head)",
    )
    self_distill: bool = option(
        True,
        "learn what the target itself says (acceptance at decode time), not the corpus",
    )
    max_train_examples: int = option(
        1024,
        "the items self-distillation answers before step 1, whatever max_steps (0.7-2.5 s each on a 2-core "
        "CPU)",
    )
    save_steps: int = 200
    tree_nodes: int = option(
        0,
        "nodes of the default tree stored with the heads; 0 fits it to this machine's latency",
    )
    # Medusa-2 (train/methods/medusa2.py): a LoRA on the target trained with the heads; decoding then runs the
    # adapted target
    medusa2: bool = option(
        False,
        "train the heads jointly with a LoRA on the target (Medusa-2) instead of on a frozen one",
    )
    lora_r: int = option(32, "Medusa-2: LoRA rank (attention and MLP projections, and an untied lm_head)")
    lora_alpha: int = option(16, "Medusa-2: LoRA alpha (the update is scaled by alpha / r)")
    lora_dropout: float = option(0.05, "Medusa-2: dropout on the LoRA input")
    head_lr_multiplier: float = option(
        4.0,
        "Medusa-2: the heads' learning rate is this times learning_rate (the LoRA's)",
    )
    heads_coefficient: float = option(
        0.2,
        "Medusa-2: lambda, the weight of the heads' pull on the adapters against L0, reached by",
    )
    heads_schedule: str = option(
        "sine",
        "Medusa-2: how lambda ramps up over the joint steps: constant | linear | sine",
    )
    heads_only_steps: int = option(
        0,
        "Medusa-2: train the heads alone (Medusa-1) for this many steps first, then jointly",
    )
    backbone_loss: str = option(
        "auto",
        "Medusa-2: the target's loss: kl (to its frozen self) | ce | auto (kl on self-generated data)",
    )
    # Medusa-2 with the KL: also learn the target's own tokens, so its greedy choices (which the heads
    # learned) hold
    backbone_ce_weight: float = option(
        0.0,
        "Medusa-2: L0 = KL + this x cross-entropy of the self-generated text",
    )
    merge: bool = option(
        False,
        "Medusa-2: save the target with the LoRA merged in (a full model) instead of the adapter",
    )
    gradient_checkpointing: bool = option(
        False,
        "Medusa-2: recompute the target's layers in the backward pass (less memory)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(self, ("num_heads", "num_layers", "lora_r", "lora_alpha"), 1)
        check_at_least(self, ("heads_only_steps",), 0)
        if self.heads_schedule not in SCHEDULES:
            raise ConfigError(
                f"--heads_schedule must be one of {', '.join(SCHEDULES)}, got {self.heads_schedule!r}"
            )
        if self.backbone_loss not in BACKBONE_LOSSES:
            raise ConfigError(
                f"--backbone_loss must be one of {', '.join(BACKBONE_LOSSES)}, got {self.backbone_loss!r}"
            )
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.head_lr_multiplier <= 0 or self.heads_coefficient < 0 or self.backbone_ce_weight < 0:
            raise ConfigError(
                "--head_lr_multiplier must be > 0, --heads_coefficient and --backbone_ce_weight >= 0"
            )
        if self.backbone_ce_weight and self.medusa2 and not uses_kl(self):
            raise ConfigError(
                "--backbone_ce_weight adds cross-entropy to the KL on the target's own text, but L0 "
                "is the cross-entropy already (--backbone_loss ce, or data the target did not write): "
                "drop it, or add --self_distill true"
            )
        if not self.medusa2:
            for field in dataclasses.fields(self):
                if field.name in MEDUSA2_OPTIONS and getattr(self, field.name) != field.default:
                    raise ConfigError(
                        f"--{field.name} applies to Medusa-2 (a LoRA-adapted target): add --medusa2 "
                        "true or drop it"
                    )
        elif 0 < self.max_steps <= self.heads_only_steps:
            raise ConfigError(
                f"--heads_only_steps ({self.heads_only_steps}) leaves no joint step of --max_steps "
                f"({self.max_steps}): the LoRA would not train; lower it or raise max_steps"
            )
        if not 0 < self.head_decay <= 1:
            raise ConfigError(f"--head_decay must be in (0, 1], got {self.head_decay}")
        if self.tree_nodes < 0:
            raise ConfigError(f"--tree_nodes must be >= 0 (0 fits the tree here), got {self.tree_nodes}")


def new_heads(cfg: MedusaConfig, target) -> MedusaHeads:
    """The recipe's heads for this target, freshly initialised (training starts from them after copying the
    target's lm_head in; the memory planner builds them on the meta device)."""
    return MedusaHeads(
        heads_config(
            cfg,
            target,
            "medusa",
            num_heads=cfg.num_heads,
            num_layers=cfg.num_layers,
            share_lm_head=cfg.share_lm_head,
        )
    )


def self_generated(cfg) -> bool:
    """Whether the training text is the target's own: self-distilled here, or a regenerated dataset folder."""
    return bool(cfg.self_distill) or bool(written_by(cfg.dataset, cfg.model))


def uses_kl(cfg) -> bool:
    """Whether L0 is the KL to the frozen target (asked for, or by default on self-generated data)."""
    return cfg.backbone_loss == "kl" or (cfg.backbone_loss == "auto" and self_generated(cfg))
