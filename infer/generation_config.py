"""What the target's `generation_config` asks of decoding, as `model.generate` would read it.

`model.generate` takes sampling settings and EOS ids from the checkpoint's generation config when the
call does not give them. The speculative loop does the same for every setting it can apply exactly
(do_sample, temperature, top-k, top-p, EOS ids), and refuses, in one line, a config that asks for a
logits processor it does not apply (a repetition penalty, suppressed tokens, ...): decoding without it
would silently differ from `model.generate`.
"""

from __future__ import annotations

from typing import Any

from transformers import GenerationConfig

from infer.verify import SamplingParams

# Settings that change the next-token distribution in ways this loop does not reproduce, with their neutral values.
NOT_APPLIED: dict[str, Any] = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "sequence_bias": None, "typical_p": 1.0,
    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": None, "exponential_decay_length_penalty": None,
    "min_length": 0, "min_new_tokens": None, "num_beams": 1,
}


def setting(config: GenerationConfig | None, name: str) -> Any:
    """A generation setting as model.generate resolves it: the config's value, else transformers' default."""
    value = getattr(config, name, None) if config is not None else None
    return value if value is not None else GenerationConfig._get_default_generation_params().get(name)


def check_applicable(config: GenerationConfig | None) -> None:
    """Refuse a generation config that asks for something speculative decoding here does not apply exactly."""
    for name, neutral in NOT_APPLIED.items():
        value = setting(config, name)
        if value is not None and value != neutral and not (name == "min_length" and value == 0):
            raise ValueError(f"the target's generation_config sets {name}={value!r}, which speculative decoding here "
                             f"does not apply: set model.generation_config.{name} = {neutral!r} to decode without it "
                             "(model.generate then matches)")


def sampling_params(config: GenerationConfig | None, do_sample: bool | None = None, temperature: float | None = None,
                    top_k: int | None = None, top_p: float | None = None) -> SamplingParams:
    """Greedy or sampling settings: the call's where given, else the generation config's, else transformers'
    defaults (model.generate's rule). A temperature of 0 given without do_sample means greedy, and one above 0
    means sampling."""
    check_applicable(config)
    given = {k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)) if v is not None}
    SamplingParams(**given)  # the call's own values are checked whether or not they end up used
    if do_sample is None:
        do_sample = temperature > 0 if temperature is not None else bool(setting(config, "do_sample"))
    if not do_sample:
        return SamplingParams()
    if temperature is None:
        temperature = setting(config, "temperature")
    if temperature == 0:
        raise ValueError("do_sample=True needs a temperature above 0 (0 is greedy: pass do_sample=False)")
    top_k = setting(config, "top_k") if top_k is None else top_k
    top_p = setting(config, "top_p") if top_p is None else top_p
    return SamplingParams(float(temperature), int(top_k or 0), float(top_p))
