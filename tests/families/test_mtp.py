"""The MTP family: a target's own multi-token-prediction layers read from its checkpoint, decoded exactly,
fine-tuned, and exported under the checkpoint's own key names (heads/mtp.py, heads/formats/mtp.py,
infer/drafters/mtp.py, train/mtp.py)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from conftest import fit_on_own_continuations
from mtp_targets import tiny_mtp_model, write_mtp_target
from recipe_args import argv as options
from recipe_args import short_run
from selfspec import SpeculativeModel
from selfspec.heads.formats.mtp import export_as, load_target_mtp, own_mtp_keys
from selfspec.heads.registry import load_heads
from selfspec.infer.drafters.mtp import mtp_proposer

CHAIN = dict(depth=3, top_k=1, total_tokens=3)
TREE = dict(depth=3, top_k=3, total_tokens=8)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Tiny GLM-4.5- and DeepSeek-V3-shaped targets with one MTP layer each, written as published."""
    root = tmp_path_factory.mktemp("mtp-targets")
    return {arch: write_mtp_target(root / arch, arch) for arch in ("glm4_moe", "deepseek_v3")}


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


def prompts(n: int = 3, length: int = 7, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, 8000, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3"])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_identical_to_generate_with_left_padded_rows(targets, arch, shape):
    spec = SpeculativeModel.from_pretrained(
        str(targets[arch]),
        mtp=True,
        draft_depth=shape["depth"],
        draft_top_k=shape["top_k"],
        draft_total_tokens=shape["total_tokens"],
    )
    assert spec.drafter.name == "mtp"
    ids = prompts()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids = ids.masked_fill(mask == 0, 2)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=2)
    ref = spec.model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=2)
    assert out.tolist() == ref.tolist()


OTHERS = {
    "ernie4_5_moe": {},
    "param2moe": {},
    "sarvam_moe": {},
    # Mellum's own MTP layer is sliding-window (refused, below): one of full attention, whose RoPE is still
    # per layer type (the MTP layer asks for its own)
    "mellum": {"mtp_layer_types": ["full_attention"]},
    # multi-head latent attention, as DeepSeek-V3's
    "sarvam_mla": dict(
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        kv_lora_rank=16,
        head_dim=8,
        num_key_value_heads=4,
    ),
}


@pytest.mark.parametrize("arch", sorted(OTHERS))
def test_the_other_mtp_architectures_decode_exactly(arch):
    """Every other transformers architecture with MTP layers that builds as a causal LM here."""
    model, draft = tiny_mtp_model(arch, **OTHERS[arch])
    prompt = torch.randint(3, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = model.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=[], pad_token_id=0)
    for shape in (CHAIN, TREE):
        spec = SpeculativeModel(model, mtp_proposer(draft, model, dynamic=True, **shape))
        out = spec.generate(prompt, max_new_tokens=16, eos_token_id=[], pad_token_id=0)
        assert out.tolist() == ref.tolist(), (arch, shape)


def test_a_sliding_window_mtp_layer_is_refused_in_one_line():
    with pytest.raises(ValueError, match="MTP layers of type sliding_attention: not supported yet"):
        tiny_mtp_model("mellum")  # as published: its MTP layer attends over a sliding window


def exported_other(arch: str, out, shared_norm: bool = True):
    """A tiny `arch` target with random MTP layers (Ernie's output norm kept as the target's final norm, as
    its checkpoint holds it), exported to `out`."""
    model, draft = tiny_mtp_model(arch, **OTHERS[arch])
    with torch.no_grad():
        for name, weight in draft.mtp.named_parameters():
            weight.normal_(1.0 if "norm" in name else 0.0, 0.2)
        if shared_norm and arch == "ernie4_5_moe":
            draft.mtp.layers[0].post_norm.weight.copy_(model.get_decoder().norm.weight)
    with warnings.catch_warnings():  # an in-memory target has no tokenizer to copy: said in a warning
        warnings.simplefilter("ignore", UserWarning)
        export_as(draft, "mtp", out, target=model, base_model=arch)
    return model, draft


