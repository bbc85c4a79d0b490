"""EAGLE-3 checkpoints of other projects: SafeAILab / SGLang (`eagle3`) and vllm-project/speculators
(`speculators-eagle3`) in, both out.

The published checkpoints are written here from the key names and config fields their projects document (not
by our exporter), on an 8-layer target so that three distinct layers are fused. What an imported drafter
computes is checked against a plain-torch EAGLE-3 forward over the hidden states the engines fuse (SGLang:
`eagle_config` id + 1; vLLM / speculators: the id itself; none: [2, L // 2, L - 3]), in the variant the
config's flags name (norm_before_residual, norm_before_fc: vLLM 0.32's llama_eagle3.py).
"""

import json
import os
import warnings

import pytest
import torch
from transformers import LlamaConfig

from eagle3_checkpoints import (
    DROP,
    SPECULATORS_VARIANTS,
    H,
    V,
    assert_decodes_like,
    published_tensors,
    random_draft,
    safeailab_checkpoint,
    speculators_checkpoint,
)
from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.eagle import EagleDraft
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.heads.formats import import_heads
from selfspec.heads.formats.eagle import detect_eagle_format, export_eagle
from selfspec.heads.formats.eagle3 import EAGLE3_FORMATS, detect_eagle3_format, import_eagle3
from selfspec.heads.formats.eagle3_config import FLAGS, VARIANTS


@pytest.mark.parametrize("weights", ["bin", "safetensors"])
@pytest.mark.parametrize("ids", [[0, 3, 6], None], ids=["eagle_config_ids", "no_ids"])
def test_import_safeailab_layout_computes_what_sglang_computes(tmp_path, target, target_dir, weights, ids):
    state = safeailab_checkpoint(tmp_path, ids=ids, weights=weights)
    assert detect_eagle3_format(tmp_path) == "eagle3" and detect_eagle_format(tmp_path) is None
    # SGLang captures hidden_states[id + 1] (llama.py set_eagle3_layers_to_capture); none: [2, L // 2, L - 3]
    layers = [1, 4, 7] if ids else [2, 4, 5]
    base = None if ids else str(target_dir)  # without ids the target's depth decides
    draft = import_eagle3(tmp_path, base_model=base, target=target)
    cfg = draft.config
    assert (cfg.kind, cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size) == ("eagle3", H, V, 40)
    assert not cfg.fc_bias  # Eagle3Draft's fc has none, as training writes it
    assert cfg.layer == layer_fields(LlamaConfig(**json.loads((tmp_path / "config.json").read_text())))
    assert cfg.base_model == (base or "")
    assert_decodes_like(draft, target, state, layers)


def test_import_without_ids_or_a_target_is_a_clear_error(tmp_path):
    safeailab_checkpoint(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"names no eagle_aux_hidden_state_layer_ids.*\[2, L // 2, L - 3\].*"
        "--base-model",
    ):
        import_eagle3(tmp_path)


def test_sglang_layer_names_and_unsorted_ids_load_as_sglang_reads_them(tmp_path, target):
    """SGLang renames midlayer to layers.0 itself, and captures layers in increasing order whatever the
    list's."""
    state = published_tensors(40)
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
    safeailab_checkpoint(tmp_path, ids=[6, 0, 3], weights="safetensors", state=renamed)
    assert detect_eagle3_format(tmp_path) == "eagle3"
    draft = import_eagle3(tmp_path)
    assert draft.config.feature_layers == [1, 4, 7]
    for name, value in draft.state_dict().items():
        assert torch.equal(value, state[name]), name


# ---------------------------------------------------------------- import vllm-project/speculators


@pytest.mark.parametrize("ids", [[1, 4, 7], None], ids=["ids", "no_ids"])
def test_import_speculators_layout_computes_what_vllm_computes(tmp_path, target, target_dir, ids):
    embed = target.get_input_embeddings().weight
    state = speculators_checkpoint(tmp_path, target_dir, ids=ids, embed=embed)
    assert detect_eagle3_format(tmp_path) == "speculators-eagle3" and detect_eagle_format(tmp_path) is None
    draft = import_eagle3(
        tmp_path
    )  # the verifier config.json names is the target; its depth gives no_ids' layers
    cfg = draft.config
    assert cfg.base_model == str(target_dir) and cfg.depth == 3  # the verifier; speculative_tokens
    assert "embed_tokens.weight" not in draft.state_dict()  # the target's own is used, as vLLM shares it
    # vLLM captures hidden_states[id] as given (gpu_model_runner.py, llama.py idx + 1)
    assert_decodes_like(draft, target, state, ids or [2, 4, 5])


