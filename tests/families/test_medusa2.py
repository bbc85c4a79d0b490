"""Medusa-2: heads trained jointly with a peft LoRA on the target, saved as heads + adapter (or a merged
target), and decoded losslessly against that adapted target."""

import json
import math

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from conftest import check_resume, medusa_args, tiny_model, tiny_tokenizer
from selfspec.heads.config import HeadsConfig
from selfspec.heads.medusa import MedusaHeads
from selfspec.heads.registry import load_heads
from selfspec.heads.target import load_target
from selfspec.infer.cli.commands import main as cli
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.train.loop.config import ConfigError, load_config
from selfspec.train.loop.method import StepContext
from selfspec.train.medusa import run
from selfspec.train.methods.medusa2 import Medusa2Method, add_lora, heads_weight, lora_targets
from selfspec.train.recipes.medusa import MedusaConfig

PROMPT = torch.tensor([[5, 6, 7, 8, 9]])


def lora_tensors(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def test_lora_covers_attention_mlp_and_an_untied_lm_head():
    model = tiny_model("llama")
    assert lora_targets(model) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "lm_head",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    model.lm_head.weight = (
        model.model.embed_tokens.weight
    )  # tied: merging into it would change the embeddings
    assert "lm_head" not in lora_targets(model)
    assert lora_targets(tiny_model("gpt2")) == ["c_attn", "c_fc", "c_proj"]


def test_adapters_off_is_the_base_model_and_kl_starts_at_zero():
    base = tiny_model("llama")
    reference = tiny_model("llama")  # the same seed: an untouched copy
    backbone = add_lora(base, r=4, alpha=8, dropout=0.0)
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
        assert torch.equal(
            backbone(input_ids=ids).logits, expected
        )  # LoRA B = 0: exactly the target at first
        for name, p in lora_tensors(backbone).items():
            if "lora_B" in name:
                p.normal_(0, 0.5)
        assert not torch.allclose(backbone(input_ids=ids).logits, expected, atol=1e-3)
        with backbone.disable_adapter():
            assert torch.equal(backbone(input_ids=ids).logits, expected)

    cfg = load_config(MedusaConfig, ["--medusa2", "true", "--self_distill", "true", "--num_heads", "2"])
    fresh = add_lora(tiny_model("llama"), r=4, alpha=8, dropout=0.0)
    heads = MedusaHeads(HeadsConfig(hidden_size=48, vocab_size=96, num_heads=2, share_lm_head=True))
    method = Medusa2Method(cfg, fresh, heads, kl=True)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids).bool(),
    }
    hidden, _ = method._per_head(batch)
    assert method._l0(batch, hidden).abs().item() < 1e-6
    for name, p in lora_tensors(fresh).items():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)
    hidden, _ = method._per_head(batch)
    assert method._l0(batch, hidden).item() > 1e-3  # the KL sees an adapted target


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_backbone_ce_weight_adds_the_cross_entropy_of_the_targets_own_tokens(weight):
    cfg = load_config(
        MedusaConfig,
        [
            "--medusa2",
            "true",
            "--self_distill",
            "true",
            "--num_heads",
            "2",
            "--backbone_ce_weight",
            str(weight),
        ],
    )
    backbone = add_lora(tiny_model("llama"), r=4, alpha=8, dropout=0.0)
    for name, p in lora_tensors(backbone).items():
        if "lora_B" in name:
            p.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    reference = tiny_model("llama")
    heads = MedusaHeads(HeadsConfig(hidden_size=48, vocab_size=96, num_heads=2, share_lm_head=True))
    method = Medusa2Method(cfg, backbone, heads, kl=True)
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones_like(ids).bool()
    loss_mask[:, :5] = False  # a prompt: neither term is taken there
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
    method.stage = StepContext(10, 10)
    with torch.no_grad():
        adapted = backbone(input_ids=ids).logits[:, 4:-1].flatten(0, 1).log_softmax(-1)
        frozen = reference(input_ids=ids).logits[:, 4:-1].flatten(0, 1).log_softmax(-1)
        kl = (frozen.exp() * (frozen - adapted)).sum(-1).mean()
        ce = -adapted.gather(-1, ids[:, 5:].reshape(-1, 1)).mean()
        _, logs = method.loss(batch, method.stage)
    assert logs["backbone_kl"].item() == pytest.approx(kl.item(), rel=1e-4)
    assert logs["backbone_ce"].item() == pytest.approx(ce.item(), rel=1e-4)
    assert logs["loss"].item() == pytest.approx(
        (kl + weight * ce + heads_weight("sine", 0.2, 1.0) * logs["heads_loss"]).item(), rel=1e-4
    )


