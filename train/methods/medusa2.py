"""Medusa-2: the heads trained jointly with a LoRA on the target (peft), so the target also learns to be
drafted.

    loss = L0 + lambda(t) * sum_k head_decay^k * CE_k

L0 keeps the adapted target close to the original: on data the target wrote itself (self-distilled or
regenerated) it is KL(frozen || adapted), the frozen distribution read from the same model with its adapters
switched off (no second copy in memory), plus `backbone_ce_weight` times the cross-entropy of those same
tokens; on other data it is the plain next-token cross-entropy. lambda(t)
ramps to `heads_coefficient` by a constant, linear or sine schedule. lambda(t) weighs what the heads ask of
the target (the gradient reaching the adapters); the heads themselves always learn from the whole sum_k term,
so a ramp starting at 0 does not freeze them (AdamW's second moment, remembering earlier larger gradients,
would otherwise shrink their steps for hundreds of steps). With `heads_only_steps` the run first trains the
heads alone (Medusa-1) and then jointly. The decoded target is the adapted one: output stays
exactly what *it* would generate, which is slightly different from the original target.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.heads.medusa import MedusaHeads
from selfspec.heads.target import ADAPTED
from selfspec.infer.core.target import decoder_layers
from selfspec.train.data.packing import reaches, segments, target_inputs
from selfspec.train.loop.method import FIRST_STEP, StepContext, StepOutput
from selfspec.train.methods.chunked_loss import agreed_calls, chunked_sum
from selfspec.train.methods.medusa import MedusaMethod
from selfspec.train.recipes.medusa import uses_kl

ADAPTER_DIR, MERGED_DIR = "adapter", "target"


def heads_weight(schedule: str, coefficient: float, progress: float) -> float:
    """lambda(t): `coefficient` times the schedule's ramp at `progress` in [0, 1] (1, t, or
    sin(t * pi / 2))."""
    progress = min(max(progress, 0.0), 1.0)
    ramp = {"constant": 1.0, "linear": progress, "sine": math.sin(progress * math.pi / 2)}[schedule]
    return coefficient * ramp


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward pass multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x unchanged, with only `scale` times its gradient passed back to what computed it."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


def lora_targets(model: nn.Module) -> list[str]:
    """Every linear projection inside the decoder layers (attention and MLP), and the lm_head unless it is
    tied to the input embeddings (merging a LoRA into a tied lm_head would change the embeddings too)."""
    from transformers.pytorch_utils import Conv1D

    names = {
        name.rsplit(".", 1)[-1]
        for layer in decoder_layers(model)
        for name, module in layer.named_modules()
        if isinstance(module, (nn.Linear, Conv1D))
    }
    head = model.get_output_embeddings()
    if head is not None and head.weight is not model.get_input_embeddings().weight:
        names.add(next(n for n, m in model.named_modules() if m is head))
    return sorted(names)


def add_lora(target: nn.Module, r: int, alpha: int, dropout: float) -> nn.Module:
    """The target wrapped by peft with a LoRA on `lora_targets` (B = 0: it computes exactly the target at
    first)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=lora_targets(target),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(target, config)


class JointMedusa(nn.Module):
    """What Medusa-2 trains: the target with its LoRA adapters, and the heads. Its state holds only what
    trains (the adapters and the heads), so checkpoints stay small whatever the target's size."""

    def __init__(self, backbone: nn.Module, heads: MedusaHeads) -> None:
        super().__init__()
        self.backbone, self.heads = backbone, heads
        self.config = heads.config
        self.trained = {n for n, p in self.named_parameters() if p.requires_grad}
        # hooks, not overrides: they apply however deeply DDP or DeepSpeed wrap the module (prefixed names)
        self.register_state_dict_post_hook(_drop_frozen)
        self.register_load_state_dict_post_hook(_frozen_not_missing)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        some: torch.Tensor,
        joint: bool = True,
        push: float = 1.0,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The adapted target's last hidden states (B, T, H) and the heads' features at `some` (M, H) each;
        with joint=False the target runs without gradients (the heads-only stage), else the heads' gradient
        reaches it scaled by `push` (lambda(t)). Packed rows: position_ids and no attention_mask
        (train.packing)."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and joint):
            hidden = (
                self.backbone.get_base_model()
                .base_model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    use_cache=False,
                )
                .last_hidden_state
            )
        return hidden, self.heads(scale_grad(hidden[some], push), project=False)

    def frozen(self, key: str) -> bool:
        """Whether a state-dict key (any wrapper's `module.` prefixes removed) names a frozen target
        tensor."""
        while key.startswith("module."):
            key = key[len("module.") :]
        return key not in self.trained


def _drop_frozen(module: JointMedusa, state: dict, prefix: str, _metadata) -> None:
    for key in [k for k in state if k.startswith(prefix) and module.frozen(k[len(prefix) :])]:
        del state[key]


def _frozen_not_missing(module: JointMedusa, incompatible) -> None:
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not module.frozen(k)]