@pytest.mark.parametrize(
    "arch, names",
    [
        ("ernie4_5_moe", ["model.mtp_emb_norm.0.weight", "model.mtp_linear_proj.0.weight"]),
        ("mellum", ["mtp.fc.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"]),
    ],
)
def test_ernies_and_mellums_layouts_export_and_load_back_identically(arch, names, tmp_path):
    _, draft = exported_other(arch, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert set(names) <= keys and not any(".layers.2." in k for k in keys), sorted(keys)
    loaded = load_target_mtp(load(tmp_path), str(tmp_path))  # through transformers' own MTP loader
    for key, value in draft.mtp.state_dict().items():
        assert torch.equal(loaded.mtp.state_dict()[key], value), key


def test_ernies_output_norm_stays_the_targets(tmp_path):
    """Ernie-4.5's MTP layers read the target's final norm: an export whose own differs is refused before
    anything is written, and fine-tuning keeps it frozen."""
    with pytest.raises(ValueError, match="final norm .* train with it frozen"):
        exported_other("ernie4_5_moe", tmp_path / "differs", shared_norm=False)
    assert not (tmp_path / "differs").exists()
    from types import SimpleNamespace

    from selfspec.train.recipes.mtp import build_drafter

    exported_other("ernie4_5_moe", tmp_path / "export")
    path = str(tmp_path / "export")
    target = load(path)
    with torch.no_grad():  # a final norm that is not a new layer's starting one
        target.get_decoder().norm.weight.normal_(1.0, 0.1)
    for new in (0, 1):  # its own layer, and a new one (which starts from the target's norm too)
        cfg = SimpleNamespace(new_layers=new, model=path, target_dtype=torch.float32)
        draft = build_drafter(cfg, target)
        frozen = {name for name, p in draft.named_parameters() if not p.requires_grad}
        assert frozen == {"mtp.layers.0.post_norm.weight"}, frozen
        assert torch.equal(draft.mtp.layers[0].post_norm.weight, target.get_decoder().norm.weight)


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3"])
def test_the_first_draft_is_transformers_mtp_models_own_prediction(targets, arch):
    """Our MTP step over the prompt's pairs gives the logits transformers' MtpModel layer gives for the same
    pairs (the hidden states it reads, the pairing and the positions are the same)."""
    from transformers.cache_utils import MtpCache

    model = load(targets[arch])
    draft = load_target_mtp(model, str(targets[arch]))
    with own_mtp_keys(model):
        theirs = type(draft.mtp).from_pretrained(model)
    ids = prompts(1, 9)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        root = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([ids[:, 1:], root], dim=1)  # x_{t+1} for t = 0 .. T-1
        hidden = out.hidden_states[-1]
        T = ids.shape[1]
        # their layer over the same pairs, the first one's embedding zeroed as the engines (and we) do
        embeds = model.get_input_embeddings()(tokens)
        embeds[:, 0] = 0
        out = theirs.forward_layer(
            0, hidden, torch.arange(1, T + 1)[None], MtpCache(config=theirs.config), inputs_embeds=embeds
        )
        logits = theirs._project_to_logits(out)
        causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
        ours = draft.logits(
            draft(hidden, tokens, model.get_input_embeddings(), causal, torch.arange(T)[None], unroll=1)[0]
        )
    torch.testing.assert_close(ours[:, -1], logits[:, -1], rtol=1e-4, atol=1e-4)


def trained(model, draft, seqs_from: torch.Tensor, steps: int = 150):
    from selfspec.train.methods.mtp import MtpMethod
    from selfspec.train.recipes.mtp import MtpConfig

    method = MtpMethod(MtpConfig(ttt_steps=3), model, draft.float().train(), [])
    return fit_on_own_continuations(model, seqs_from, method, steps=steps, lr=3e-3)


def test_fine_tuning_raises_acceptance_and_decoding_stays_exact(targets):
    model = load(targets["glm4_moe"])
    ids = prompts(4, 6, seed=7)
    taus = {}
    for stage in ("checkpoint", "fine-tuned"):
        draft = load_target_mtp(model, str(targets["glm4_moe"]))
        if stage == "fine-tuned":
            draft = trained(model, draft, ids)
        spec = SpeculativeModel(model, mtp_proposer(draft, model, **CHAIN))
        for i in range(2):
            out = spec.generate(ids[i : i + 1], max_new_tokens=40, eos_token_id=[])
            ref = model.generate(
                ids[i : i + 1], max_new_tokens=40, do_sample=False, pad_token_id=2, eos_token_id=[]
            )
            assert out.tolist() == ref.tolist()
            taus[stage, i] = spec.last_stats.tau
    assert (
        min(taus["fine-tuned", i] for i in range(2)) > max(taus["checkpoint", i] for i in range(2)) + 0.5
    ), taus


def test_our_chain_of_one_makes_as_many_forwards_as_transformers_mtp_generator(targets, tmp_path):
    """A drafter that passes often (fine-tuned on these prompts' continuations), exported into the checkpoint:
    transformers' MTPCandidateGenerator (one token a step) and our chain of 1 accept exactly the same
    tokens."""
    model = load(targets["glm4_moe"])
    ids = prompts(2, 6, seed=7)
    draft = trained(model, load_target_mtp(model, str(targets["glm4_moe"])), ids)
    export_as(
        draft.to(model.dtype), "mtp", tmp_path / "tuned", target=model, base_model=str(targets["glm4_moe"])
    )
    tuned = load(tmp_path / "tuned")
    spec = SpeculativeModel.from_pretrained(
        str(tmp_path / "tuned"), model=tuned, mtp=True, draft_depth=1, draft_top_k=1, draft_total_tokens=1
    )
    calls = [0]
    for i in range(2):
        calls[0] = 0
        hook = tuned.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        with own_mtp_keys(tuned):
            ref = tuned.generate(
                ids[i : i + 1],
                max_new_tokens=40,
                do_sample=False,
                use_mtp=True,
                pad_token_id=2,
                eos_token_id=[],
            )
        hook.remove()
        out = spec.generate(ids[i : i + 1], max_new_tokens=40, eos_token_id=[])
        assert out.tolist() == ref.tolist()
        assert spec.last_stats.target_forwards == calls[0] < 35  # prefill included in both; drafts passed
        tree = SpeculativeModel.from_pretrained(
            str(tmp_path / "tuned"), model=tuned, mtp=True, **{f"draft_{k}": v for k, v in TREE.items()}
        )
        assert tree.generate(ids[i : i + 1], max_new_tokens=40, eos_token_id=[]).tolist() == ref.tolist()
        assert tree.last_stats.target_forwards <= calls[0]  # our tree's tau is at least theirs


def test_export_writes_the_published_layout_and_loads_back_identically(targets, tmp_path):
    src = targets["glm4_moe"]
    model = load(src)
    draft = load_target_mtp(model, str(src))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.01 * torch.randn_like(p))  # "fine-tuned": different from the checkpoint's
    export_as(draft, "mtp", tmp_path / "out", target=model, base_model=str(src))
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    L = model.config.num_hidden_layers
    for key in (
        "eh_proj.weight",
        "enorm.weight",
        "hnorm.weight",
        "shared_head.norm.weight",
        "embed_tokens.weight",
        "shared_head.head.weight",
        "mlp.experts.0.gate_proj.weight",
        "self_attn.q_proj.weight",
    ):
        assert f"model.layers.{L}.{key}" in keys, key
    assert not any(".mtp_block." in k or ".post_norm." in k for k in keys)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    again = load(tmp_path / "out")
    for name, value in model.state_dict().items():  # the target itself is unchanged
        assert torch.equal(again.state_dict()[name], value), name
    back = load_target_mtp(again, str(tmp_path / "out"))
    for name, value in draft.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name