def test_the_targets_fingerprint_ignores_its_adapters_only():
    from selfspec.train.data.fingerprints import weights_fingerprint

    plain = weights_fingerprint(tiny_model("llama"))
    backbone = add_lora(tiny_model("llama"), r=4, alpha=8, dropout=0.0)
    for p in lora_tensors(backbone).values():
        p.data.normal_()
    assert weights_fingerprint(backbone) == plain
    with torch.no_grad():
        backbone.get_base_model().model.norm.weight.add_(1e-3)
    assert weights_fingerprint(backbone) != plain


def test_heads_weight_schedules_ramp_to_the_coefficient():
    assert heads_weight("constant", 0.2, 0.0) == heads_weight("constant", 0.2, 0.7) == 0.2
    assert heads_weight("linear", 0.2, 0.25) == pytest.approx(0.05)
    assert heads_weight("sine", 0.2, 0.5) == pytest.approx(0.2 * math.sin(math.pi / 4))
    assert heads_weight("sine", 0.2, 0.0) == 0 and heads_weight("linear", 0.2, 1.5) == pytest.approx(0.2)


def train_medusa2(tiny_model_dir, text_data, out, **extra):
    options = {
        "max_steps": 6,
        "medusa2": True,
        "share_lm_head": True,
        "lora_r": 4,
        "lora_alpha": 8,
        "learning_rate": 5e-3,
    } | extra
    args = medusa_args(tiny_model_dir, text_data, out, **options)
    return run(load_config(MedusaConfig, args))


