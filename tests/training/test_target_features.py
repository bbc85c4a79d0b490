"""Prefill and verification keep only the hidden states the drafter reads (not every layer's), and those are
exactly what output_hidden_states gives: the last hidden states, or EAGLE-3's chosen layers."""

import pytest
import torch

from conftest import VOCAB, prefill_one, tiny_model, verify_one
from selfspec.infer.core.cache import new_cache
from selfspec.infer.core.target import Target
from selfspec.infer.core.tree import tree_from_choices


@pytest.mark.parametrize("layers", [None, [0, 1], [1, 1, 0]])
def test_features_equal_output_hidden_states_without_asking_for_them(arch, layers, monkeypatch):
    model = tiny_model(arch)
    target = Target(model, layers)
    asked = []
    forward = model.forward
    monkeypatch.setattr(
        model, "forward", lambda *a, **k: asked.append(k.get("output_hidden_states")) or forward(*a, **k)
    )
    prompt = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    cache = new_cache(model, 32)
    logits, features = prefill_one(target, prompt, cache)
    tree = tree_from_choices([[0], [1], [0, 0]])
    tokens = torch.tensor([5, 6, 7, 8])
    node_logits, node_features = verify_one(target, tokens, tree, 9, cache)
    assert asked == [None, None]  # the model never builds every layer's hidden states

    with torch.no_grad():
        ref = model(torch.cat([prompt[0], tokens[:1]])[None], output_hidden_states=True)
    hs = ref.hidden_states
    want = hs[-1][0] if layers is None else torch.cat([hs[i][0] for i in layers], dim=-1)
    torch.testing.assert_close(features, want[:9], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        node_features[0], want[9], atol=1e-5, rtol=1e-5
    )  # the root, verified after the prompt
    torch.testing.assert_close(logits, ref.logits[0, 8], atol=1e-5, rtol=1e-5)
    assert features.shape[-1] == model.config.hidden_size * (1 if layers is None else len(layers))


def test_the_last_layer_or_an_unknown_one_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="must be hidden_states indices 0..1"):
        Target(model, [2])
