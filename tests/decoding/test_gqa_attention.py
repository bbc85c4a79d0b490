"""The target's attention without repeat_kv's KV copy (`infer.attention`, `heads.gqa`): the same logits and
features as transformers' own sdpa on every architecture, for prompts and trees, alone and batched; the same
greedy tokens as model.generate; no byte of the cache copied; the user's model left as it was."""

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv

import selfspec.heads.gqa as gqa
import selfspec.infer.core.attention as attention
from batch_rows import batch_prompts, drafter, left_padded
from conftest import VOCAB, tiny_model
from dflash_drafts import proposer as dflash_proposer
from dflash_drafts import random_draft as random_dflash
from selfspec.heads.gqa import ALIGN, fold_mask, grouped_sdpa
from selfspec.infer.core.cache import WIDTH_STEP, new_cache
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.core.mask import RowMask
from selfspec.infer.core.target import Target
from selfspec.infer.drafters.draft_model import DraftModelProposer
from selfspec.infer.measure.kv_bytes import CopyCounter, storages


@pytest.fixture(params=["native", "folded"])
def path(request, monkeypatch) -> str:
    """Both ways round the copy: the CPU's own grouped kernel, and the fold CUDA takes (forced here)."""
    monkeypatch.setattr(gqa, "native_gqa", lambda *device: request.param == "native")
    return request.param


def reference(query, key, value, mask, scale):
    """What transformers' sdpa computes: the keys and values repeated per query head."""
    groups = query.shape[1] // key.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask, scale=scale
    )


@pytest.mark.parametrize("fold", [False, True, "repeat"])
@pytest.mark.parametrize("kind", ["bool", "additive", "broadcast"])
def test_grouped_sdpa_equals_repeated_keys(fold, kind, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, t, 8, generator=gen) for h, t in ((6, 5), (2, 37), (2, 37)))  # G = 3, S = 37
    visible = torch.rand(2 if kind != "broadcast" else 1, 1, 5, 37, generator=gen) < 0.7
    visible[..., 0] = True  # every query sees something
    mask = visible if kind != "additive" else torch.where(visible, 0.0, torch.finfo(torch.float32).min)
    if fold == "repeat":  # what a long prompt takes off the CPU: the fold would copy more than the keys
        monkeypatch.setattr(gqa, "native_gqa", lambda *device: False)
        monkeypatch.setattr(gqa, "folds_cheaper", lambda *args: False)
    out = grouped_sdpa(q, k, v, mask, 0.3, fold=None if fold == "repeat" else fold)
    torch.testing.assert_close(out, reference(q, k, v, mask, 0.3), atol=1e-6, rtol=0)


def test_folded_mask_rows_repeat_per_group_with_an_aligned_row_stride():
    mask = torch.rand(2, 1, 5, 37) < 0.5
    folded = fold_mask(mask, 3)
    assert folded.shape == (2, 1, 15, 37) and folded.stride(-2) % ALIGN == 0
    assert torch.equal(folded.view(2, 1, 3, 5, 37), mask[:, :, None].expand(2, 1, 3, 5, 37))


def prefill_and_tree(target: Target, model, ids: torch.Tensor, start: torch.Tensor | None):
    """Prompt logits and features, then one tree's (two branches below a chain) on top, batched."""
    B, T = ids.shape
    cache = new_cache(model, T + 8)
    logits, features = target.prefill_rows(ids, cache, start)
    start = start if start is not None else torch.zeros(B, dtype=torch.long)
    mask = RowMask(B, 5, cache.max_length, target.dtype, target.device)
    mask.open(start, T)
    ancestors = torch.ones(5, 5, dtype=torch.bool).tril()
    ancestors[3, 2] = ancestors[4, 2] = False  # nodes 2 and 3 are siblings below node 1; node 4 is 3's child
    tokens = torch.randint(3, VOCAB, (B, 5), generator=torch.Generator().manual_seed(1))
    positions = (T - start)[:, None] + torch.tensor([0, 1, 2, 2, 3])
    tree_logits, tree_features = target.verify_rows(
        tokens, positions, mask.at(T, ancestors.expand(B, 5, 5)), cache
    )
    return logits, features, tree_logits, tree_features, cache