def test_speculators_embedding_from_another_model_is_warned_about(tmp_path, target, target_dir):
    speculators_checkpoint(tmp_path, target_dir, ids=[1, 4, 7], embed=torch.randn(V, H))
    with pytest.warns(UserWarning, match="embed_tokens differ from the target's"):
        import_eagle3(tmp_path, target=target)


@pytest.mark.parametrize("variant", SPECULATORS_VARIANTS, ids=lambda v: "+".join(v))
def test_import_speculators_variants_computes_what_vllm_computes(tmp_path, target, target_dir, variant):
    state = speculators_checkpoint(
        tmp_path, target_dir, ids=[1, 4, 7], extra=variant, input_norm=variant.get("norm_before_fc", False)
    )
    draft = import_eagle3(tmp_path)
    assert_decodes_like(draft, target, state, [1, 4, 7], **variant)


SAFEAILAB_VARIANTS = [  # (config fields, the flags vLLM reads from them)
    (
        {"eagle_config": {"norm_before_fc": True}},
        {"norm_before_fc": True},
    ),  # SGLang and vLLM read it here first
    (
        {"norm_before_fc": True},
        {"norm_before_fc": True},
    ),  # ... and at the top level when eagle_config has none
    ({"norm_before_fc": True, "eagle_config": {"norm_before_fc": False}}, {}),  # eagle_config wins
    ({"norm_before_residual": True}, {"norm_before_residual": True}),  # vLLM only: SGLang ignores it
]


@pytest.mark.parametrize(
    ("extra", "variant"), SAFEAILAB_VARIANTS, ids=[json.dumps(e) for e, _ in SAFEAILAB_VARIANTS]
)
def test_import_safeailab_layout_variants_computes_what_vllm_computes(tmp_path, target, extra, variant):
    state = published_tensors(40, input_norm=variant.get("norm_before_fc", False))
    safeailab_checkpoint(tmp_path, ids=[0, 3, 6], weights="safetensors", extra=extra, state=state)
    assert_decodes_like(import_eagle3(tmp_path), target, state, [1, 4, 7], **variant)


