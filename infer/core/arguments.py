"""The checks a decode call makes on its arguments before the first step, each a one-line error naming the
problem and the fix; and the limits they imply (the model's positions)."""

from __future__ import annotations

import operator
from typing import Any

import torch


def unavailable_device(text: str) -> str | None:
    """Why a device named `text` cannot hold a model on this machine (no such kind, or none of it here), in a
    line that says what to use instead; None when it can."""
    try:
        kind = torch.device(text).type
    except RuntimeError as e:
        return " ".join(str(e).split())
    available = {
        "cpu": lambda: True,
        "cuda": torch.cuda.is_available,
        "mps": torch.backends.mps.is_available,
        "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
    }
    if kind not in available:
        return f"{text}: a model cannot run on a {kind} device; use cpu, cuda, mps or xpu"
    if not available[kind]():
        return f"{text}: no {kind.upper()} device is available here; use cpu"
    return None


def max_positions(config) -> int | None:
    """How many positions a model embeds: `max_position_embeddings` (`n_positions` in GPT-2-style configs);
    None when its config names no limit."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions"):
        limit = getattr(config, name, None)
        if limit:
            return int(limit)
    return None


def fit_budget(prompt_len: int, max_new_tokens: int, limit: int | None) -> int:
    """`max_new_tokens` clipped so that prompt + new tokens fit in `limit` positions (None: no limit).
    A prompt that leaves no room for a single new token is a ValueError."""
    if limit is None:
        return max_new_tokens
    if prompt_len >= limit:
        raise ValueError(
            f"the prompt is {prompt_len} tokens but the model takes at most {limit} positions "
            "(max_position_embeddings), so no new token fits after it: shorten the prompt"
        )
    return min(max_new_tokens, limit - prompt_len)


def check_drafter_device(drafter: Any, device: torch.device) -> None:
    """A drafter reading the target's hidden states must sit where they come out (the device of the target's
    last layer, also under device_map="auto"); a clear error now instead of a device mismatch
    mid-generation."""
    if drafter.weights_device is not None and drafter.weights_device != device:
        raise ValueError(
            f"the drafter's weights are on {drafter.weights_device} but the target's last layer is on "
            f"{device}: move the drafter there (SpeculativeModel.from_pretrained(..., device_map="
            f"'{device}'))"
        )


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one (an accelerator without an index means the current one)."""
    if a.type != b.type:
        return False
    if a.type == "cpu" or a.index == b.index:
        return True
    current = torch.accelerator.current_device_index() if torch.accelerator.is_available() else 0
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def check_generator(generator: torch.Generator | None, device: torch.device) -> None:
    """Sampling draws on the target's device: a generator made for another device would fail
    mid-generation."""
    if generator is not None and not same_device(torch.device(generator.device), device):
        raise ValueError(
            f"the random generator is on {generator.device} but the target runs on {device}: create it "
            f"there, torch.Generator(device='{device}').manual_seed(...)"
        )


def token_ids(value: Any, name: str) -> list[int]:
    """Token ids as model.generate takes them -- an int, a list of them, a tensor or a numpy array or integer
    -- as a list of ints; anything else (floats, bools, strings) is a one-line error."""
    if hasattr(value, "reshape") and hasattr(value, "tolist"):  # torch and numpy, any shape
        value = value.reshape(-1).tolist()
    values = list(value) if isinstance(value, (list, tuple, set)) else [value]
    try:
        if any(isinstance(v, bool) or getattr(v, "dtype", None) in (torch.bool, bool) for v in values):
            raise TypeError
        return [operator.index(v) for v in values]
    except TypeError:
        raise ValueError(f"{name} must be a token id or a list of them, got {value!r}") from None


def eos_set(eos_token_id: Any) -> set[int]:
    """The EOS id or ids as a set of ints (None: none); see `token_ids` for what it takes."""
    return set() if eos_token_id is None else set(token_ids(eos_token_id, "eos_token_id"))


def infer_attention_mask(
    input_ids: torch.Tensor, pad_token_id: int | None, eos: set[int]
) -> torch.Tensor | None:
    """The attention mask model.generate infers when none is given: 0 where input_ids hold the pad id, if they
    hold it and it is not an EOS id; None (no padding) otherwise."""
    if pad_token_id is None or pad_token_id in eos or not bool((input_ids == pad_token_id).any()):
        return None
    mask = (input_ids != pad_token_id).long()
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError(
            f"input_ids hold the pad id {pad_token_id} after a prompt's first token, and no "
            "attention_mask was given (model.generate would mask those tokens out): pass the "
            "tokenizer's attention_mask"
        )
    return mask


def check_ids(name: str, value: Any) -> torch.Tensor:
    """`input_ids` / `attention_mask` as the caller gave them: an integer (or bool mask) tensor of 1 or 2
    dimensions, else a TypeError / ValueError naming what was given."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of token ids (as a tokenizer's return_tensors='pt' gives), "
            f"got {type(value).__name__}"
        )
    allowed = (torch.bool,) if name == "attention_mask" else ()
    if value.is_floating_point() or value.is_complex() or (value.dtype == torch.bool and not allowed):
        raise TypeError(f"{name} must hold integers, got a {str(value.dtype).removeprefix('torch.')} tensor")
    if value.dim() not in (1, 2):
        raise ValueError(f"{name} must be (tokens,) or (batch, tokens), got shape {tuple(value.shape)}")
    return value


def prompt_starts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Where each row's prompt begins after its left padding (attention_mask 0 on padding, 1 on tokens)."""
    if attention_mask is None:
        return [0] * input_ids.shape[0]
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} must have the shape of input_ids "
            f"{tuple(input_ids.shape)}"
        )
    m = attention_mask.to(torch.long).cpu()
    if not bool(((m == 0) | (m == 1)).all()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (tokens) only")
    if bool((m[:, 1:] < m[:, :-1]).any()):
        raise ValueError(
            "attention_mask has padding after tokens: pad on the left (tokenizer.padding_side = 'left')"
        )
    starts = (m == 0).sum(1).tolist()
    if max(starts) == input_ids.shape[1]:
        raise ValueError(
            f"row {starts.index(input_ids.shape[1])} of the batch is all padding: give every row a token"
        )
    return starts
