"""How a generate call's settings are resolved, by model.generate's rules (transformers 5).

The call's `generation_config` (default: an empty one) is copied, its unset fields are filled from the
target's `generation_config`, then from transformers' global defaults, and the call's keyword arguments
override the result. `do_sample` alone decides greedy or sampling (a temperature without `do_sample=True`
stays greedy, as in transformers); `max_new_tokens`, else `max_length`, bounds the length. What this loop
cannot apply exactly (a repetition penalty, beams, scores in the output, ...) is refused in one line naming
the setting: decoding without it would silently differ from `model.generate`.
"""

from __future__ import annotations

import copy
import dataclasses
import reprlib
import sys
import warnings
from pathlib import Path
from typing import Any

from transformers import GenerationConfig

import selfspec
from selfspec.infer.core.arguments import token_ids
from selfspec.infer.core.verify import SamplingParams

# Settings that change the next-token distribution in ways this loop does not reproduce, with their neutral
# values.
NOT_APPLIED: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "sequence_bias": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "min_p": None,
    "exponential_decay_length_penalty": None,
    "min_length": 0,
    "min_new_tokens": None,
    "num_beams": 1,
}
# What the output cannot hold or the loop does not do, with the values that ask for nothing.
NOT_RETURNED: dict[str, Any] = {
    "num_return_sequences": 1,
    "output_scores": False,
    "output_logits": False,
    "output_attentions": False,
    "output_hidden_states": False,
    "num_beam_groups": 1,
    "penalty_alpha": None,
    "guidance_scale": None,
    "stop_strings": None,
    "max_time": None,
    "prompt_lookup_num_tokens": None,
    "assistant_early_exit": None,
    "watermarking_config": None,
    "use_cache": True,
}
# Keyword arguments generate takes besides GenerationConfig fields.
CALL_ARGUMENTS = (
    "input_ids",
    "inputs",
    "attention_mask",
    "generator",
    "streamer",
    "generation_config",
    "tokenizer",
)  # tokenizer: model.generate reads it for stop_strings only, refused below


