"""Targets whose attention tree verification cannot reproduce exactly are refused up front, in one line naming
the setting (infer/core/exactness.py): sliding-window and chunked attention past the window (read from the
text config, composite configs included), LongRoPE and dynamic RoPE past their switch point, ALiBi, and
linear-attention, state-space and hybrid layers. Targets without any of these decode as before."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    FalconConfig,
    Gemma3Config,
    LlamaConfig,
    MambaConfig,
    MistralConfig,
    MptConfig,
    Phi3Config,
    Qwen2Config,
)

from selfspec.infer.core.exactness import check_architecture, check_length
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.drafters.prompt_lookup import PromptLookupProposer

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.mark.parametrize(
    "config, length, setting",
    [
        (MistralConfig(sliding_window=32), 40, "sliding_window 32"),
        (
            Qwen2Config(use_sliding_window=True, sliding_window=32, max_window_layers=0),
            40,
            "sliding_window 32",
        ),
        # composite: the window is in the text config only (the guard used to read the top-level config)
        (Gemma3Config(text_config={"sliding_window": 64, "num_hidden_layers": 6}), 100, "sliding_window 64"),
        (
            LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=2048),
            3000,
            "dynamic RoPE",
        ),
        (
            Phi3Config(
                rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
                original_max_position_embeddings=4096,
                max_position_embeddings=131072,
            ),
            5000,
            "longrope RoPE",
        ),
    ],
)
def test_a_length_past_the_switch_point_is_refused_and_one_within_passes(config, length, setting):
    with pytest.raises(ValueError, match=setting) as refused:
        check_length(config, length)
    assert "\n" not in str(refused.value)
    check_length(config, 30)  # within every window and switch point


def test_chunked_attention_is_read_like_a_window():
    from transformers import Llama4TextConfig

    config = Llama4TextConfig(attention_chunk_size=64, num_hidden_layers=4)
    with pytest.raises(ValueError, match="attention_chunk_size 64"):
        check_length(config, 100)
    check_length(config, 64)


@pytest.mark.parametrize(
    "config, what",
    [
        (BloomConfig(), "ALiBi"),
        (MptConfig(), "ALiBi"),
        (FalconConfig(alibi=True), "ALiBi"),
        (MambaConfig(), "linear_attention"),
        (
            LlamaConfig(layer_types=["full_attention", "linear_attention"], num_hidden_layers=2),
            "linear_attention",
        ),
    ],
)
def test_alibi_and_recurrent_layers_are_refused_whatever_the_length(config, what):
    with pytest.raises(ValueError, match=what):
        check_architecture(config)


@pytest.mark.parametrize(
    "config", [LlamaConfig(), Qwen2Config(), FalconConfig(), MistralConfig(sliding_window=None)]
)
def test_plain_attention_passes(config):
    check_architecture(config)
    check_length(config, 100_000)


def test_a_sliding_window_target_is_refused_before_it_decodes_past_its_window():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MistralConfig(sliding_window=16, **SMALL)).eval()
    spec = SpeculativeModel(model, PromptLookupProposer(4))
    prompt = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3]])
    with pytest.raises(ValueError, match="exceeds the model's sliding window"):
        spec.generate(prompt, max_new_tokens=20)
    short = spec.generate(prompt, max_new_tokens=2)  # 8 + 2 + the tree stays within 16
    assert short.tolist() == model.generate(prompt, max_new_tokens=2, do_sample=False).tolist()


def test_an_alibi_target_is_refused_when_the_speculative_model_is_made():
    model = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4))
    with pytest.raises(ValueError, match="bloom uses ALiBi"):
        SpeculativeModel(model, PromptLookupProposer(4))
