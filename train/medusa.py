"""Train Medusa heads on a frozen causal LM.

    accelerate launch train/medusa.py                        # demo target, stdlib corpus, CPU, < 10 min
    accelerate launch train/medusa.py --config configs/medusa/llama3-8b-sharegpt.yaml

Head k (0-based) learns the token k + 2 positions ahead from the target's last hidden state; the
loss is cross-entropy weighted by head_decay**k, on loss-mask positions only. At the end the heads
are saved with a default tree fitted to how often each path of their top-k candidates was right in validation.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from selfspec.heads.errors import run_main
from selfspec.heads.medusa import MedusaHeads
from selfspec.train.config import ConfigError, check_at_least, load_config
from selfspec.train.distributed import gathers_weights, unpartitioned
from selfspec.train.loop import heads_config, start_run, train
from selfspec.train.medusa_method import MedusaMethod
from selfspec.train.run_data import datasets_for
from selfspec.train.target_shard import load_training_target
from selfspec.train.train_config import TrainConfig

# the options only Medusa-2 reads: set on a Medusa-1 run they would be ignored, so they are refused
MEDUSA2_OPTIONS = ("lora_r", "lora_alpha", "lora_dropout", "head_lr_multiplier", "heads_coefficient", "heads_schedule",
                   "heads_only_steps", "backbone_loss", "backbone_ce_weight", "merge", "gradient_checkpointing")


@dataclasses.dataclass
class MedusaConfig(TrainConfig):
    """Train Medusa heads on a frozen causal LM (defaults: the demo target on CPU, under 10 minutes)."""

    kind: ClassVar[str] = "medusa"  # the drafter family this recipe trains (heads/families)

    output_dir: str = "outputs/medusa-demo"
    max_steps: int = 400
    max_minutes: float = 7.0
    learning_rate: float = 1e-3
    max_length: int = 192
    per_device_train_batch_size: int = 8
    mixed_precision: str = "auto"  # auto: bf16 on a GPU with bf16 or a CPU with AMX, float32 elsewhere
    num_heads: int = 4  # heads; head k predicts the token k + 2 positions ahead
    num_layers: int = 1  # residual blocks per head
    head_decay: float = 0.8  # weight of head k's loss is head_decay ** k
    # Medusa's later format: heads reuse the target's frozen lm_head. On a small target K separate
    # vocabulary projections cost nearly a target forward per draft (memory-bound); one shared is cheap.
    share_lm_head: bool = True  # heads reuse the target's frozen lm_head (else one projection per head)
    self_distill: bool = True  # learn what the target itself says (acceptance at decode time), not the corpus
    max_train_examples: int = 1024  # the items self-distillation answers before step 1, whatever max_steps (0.7-2.5 s each on a 2-core CPU)
    save_steps: int = 200
    tree_nodes: int = 0  # nodes of the default tree stored with the heads; 0 fits it to this machine's latency
    # Medusa-2 (train/medusa2.py): a LoRA on the target trained with the heads; decoding then runs the adapted target
    medusa2: bool = False  # train the heads jointly with a LoRA on the target (Medusa-2) instead of on a frozen one
    lora_r: int = 32  # Medusa-2: LoRA rank (attention and MLP projections, and an untied lm_head)
    lora_alpha: int = 16  # Medusa-2: LoRA alpha (the update is scaled by alpha / r)
    lora_dropout: float = 0.05  # Medusa-2: dropout on the LoRA input
    head_lr_multiplier: float = 4.0  # Medusa-2: the heads' learning rate is this times learning_rate (the LoRA's)
    heads_coefficient: float = 0.2  # Medusa-2: lambda, the weight of the heads' pull on the adapters against L0, reached by
    heads_schedule: str = "sine"  # Medusa-2: how lambda ramps up over the joint steps: constant | linear | sine
    heads_only_steps: int = 0  # Medusa-2: train the heads alone (Medusa-1) for this many steps first, then jointly
    backbone_loss: str = "auto"  # Medusa-2: the target's loss: kl (to its frozen self) | ce | auto (kl on self-generated data)
    # Medusa-2 with the KL: also learn the target's own tokens, so its greedy choices (which the heads learned) hold
    backbone_ce_weight: float = 0.0  # Medusa-2: L0 = KL + this x cross-entropy of the self-generated text
    merge: bool = False  # Medusa-2: save the target with the LoRA merged in (a full model) instead of the adapter
    gradient_checkpointing: bool = False  # Medusa-2: recompute the target's layers in the backward pass (less memory)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(self, ("num_heads", "num_layers", "lora_r", "lora_alpha"), 1)
        check_at_least(self, ("heads_only_steps",), 0)
        from selfspec.train.medusa2 import BACKBONE_LOSSES, SCHEDULES, uses_kl

        if self.heads_schedule not in SCHEDULES:
            raise ConfigError(f"--heads_schedule must be one of {', '.join(SCHEDULES)}, got {self.heads_schedule!r}")
        if self.backbone_loss not in BACKBONE_LOSSES:
            raise ConfigError(f"--backbone_loss must be one of {', '.join(BACKBONE_LOSSES)}, got {self.backbone_loss!r}")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.head_lr_multiplier <= 0 or self.heads_coefficient < 0 or self.backbone_ce_weight < 0:
            raise ConfigError("--head_lr_multiplier must be > 0, --heads_coefficient and --backbone_ce_weight >= 0")
        if self.backbone_ce_weight and self.medusa2 and not uses_kl(self):
            raise ConfigError("--backbone_ce_weight adds cross-entropy to the KL on the target's own text, but L0 "
                              "is the cross-entropy already (--backbone_loss ce, or data the target did not write): "
                              "drop it, or add --self_distill true")
        if not self.medusa2:
            for field in dataclasses.fields(self):
                if field.name in MEDUSA2_OPTIONS and getattr(self, field.name) != field.default:
                    raise ConfigError(f"--{field.name} applies to Medusa-2 (a LoRA-adapted target): add --medusa2 "
                                      "true or drop it")
        elif 0 < self.max_steps <= self.heads_only_steps:
            raise ConfigError(f"--heads_only_steps ({self.heads_only_steps}) leaves no joint step of --max_steps "
                              f"({self.max_steps}): the LoRA would not train; lower it or raise max_steps")
        if not 0 < self.head_decay <= 1:
            raise ConfigError(f"--head_decay must be in (0, 1], got {self.head_decay}")
        if self.tree_nodes < 0:
            raise ConfigError(f"--tree_nodes must be >= 0 (0 fits the tree here), got {self.tree_nodes}")



def new_heads(cfg: MedusaConfig, target) -> MedusaHeads:
    """The recipe's heads for this target, freshly initialised (training starts from them after copying the
    target's lm_head in; the memory planner builds them on the meta device)."""
    return MedusaHeads(heads_config(cfg, target, "medusa", num_heads=cfg.num_heads, num_layers=cfg.num_layers,
                                    share_lm_head=cfg.share_lm_head))


