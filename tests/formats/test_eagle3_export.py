"""Our EAGLE-3 drafters written in the `eagle3` (SafeAILab / SGLang) and `speculators-eagle3` layouts: exact
round trips, the config.json each engine reads, and what a layout cannot hold refused."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig

from conftest import WEIGHT_FILES
from eagle3_checkpoints import (
    DROP,
    SPECULATORS_VARIANTS,
    H,
    V,
    deep_target,
    published_tensors,
    random_draft,
    speculators_checkpoint,
)
from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.eagle import EagleDraft
from selfspec.heads.formats import export_heads
from selfspec.heads.formats.eagle import detect_eagle_format
from selfspec.heads.formats.eagle3 import EAGLE3_FORMATS, detect_eagle3_format, import_eagle3, layout_keys
from selfspec.heads.formats.eagle3_config import FLAGS, VARIANTS
from selfspec.heads.formats.eagle3_export import export_eagle3
from selfspec.heads.medusa import MedusaHeads
from selfspec.heads.registry import load_heads
from selfspec.infer.cli.commands import main as cli


def assert_same_draft(back, draft):
    assert back.config.to_dict() == draft.config.to_dict()
    state, back_state = draft.state_dict(), back.state_dict()
    assert back_state.keys() == state.keys()
    for name, value in state.items():
        assert back_state[name].dtype == value.dtype and torch.equal(back_state[name], value), name


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
@pytest.mark.parametrize("size", [40, 0], ids=["draft_vocab", "full_vocab"])
@pytest.mark.parametrize("fmt", EAGLE3_FORMATS)
def test_export_import_round_trip_is_exact(tmp_path, target, fmt, size, weights):
    draft = random_draft(target, size, feature_layers=[1, 3, 6], base_model="org/target")
    draft.config.dtype = "bfloat16"  # the weights stay float32: each kept as it is
    if fmt == "speculators-eagle3":
        draft.config.depth = 5  # carried as speculative_tokens; the eagle3 layout has no decoding settings
    export_eagle3(
        draft, fmt, tmp_path, weights=weights, target=target if fmt == "speculators-eagle3" else None
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", WEIGHT_FILES[weights]]
    assert detect_eagle3_format(tmp_path) == fmt and detect_eagle_format(tmp_path) is None
    back = import_eagle3(tmp_path, base_model="org/target" if fmt == "eagle3" else None)
    assert_same_draft(back, draft)
    file = tmp_path / WEIGHT_FILES[weights]
    written = load_file(file) if weights == "safetensors" else torch.load(file, weights_only=True)
    assert set(written) == layout_keys(fmt, draft_vocab=bool(size))
    # a full-vocabulary drafter has no d2t: vLLM's loader has no parameter for one (llama_eagle3.py)
    assert ("d2t" in written) == bool(size)
    # speculators saves the verifier's embedding, and its loader leaves a missing one uninitialised
    assert ("embed_tokens.weight" in written) == (fmt == "speculators-eagle3")
    if fmt == "speculators-eagle3":
        assert torch.equal(written["embed_tokens.weight"], target.get_input_embeddings().weight)


def at(raw, path):
    """config.json's value at a dotted path, or DROP where it is absent."""
    for key in path.split("."):
        raw = raw.get(key, DROP) if isinstance(raw, dict) else DROP
    return raw


# (layout, the drafter's flags, where the layout's engines read them in config.json: speculators-eagle3 at the
# top level (vLLM update_eagle3); eagle3 norm_before_fc in eagle_config (SGLang and vLLM read it there first)
# and no norm_before_residual, which SGLang ignores)
ROUND_TRIPS = [
    ("speculators-eagle3", v, {f: v.get(f, False) for f in FLAGS}) for v in SPECULATORS_VARIANTS
] + [
    ("eagle3", {"norm_before_fc": True}, {"eagle_config.norm_before_fc": True, "norm_before_residual": DROP})
]