@pytest.mark.parametrize("start", [None, [0], [0, 3, 6]], ids=["one", "one-masked", "padded-batch"])
def test_logits_and_features_equal_transformers_sdpa(arch, path, start):
    model = tiny_model(arch)
    start = None if start is None else torch.tensor(start)
    ids = torch.randint(
        3, VOCAB, (1 if start is None else len(start), 9), generator=torch.Generator().manual_seed(0)
    )
    grouped = prefill_and_tree(Target(model), model, ids, start)
    plain = prefill_and_tree(Target(model, grouped_attention=False), model, ids, start)
    for a, b in zip(grouped[:4], plain[:4]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    cache = grouped[4]
    for (
        layer
    ) in cache.layers:  # padding's keys and values are finite: a masked NaN still poisons a weighted sum
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()
    assert model.config._attn_implementation == "sdpa"  # switched for our forwards only


def test_grouped_attention_runs_and_copies_no_cache_bytes(path):
    model = tiny_model("llama")  # 4 heads over 2 key/value heads
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    copied = {}
    for grouped in (True, False):
        target = Target(model, grouped_attention=grouped)
        cache = new_cache(model, 17)
        target.prefill_rows(ids, cache)
        mask = RowMask(2, 4, cache.max_length, target.dtype, target.device)
        mask.open(torch.zeros(2, dtype=torch.long), 9)
        block = mask.at(9, torch.ones(2, 4, 4, dtype=torch.bool).tril())
        with CopyCounter(storages(cache)) as counter:
            target.verify_rows(ids[:, :4], torch.arange(9, 13).expand(2, 4), block, cache)
        copied[grouped] = counter.bytes
    # repeat_kv: each of 2 layers' keys and values (2, 4 heads, 13 filled, 12) float32, copied once
    assert copied == {True: 0, False: 2 * 2 * 2 * 4 * 13 * 12 * 4}


@pytest.mark.parametrize("kind", ["eagle", "self"])
def test_greedy_decoding_equals_generate(arch, path, kind):
    """A random EAGLE tree (rejections, siblings), and the target drafting for itself (every node accepted:
    the cache and positions many nodes deep)."""
    model = tiny_model(arch)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (6, 2, 9)]
    ids, mask = left_padded(prompts)
    proposer = drafter(model, kind) if kind != "self" else DraftModelProposer(tiny_model(arch), 3, VOCAB)
    spec = SpeculativeModel(model, proposer)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[])
    expected = model.generate(
        ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert torch.equal(out, expected)
    assert max(spec.last_stats.accept_lengths) >= {"eagle": 1, "self": 4}[kind]  # self: root + 3 drafted


def transposed_layout(sdpa):
    """SDPA as CUDA's memory-efficient kernel returns it: (B, H, T, D) values over (B, T, H, D) memory
    (torch's meta kernel for `_scaled_dot_product_efficient_attention` gives these strides)."""

    def kernel(*args, **kwargs):
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    return kernel


@pytest.mark.parametrize("mask_rows, layout", [(5, "transposed"), (1, "contiguous")])
def test_the_fold_takes_any_output_layout_and_a_one_row_mask(mask_rows, layout, monkeypatch):
    """CUDA's memory-efficient output ((B, T, H, D) memory): `.view` on it raised 'view size is not
    compatible' on every grouped-query target. DFlash's (B, 1, 1, S) mask (every block position sees the same
    columns): folding its one row instead of the block's T failed with 'The size of tensor a (64) must match
    the size of tensor b'."""
    if layout == "transposed":
        monkeypatch.setattr(
            torch.nn.functional,
            "scaled_dot_product_attention",
            transposed_layout(torch.nn.functional.scaled_dot_product_attention),
        )
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, t, 8, generator=gen) for h, t in ((6, 5), (2, 37), (2, 37)))
    mask = torch.rand(2, 1, mask_rows, 37, generator=gen) < 0.7
    mask[..., 0] = True
    torch.testing.assert_close(
        grouped_sdpa(q, k, v, mask, 0.3, fold=True), reference(q, k, v, mask, 0.3), atol=1e-6, rtol=0
    )


