"""EAGLE-3 drafters in the layouts published and served elsewhere: import them here, export ours
(heads/formats/eagle3_export.py); how their config.json is read is heads/formats/eagle3_config.py.

`Eagle3Draft` already uses SafeAILab's tensor names (`fc.weight`, `midlayer.*`, `norm.weight`,
`lm_head.weight`, `d2t`, `t2d`) and computes SafeAILab's layer, so no tensor is converted: a layout only
renames the draft layer (`LAYOUTS`), drops the vocabulary maps where an engine would choke on them, and writes
the config.json its loaders read. The target's embedding never travels (every engine uses the target's own);
one found in a file is ignored. The weights load with a strict `load_state_dict`. Sources (read for this
module, versions named):

`eagle3` — SafeAILab's layout (yuhuili/EAGLE3-*, SpecForge's drafters), which SGLang serves and vLLM loads.
  - SafeAILab/EAGLE commit cb7e0841, `eagle/model/cnets.py` (the EAGLE-3 `Model`): `fc = Linear(3 *
    (target_hidden_size or hidden_size), H, bias=False)` on the fused features; `midlayer`
    (`LlamaDecoderLayeremb`): `residual = hidden`, q/k/v on `cat(input_layernorm(embed), hidden_norm(hidden))`
    (embedding first), post-attention norm + MLP; logits `lm_head(norm(out))` over `draft_vocab_size` tokens,
    target id = draft id + `d2t[draft id]`; buffers `d2t` (long, N) and `t2d` (bool, V). `ea_model.py`:
    `pytorch_model.bin` first, else `model.safetensors`; `load_state_dict(strict=False)`; `d2t`/`t2d` deleted
    when `vocab_size == draft_vocab_size`; the embedding is read from the base model. `modeling_llama_kv.py`
    fuses the hidden states entering layers 2, L // 2 and L - 3 (hidden_states indices [2, L // 2, L - 3]) and
    reads no layer ids from any config. `eagle/traineagle3/config.json`: a Llama config plus
    `draft_vocab_size`.
  - SGLang 0.5.23 (the PyPI wheel), `sglang/srt/models/llama_eagle3.py` (`LlamaForCausalLMEagle3`): `midlayer`
    is renamed `layers.0` (so either name loads); `d2t` becomes `hot_token_id`, `t2d` is skipped; unknown
    names are skipped; fc's bias is config `bias`; `norm_before_fc` (`eagle_config` first, then the top level)
    adds `input_norm`, one RMSNorm(n * H, rms_norm_eps) over the whole fc input; `norm_before_residual` is
    not read (the residual is always the un-normed hidden); `fc_norm` / `use_aux_norm` add `fc_norm.{i}`;
    `norm_output` feeds back the normed output; `tie_word_embeddings: true` makes lm_head the embedding; no
    `draft_vocab_size` takes the target's lm_head; fc reads `num_aux_hidden_states`, else
    `len(eagle_config.eagle_aux_hidden_state_layer_ids)`, else 3 hidden states. `models/llama.py`
    `set_eagle3_layers_to_capture`: no ids -> capture before layers [2, L // 2, L - 3] (hidden_states
    indices); ids -> `id + 1` ("for the ith layer, it takes the output of the (i-1)th layer").
    `model_runner_components/spec_aux_hidden_state.py` reads the ids only from `eagle_config`.
    `speculative/eagle_worker_v2.py` `init_lm_head`: `set_embed(target's)`.
  - vLLM 0.32.0 (the PyPI wheel), `model_executor/models/llama_eagle3.py` (`Eagle3LlamaForCausalLM`, which the
    registry maps `LlamaForCausalLMEagle3` to): `midlayer.` -> `layers.0.` (`LlamaModel.hf_to_vllm_mapper`);
    `d2t` -> `draft_id_to_target_id`, a parameter only when `draft_vocab_size` differs from the target's
    vocabulary (otherwise a `d2t` in the file is an unknown name and `AutoWeightsLoader` raises); `t2d`
    skipped; `embed_tokens` optional (`v1/spec_decode/llm_base_proposer.py` `_maybe_share_embeddings`); fc
    without bias, sized like SGLang's. Variant flags read: `norm_before_residual` (default false here;
    `LlamaDecoderLayer._norm_before_residual`: residual = hidden_norm(hidden), the attention input unchanged),
    `norm_before_fc` (`eagle_config` first, then the top level; `combine_hidden_states`: `input_norm`, one
    RMSNorm(n * H, rms_norm_eps) over the whole fc input, loaded from `input_norm.weight`, a name
    `load_weights` drops when the flag is off), `fc_norm`, `norm_output`, `eagle_config.use_aux_hidden_state`,
    `logit_scale`. Layer ids
    (`v1/worker/gpu_model_runner.py` `_get_eagle3_aux_layers_from_config`, and
    `v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`): a top-level `eagle_aux_hidden_state_layer_ids` first,
    else `eagle_config`'s, both used AS GIVEN; `models/llama.py` `LlamaModel.forward` captures hidden +
    residual after layer idx when `idx + 1` is an id (id 0: the embeddings) — transformers' hidden_states
    indices, except index L, which vLLM captures before the final norm and transformers after it;
    `interfaces.py`: the default is (2, L // 2, L - 3); `EagleModelMixin._set_aux_hidden_state_layers` sorts
    and de-duplicates the ids.

`speculators-eagle3` — vllm-project/speculators' layout (RedHatAI/*.eagle3); vLLM knows it by config.json.
  - speculators commit c05b95b3, `src/speculators/models/eagle3/config.py` (`Eagle3SpeculatorConfig`):
    `speculators_model_type: "eagle3"`, `architectures: ["Eagle3Speculator"]`, `transformer_layer_config` (the
    draft layer's config, `model_type` llama or qwen3), `draft_vocab_size`, `norm_before_residual` (false),
    `target_hidden_size`, `eagle_aux_hidden_state_layer_ids`, `norm_before_fc`, `fc_norm`, `norm_output`;
    `config.py`: `speculators_config` {algorithm, proposal_methods, default_proposal_method, verifier
    {name_or_path, architectures}}, and no top-level `model_type`; `proposals/greedy.py`: proposal_type,
    speculative_tokens, verifier_accept_k, accept_tolerance. `models/eagle3/core.py`: fc over
    `len(eagle_aux_hidden_state_layer_ids) or 3` hidden states, the draft layer is `layers.0`
    (`model_definitions.py`: residual = hidden, or `hidden_norm(hidden)` with norm_before_residual);
    `input_norm` (RMSNorm(n * H, rms_norm_eps)) before fc with norm_before_fc; `train/config/schema.py`: a new
    eagle3 run defaults to norm_before_residual, norm_before_fc AND norm_output true;
    `model.py`: `d2t`/`t2d` exist only when `draft_vocab_size` differs from the verifier's;
    `embed_tokens.weight` (the verifier's) is saved, and export writes it: speculators 0.9.0's
    `Eagle3DraftModel` lists it in `_keys_to_ignore_on_load_missing`, so a file without it loads with the
    embedding uninitialised and no warning (vLLM shares the target's embedding either way). `models/utils.py`
    `resolve_target_layer_ids`: default [2, L // 2, L - 3], given to vLLM to extract the training features, so
    the ids are vLLM's (hidden_states indices).
  - vLLM 0.32.0: `transformers_utils/config.py`: a config.json with `speculators_config` and no `model_type`
    is a `SpeculatorsConfig` (`configs/speculators/base.py`: needs `speculators_config.proposal_methods[0]
    .speculative_tokens`, `speculators_config.verifier.name_or_path`, a dict `transformer_layer_config`).
    `configs/speculators/algos.py` `update_eagle3`: the draft config is `transformer_layer_config` plus the
    top-level `draft_vocab_size`, `target_hidden_size`, `norm_before_residual` — TRUE WHEN ABSENT —,
    `norm_before_fc`, `fc_norm`, `norm_output` and `eagle_aux_hidden_state_layer_ids`; `model_type` llama ->
    `Eagle3LlamaForCausalLM` (the loader above), qwen3 -> `Eagle3Qwen3ForCausalLM`. With no `eagle_config`,
    `llama_eagle3.py` builds fc for `num_aux_hidden_states` or 3 hidden states.

Layer ids. Our `feature_layers` are transformers' hidden_states indices (0 = the embeddings). SGLang reads
`eagle_config` ids as "output of layer id" (hidden_states index id + 1); vLLM reads any id as a hidden_states
index. So `eagle3` export writes both: `eagle_config.eagle_aux_hidden_state_layer_ids = [j - 1 ...]`, which
SGLang reads, and the top-level `eagle_aux_hidden_state_layer_ids = [j ...]`, which vLLM reads first (SGLang
only counts it); import reads `eagle_config` + 1 and refuses a top-level list that disagrees.
`speculators-eagle3` writes and reads the top-level ids as given. With no ids, every engine fuses
[2, L // 2, L - 3] of the target's L layers, so import then needs the target (`base_model`, or the
speculators verifier) to know L.

Variants. `FLAGS` (norm_before_residual, norm_before_fc) are HeadsConfig fields Eagle3Draft computes: import
reads them where the layout's engines do (speculators-eagle3: the top level, norm_before_residual TRUE when
absent, as vLLM reads it, with a warning since speculators' own config class defaults it to false; eagle3:
norm_before_fc from `eagle_config`, else the top level, and norm_before_residual from the top level, which
only vLLM reads), and export writes them there. SGLang ignores norm_before_residual, so an `eagle3` export of
a drafter with it is refused (export speculators-eagle3, which vLLM serves); SafeAILab's loader reads neither
flag and skips `input_norm.weight`. The other flags, in `VARIANTS`, change what the drafter computes in ways
Eagle3Draft does not; one at a value other than Eagle3Draft's is refused, naming it. So are a draft layer
count other than 1, a non-Llama draft layer, a `target_hidden_size` other than the hidden size, and a
checkpoint without its own lm_head. `tie_word_embeddings` is ignored: only SGLang reads it, and the file's
lm_head is what was trained.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from torch import nn

from selfspec.heads.config import DTYPES, HeadsConfig
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.heads.formats.checkpoint import Checkpoint
from selfspec.heads.formats.eagle import check_target, layer_config_from_json
from selfspec.heads.formats.eagle3_config import (
    draft_vocab_maps,
    feature_layers,
    flags,
    refuse_variants,
    settings,
    target_layers,
)
from selfspec.heads.formats.medusa import load_strict

EMBED_KEY = "embed_tokens.weight"
INPUT_NORM = "input_norm.weight"  # norm_before_fc's RMSNorm over the fc input, named alike by every engine
VOCAB_MAPS = ("d2t", "t2d")  # integer buffers: draft id -> target id offset, which target ids are draftable
LAYER = "midlayer."  # our name of the draft layer
LAYER_PARAMS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
)
# RoPE caches some checkpoints saved; no loader reads them.
IGNORED = re.compile(r".*rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
# Draft-layer architectures computing Eagle3Draft's Llama layer: SGLang's and vLLM's class names, and the
# plain Llama name SafeAILab's training config carries.
LLAMA_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")


@dataclasses.dataclass(frozen=True)
class Layout:
    architecture: str  # config.json `architectures`
    layer: str  # the file's name for our `midlayer.`
    engines: tuple[str, ...]  # who loads it


LAYOUTS = {
    "eagle3": Layout("LlamaForCausalLMEagle3", "midlayer.", ("safeailab", "sglang", "vllm")),
    "speculators-eagle3": Layout("Eagle3Speculator", "layers.0.", ("speculators", "vllm")),
}
EAGLE3_FORMATS = tuple(LAYOUTS)


def layout_keys(fmt: str, draft_vocab: bool, norm_before_fc: bool = False) -> set[str]:
    """Every tensor `export_eagle3` writes in `fmt`; `d2t`/`t2d` only for a draft vocabulary smaller than the
    target's (vLLM has nowhere to load them otherwise, and SafeAILab deletes them); `input_norm.weight` only
    with norm_before_fc; the target's `embed_tokens.weight` in speculators-eagle3, as speculators saves it."""
    layer = LAYOUTS[fmt].layer
    return {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        *(layer + p for p in LAYER_PARAMS),
        *(VOCAB_MAPS if draft_vocab else ()),
        *((INPUT_NORM,) if norm_before_fc else ()),
        *((EMBED_KEY,) if fmt == "speculators-eagle3" else ()),
    }