@pytest.mark.parametrize(
    "merge, shared", [(False, True), (True, False)], ids=["adapter+shared-lm-head", "merged+own-lm-heads"]
)
def test_only_lora_and_heads_train_and_decoding_matches_the_adapted_target(
    merge, shared, tiny_model_dir, text_data, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "medusa2"
    # the merged variant also recomputes the target's layers in the backward pass (gradient checkpointing)
    result = train_medusa2(
        tiny_model_dir, text_data, out, merge=merge, share_lm_head=shared, gradient_checkpointing=merge
    )
    assert set(result["heads"].state_dict()) == set(
        load_heads(out).state_dict()
    )  # the heads' own lm_heads or not
    assert any(n.endswith(f"{1}.weight") for n in result["heads"].state_dict()) != shared
    logged = result["history"][-1][1]
    assert (
        "backbone_ce" in logged and "backbone_kl" not in logged
    )  # not self-generated data: plain cross-entropy
    config = HeadsConfig.load(out)
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    merged = result["target"].state_dict()
    changed = sorted(n for n in original if not torch.equal(original[n], merged[n]))
    # only the LoRA'd projections moved; embeddings and norms are the original's bit for bit
    assert changed and all(n.rsplit(".", 2)[-2] in lora_targets(tiny_model("llama")) for n in changed)
    assert all(torch.equal(original[n], merged[n]) for n in original if "norm" in n or "embed" in n)
    if merge:
        assert config.merged_target == "target" and config.adapter is None and not (out / "adapter").exists()
        assert (out / "target" / "config.json").is_file() and (out / "target" / "tokenizer.json").is_file()
    else:
        assert config.adapter == "adapter" and config.merged_target is None
        adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
        assert adapter and all("lora_" in n for n in adapter)  # LoRA tensors only, no copy of the lm_head
        assert any("lora_B" in n and v.abs().sum() > 0 for n, v in adapter.items())  # the adapter trained
        rebuilt = PeftModel.from_pretrained(tiny_model("llama"), str(out / "adapter")).merge_and_unload()
        for name, value in rebuilt.state_dict().items():
            torch.testing.assert_close(value, merged[name])  # base + saved adapter = the adapted target
    spec = SpeculativeModel.from_pretrained(out, dtype=torch.float32)
    assert spec.model.state_dict().keys() == merged.keys()
    for name, value in spec.model.state_dict().items():
        torch.testing.assert_close(value, merged[name])
    plain = spec.model.generate(PROMPT, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(spec.generate(PROMPT, max_new_tokens=24), plain)
    with pytest.raises(ValueError, match="trained with a LoRA adapter"):  # the base alone would accept little
        SpeculativeModel.from_pretrained(out, model=tiny_model("llama"))
    again = SpeculativeModel.from_pretrained(
        result["heads"], model=result["target"]
    )  # what run() returns fits
    assert torch.equal(again.generate(PROMPT, max_new_tokens=24), plain)
    if merge:
        with pytest.raises(ValueError, match="decode with their merged target in .*target, not"):
            load_target(load_heads(out), str(tiny_model_dir))
    # resumed to save the other form: the first one's folder goes, so one adapted target is left to load or
    # push
    capsys.readouterr()
    train_medusa2(tiny_model_dir, text_data, out, merge=not merge, share_lm_head=shared, resume="latest")
    assert (out / "target").is_dir() != merge and (out / "adapter").is_dir() == merge
    assert (
        f"saved Medusa-2 heads and {'LoRA adapter' if merge else 'merged target'} to"
        in capsys.readouterr().out
    )


def test_cli_generates_with_the_adapter_and_push_uploads_it(
    tiny_model_dir,
    text_data,
    tmp_path,
    monkeypatch,
    capsys,
    hub,
):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "medusa2"
    train_medusa2(tiny_model_dir, text_data, out, max_steps=2, eval_steps=2)
    capsys.readouterr()
    cli(
        [
            "generate",
            "--heads",
            str(out),
            "--prompt",
            "def add",
            "--max-new-tokens",
            "12",
            "--json",
            str(tmp_path / "out.json"),
            "--quiet",
        ]
    )
    adapted = load_target(load_heads(out))  # the base model named in the config, the adapter merged in
    prompt = tiny_tokenizer()("def add", return_tensors="pt").input_ids
    expected = adapted.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[
        0, prompt.shape[1] :
    ]
    assert json.loads((tmp_path / "out.json").read_text())["token_ids"] == expected.tolist()
    cli(
        [
            "bench",
            "--heads",
            str(out),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "8",
            "--json",
            str(tmp_path / "bench.json"),
        ]
    )
    methods = json.loads((tmp_path / "bench.json").read_text())["methods"]
    assert list(methods) == [
        "hf_generate",
        "plain",
        "medusa2",
    ]  # the baseline is the adapted target's generate
    assert all(m["identical_to_baseline"] for m in methods.values())
    medusa1 = tmp_path / "medusa1"
    load_heads(out).save_pretrained(medusa1)  # a copy brings its adapter along
    assert (medusa1 / "adapter" / "adapter_config.json").is_file()
    with pytest.raises(SystemExit):  # an adapted target cannot be shared with other drafters in one run
        cli(["bench", "--heads", str(out), "--heads", str(medusa1), "--num-prompts", "1"])
    assert "Medusa-2 checkpoint" in capsys.readouterr().err
    cli(["push", "--heads", str(out), "--repo-id", "me/tiny-medusa2"])
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= set(hub["files"])
    assert json.loads(hub["files"]["config.json"])["adapter"] == "adapter"


def test_missing_adapter_and_bad_options_are_one_line_errors(medusa_dir, tmp_path):
    config = json.loads((medusa_dir / "config.json").read_text())
    (medusa_dir / "config.json").write_text(json.dumps(config | {"adapter": "adapter"}))
    with pytest.raises(FileNotFoundError, match="adapted target in .*adapter, which is missing"):
        load_target(load_heads(medusa_dir))
    with pytest.raises(ValueError, match="adapter must be null or 'adapter'"):
        HeadsConfig(adapter="../elsewhere")
    with pytest.raises(ConfigError, match="--merge applies to Medusa-2"):
        load_config(MedusaConfig, ["--merge", "true"])
    with pytest.raises(ConfigError, match="--heads_schedule must be one of constant, linear, sine"):
        load_config(MedusaConfig, ["--medusa2", "true", "--heads_schedule", "cosine"])
    with pytest.raises(ConfigError, match="--backbone_loss"):
        load_config(MedusaConfig, ["--medusa2", "true", "--backbone_loss", "mse"])
    with pytest.raises(ConfigError, match="--backbone_ce_weight applies to Medusa-2"):
        load_config(MedusaConfig, ["--backbone_ce_weight", "0.5"])
    for option, value in (("lora_r", "8"), ("heads_schedule", "linear"), ("head_lr_multiplier", "2")):
        with pytest.raises(
            ConfigError, match=f"--{option} applies to Medusa-2 .*add --medusa2 true or drop it"
        ):
            load_config(MedusaConfig, [f"--{option}", value])  # else a Medusa-1 run would ignore it
    load_config(MedusaConfig, ["--lora_r", "32"])  # the default, as a recipe may spell it out
    with pytest.raises(
        ConfigError, match=r"--heads_only_steps \(400\) leaves no joint step of --max_steps \(400\)"
    ):
        load_config(MedusaConfig, ["--medusa2", "true", "--heads_only_steps", "400"])
    with pytest.raises(ConfigError, match="--backbone_ce_weight adds cross-entropy to the KL"):
        load_config(
            MedusaConfig, ["--medusa2", "true", "--backbone_loss", "ce", "--backbone_ce_weight", "0.5"]
        )
    with pytest.raises(ConfigError, match="--backbone_ce_weight adds cross-entropy to the KL"):
        load_config(
            MedusaConfig,
            [
                "--medusa2",
                "true",
                "--self_distill",
                "false",
                "--dataset",
                str(tmp_path),
                "--backbone_ce_weight",
                "0.5",
            ],
        )
    with pytest.raises(ConfigError, match="--backbone_ce_weight >= 0"):
        load_config(MedusaConfig, ["--medusa2", "true", "--backbone_ce_weight", "-1"])


def test_bits_per_byte_of_a_uniform_model_is_log2_vocab_per_token():
    from selfspec.train.data.bits_per_byte import bits_per_byte

    model, tok = tiny_model("llama"), tiny_tokenizer()
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every next token at probability 1/96
    texts = ["def add(a, b):\n", "    return a + b\n"]
    tokens = sum(len(ids) + 1 for ids in tok(texts, add_special_tokens=False)["input_ids"])  # EOS after each
    expected = (tokens - 1) * math.log2(96) / len("".join(texts).encode())
    assert bits_per_byte(model, tok, texts, seq_len=64) == pytest.approx(expected, rel=1e-3)


def test_heads_only_stage_leaves_the_lora_alone_then_the_joint_loss_adds_l0():
    cfg = load_config(
        MedusaConfig,
        [
            "--medusa2",
            "true",
            "--num_heads",
            "2",
            "--heads_only_steps",
            "3",
            "--heads_schedule",
            "linear",
            "--heads_coefficient",
            "0.5",
        ],
    )
    backbone = add_lora(tiny_model("llama"), r=4, alpha=8, dropout=0.0)
    for name, p in lora_tensors(backbone).items():
        if "lora_B" in name:  # a trained adapter, so that L0 is not zero
            p.data.normal_(0, 0.5)
    method = Medusa2Method(
        cfg,
        backbone,
        MedusaHeads(HeadsConfig(hidden_size=48, vocab_size=96, num_heads=2, share_lm_head=True)),
        kl=False,
    )
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids).bool(),
    }
    method.stage = StepContext(2, 7)
    loss, logs = method.loss(batch, method.stage)
    loss.backward()
    # zero gradients (DDP needs one for every trained tensor), so AdamW leaves the adapter as it is
    assert all(p.grad is not None and not p.grad.any() for p in lora_tensors(backbone).values())
    assert "backbone_ce" not in logs and all(p.grad is not None for p in method.trainable.heads.parameters())
    for p in lora_tensors(backbone).values():
        p.grad = None
    method.stage = StepContext(5, 7)  # joint: lambda = 0.5 * (5 - 3) / (7 - 3)
    loss, logs = method.loss(batch, method.stage)
    assert logs["loss"].item() == pytest.approx(
        logs["backbone_ce"].item() + 0.25 * logs["heads_loss"].item(), rel=1e-5
    )
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_tensors(backbone).values())


