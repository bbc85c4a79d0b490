"""Tiny targets that ship MTP layers, written the way the published checkpoints store them (GLM-4.5's and
DeepSeek-V3's `model.layers.{num_hidden_layers + k}.*`), for the MTP family's tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig

from selfspec.heads.formats.mtp import published_tensors
from selfspec.heads.mtp import MtpDraft, mtp_config_for

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-target"
VOCAB = 8192  # the demo target's tokenizer, copied alongside

ARCHITECTURES = {
    "glm4_moe": lambda layers: Glm4MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        max_position_embeddings=512,
        num_mtp_layers=layers,
        partial_rotary_factor=0.5,
        eos_token_id=1,
        pad_token_id=2,
        bos_token_id=0,
    ),
    "deepseek_v3": lambda layers: DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
        max_position_embeddings=512,
        num_mtp_layers=layers,
        eos_token_id=1,
        pad_token_id=2,
        bos_token_id=0,
    ),
}


def write_mtp_target(out: Path, arch: str = "glm4_moe", layers: int = 1, seed: int = 0, **overrides) -> Path:
    """A random `arch` target with `layers` random MTP layers (config fields `overrides`), saved to `out` with
    them in its checkpoint."""
    torch.manual_seed(seed)
    config = ARCHITECTURES[arch](layers)
    for name, value in overrides.items():
        setattr(config, name, value)
    model = AutoModelForCausalLM.from_config(config).eval()
    draft = MtpDraft(mtp_config_for(model, str(out)))
    model.save_pretrained(out)
    state = load_file(str(out / "model.safetensors")) | published_tensors(draft, model)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(DEMO / name, out / name)
    return out


# the other architectures transformers gives MTP layers, shrunk from their default configs
SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    n_routed_experts=4,
    num_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_k=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    eos_token_id=1,
    pad_token_id=2,
    bos_token_id=0,
)


def tiny_mtp_model(model_type: str, seed: int = 0, **fields) -> tuple[torch.nn.Module, MtpDraft]:
    """A random tiny `model_type` target (its default config with one MTP layer, the fields of SMALL it has,
    then `fields`) and a random MTP drafter for it, in memory."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, num_mtp_layers=1)
    for name, value in SMALL.items():
        if hasattr(config, name):
            setattr(config, name, value)
    for name, value in fields.items():
        setattr(config, name, value)
    for name in ("layer_types", "mlp_layer_types", "mtp_layer_types", "mtp_mlp_layer_types"):
        kinds = getattr(config, name, None)
        if isinstance(kinds, list):  # one per layer
            count = 1 if name.startswith("mtp") else config.num_hidden_layers
            setattr(config, name, (kinds * count)[:count])
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() > 1:
                weight.normal_(0, 0.3)
    return model, MtpDraft(mtp_config_for(model, model_type)).eval()