def _ours(name: str) -> str:
    """A file's tensor name as Eagle3Draft names it: SGLang loads `layers.0.` and `midlayer.` alike."""
    return LAYER + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def theirs_name(fmt: str):
    layer = LAYOUTS[fmt].layer
    return lambda k: layer + k.removeprefix(LAYER) if k.startswith(LAYER) else k


# ---------------------------------------------------------------- detection


def detect_eagle3_format(directory: str | Path | Checkpoint) -> str | None:
    """ "eagle3" or "speculators-eagle3" for an EAGLE-3 checkpoint directory; None for anything else (a
    selfspec heads directory, an EAGLE-1 drafter, a full model, no config or weights). A config.json that is
    not JSON, or weights that cannot be read, are errors naming the file."""
    checkpoint = Checkpoint.read(directory)
    raw = checkpoint.config
    if raw is None or checkpoint.is_selfspec or not checkpoint.weight_files:
        return None
    if "speculators_config" in raw or "speculators_model_type" in raw:
        return "speculators-eagle3" if raw.get("speculators_model_type") == "eagle3" else None
    names = checkpoint.weight_names
    eagle3_arch = any("Eagle3" in str(a) for a in raw.get("architectures") or [])
    layer = (LAYER, "layers.0.") if eagle3_arch else (LAYER,)
    if "fc.weight" in names and any(n.startswith(layer) for n in names):
        return "eagle3"
    return None