def test_norm_before_fc_needs_its_input_norm_of_the_fc_input_width(tmp_path):
    state = published_tensors(40)
    safeailab_checkpoint(
        tmp_path, ids=[0, 3, 6], extra={"eagle_config": {"norm_before_fc": True}}, state=state
    )
    with pytest.raises(ValueError, match=r"missing \['input_norm.weight'\]"):
        import_eagle3(tmp_path)
    torch.save(state | {"input_norm.weight": torch.ones(H)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"input_norm.weight has shape \(48,\), expected \(144,\)"):
        import_eagle3(tmp_path)


def test_full_vocabulary_without_vocab_maps_is_the_identity(tmp_path, target):
    state = published_tensors(V)
    del state["d2t"], state["t2d"]  # speculators saves none (model.py), SafeAILab deletes them (ea_model.py)
    safeailab_checkpoint(tmp_path, ids=[0, 3, 6], size=V, state=state)
    draft = import_eagle3(tmp_path)
    assert draft.config.draft_vocab_size == 0
    assert torch.equal(draft.to_target(torch.arange(V)), torch.arange(V)) and bool(draft.t2d.all())


def test_a_t2d_that_disagrees_with_d2t_is_rebuilt_with_a_warning(tmp_path):
    state = published_tensors(40)
    wrong = state | {"t2d": ~state["t2d"]}
    safeailab_checkpoint(tmp_path, ids=[0, 3, 6], state=wrong)
    with pytest.warns(UserWarning, match="t2d does not mark exactly the target ids d2t maps to"):
        draft = import_eagle3(tmp_path)
    assert torch.equal(draft.t2d, state["t2d"])


# ---------------------------------------------------------------- variants and other refusals


REFUSED = [
    ("eagle3", {"eagle_config": {"use_aux_hidden_state": False}}),
    ("eagle3", {"fc_norm": True}),
    ("eagle3", {"use_aux_norm": True}),
    ("eagle3", {"norm_output": True}),
    ("eagle3", {"bias": True}),
    ("eagle3", {"logit_scale": 0.5}),
    ("speculators-eagle3", {"fc_norm": True}),
    ("speculators-eagle3", {"norm_output": True}),
    ("speculators-eagle3", {"transformer_layer_config": {"logit_scale": 2.0}}),
]


def published(fmt, path, verifier, extra):
    if fmt == "eagle3":
        return safeailab_checkpoint(path, ids=[0, 3, 6], extra=extra)
    return speculators_checkpoint(path, verifier, ids=[1, 4, 7], extra=extra)


@pytest.mark.parametrize(("fmt", "extra"), REFUSED, ids=[f"{f}-{json.dumps(e)}" for f, e in REFUSED])
def test_each_variant_flag_is_refused_naming_it(tmp_path, target_dir, fmt, extra):
    published(fmt, tmp_path, target_dir, extra)
    flag, value = next(iter(extra.items()))
    if isinstance(value, dict):
        flag, value = next(iter(value.items()))
    with pytest.raises(
        ValueError, match=f"{flag} = {json.dumps(value)} means .*Eagle3Draft does not compute"
    ):
        import_eagle3(tmp_path)


def test_every_variant_flag_is_exercised():
    named = set()
    for _, extra in REFUSED:
        for key, value in extra.items():
            named |= set(value) if isinstance(value, dict) else {key}
    assert named == set(VARIANTS)


@pytest.mark.parametrize("fmt", EAGLE3_FORMATS)
def test_flags_at_their_neutral_values_load(tmp_path, target_dir, fmt):
    neutral = {flag: v.neutral for flag, v in VARIANTS.items() if flag != "use_aux_hidden_state"}
    neutral |= {flag: False for flag in FLAGS}
    extra = (
        neutral | {"eagle_config": {"norm_before_fc": False, "use_aux_hidden_state": True}}
        if fmt == "eagle3"
        else neutral | {"transformer_layer_config": {"logit_scale": 1.0}}
    )
    state = published(fmt, tmp_path, target_dir, extra)
    draft = import_eagle3(tmp_path)
    for name, value in draft.state_dict().items():
        assert torch.equal(value, state[name]), name


def test_speculators_config_without_norm_before_residual_is_read_as_vllm_reads_it(tmp_path, target_dir):
    speculators_checkpoint(tmp_path, target_dir, ids=[1, 4, 7], extra={"norm_before_residual": DROP})
    with pytest.warns(UserWarning, match="norm_before_residual is absent, which vLLM reads as true"):
        draft = import_eagle3(tmp_path)
    assert draft.config.norm_before_residual is True and draft.config.norm_before_fc is False


STRUCTURAL = [
    ("eagle3", {"num_hidden_layers": 2}, "num_hidden_layers = 2 draft layers; Eagle3Draft has one"),
    ("eagle3", {"target_hidden_size": 64}, "target_hidden_size 64 differs from the draft's hidden_size 48"),
    ("eagle3", {"attention_bias": True}, "attention_bias: true"),
    (
        "eagle3",
        {"architectures": ["GptOssForCausalLMEagle3"]},
        "Eagle3Draft computes the Llama EAGLE-3 layer",
    ),
    (
        "eagle3",
        {"eagle_aux_hidden_state_layer_ids": [0, 3, 6]},
        r"SGLang fuses hidden_states \[1, 4, 7\] .* but vLLM \[0, 3, 6\]",
    ),
    (
        "eagle3",
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3]}},
        "fuses 3 hidden states, but the config names 2 layers",
    ),
    ("eagle3", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 3]}}, r"\[1, 4, 4\] repeat one"),
    ("eagle3", {"num_aux_hidden_states": 2}, "and num_aux_hidden_states 2"),
    ("eagle3", {"draft_vocab_size": 41}, "draft_vocab_size is 41 but lm_head.weight has 40 rows"),
    (
        "speculators-eagle3",
        {"transformer_layer_config": {"model_type": "qwen3"}},
        "the draft layer is 'qwen3'",
    ),
    ("speculators-eagle3", {"norm_before_fc": "yes"}, 'norm_before_fc must be true or false, got "yes"'),
    ("eagle3", {"eagle_config": {"norm_before_fc": 1}}, "norm_before_fc must be true or false, got 1"),
    (
        "speculators-eagle3",
        {"eagle_aux_hidden_state_layer_ids": [1, 4, 8]},
        r"indices \[1, 4, 8\] must lie in \[0, L - 1 = 7\] .index L is normed in transformers",
    ),
]