def test_a_target_without_mtp_layers_is_refused_in_one_line(tiny_model_dir):
    with pytest.raises(ValueError, match=r"has no MTP layers.*train/mtp.py --new_layers 1"):
        SpeculativeModel.from_pretrained(str(tiny_model_dir), mtp=True)
    with pytest.raises(ValueError, match="give the target's name or path"):
        SpeculativeModel.from_pretrained(load_heads_like(), mtp=True)


def load_heads_like():
    from selfspec.heads.config import HeadsConfig
    from selfspec.heads.medusa import MedusaHeads

    return MedusaHeads(HeadsConfig(kind="medusa", hidden_size=8, vocab_size=16))


def _args(model_dir, data, out, **extra):
    return options(short_run(model_dir, data, out, **({"ttt_steps": 2} | CHAIN | extra)))


def test_the_recipe_fine_tunes_saves_and_resumes_like_an_uninterrupted_run(
    targets, text_data, tmp_path, monkeypatch
):
    from conftest import check_resume
    from selfspec.train.loop.config import load_config
    from selfspec.train.methods.mtp import MtpMethod
    from selfspec.train.mtp import run
    from selfspec.train.recipes.mtp import MtpConfig

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    src = targets["glm4_moe"]
    result = run(load_config(MtpConfig, _args(src, text_data, tmp_path / "m", max_steps=10)))
    history = result["history"]
    assert history[-1][1]["loss"] < history[0][1]["loss"]
    for name, value in load(src).state_dict().items():  # the trunk is frozen: bit-identical after training
        assert torch.equal(result["target"].state_dict()[name], value), name
    loaded = load_heads(tmp_path / "m")
    assert loaded.config.kind == "mtp" and loaded.config.num_layers == 1
    assert (loaded.config.depth, loaded.config.top_k, loaded.config.total_tokens) == (3, 1, 3)
    # the saved layers decode as a drafter folder, exactly
    spec = SpeculativeModel.from_pretrained(str(tmp_path / "m"), model=load(src))
    ids = prompts(1, 6)
    ref = spec.model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=2)
    assert spec.generate(ids, max_new_tokens=12).tolist() == ref.tolist()

    def run_to(out, **extra):
        return run(load_config(MtpConfig, _args(src, text_data, out, **extra)))

    check_resume(monkeypatch, MtpMethod, run_to, tmp_path / "resume", "draft")