@pytest.mark.parametrize("shared", [False, True])
def test_lambda_scales_what_reaches_the_adapters_not_the_heads_own_gradient(shared):
    """The adapters get grad(L0) + lambda * grad(heads' loss); the heads get the whole grad(heads' loss), so a
    ramp from 0 does not stall them (AdamW would carry the earlier, larger gradients' scale)."""

    def method_at(schedule, coefficient):
        torch.manual_seed(0)
        backbone = add_lora(tiny_model("llama"), r=4, alpha=8, dropout=0.0)  # untied: the lm_head has a LoRA
        for name, p in lora_tensors(backbone).items():
            if "lora_B" in name:
                p.data.normal_(0, 0.5)
        heads = MedusaHeads(HeadsConfig(hidden_size=48, vocab_size=96, num_heads=2, share_lm_head=shared))
        cfg = load_config(
            MedusaConfig,
            [
                "--medusa2",
                "true",
                "--num_heads",
                "2",
                "--heads_schedule",
                schedule,
                "--heads_coefficient",
                str(coefficient),
            ],
        )
        method = Medusa2Method(cfg, backbone, heads, kl=False)
        method.stage = StepContext(3, 7)
        return method, list(lora_tensors(backbone).values()), list(heads.parameters())

    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids).bool(),
    }
    plain, lora, heads = method_at("constant", 1.0)  # lambda = 1: nothing scaled, the unweighted gradients
    hidden, per_head = plain._per_head(batch)
    l0, heads_loss = plain._l0(batch, hidden), plain._heads_loss(per_head)[0]
    l0_lora = torch.autograd.grad(l0, lora, retain_graph=True, allow_unused=True)
    heads_grads = [
        g if g is not None else torch.zeros_like(p)
        for g, p in zip(torch.autograd.grad(heads_loss, lora + heads, allow_unused=True), lora + heads)
    ]
    lam = 0.5 * math.sin(3 / 7 * math.pi / 2)
    method, lora, heads = method_at("sine", 0.5)
    method.loss(batch, method.stage)[0].backward()
    lm_head_grads = 0
    for (name, p), a, b in zip(lora_tensors(method.backbone).items(), l0_lora, heads_grads):
        expected = (a if a is not None else 0) + lam * b
        torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-5)  # two sums in another order
        lm_head_grads += "lm_head" in name and b.abs().sum().item() > 0
    assert lm_head_grads == (2 if shared else 0)  # shared heads ask the lm_head's adapter for help too
    for p, expected in zip(heads, heads_grads[len(lora) :]):
        torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-5)  # two sums in another order