class Medusa2Method(MedusaMethod):
    """MedusaMethod on the adapted target, plus the target's own loss L0 (see the module docstring)."""

    label = "Medusa-2 heads and LoRA adapter"

    def __init__(self, cfg, backbone: nn.Module, heads: MedusaHeads, kl: bool, tokenizer=None) -> None:
        super().__init__(cfg, backbone.get_base_model(), heads)
        self.backbone, self.kl, self.tokenizer = backbone, kl, tokenizer
        self.label = "Medusa-2 heads and merged target" if cfg.merge else "Medusa-2 heads and LoRA adapter"
        self.trainable = JointMedusa(backbone, heads)
        self.stage = FIRST_STEP  # the step of the newest loss: it decides the stage and the heads' weight
        self._l0_sums = None

    def _heads_weight(self) -> float:
        """lambda(t) at the current step (0 in the heads-only stage)."""
        if not self._joint_stage():
            return 0.0
        joint_steps = max(self.stage.total_steps - self.cfg.heads_only_steps, 1)
        return heads_weight(
            self.cfg.heads_schedule,
            self.cfg.heads_coefficient,
            (self.stage.step - self.cfg.heads_only_steps) / joint_steps,
        )

    def param_groups(self, lr: float) -> list[dict]:
        """The adapters at the run's learning rate, the heads at head_lr_multiplier times it."""
        lora = [p for p in self.trainable.backbone.parameters() if p.requires_grad]
        heads = [p for p in self.trainable.heads.parameters() if p.requires_grad]
        return [{"params": lora, "lr": lr}, {"params": heads, "lr": lr * self.cfg.head_lr_multiplier}]

    def _joint_stage(self) -> bool:
        return self.stage.step >= self.cfg.heads_only_steps

    def _features(self, batch, some):
        with self.timer.section("target"):  # the adapted target's forward (its backward: the drafter's part)
            return self.module(
                batch["input_ids"],
                some=some,
                joint=self._joint_stage() and torch.is_grad_enabled(),
                push=self._heads_weight(),
                **target_inputs(batch),
            )

    def _logits(self, k: int, outputs: torch.Tensor) -> torch.Tensor:
        if not self.shared:  # the heads' own projection, inside the joint module (DDP and DeepSpeed wrap it)
            heads = self.trainable.heads
            return heads.project_head(k, outputs.to(heads.heads[k][-1].weight.dtype)).float()
        if not self._joint_stage():  # heads alone: the lm_head's frozen weights (its LoRA is still 0)
            frozen = getattr(self.lm_head, "base_layer", self.lm_head)
            return frozen(outputs.to(frozen.weight.dtype)).float()
        if not hasattr(self.lm_head, "lora_B"):  # tied, so without an adapter: the frozen lm_head
            return super()._logits(k, outputs)
        return self._adapted_lm_head(outputs.to(self.lm_head.weight.dtype)).float()

    def _adapted_lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """The LoRA-adapted lm_head on the heads' features, its adapter passed lambda(t) times the heads'
        gradient (as every other adapter is) while the features get all of it. (Its weights are whole here:
        Medusa-2 runs under DDP or ZeRO-2 only.)"""
        head, push = self.lm_head, self._heads_weight()
        out = head.base_layer(x)
        for name in head.active_adapters:
            if name not in head.lora_A:
                continue
            if head.merged or head.use_dora.get(name) or head.lora_B[name].bias is not None:
                raise RuntimeError("Medusa-2's shared lm_head expects a plain unmerged LoRA (add_lora's)")
            a, b = (scale_grad(m[name].weight, push) for m in (head.lora_A, head.lora_B))
            lora = F.linear(F.linear(head.lora_dropout[name](x).to(a.dtype), a), b) * head.scaling[name]
            out = (out + lora).to(out.dtype)  # as peft adds it: the adapter stays float32 under a bf16 target
        return out

    def _l0_rows(self, batch, hidden):
        """The adapted and frozen hidden states at the positions whose next token is trained on, and that
        token."""
        mask = batch["loss_mask"][:, 1:].bool() & reaches(segments(batch), 1)[:, :-1]  # t predicts t + 1
        labels = batch["input_ids"][:, 1:][mask]
        with torch.no_grad(), self.backbone.disable_adapter(), self.timer.section("target"):
            frozen = (
                self.target.base_model(
                    input_ids=batch["input_ids"], use_cache=False, **target_inputs(batch)
                ).last_hidden_state
                if self.kl
                else None
            )
        adapted = hidden[:, :-1][mask]
        return adapted, (frozen[:, :-1][mask] if frozen is not None else adapted.detach()), labels

    def _l0_sum(self, adapted: torch.Tensor, frozen: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sums over a chunk of rows: [KL(frozen || adapted) (0 without the KL), cross-entropy of the
        labels]."""
        logits = self.lm_head(adapted.to(self.lm_head.weight.dtype)).float()
        ce = F.cross_entropy(logits, labels, reduction="sum")
        if not self.kl:
            return torch.stack([torch.zeros_like(ce), ce])
        with torch.no_grad(), self.backbone.disable_adapter():
            reference = self.lm_head(frozen.to(self.lm_head.weight.dtype)).float().log_softmax(-1)
        return torch.stack(
            [F.kl_div(logits.log_softmax(-1), reference, log_target=True, reduction="sum"), ce]
        )

    def _l0_total(self, batch, hidden) -> tuple[torch.Tensor, int]:
        """[KL, cross-entropy] summed over the batch's trained positions, and how many there are."""
        rows = self._l0_rows(batch, hidden)
        calls = agreed_calls([rows[2].numel()], self.chunk, self.agree)[0]
        return chunked_sum(self._l0_sum, rows, self.chunk, calls), rows[2].numel()

    def _l0_parts(self, batch, hidden) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's mean KL (0 without it) and mean cross-entropy at its trained positions."""
        total, count = self._l0_total(batch, hidden)
        kl, ce = total / max(count, 1)
        return kl, ce

    def _combine(self, kl: torch.Tensor, ce: torch.Tensor) -> torch.Tensor:
        """L0 from its parts: KL + backbone_ce_weight * CE on the target's own text, else the CE alone."""
        return kl + self.cfg.backbone_ce_weight * ce if self.kl else ce

    def _l0_logs(self, kl: torch.Tensor, ce: torch.Tensor) -> dict:
        """L0's parts by name (the KL only where it is computed)."""
        return ({"backbone_kl": kl} if self.kl else {}) | {"backbone_ce": ce}

    def _l0(self, batch, hidden) -> torch.Tensor:
        return self._combine(*self._l0_parts(batch, hidden))

    def loss(self, batch, step: StepContext = FIRST_STEP) -> StepOutput:
        self.stage = step
        hidden, heads = self._per_head(batch)
        heads_loss, logs = self._heads_loss(heads)
        if not self._joint_stage():
            # every adapter tensor still gets a (zero) gradient: DDP expects each trained tensor's every step
            untouched = sum(p.sum() for p in self.trainable.backbone.parameters() if p.requires_grad)
            logs["loss"] = heads_loss.detach()
            return StepOutput(heads_loss + 0.0 * untouched, logs)
        kl, ce = self._l0_parts(batch, hidden)
        l0 = self._combine(kl, ce)
        # the objective is l0 + lambda * heads_loss: lambda is applied on the way back into the target
        logs |= self._l0_logs(kl.detach(), ce.detach()) | {
            "heads_loss": heads_loss.detach(),
            "loss": (l0 + self._heads_weight() * heads_loss).detach(),
        }
        return StepOutput(l0 + heads_loss, logs)

    def _eval_extra(self, batch, hidden) -> None:
        total, count = self._l0_total(batch, hidden)
        part = torch.cat([total.double(), torch.tensor([count], dtype=torch.float64, device=hidden.device)])
        self._l0_sums = part if self._l0_sums is None else self._l0_sums + part

    def evaluate(self, batches, total=None):
        self._l0_sums = None
        metrics = super().evaluate(batches, total)
        sums = self._l0_sums if self._l0_sums is not None else torch.zeros(3, dtype=torch.float64)
        sums = (total(sums) if total else sums).cpu()
        metrics |= {k: float(v) for k, v in self._l0_logs(*(sums[:2] / sums[2].clamp(min=1))).items()}
        return metrics

    def save(self, joint: JointMedusa, output_dir: Path, metrics: dict[str, float]) -> None:
        """The adapter (peft's format), then the heads with a tree fitted on the merged target; with `merge`
        the merged target (and tokenizer) next to them instead of the adapter."""
        backbone, heads = joint.backbone, joint.heads
        stale = output_dir / (
            ADAPTER_DIR if self.cfg.merge else MERGED_DIR
        )  # a resumed run saved the other form
        if stale.is_dir():
            shutil.rmtree(stale)
        if self.cfg.merge:
            heads.config.merged_target, heads.config.adapter = MERGED_DIR, None
        else:
            heads.config.adapter, heads.config.merged_target = ADAPTER_DIR, None
            # the lm_head's own weights are frozen: the adapter holds the LoRA tensors only, not a vocabulary
            # copy
            backbone.save_pretrained(str(output_dir / ADAPTER_DIR), save_embedding_layers=False)
        merged = backbone.merge_and_unload()  # what decoding runs: time the tree on it
        setattr(merged, ADAPTED, str(output_dir / (MERGED_DIR if self.cfg.merge else ADAPTER_DIR)))
        self.target = merged.eval()
        heads.source_dir = output_dir  # the returned heads find their adapted target, as loaded ones do
        if self.cfg.merge:
            merged.save_pretrained(str(output_dir / MERGED_DIR))
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(output_dir / MERGED_DIR))
        super().save(heads, output_dir, metrics)


def medusa2_method(cfg, target, heads: MedusaHeads, tokenizer) -> Medusa2Method:
    """The Medusa-2 method for a frozen target: LoRA added, L0 chosen (KL on self-generated data, else CE)."""
    if cfg.gradient_checkpointing:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    backbone = add_lora(target, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout)
    kl = uses_kl(cfg)
    return Medusa2Method(cfg, backbone, heads, kl, tokenizer)