def test_new_layers_for_a_target_without_any(tiny_model_dir, text_data, tmp_path, monkeypatch, capsys):
    from selfspec.train.loop.config import load_config
    from selfspec.train.mtp import run
    from selfspec.train.recipes.mtp import MtpConfig

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    run(load_config(MtpConfig, _args(tiny_model_dir, text_data, tmp_path / "new", max_steps=4)))
    assert "no MTP layers of its own: training 1 new one" in capsys.readouterr().out
    drafter = load_heads(tmp_path / "new")
    model = load(tiny_model_dir)
    spec = SpeculativeModel.from_pretrained(drafter, model=model)
    ids = torch.randint(4, 90, (1, 6), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert spec.generate(ids, max_new_tokens=12).tolist() == ref.tolist()


def test_the_cli_generates_and_benches_with_the_targets_own_layers(targets, capsys):
    from selfspec.infer.cli.commands import main

    src = str(targets["glm4_moe"])
    main(["generate", "--model", src, "--mtp", "--prompt", "def f(x):", "--max-new-tokens", "8"])
    captured = capsys.readouterr()
    assert "target forwards" in captured.out + captured.err
    main(["bench", "--model", src, "--mtp", "--num-prompts", "2", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert "hf_mtp" in out and "\nmtp " in out
    main(["tune", "--model", src, "--mtp", "--num-prompts", "1", "--max-new-tokens", "8"])
    assert (
        "the fastest here: --depth" in capsys.readouterr().out
    )  # printed, as there is no folder to store it in
    for argv in (
        ["generate", "--model", src, "--mtp", "--prompt-lookup", "--prompt", "x"],
        ["tune", "--model", src],
    ):
        with pytest.raises(SystemExit):
            main(argv)
    assert "exactly one drafter" in capsys.readouterr().err


def test_mtp_sampling_matches_the_target_distribution():
    from transformers import Glm4MoeConfig

    from sampling_checks import RUNS, V, chi_square, critical, exact_joint, run_sampling
    from selfspec.heads.mtp import MtpDraft, mtp_config_for

    torch.manual_seed(5)
    config = Glm4MoeConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        n_routed_experts=2,
        num_experts_per_tok=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        num_mtp_layers=1,
        initializer_range=0.1,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    draft = MtpDraft(mtp_config_for(model, "tiny")).eval()
    spec = SpeculativeModel(model, mtp_proposer(draft, model, **CHAIN))
    prompt = torch.tensor([[3, 1, 4, 1, 5, 3, 1, 4, 1]])
    accepted = []
    counts = run_sampling(spec, prompt, (1.0, 0, 1.0), accepted)
    stat, dof = chi_square(counts, exact_joint(model, prompt, (1.0, 0, 1.0)), RUNS)
    assert stat < critical(dof), (
        f"chi2 {stat:.1f} with {dof} dof: the sampled distribution is not the target's"
    )
    assert sum(a > 0 for a in accepted) > RUNS // 100
