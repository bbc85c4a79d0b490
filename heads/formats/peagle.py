"""P-EAGLE drafters in the layouts vLLM 0.32 serves with `parallel_drafting`
(docs/design/peagle-vllm-0.32.md).

A P-EAGLE checkpoint is an EAGLE-3 checkpoint (heads/formats/eagle3.py) plus what its parallel slots read:
    mask_hidden         (1, n * H)  the pre-fc feature of every parallel slot (vLLM's `mask_hidden` buffer)
    embed_tokens.weight (V, H)      the target's input embedding with row `mask_token_id` = our mask_embedding
    mask_token_id       config.json, top level: the token id vLLM feeds the slots
                        (llm_base_proposer.py:356-380)
Layouts:
    peagle              SafeAILab/vLLM EAGLE-3 names (LlamaForCausalLMEagle3, `midlayer.*`); served with
                        speculative_config {"method": "eagle3", "parallel_drafting": true, ...}
    speculators-peagle  speculators 0.9's (`speculators_model_type: "peagle"`, `layers.0.*`); vLLM turns it
                        into eagle3 + parallel_drafting itself
                        (transformers_utils/configs/speculators/base.py:128-134)
The EAGLE-3 part is written and read by the EAGLE-3 layouts' own code, so the two never drift apart.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from selfspec.heads.config import HeadsConfig
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.heads.formats.checkpoint import Checkpoint
from selfspec.heads.formats.eagle3 import EMBED_KEY, detect_eagle3_format, import_eagle3
from selfspec.heads.formats.eagle3_export import eagle3_checkpoint, target_tensor, write_checkpoint
from selfspec.heads.peagle import PEagleDraft

LAYOUTS = {"peagle": "eagle3", "speculators-peagle": "speculators-eagle3"}  # each layout's EAGLE-3 part
MASK_HIDDEN = "mask_hidden"


def detect_peagle_format(directory: str | Path | Checkpoint) -> str | None:
    """ "peagle" or "speculators-peagle" for a P-EAGLE checkpoint directory, None for anything else."""
    checkpoint = Checkpoint.read(directory)
    raw = checkpoint.config
    if raw is None or checkpoint.is_selfspec or not checkpoint.weight_files:
        return None
    if raw.get("speculators_model_type") == "peagle":
        return "speculators-peagle"
    if "mask_token_id" in raw and MASK_HIDDEN in checkpoint.weight_names and detect_eagle3_format(checkpoint):
        return "peagle"
    return None


class _EagleThreePart(Checkpoint):
    """A P-EAGLE checkpoint read as the EAGLE-3 checkpoint inside it: its config as the EAGLE-3 layout's, its
    weights without mask_hidden (kept aside)."""

    def __init__(self, checkpoint: Checkpoint, fmt: str) -> None:
        config = dict(checkpoint.require_config())
        if fmt == "speculators-peagle":
            config["speculators_model_type"] = "eagle3"
        super().__init__(checkpoint.path, config)
        self.whole = checkpoint
        self.mask_hidden: torch.Tensor | None = None
        self.embed: torch.Tensor | None = None

    @property
    def weight_files(self) -> list[Path]:
        return self.whole.weight_files

    def read_weights(self) -> dict[str, torch.Tensor]:
        state = self.whole.read_weights()
        self.mask_hidden = state.pop(MASK_HIDDEN, None)
        self.embed = state.get(EMBED_KEY)
        return state


def import_peagle(
    directory: str | Path | Checkpoint,
    format: str | None = None,  # noqa: A002
    base_model: str | None = None,
    target: nn.Module | None = None,
) -> PEagleDraft:
    """Build a `PEagleDraft` from a `peagle` or `speculators-peagle` checkpoint directory (what `export_as`
    writes, and speculators 0.9 saves); the EAGLE-3 part is read as import_eagle3 reads it (its arguments are
    the same)."""
    checkpoint = Checkpoint.read(directory)
    fmt = format or detect_peagle_format(checkpoint)
    if fmt not in LAYOUTS:
        raise ValueError(
            f"{checkpoint.path} is not a P-EAGLE checkpoint: it expects an EAGLE-3 checkpoint with "
            "mask_hidden in its weights and mask_token_id in config.json"
        )
    raw = checkpoint.require_config()
    token = raw.get("mask_token_id", raw.get("pard_token"))
    part = _EagleThreePart(checkpoint, fmt)
    body = import_eagle3(part, LAYOUTS[fmt], base_model=base_model, target=target)
    vocab = body.config.vocab_size
    if type(token) is not int or not 0 <= token < vocab:
        raise ValueError(
            f"{checkpoint.path / 'config.json'}: mask_token_id must be a token id in [0, {vocab}), got "
            f"{token!r}"
        )
    fused = body.fc.in_features
    if part.mask_hidden is None or part.mask_hidden.numel() != fused:
        found = None if part.mask_hidden is None else tuple(part.mask_hidden.shape)
        raise ValueError(
            f"{checkpoint.path}: mask_hidden should hold the fc input's {fused} values, found {found}"
        )
    if part.embed is None or tuple(part.embed.shape) != (vocab, body.config.hidden_size):
        raise ValueError(
            f"{checkpoint.path}: embed_tokens.weight ({vocab}, {body.config.hidden_size}) is missing or "
            "misshapen: the parallel slots' token embedding is its mask_token_id row"
        )
    config = HeadsConfig.from_dict(body.config.to_dict() | {"kind": "peagle", "mask_token_id": token})
    draft = PEagleDraft(config).to(body.fc.weight.dtype)
    state = body.state_dict() | {
        "mask_hidden": part.mask_hidden.reshape(-1),
        "mask_embedding": part.embed[token],
    }
    draft.load_state_dict({k: v.to(draft.state_dict()[k].dtype) for k, v in state.items()})
    return draft.eval()


def export_as(
    draft: PEagleDraft,
    fmt: str,
    out_dir: str | Path,
    target: nn.Module | None = None,
    base_model: str | None = None,
    weights: str | None = None,
) -> None:
    """Write `draft` as a `peagle` or `speculators-peagle` checkpoint (see the module docstring). The target
    is needed: its input embedding, with the mask token's row learned, is part of the checkpoint."""
    if fmt not in LAYOUTS:
        raise ValueError(f"unknown P-EAGLE format {fmt!r}; choose one of {', '.join(LAYOUTS)}")
    if target is None:
        raise ValueError(
            "a P-EAGLE checkpoint carries the target's input embedding with the mask token's row "
            "learned (embed_tokens.weight): give the target (--model, or target=)"
        )
    cfg = draft.config
    body = Eagle3Draft(HeadsConfig.from_dict(cfg.to_dict() | {"kind": "eagle3", "mask_token_id": None}))
    dtype = draft.fc.weight.dtype
    body.to(dtype).load_state_dict({k: v for k, v in draft.state_dict().items() if not k.startswith("mask_")})
    state, config = eagle3_checkpoint(body, LAYOUTS[fmt], base_model, target)
    embed = target_tensor(target.get_input_embeddings().weight, "input embedding", draft, dtype)
    embed[cfg.mask_token_id] = draft.mask_embedding.detach().cpu().to(dtype)
    state |= {EMBED_KEY: embed, MASK_HIDDEN: draft.mask_hidden.detach().cpu()[None].to(dtype)}
    config["mask_token_id"] = cfg.mask_token_id
    if fmt == "speculators-peagle":
        config |= {"speculators_model_type": "peagle", "architectures": ["PEagleSpeculator"]}
        config["speculators_config"]["algorithm"] = "peagle"
    write_checkpoint(out_dir, state, weights or "safetensors", config)