@dataclasses.dataclass(frozen=True)
class Settings:
    """A generate call's resolved settings: how to draw, when to stop, what to pad with and what to return."""

    params: SamplingParams
    eos_ids: list[int]  # in the config's order
    pad_token_id: int | None
    max_new_tokens: int | None  # None: bounded by max_length instead
    max_length: int
    return_dict: bool
    default_length: bool = False  # nothing set the length: model.generate's 20 new tokens, with its warning

    def warn_default_length(self) -> None:
        """transformers' warning for a call that set no length, pointed at the caller's line (generate warns
        it; resolving settings to check them does not)."""
        if self.default_length:
            warnings.warn(
                f"Using the model-agnostic default `max_length` (={self.max_new_tokens}) to control the "
                "generation length: that many new tokens, as model.generate makes. Set `max_new_tokens` "
                "to control the length.",
                UserWarning,
                stacklevel=caller_level(),
            )

    @property
    def eos(self) -> set[int]:
        return set(self.eos_ids)

    @property
    def output_pad_id(self) -> int:
        """What fills the rows that stopped early: the pad id, else the first EOS id, as model.generate."""
        return self.pad_token_id if self.pad_token_id is not None else (self.eos_ids or [0])[0]

    def budget(self, prompt_width: int) -> int:
        """New tokens per row: max_new_tokens, else max_length minus the (padded) prompt, as
        model.generate."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        if prompt_width >= self.max_length:
            raise ValueError(
                f"the prompt is {prompt_width} tokens but max_length is {self.max_length}, so no new "
                "token fits: set max_new_tokens (or a larger max_length)"
            )
        return self.max_length - prompt_width


def merged_config(
    model_config: GenerationConfig | None, generation_config: GenerationConfig | None, kwargs: dict[str, Any]
) -> tuple[GenerationConfig, dict[str, Any]]:
    """The call's config (a copy: the caller's object is never changed) completed from the model's config and
    transformers' defaults, the call's keyword arguments applied; and the keyword arguments that are no
    field."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ValueError(
            f"generation_config must be a transformers.GenerationConfig, got "
            f"{type(generation_config).__name__}"
        )
    config = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    if model_config is not None:
        config.update(**model_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    config.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
    with (
        warnings.catch_warnings()
    ):  # transformers' warnings about greedy-with-temperature: the rule is the same
        warnings.simplefilter("ignore")
        try:
            unused = config.update(**kwargs)
        except ValueError as e:  # transformers' own validation of the values
            raise ValueError(f"generation settings: {' '.join(str(e).split())}") from None
    return config, unused


def caller_level() -> int:
    """The warnings stacklevel of the first frame outside selfspec's own modules: the user's call, whichever
    public method (generate, decode, stream) it went through."""
    ours = {str(Path(__file__).parent), str(Path(selfspec.__file__).parent)}
    frame, level = sys._getframe(1), 1
    while frame is not None and str(Path(frame.f_code.co_filename).parent) in ours:
        frame, level = frame.f_back, level + 1
    return level


def no_max_length(
    model_config: GenerationConfig | None, generation_config: GenerationConfig | None, kwargs: dict[str, Any]
) -> bool:
    """Whether neither the call, its generation_config nor the model's sets max_length: model.generate then
    makes the default max_length (20) of *new* tokens, past the prompt (transformers 5's
    `has_default_max_length`)."""
    return (
        all(c is None or c.max_length is None for c in (model_config, generation_config))
        and kwargs.get("max_length") is None
    )


def check_applicable(config: GenerationConfig) -> None:
    """Refuse a generation config that asks for something speculative decoding here does not apply exactly."""
    for name, neutral in NOT_APPLIED.items():
        value = getattr(config, name, None)
        if value is not None and value != neutral and not (name == "min_length" and value == 0):
            raise ValueError(
                f"the generation config sets {name}={value!r}, which speculative decoding here does not "
                f"apply: leave it out (or set generation_config.{name} = {neutral!r}) to decode without "
                "it (model.generate then matches)"
            )
    for name, neutral in NOT_RETURNED.items():
        value = getattr(config, name, None)
        if value is not None and value != neutral:
            raise ValueError(
                f"the generation config sets {name}={value!r}, which speculative decoding here does not "
                f"support: leave it out (generate returns the sequences, and with "
                "return_dict_in_generate=True also the decoding statistics)"
            )


def sampling_params(config: GenerationConfig) -> SamplingParams:
    """Greedy unless the resolved config says do_sample, as model.generate; then its temperature, top-k,
    top-p."""
    SamplingParams(
        float(config.temperature or 0), int(config.top_k or 0), float(config.top_p or 1.0)
    )  # checked
    if not config.do_sample:
        return SamplingParams()
    if not config.temperature:
        raise ValueError("do_sample=True needs a temperature above 0 (0 is greedy: pass do_sample=False)")
    return SamplingParams(float(config.temperature), int(config.top_k or 0), float(config.top_p or 1.0))


def check_call(kwargs: dict[str, Any]) -> None:
    """The call's own lengths and sampling values, checked before transformers sees them (one line each)."""
    for name in ("max_new_tokens", "max_length"):
        value = kwargs.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
        if value < 1:  # as model.generate
            raise ValueError(f"{name} must be >= 1, got {value}")
    SamplingParams(**{k: kwargs[k] for k in ("temperature", "top_k", "top_p") if kwargs.get(k) is not None})


def resolve(
    model_config: GenerationConfig | None, generation_config: GenerationConfig | None = None, **kwargs: Any
) -> Settings:
    """A call's settings by model.generate's rules; an argument that is neither a generation setting nor one
    of generate's own (`CALL_ARGUMENTS`) is refused in one line naming it."""
    check_call(kwargs)
    kwargs = {
        k: v for k, v in kwargs.items() if k != "tokenizer"
    }  # what model.generate reads for stop_strings
    config, unused = merged_config(model_config, generation_config, kwargs)
    if unused:
        name = next(iter(unused))
        raise ValueError(
            f"generate got an argument it does not support: {name}={reprlib.repr(unused[name])} (it "
            "takes transformers' generation settings and input_ids, attention_mask, generation_config, "
            "streamer, generator, tokenizer)"
        )
    if config.stop_strings:
        raise ValueError(
            f"stop_strings={reprlib.repr(config.stop_strings)} is not supported by speculative decoding "
            "here: stop on token ids (eos_token_id=[...]) or cut the decoded text at the string"
        )
    check_applicable(config)
    params = sampling_params(config)
    max_new_tokens = config.max_new_tokens
    default_length = max_new_tokens is None and no_max_length(model_config, generation_config, kwargs)
    if default_length:
        max_new_tokens = int(config.max_length)  # transformers: the default max_length counts new tokens
    pad = config.pad_token_id
    eos = [] if config.eos_token_id is None else token_ids(config.eos_token_id, "eos_token_id")
    return Settings(
        params=params,
        eos_ids=eos,
        pad_token_id=None if pad is None else token_ids(pad, "pad_token_id")[0],
        max_new_tokens=max_new_tokens,
        max_length=int(config.max_length),
        default_length=default_length,
        return_dict=bool(config.return_dict_in_generate),
    )