def test_resumed_medusa2_run_ends_like_an_uninterrupted_one(tiny_model_dir, text_data, tmp_path, monkeypatch):
    """Checkpoints hold the adapters and heads only (not the frozen target), and resuming restores both."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))

    def run_to(out, **extra):
        return train_medusa2(tiny_model_dir, text_data, out, **extra)

    check_resume(monkeypatch, Medusa2Method, run_to, tmp_path, "heads")
    saved = load_file(str(next((tmp_path / "full" / "checkpoints").glob("step-*")) / "model.safetensors"))
    assert saved and all("lora_" in n or n.startswith("heads.") for n in saved)
    full, resumed = (
        load_file(str(tmp_path / d / "adapter" / "adapter_model.safetensors")) for d in ("full", "resumed")
    )
    assert full.keys() == resumed.keys()
    for name, value in full.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_heads_lm_head_path_computes_what_the_adapted_lm_head_does(dtype):
    """The shared heads' own route through an adapted lm_head (which scales the adapter's gradient) gives
    peft's output, also for a bf16 target whose adapter peft keeps in float32 (validation runs without
    autocast)."""
    backbone = add_lora(tiny_model("llama").to(dtype), r=4, alpha=8, dropout=0.0)
    for name, p in lora_tensors(backbone).items():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)
    cfg = load_config(MedusaConfig, ["--medusa2", "true", "--num_heads", "2"])
    method = Medusa2Method(
        cfg,
        backbone,
        MedusaHeads(HeadsConfig(hidden_size=48, vocab_size=96, num_heads=2, share_lm_head=True)),
        kl=True,
    )
    method.stage = StepContext(1, 7)
    x = torch.randn(5, 48, dtype=dtype)
    for train in (True, False):
        backbone.train(train)
        with torch.no_grad():
            torch.testing.assert_close(method._logits(0, x), method.lm_head(x).float())