def test_cuda_backends_are_asked_which_takes_grouped_heads_under_a_mask(monkeypatch):
    """Memory-efficient first where it takes `enable_gqa` under a mask, else cuDNN, else None (then the fold):
    SDPA ranks math above cuDNN, so the grouped call names the backend it found."""
    params = torch.backends.cuda.SDPAParams(
        torch.zeros(1, 8, 4, 64),
        torch.zeros(1, 2, 16, 64),
        torch.zeros(1, 2, 16, 64),
        torch.ones(1, 1, 4, 16, dtype=torch.bool),
        0.0,
        False,
        True,
    )
    for efficient, cudnn, expected in (
        (True, True, "EFFICIENT_ATTENTION"),
        (False, True, "CUDNN_ATTENTION"),
        (False, False, None),
    ):
        monkeypatch.setattr(torch.backends.cuda, "can_use_efficient_attention", lambda p, e=efficient: e)
        monkeypatch.setattr(torch.backends.cuda, "can_use_cudnn_attention", lambda p, c=cudnn: c)
        found = gqa.fused_backend(params)
        assert (found.name if found is not None else None) == expected
    assert gqa.gqa_backend(torch.device("cpu")) is None and gqa.native_gqa(torch.device("cpu"))


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "dflash"])
def test_drafters_draft_the_same_trees_on_either_path(kind, batch, monkeypatch):
    """The drafters' own attention (heads.gqa) folded as on CUDA, with the memory-efficient kernel's output
    layout, every drafter's mask shape, one row and a padded batch: the same acceptance step by step (the
    trees the drafter proposed), not only the same tokens."""
    model = tiny_model("qwen2")
    prompts = (
        batch_prompts(3)[:batch]
        if batch > 1
        else [torch.randint(3, VOCAB, (7,), generator=torch.Generator().manual_seed(3))]
    )
    ids, attention_mask = left_padded(prompts)
    runs = {}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for native in (True, False):
        monkeypatch.setattr(gqa, "native_gqa", lambda *device, native=native: native)
        monkeypatch.setattr(
            torch.nn.functional, "scaled_dot_product_attention", sdpa if native else transposed_layout(sdpa)
        )
        proposer = drafter(model, kind) if kind != "dflash" else dflash_proposer(model, random_dflash(model))
        spec = SpeculativeModel(model, proposer)
        out = spec.generate(
            ids, attention_mask=attention_mask, max_new_tokens=24, eos_token_id=[], pad_token_id=0
        )
        runs[native] = out, spec.last_stats.accept_lengths
    assert torch.equal(runs[True][0], runs[False][0]) and runs[True][1] == runs[False][1]


def test_what_it_does_not_cover_goes_to_transformers_sdpa():
    """Softcapping (Gemma-2) is not folded: transformers' sdpa refuses it as it always has."""
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    with pytest.raises(ValueError, match="softcap"):
        attention.grouped_sdpa_attention(module, q, k, k, torch.zeros(1, 1, 3, 5), softcap=30.0)


def test_eager_targets_keep_eager_and_the_switch_undoes_itself_on_errors():
    eager = tiny_model("llama", attn="eager")
    Target(eager).prefill_rows(torch.tensor([[5, 6, 7]]), new_cache(eager, 8), hidden=False)
    assert eager.config._attn_implementation == "eager"
    model = tiny_model("llama")
    with pytest.raises(RuntimeError), attention.using_grouped_attention(attention.model_configs(model)):
        assert model.config._attn_implementation == attention.ATTENTION
        raise RuntimeError
    assert model.config._attn_implementation == "sdpa"


def test_cache_and_mask_widths_are_multiples_of_16():
    model = tiny_model("llama")
    cache = new_cache(model, 21)
    assert cache.max_length == 32 == 2 * WIDTH_STEP
    Target(model).prefill_rows(torch.tensor([[5, 6, 7]]), cache, hidden=False)
    assert all(layer.keys.stride(1) % (WIDTH_STEP * layer.keys.shape[-1]) == 0 for layer in cache.layers)
    mask = RowMask(1, 4, cache.max_length, torch.float32, "cpu").at(3, torch.ones(1, 4, 4, dtype=torch.bool))
    assert mask.shape[-1] == 7 and mask.stride(-2) % WIDTH_STEP == 0  # the view's rows stay aligned


def test_kv_bytes_script_reports_the_copy_before_and_none_after(tmp_path):
    import json

    from selfspec.infer.measure.kv_bytes import main

    main(["--context", "32", "--tree", "8", "--layers", "1", "--out", str(tmp_path / "kv.json")])
    result = json.loads((tmp_path / "kv.json").read_text())
    # one layer's keys and values repeated to 16 heads of 64 over the 32 + 8 filled columns, float32
    assert result["sdpa"]["kv_copied"] == 2 * 16 * 40 * 64 * 4
    assert result["selfspec_sdpa"]["kv_copied"] == result["selfspec_sdpa_folded"]["kv_copied"] == 0
