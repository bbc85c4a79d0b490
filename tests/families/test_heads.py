import pytest
import torch

from conftest import VOCAB, tiny_model
from selfspec.heads.config import HeadsConfig, check_compatible
from selfspec.heads.medusa import MedusaHeads
from selfspec.heads.registry import load_heads


def make(num_layers=2, share=False):
    return MedusaHeads(
        HeadsConfig(
            hidden_size=48,
            vocab_size=VOCAB,
            num_heads=3,
            num_layers=num_layers,
            share_lm_head=share,
            base_model="tiny",
        )
    )


def test_blocks_are_separate_modules_and_start_as_identity():
    heads = make()
    blocks = [b for head in heads.heads for b in head[:-1]]
    assert len({id(b.linear.weight) for b in blocks}) == 6
    block = heads.heads[0][0]
    assert torch.count_nonzero(block.linear.weight) == 0  # W starts at zero: the block adds only SiLU(b)
    x = torch.randn(5, 48)
    torch.testing.assert_close(block(x), x + torch.nn.functional.silu(block.linear.bias))


def test_projection_starts_as_the_target_lm_head():
    model = tiny_model("llama")
    heads = make(num_layers=1)
    heads.init_from_lm_head(model.get_output_embeddings())
    for head in heads.heads:
        assert torch.equal(head[-1].weight, model.get_output_embeddings().weight)
    logits = heads(torch.randn(2, 48))
    assert len(logits) == 3 and logits[0].shape == (2, VOCAB)


def test_shared_lm_head_has_no_projection_and_needs_the_lm_head():
    model = tiny_model("llama")
    heads = make(share=True)
    assert not any(n.endswith(f"{2}.weight") and "linear" not in n for n, _ in heads.named_parameters())
    with pytest.raises(ValueError, match="lm_head"):
        heads(torch.randn(2, 48))
    assert torch.stack(heads(torch.randn(2, 48), model.get_output_embeddings())).shape == (3, 2, VOCAB)


@pytest.mark.parametrize("share", [False, True])
def test_drafting_runs_the_stacked_heads_as_forward_does(tmp_path, share):
    """`draft_logits` runs the K heads as one batched matmul per layer over weights stacked in place: the
    logits are forward's, the parameters keep their names, values and objects, and a cast re-stacks."""
    model = tiny_model("llama")
    heads = make(share=share)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.2)
    before = {name: (p, p.detach().clone()) for name, p in heads.named_parameters()}
    hidden, lm_head = torch.randn(4, 48), model.get_output_embeddings()
    expected = torch.stack(heads(hidden, lm_head))
    torch.testing.assert_close(heads.draft_logits(hidden, lm_head), expected)
    stacked = heads.stacked()
    assert stacked.blocks[0][0].shape == (3, 48, 48) and (stacked.projection is None) == share
    for name, p in heads.named_parameters():
        assert p is before[name][0] and torch.equal(p, before[name][1])
    assert heads.heads[1][0].linear.weight.data_ptr() == stacked.blocks[0][0][1].data_ptr()  # a view, no copy
    heads.save_pretrained(tmp_path)
    assert torch.equal(load_heads(tmp_path).heads[2][1].linear.weight, heads.heads[2][1].linear.weight)
    heads.double()
    assert heads.stacked() is not stacked
    torch.testing.assert_close(
        heads.draft_logits(hidden.double(), lm_head.double()), expected.double(), atol=1e-5, rtol=1e-4
    )


def test_stacking_under_inference_mode_leaves_the_heads_trainable_and_a_cast_lets_go():
    heads = make(num_layers=1)
    with torch.inference_mode():
        heads.draft_logits(torch.randn(2, 48))
    loss = sum(logits.sum() for logits in heads(torch.randn(2, 48)))
    loss.backward()  # parameters re-homed inside inference mode could not be saved for backward
    assert heads.heads[0][0].linear.weight.grad is not None
    heads.half()
    assert heads._stacked is None  # not the float32 copies until the next draft


def test_save_load_round_trip(tmp_path):
    heads = make()
    for p in heads.parameters():
        torch.nn.init.normal_(p)
    heads.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "model.safetensors", "README.md"}
    loaded = load_heads(tmp_path)
    assert loaded.config == heads.config
    for name, value in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value)
    assert "base_model: tiny" in (tmp_path / "README.md").read_text()


def test_load_rejects_weights_that_do_not_match_config(tmp_path):
    make(num_layers=2).save_pretrained(tmp_path)
    cfg = (tmp_path / "config.json").read_text().replace('"num_layers": 2', '"num_layers": 1')
    (tmp_path / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="missing|unexpected"):
        load_heads(tmp_path)


def test_config_rejects_unknown_keys_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="unknown key.*medusa_num_heads"):
        HeadsConfig.from_dict({"medusa_num_heads": 5})
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_heads(tmp_path)


def test_mismatched_target_names_both_sizes():
    heads = make()
    other = tiny_model("llama", vocab=VOCAB + 4)
    with pytest.raises(ValueError, match=rf"vocabulary size {VOCAB} .* has {VOCAB + 4}"):
        check_compatible(heads.config, other)
    wide = MedusaHeads(HeadsConfig(hidden_size=64, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="hidden size 64 .* hidden size 48"):
        check_compatible(wide.config, tiny_model("llama"))


def test_heads_claiming_another_base_model_fail_clearly(tmp_path):
    from transformers import LlamaConfig

    from conftest import tiny_model
    from selfspec.heads.config import check_compatible

    named = tmp_path / "trained-on"
    LlamaConfig(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
    ).save_pretrained(named)
    config = HeadsConfig(base_model=str(named), hidden_size=48, vocab_size=96)
    with pytest.raises(ValueError, match=r"trained on .*trained-on.*num_hidden_layers 4 vs 2"):
        check_compatible(config, tiny_model("llama"))
    check_compatible(
        HeadsConfig(base_model="someone/not-on-this-machine", hidden_size=48, vocab_size=96),
        tiny_model("llama"),
    )  # unknown here: the shapes are all that can be checked