def run(cfg: MedusaConfig) -> dict:
    """Set up, train and save; returns the target, the trained heads and the validation history."""
    accelerator = start_run(cfg)
    if cfg.medusa2 and gathers_weights(accelerator):  # before any heavy work
        raise ConfigError("Medusa-2 trains a LoRA inside the target, which stays whole on every rank: use DDP "
                          "or DeepSpeed ZeRO-2 (configs/accelerate/ddp.yaml, deepspeed-zero2.yaml), not ZeRO-3/FSDP")
    target, tokenizer = load_training_target(cfg, accelerator)
    with unpartitioned(accelerator, cfg.seed):  # built whole and alike on every rank; prepare() shards it
        heads = new_heads(cfg, target)
        heads.init_from_lm_head(target.get_output_embeddings())
        heads.to(accelerator.device)
    initial = {k: v.detach().clone() for k, v in heads.state_dict().items()}
    train_data, eval_data = datasets_for(cfg, tokenizer, target, accelerator)
    if cfg.medusa2:
        from selfspec.train.medusa2 import medusa2_method

        method = medusa2_method(cfg, target, heads, tokenizer)
    else:
        method = MedusaMethod(cfg, target, heads)
    history, trained = train(cfg, accelerator, method, train_data, eval_data)
    trained = trained.heads if cfg.medusa2 else trained
    return {"target": method.target, "heads": trained, "initial": initial, "history": history}


def main(argv: list[str] | None = None) -> None:
    """The script: options from the command line; a user error ends in one line (exit 2)."""
    run_main(lambda args: run(load_config(MedusaConfig, args)), argv, prog="train/medusa.py")


if __name__ == "__main__":
    main()