@pytest.mark.parametrize(
    ("fmt", "variant", "written"), ROUND_TRIPS, ids=[f"{f}-{'+'.join(v)}" for f, v, _ in ROUND_TRIPS]
)
def test_export_import_round_trip_keeps_the_variant_flags(tmp_path, target, fmt, variant, written):
    draft = random_draft(target, 40, feature_layers=[1, 3, 6], **variant)
    assert (draft.input_norm is not None) == variant.get("norm_before_fc", False)
    export_eagle3(draft, fmt, tmp_path, target=target if fmt == "speculators-eagle3" else None)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert {path: at(raw, path) for path in written} == written
    names = set(load_file(tmp_path / "model.safetensors"))
    assert names == layout_keys(fmt, draft_vocab=True, norm_before_fc=variant.get("norm_before_fc", False))
    assert ("input_norm.weight" in names) == variant.get("norm_before_fc", False)  # the engines' name
    assert_same_draft(import_eagle3(tmp_path, base_model=""), draft)


def test_eagle3_config_is_what_sglang_safeailab_and_vllm_read(tmp_path, target):
    draft = random_draft(target, 40, feature_layers=[1, 3, 6])
    export_eagle3(draft, "eagle3", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["model_type"] == "llama"
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]  # SGLang adds 1
    assert raw["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]  # vLLM reads this first, as given
    assert raw["draft_vocab_size"] == 40 and raw["vocab_size"] == V and raw["num_hidden_layers"] == 1
    assert (
        raw["tie_word_embeddings"] is False and "bias" not in raw
    )  # SGLang: bias is fc's, tie makes lm_head embed
    assert not set(raw) & {f for f in [*VARIANTS, *FLAGS] if f != "bias"}  # every variant flag at its default
    assert raw["eagle_config"]["norm_before_fc"] is False
    assert layer_fields(LlamaConfig(**raw)) == draft.config.layer
    safeailab = published_tensors(40)
    assert set(load_file(tmp_path / "model.safetensors")) == set(safeailab)  # SafeAILab's names exactly


def test_speculators_config_is_what_vllm_reads(tmp_path, target, target_dir):
    draft = random_draft(target, 40, feature_layers=[1, 3, 6])
    with pytest.warns(
        UserWarning, match="names the verifier as .*, a path on this machine.*--base-model <Hub id>"
    ):
        export_eagle3(draft, "speculators-eagle3", tmp_path, base_model=str(target_dir), target=target)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "model_type" not in raw  # vLLM: speculators_config and no model_type make a speculators config
    assert raw["architectures"] == ["Eagle3Speculator"] and raw["speculators_model_type"] == "eagle3"
    assert raw["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]  # hidden_states indices, as vLLM reads them
    assert raw["norm_before_residual"] is False  # written: vLLM reads an absent one as true
    assert not any(raw[f] for f in ("norm_before_fc", "fc_norm", "norm_output"))
    assert raw["draft_vocab_size"] == 40 and raw["target_hidden_size"] is None
    layer = raw["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["vocab_size"] == V and layer["num_hidden_layers"] == 1
    assert layer_fields(LlamaConfig(**layer)) == draft.config.layer
    spec = raw["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == draft.config.depth
    assert spec["verifier"] == {
        "name_or_path": str(target_dir.resolve()),
        "architectures": ["LlamaForCausalLM"],
    }
    hand = speculators_checkpoint(tmp_path / "hand", target_dir, ids=[1, 3, 6])
    published_names = {k.replace("midlayer.", "layers.0.") for k in hand} | {"embed_tokens.weight"}
    assert set(load_file(tmp_path / "model.safetensors")) == published_names


def test_export_refuses_what_the_layouts_cannot_hold(tmp_path, target):
    eagle1 = EagleDraft(
        HeadsConfig(kind="eagle", hidden_size=H, vocab_size=V, layer=layer_fields(target.config))
    )
    medusa = MedusaHeads(HeadsConfig(hidden_size=H, vocab_size=V))
    for fmt in EAGLE3_FORMATS:
        for heads in (eagle1, medusa):
            kind = heads.config.kind
            with pytest.raises(
                ValueError, match=f"{fmt} is a layout of EAGLE-3 drafters but these heads are {kind}"
            ):
                export_heads(heads, fmt, tmp_path / "x")
    draft = random_draft(target, 40)
    for fmt in ("eagle1", "sglang-eagle"):
        with pytest.raises(
            ValueError,
            match=f"{fmt} is a layout of EAGLE-1/2 drafters but these heads are eagle3: choose one of "
            "eagle3, speculators-eagle3",
        ):
            export_heads(draft, fmt, tmp_path / "x")
    with pytest.raises(ValueError, match="eagle3's config.json names no base model"):
        export_heads(draft, "eagle3", tmp_path / "x", base_model="org/x")
    with pytest.raises(ValueError, match=r"feature_layers \[5, 2, 4\] must be strictly increasing"):
        export_eagle3(random_draft(target, feature_layers=[5, 2, 4]), "eagle3", tmp_path / "x")
    with pytest.raises(ValueError, match="fuses 2 hidden states; vLLM 0.32 builds .* for 3"):
        export_eagle3(random_draft(target, feature_layers=[2, 5]), "speculators-eagle3", tmp_path / "x")
    wider = deep_target(1)
    wider.resize_token_embeddings(V + 1)
    with pytest.raises(ValueError, match="carries the target's input embedding .* give the target"):
        export_eagle3(draft, "speculators-eagle3", tmp_path / "x")
    with pytest.raises(
        ValueError, match=r"input embedding is \(97, 48\).* give the target it was trained on"
    ):
        export_eagle3(draft, "speculators-eagle3", tmp_path / "x", target=wider)
    with pytest.raises(ValueError, match=r"include hidden_states\[8\], which transformers norms"):
        export_eagle3(random_draft(target, feature_layers=[2, 4, 8]), "eagle3", tmp_path / "x", target=target)
    shuffled = random_draft(target)
    shuffled.d2t[:2] = torch.tensor([1, -1])  # the whole vocabulary, two ids swapped
    with pytest.raises(ValueError, match="whole target vocabulary in another order"):
        export_eagle3(shuffled, "eagle3", tmp_path / "x")
    with pytest.raises(
        ValueError,
        match="norm_before_residual, which SGLang and SafeAILab do not read.*export it as speculators-eagle3",
    ):
        export_eagle3(random_draft(target, 40, norm_before_residual=True), "eagle3", tmp_path / "x")
    stale = random_draft(target, 40)
    stale.t2d.fill_(True)
    with pytest.raises(ValueError, match="t2d does not mark exactly the target ids d2t maps to"):
        export_eagle3(stale, "eagle3", tmp_path / "x")
    assert not (tmp_path / "x").exists()  # refused before anything is written
    export_eagle3(draft, "eagle3", tmp_path / "y", weights="bin")
    with pytest.raises(ValueError, match="already holds pytorch_model.bin"):
        export_eagle3(draft, "eagle3", tmp_path / "y")
    # a two-layer drafter exports as eagle3: SGLang and vLLM size fc from eagle_config's ids
    two = random_draft(target, feature_layers=[2, 5])
    export_eagle3(two, "eagle3", tmp_path / "two")
    assert_same_draft(import_eagle3(tmp_path / "two"), two)


@pytest.mark.parametrize("fmt", EAGLE3_FORMATS)
def test_cli_export_then_import_keeps_the_drafter(tmp_path, target, target_dir, fmt, capsys):
    draft = random_draft(target, 40, base_model=str(target_dir))
    draft.save_pretrained(tmp_path / "ours")
    cli(["export", "--heads", str(tmp_path / "ours"), "--format", fmt, "--out", str(tmp_path / "out")])
    cli(
        [
            "import",
            "--src",
            str(tmp_path / "out"),
            "--out",
            str(tmp_path / "back"),
            "--base-model",
            str(target_dir),
        ]
    )
    assert "imported eagle3 heads" in capsys.readouterr().out
    assert_same_draft(load_heads(tmp_path / "back"), draft)


def test_an_export_says_which_settings_its_layout_leaves_behind(tmp_path, target, target_dir):
    """Export then import gave the defaults for the fitted tree and the target where the layout has no room
    for them, silently; what the layout carries comes back exactly."""
    draft = random_draft(target, 40, feature_layers=[1, 3, 6], base_model="org/target")
    draft.config.depth, draft.config.top_k, draft.config.total_tokens = 5, 2, 8  # a fitted tree
    with pytest.warns(
        UserWarning, match=r"^speculators-eagle3 has no room for top_k=2, total_tokens=8: importing"
    ):
        export_heads(draft, "speculators-eagle3", tmp_path / "spec", target=target)
    back = import_eagle3(tmp_path / "spec")
    assert (back.config.base_model, back.config.depth) == ("org/target", 5)  # carried
    with pytest.warns(
        UserWarning,
        match=r"^eagle3 has no room for base_model=org/target, depth=5, top_k=2, "
        r"total_tokens=8: importing the export gives the defaults",
    ):
        export_heads(draft, "eagle3", tmp_path / "safeailab", target=target)