# ---------------------------------------------------------------- import


def import_eagle3(
    directory: str | Path | Checkpoint,
    format: str | None = None,  # noqa: A002
    base_model: str | None = None,
    target: nn.Module | None = None,
) -> Eagle3Draft:
    """Build an `Eagle3Draft` from an `eagle3` (SafeAILab / SGLang) or `speculators-eagle3` checkpoint
    directory.

    Shapes come from the weights and config.json, the fused layers from the ids config.json names (see the
    module docstring), else from the target's default layers, which needs `target` or `base_model` (the
    speculators verifier by default) on this machine. The weights keep the file's dtype; `base_model` is what
    the imported config names (default: the speculators verifier, else nothing). With `target`, a drafter for
    another hidden or vocabulary size is refused and an embedding unlike the target's is warned about.
    """
    checkpoint = Checkpoint.read(directory)
    directory, raw = checkpoint.path, checkpoint.require_config()
    cfg_path = directory / "config.json"
    fmt = format or detect_eagle3_format(checkpoint)
    if fmt is None:
        raise ValueError(
            f"{directory} is not an EAGLE-3 checkpoint this importer recognises: it expects "
            "fc.weight and midlayer.* (SafeAILab / SGLang) or a speculators config.json "
            "(speculators_model_type eagle3)"
        )
    if fmt not in LAYOUTS:
        raise ValueError(f"unknown EAGLE-3 format {fmt!r}; supported: {', '.join(EAGLE3_FORMATS)}")
    declared_base, depth = "", None
    if fmt == "speculators-eagle3":
        if raw.get("speculators_model_type") != "eagle3":
            raise ValueError(
                f"{cfg_path}: speculators_model_type is {raw.get('speculators_model_type')!r}, not 'eagle3'"
            )
        layer_json = raw.get("transformer_layer_config")
        if not isinstance(layer_json, dict):
            raise ValueError(
                f"{cfg_path}: transformer_layer_config (the draft layer's config) must be a JSON object"
            )
        if layer_json.get("model_type", "llama") != "llama":  # vLLM's default; qwen3 layers add q/k norms
            raise ValueError(
                f"{cfg_path}: the draft layer is {layer_json['model_type']!r}; Eagle3Draft's layer is "
                "a Llama layer (transformer_layer_config.model_type 'llama')"
            )
        spec = raw.get("speculators_config") or {}
        declared_base = str(((spec.get("verifier") or {}).get("name_or_path")) or "")
        tokens = ((spec.get("proposal_methods") or [{}])[0] or {}).get("speculative_tokens")
        depth = tokens if type(tokens) is int and tokens >= 1 else None
    else:
        archs = raw.get("architectures") or []
        if archs and not set(archs) & set(LLAMA_ARCHS):
            raise ValueError(
                f"{cfg_path}: architectures {archs}: Eagle3Draft computes the Llama EAGLE-3 layer "
                f"({', '.join(LLAMA_ARCHS[:2])})"
            )
        layer_json = raw
    stated = settings(raw, fmt, layer_json, cfg_path)
    refuse_variants(stated, fmt, cfg_path)
    draft_flags = flags(stated, fmt, cfg_path)
    if layer_json.get("num_hidden_layers", 1) != 1:
        raise ValueError(
            f"{cfg_path}: num_hidden_layers = {layer_json['num_hidden_layers']} draft layers; "
            "Eagle3Draft has one"
        )

    files = checkpoint.weight_files
    where = files[0] if len(files) == 1 else directory
    state = checkpoint.read_weights()
    embed = state.pop(EMBED_KEY, None)
    file_names = {_ours(k): k for k in state if not IGNORED.match(k)}
    if len(file_names) != len([k for k in state if not IGNORED.match(k)]):
        raise ValueError(f"{where} holds the draft layer twice, as midlayer.* and as layers.0.*")
    state = {ours: state[theirs] for ours, theirs in file_names.items()}
    fc, lm_head = state.get("fc.weight"), state.get("lm_head.weight")
    if fc is None or fc.dim() != 2 or not fc.is_floating_point():
        found = None if fc is None else f"{fc.dtype} {tuple(fc.shape)}"
        raise ValueError(f"{where}: fc.weight should be a float (H, n * H) matrix, found {found}")
    hidden = layer_json.get("hidden_size")
    if hidden != fc.shape[0] or fc.shape[1] % hidden:
        raise ValueError(
            f"{cfg_path}: hidden_size is {hidden} but fc.weight is {tuple(fc.shape)}, not (H, n * H)"
        )
    target_hidden = raw.get("target_hidden_size", layer_json.get("target_hidden_size"))
    if target_hidden not in (None, hidden):
        raise ValueError(
            f"{cfg_path}: target_hidden_size {target_hidden} differs from the draft's hidden_size "
            f"{hidden}; Eagle3Draft's layer is as wide as the target"
        )
    if lm_head is None or lm_head.dim() != 2:
        raise ValueError(
            f"{where} has no lm_head.weight: this drafter would use the target's lm_head (SGLang's "
            "load_lm_head_from_target), which Eagle3Draft does not; it needs its own"
        )
    vocab, size = layer_json.get("vocab_size"), lm_head.shape[0]
    if type(vocab) is not int or vocab < size:
        raise ValueError(
            f"{cfg_path}: vocab_size (the target's vocabulary) is {vocab!r}; lm_head.weight has {size} rows"
        )
    declared = raw.get("draft_vocab_size")
    if declared is not None and declared != size:
        raise ValueError(f"{cfg_path}: draft_vocab_size is {declared} but lm_head.weight has {size} rows")
    d2t, t2d = draft_vocab_maps(state.pop("d2t", None), state.pop("t2d", None), size, vocab, where)

    base = base_model if base_model is not None else declared_base
    num_layers = target_layers(target, base)
    layers = feature_layers(raw, fmt, num_layers, cfg_path)
    fused = fc.shape[1] // hidden
    counted = layer_json.get("num_aux_hidden_states", raw.get("num_aux_hidden_states"))
    if len(layers) != fused or counted not in (None, fused):
        raise ValueError(
            f"{cfg_path}: fc.weight {tuple(fc.shape)} fuses {fused} hidden states, but the config "
            f"names {len(layers)} layers {layers}"
            + (f" and num_aux_hidden_states {counted}" if counted is not None else "")
        )
    named = (layer_json.get("torch_dtype"), layer_json.get("dtype"), str(fc.dtype).removeprefix("torch."))
    config = HeadsConfig(
        kind="eagle3",
        base_model=base,
        hidden_size=hidden,
        vocab_size=vocab,
        num_layers=1,
        fc_bias=False,
        dtype=next((d for d in named if d in DTYPES), "float32"),
        layer=layer_config_from_json(layer_json, cfg_path),
        feature_layers=layers,
        draft_vocab_size=0 if size == vocab else size,
        **draft_flags,
        **({"depth": depth} if depth else {}),
    )
    draft = Eagle3Draft(config).to(fc.dtype)
    theirs = {**file_names, "d2t": "d2t", "t2d": "t2d"}
    load_strict(
        draft,
        state | {"d2t": d2t, "t2d": t2d},
        where,
        lambda k: theirs.get(k, theirs_name(fmt)(k)),
        integers=VOCAB_MAPS,
    )
    draft.eval()
    if target is not None:
        check_target(config, target, embed, directory)
    return draft