@pytest.mark.parametrize(("fmt", "extra", "message"), STRUCTURAL, ids=[m[:30] for _, _, m in STRUCTURAL])
def test_what_eagle3draft_cannot_be_is_refused(tmp_path, target_dir, fmt, extra, message):
    published(fmt, tmp_path, target_dir, extra)
    with pytest.raises(ValueError, match=message):
        import_eagle3(tmp_path)


def test_unreadable_or_incomplete_weights_are_clear_errors(tmp_path):
    state = safeailab_checkpoint(tmp_path, ids=[0, 3, 6])
    torch.save({**state, "hook": os.getcwd}, tmp_path / "pytorch_model.bin")  # a pickled global
    with pytest.raises(ValueError, match=r"cannot read the weights .*weights_only=True"):
        import_eagle3(tmp_path, format="eagle3")
    torch.save({k: v for k, v in state.items() if k != "lm_head.weight"}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="no lm_head.weight: this drafter would use the target's lm_head"):
        import_eagle3(tmp_path)
    torch.save({k: v for k, v in state.items() if "o_proj" not in k}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"missing \['midlayer.self_attn.o_proj.weight'\]"):
        import_eagle3(tmp_path)
    torch.save(state | {"midlayer.mlp.up_proj.weight": torch.zeros(80, H)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(
        ValueError, match=r"midlayer.mlp.up_proj.weight has shape \(80, 48\), expected \(96, 48\)"
    ):
        import_eagle3(tmp_path)
    torch.save(state | {"input_norm.weight": torch.ones(3 * H)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"unexpected \['input_norm.weight'\]"):
        import_eagle3(tmp_path)
    torch.save(state | {"d2t": state["d2t"] + V}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"d2t maps draft ids to target ids outside \[0, 96\)"):
        import_eagle3(tmp_path)
    quantized = state | {"midlayer.hidden_norm.weight": torch.ones(H, dtype=torch.int8)}
    torch.save(quantized, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="midlayer.hidden_norm.weight is torch.int8; quantized drafters"):
        import_eagle3(tmp_path)


def test_detection_tells_the_layouts_apart(tmp_path, target, target_dir):
    assert detect_eagle3_format(tmp_path) is None  # empty
    safeailab_checkpoint(tmp_path / "sglang", ids=[0, 3, 6])
    speculators_checkpoint(tmp_path / "speculators", target_dir, ids=[1, 4, 7])
    assert isinstance(import_heads(tmp_path / "sglang"), Eagle3Draft)
    assert import_heads(tmp_path / "speculators").config.feature_layers == [1, 4, 7]
    speculators_checkpoint(
        tmp_path / "peagle", target_dir, ids=[1, 4, 7], extra={"speculators_model_type": "peagle"}
    )
    assert detect_eagle3_format(tmp_path / "peagle") is None
    eagle1 = EagleDraft(
        HeadsConfig(kind="eagle", hidden_size=H, vocab_size=V, layer=layer_fields(target.config))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_eagle(eagle1, "eagle1", tmp_path / "eagle1")
    assert (
        detect_eagle3_format(tmp_path / "eagle1") is None
        and detect_eagle_format(tmp_path / "eagle1") == "eagle1"
    )
    random_draft(target).save_pretrained(tmp_path / "ours")  # a selfspec heads directory
    assert detect_eagle3_format(tmp_path / "ours") is None
    assert detect_eagle3_format(target_dir) is None  # a full causal LM


# ---------------------------------------------------------------- export
