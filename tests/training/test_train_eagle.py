import pytest
import torch
from safetensors.torch import load_file

import selfspec.train.data.eagle_features as eagle_features
import selfspec.train.eagle as eagle_recipe
from conftest import check_resume, tiny_model
from recipe_args import eagle_args
from selfspec.heads.eagle import EagleDraft
from selfspec.heads.registry import load_heads
from selfspec.infer.measure.tune import tune_eagle
from selfspec.train.data.eagle_features import cached_features, target_features, write_features
from selfspec.train.data.examples import examples_from_lists, pad_batch
from selfspec.train.data.features import FeatureShards, shard_path, write_safetensors
from selfspec.train.data.vocabulary import draft_vocabulary
from selfspec.train.eagle import run
from selfspec.train.loop.config import ConfigError, load_config
from selfspec.train.recipes.draft_shape import draft_vocab_size
from selfspec.train.recipes.eagle import EagleConfig, new_draft


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {
            "self_distill": True,
            "max_train_examples": 24,
            "mixed_precision": "bf16",
            "distill_prompt_tokens": 8,
        },
    ],
    ids=["fp32", "self-distill+bf16"],
)
def test_training_lowers_loss_changes_the_drafter_only(
    variant, tiny_model_dir, text_data, tmp_path, monkeypatch
):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "eagle"
    result = run(
        load_config(EagleConfig, eagle_args(tiny_model_dir, text_data, out, max_steps=12, **variant))
    )
    history = result["history"]
    assert history[-1][1]["loss"] < history[0][1]["loss"]
    trained = result["draft"].state_dict()
    assert set(trained) == set(result["initial"])
    unchanged = {
        name for name, before in result["initial"].items() if torch.equal(trained[name].cpu(), before.cpu())
    }
    # an RMSNorm gain may legitimately sit still for a few steps; every other parameter must move
    assert all(name.endswith("layernorm.weight") for name in unchanged), unchanged
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    target = result["target"].state_dict()
    assert set(target) == set(original)
    for name, param in target.items():
        assert torch.equal(param.cpu(), original[name].to(param.dtype)), f"target parameter {name} changed"
    loaded = load_heads(out)
    assert isinstance(loaded, EagleDraft)
    assert (loaded.config.depth, loaded.config.top_k, loaded.config.total_tokens) == (3, 2, 6)
    assert not any("embed" in name or "lm_head" in name for name in loaded.state_dict())


def test_cached_features_train_like_online_features(tiny_model_dir, text_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    few = {
        "noise": 0,
        "eval_batches": 1,
        "per_device_eval_batch_size": 2,
        "tune_prompts": 1,
        "eval_fraction": 0.1,
    }  # 10 validation examples, of which validation reads 2
    online = run(load_config(EagleConfig, eagle_args(tiny_model_dir, text_data, tmp_path / "a", **few)))
    cached = run(
        load_config(
            EagleConfig, eagle_args(tiny_model_dir, text_data, tmp_path / "b", cache_features=True, **few)
        )
    )
    printed = capsys.readouterr().out
    assert "caching target features for train" in printed and "GB on disk" in printed
    assert list((tmp_path / "cache").rglob("features-train-*/000000.safetensors"))
    for name, value in online["draft"].state_dict().items():
        torch.testing.assert_close(cached["draft"].state_dict()[name], value, rtol=1e-4, atol=1e-5)
    # only the validation examples validation reads are cached, and it reports what it reported online
    assert "caching target features for eval: 2 examples" in printed
    for (step_a, online_metrics), (step_b, cached_metrics) in zip(online["history"], cached["history"]):
        assert step_a == step_b
        for key in ("top1", "top5", "loss"):
            assert cached_metrics[key] == pytest.approx(online_metrics[key], rel=1e-4, abs=1e-5), key


def test_resume_after_interruption_matches_uninterrupted_run(
    tiny_model_dir, text_data, tmp_path, monkeypatch
):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))

    def run_to(out, **extra):
        return run(load_config(EagleConfig, eagle_args(tiny_model_dir, text_data, out, **extra)))

    check_resume(monkeypatch, eagle_recipe.EagleMethod, run_to, tmp_path, "draft")


def test_unknown_options_are_errors():
    with pytest.raises(ConfigError, match="unknown key.*'w_clss'.*Valid keys:.*w_cls"):
        load_config(EagleConfig, ["--w_clss", "0.2"])
    cfg = load_config(EagleConfig, ["--noise", "0.05", "--cache_features"])
    assert cfg.noise == 0.05 and cfg.cache_features is True


def test_training_fits_the_tree_when_none_is_given(tiny_model_dir, text_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    args = eagle_args(
        tiny_model_dir,
        text_data,
        tmp_path / "fit",
        max_steps=2,
        depth=0,
        top_k=0,
        total_tokens=0,
        tune_depths="2,3",
        tune_top_ks=2,
        tune_totals=4,
        tune_prompts=2,
        tune_new_tokens=8,
    )
    run(load_config(EagleConfig, args))
    printed = capsys.readouterr().out
    assert "dynamic tree fitted to this machine" in printed and printed.count("tokens/s") == 2
    chosen = next(line for line in printed.splitlines() if "<- chosen" in line)
    config = load_heads(tmp_path / "fit").config
    assert f"depth {config.depth:2d}  top_k  2  total_tokens   4" in chosen


def test_a_partly_fixed_tree_is_an_error():
    with pytest.raises(ValueError, match="all of depth, top_k and total_tokens"):
        load_config(EagleConfig, ["--depth", "4"])


def test_tune_measures_every_setting_and_keeps_the_fastest():
    model = tiny_model("llama")
    from eagle_drafts import random_draft

    draft = random_draft(model)
    prompts = [torch.randint(3, 90, (5,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    best, rows = tune_eagle(model, draft, prompts, [(2, 2, 3), (3, 2, 6)], max_new_tokens=12)
    assert [(r["depth"], r["top_k"], r["total_tokens"]) for r in rows] == [(2, 2, 3), (3, 2, 6)]
    assert best is max(rows, key=lambda r: r["tokens_per_s"])
    assert all(r["tau"] >= 1 and r["ms_per_step"] > 0 for r in rows)


def test_tune_takes_chat_prompts_that_hold_the_pad_id():
    model = tiny_model(
        "llama"
    )  # SmolLM2: pad id = <|im_end|>, which every chat prompt holds after its system turn
    from eagle_drafts import random_draft

    model.generation_config.pad_token_id = model.generation_config.eos_token_id = 7
    prompts = [torch.tensor([3, 9, 7, 11, 12, 7, 13])]
    best, rows = tune_eagle(model, random_draft(model), prompts, [(2, 2, 3)], max_new_tokens=6)
    assert rows[0]["tau"] >= 1


def test_eagle3_drafter_starts_with_the_targets_head_rows_of_its_vocabulary():
    model = tiny_model("llama")
    V = model.config.vocab_size
    ids = torch.randint(3, V, (6, 20), generator=torch.Generator().manual_seed(0))
    data = examples_from_lists(ids.tolist())
    draft = eagle_recipe.build_drafter(EagleConfig(version=3, draft_vocab_size=V // 4), model, data)
    assert torch.equal(
        draft.draft_ids, draft_vocabulary([(ids, torch.ones_like(ids))], V, V // 4).sort().values
    )
    assert draft.lm_head.weight.shape[0] == V // 4 and not torch.equal(draft.draft_ids, torch.arange(V // 4))
    torch.testing.assert_close(
        draft.lm_head.weight, model.get_output_embeddings().weight[draft.draft_ids], rtol=0, atol=0
    )


def test_an_eagle1_drafter_drafts_among_the_most_frequent_tokens_when_asked():
    """--draft_vocab_size N on EAGLE-1 keeps the N most frequent trained tokens (its d2t); unset, EAGLE-1
    drafts over the whole vocabulary (published loaders' layout) and EAGLE-3 takes a quarter of it (2048 to
    32768)."""
    model = tiny_model("llama")
    V = model.config.vocab_size
    ids = torch.randint(3, V, (6, 20), generator=torch.Generator().manual_seed(1))
    data = examples_from_lists(ids.tolist())
    draft = eagle_recipe.build_drafter(EagleConfig(draft_vocab_size=V // 4), model, data)
    assert draft.config.draft_vocab_size == V // 4
    assert torch.equal(
        draft.draft_ids, draft_vocabulary([(ids, torch.ones_like(ids))], V, V // 4).sort().values
    )
    assert eagle_recipe.build_drafter(EagleConfig(), model, data).config.draft_vocab_size == 0
    sizes = {
        v: draft_vocab_size(EagleConfig(version=3).draft_vocab_size, v) for v in (1000, 8192, 128256, 200000)
    }
    assert sizes == {1000: 0, 8192: 2048, 128256: 32064, 200000: 32768}
    assert draft_vocab_size(EagleConfig(version=3, draft_vocab_size=0).draft_vocab_size, 8192) == 0
    with pytest.raises(ConfigError, match="--draft_vocab_size must be >= 0"):
        EagleConfig(draft_vocab_size=-1)
    with pytest.raises(ConfigError, match="--draft_vocab_size 4 is below top_k 8"):
        EagleConfig(draft_vocab_size=4)  # the tree fit tries top_k 2, 4 and 8
    with pytest.raises(
        ConfigError, match=f"--draft_vocab_size {V + 1} is above the target's vocabulary of {V}"
    ):
        new_draft(EagleConfig(draft_vocab_size=V + 1), model)  # not silently the whole vocabulary


@pytest.mark.parametrize(
    "options, message",
    [
        ({"version": 3, "num_layers": 2}, "an EAGLE-3 drafter has one decoder layer and no fc bias"),
        ({"version": 3, "fc_bias": True}, "an EAGLE-3 drafter has one decoder layer and no fc bias"),
        ({"ttt_steps": 3}, "--ttt_steps and --feature_layers apply to EAGLE-3"),
        ({"feature_layers": [1, 2, 3]}, "--ttt_steps and --feature_layers apply to EAGLE-3"),
        (
            {"version": 3, "feature_layers": [5, 2, 4]},
            r"--feature_layers must be distinct .* got \[5, 2, 4\]",
        ),
        (
            {"version": 3, "feature_layers": [2, 2, 5]},
            r"--feature_layers must be distinct .* got \[2, 2, 5\]",
        ),
    ],
)
def test_options_a_version_would_ignore_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        EagleConfig(**options)


def test_fc_bias_defaults_to_each_versions_layout():
    assert EagleConfig().fc_bias is True and EagleConfig(version=3).fc_bias is False
    assert EagleConfig(fc_bias=False).fc_bias is False


def test_resuming_with_another_draft_vocabulary_is_refused_by_the_fingerprint():
    from types import SimpleNamespace

    from selfspec.train.data.fingerprints import run_fingerprint

    model = tiny_model("llama")
    V = model.config.vocab_size
    data = examples_from_lists(
        torch.randint(3, V, (6, 20), generator=torch.Generator().manual_seed(1)).tolist()
    )
    one = SimpleNamespace(num_processes=1)
    prints = [
        run_fingerprint(
            EagleConfig(draft_vocab_size=size),
            one,
            eagle_recipe.build_drafter(EagleConfig(draft_vocab_size=size), model, data),
            data,
        )
        for size in (V // 4, V // 2)
    ]
    assert (
        prints[0]["drafter_shapes_sha1"] == prints[1]["drafter_shapes_sha1"]
    )  # d2t is a buffer, not a parameter
    assert prints[0]["drafter_buffers_sha1"] != prints[1]["drafter_buffers_sha1"]


def test_the_demo_budget_follows_the_version_and_explicit_values_win():
    assert (EagleConfig().max_steps, EagleConfig().max_minutes) == (2400, 10.5)
    assert (EagleConfig(version=3).max_steps, EagleConfig(version=3).max_minutes) == (800, 20.0)
    given = load_config(EagleConfig, ["--version", "3", "--max_steps", "2400", "--max_minutes", "10.5"])
    assert (given.max_steps, given.max_minutes) == (2400, 10.5)


def variable_length_examples(n: int = 7):
    """`n` rows of 5, 7, 9, ... random tokens (conversations: no two of one length), their loss masks all
    1."""
    gen = torch.Generator().manual_seed(4)
    return examples_from_lists([torch.randint(3, 90, (5 + 2 * i,), generator=gen).tolist() for i in range(n)])


def straightforward_features(target, examples, layers=None) -> list[torch.Tensor]:
    """Each example's features computed alone, unpadded."""
    return [
        target_features(target, examples[i]["input_ids"][None].long(), None, layers)[0]
        for i in range(len(examples))
    ]


@pytest.mark.parametrize("layers", [None, [0, 1]], ids=["eagle", "eagle3"])
def test_feature_shards_written_by_two_ranks_equal_the_straightforward_features(
    layers, tmp_path, monkeypatch
):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    target, ex = tiny_model("llama"), variable_length_examples()
    cfg = EagleConfig(max_length=64, feature_shard_examples=2)
    folder, size = write_features(cfg, target, ex, "train", layers, rank=0, world=2, batch_size=3)
    assert sorted(p.name for p in folder.iterdir()) == [
        "000000.safetensors",
        "000002.safetensors",
    ]  # rank 0's
    with pytest.raises(RuntimeError, match="lacks 2 shard"):
        FeatureShards(folder, len(ex), size)
    assert write_features(cfg, target, ex, "train", layers, rank=1, world=2, batch_size=3) == (folder, size)
    assert len(list(folder.iterdir())) == 4
    shards = FeatureShards(folder, len(ex), size)
    for i, want in enumerate(straightforward_features(target, ex, layers)):
        assert shards(i).shape == want.shape == (len(ex[i]["input_ids"]), 48 * (3 if layers else 1))
        torch.testing.assert_close(shards(i), want, rtol=1e-4, atol=1e-4)


def test_a_partly_written_feature_cache_computes_only_what_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    target, ex = tiny_model("llama"), variable_length_examples()
    cfg = EagleConfig(max_length=64, feature_shard_examples=2)
    folder, size = write_features(cfg, target, ex, "train")
    assert "4 shards of 2 examples" in capsys.readouterr().out
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    shard_path(folder, 1).unlink()  # a crash: one shard never finished, its temporary file left behind
    stray = folder / f".{shard_path(folder, 1).name}.abc123"
    stray.write_bytes(b"half a shard")
    computed = []
    monkeypatch.setattr(
        eagle_features,
        "target_features",
        lambda t, ids, attn, layers: computed.append(ids.shape[0]) or target_features(t, ids, attn, layers),
    )
    assert write_features(cfg, target, ex, "train") == (folder, size)
    assert computed == [2] and "1 to write" in capsys.readouterr().out  # examples 2 and 3 only
    after = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert after.keys() == before.keys() and not stray.exists()
    assert all(after[name] == before[name] for name in before if name != "000001.safetensors")
    computed.clear()
    data = cached_features(
        EagleConfig(max_length=64), target, ex, "train"
    )  # another shard size: another cache
    assert computed == [7] and "1 shards of 4096 examples" in capsys.readouterr().out
    data = cached_features(EagleConfig(max_length=64), target, ex, "train")  # complete: only read
    assert computed == [7] and capsys.readouterr().out == ""
    want = straightforward_features(target, ex)
    batch = pad_batch([data[2], data[5]])
    assert batch["features"].shape == (2, 15, 48) and batch["features"][0, 9:].eq(0).all()
    torch.testing.assert_close(batch["features"][0, :9], want[2], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batch["features"][1], want[5], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_two_processes_write_the_feature_cache_together(tiny_model_dir, text_data, tmp_path, monkeypatch):
    """The real launch: each of 2 processes writes its shards, both train from all of them; the shards equal
    those one process writes."""
    from safetensors.torch import load_file as read_shard

    from distributed_runs import launch, run_args

    def shards(cache: str) -> dict[str, dict[str, torch.Tensor]]:
        return {
            p.name: read_shard(p) for p in sorted((tmp_path / cache).rglob("features-train-*/*.safetensors"))
        }

    extra = {"cache_features": "true", "feature_shard_examples": 8, "max_steps": 2, "eval_fraction": 0.1}
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "c2"))
    log = launch(
        "cpu-2proc", "eagle", run_args("eagle", tiny_model_dir, text_data, tmp_path / "two", 2, **extra)
    )
    assert "written by 2 process(es)" in log
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "c1"))
    launch(
        "cpu",
        "eagle",
        run_args("eagle", tiny_model_dir, text_data, tmp_path / "one", 4, **extra),
        processes=1,
    )
    two, one = shards("c2"), shards("c1")
    assert two.keys() == one.keys() and len(two) >= 4
    for name in one:
        assert one[name].keys() == two[name].keys()
        for key in one[name]:
            torch.testing.assert_close(two[name][key], one[name][key], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_shard_written_a_tensor_at_a_time_is_a_safetensors_file(dtype, tmp_path):
    tensors = {
        "3": torch.randn(5, 4).to(dtype),
        "4": torch.randn(1, 4).to(dtype),
        "5": torch.randn(2, 4).to(dtype),
    }
    path = str(tmp_path / "000001.safetensors")
    write_safetensors(path, {k: tuple(v.shape) for k, v in tensors.items()}, dtype, iter(tensors.values()))
    back = load_file(path)
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(back[name], tensor)
    with pytest.raises(ValueError, match=r"tensor 4: expected \(1, 4\)"):
        write_safetensors(path, {"3": (5, 4), "4": (1, 4)}, dtype, [tensors["3"], tensors["5"]])


def test_calibration_prompts_are_a_chats_turns_up_to_its_first_answer():
    """The tree is fitted on prompts as decoding gets them: a chat's tokens before its first trained token (a
    ChatML prompt's first 32 tokens are little more than its system prompt), plain text's first tokens."""
    import datasets

    from selfspec.train.data.examples import Examples
    from selfspec.train.recipes.feature_run import calibration_prompts

    rows = datasets.Dataset.from_dict(
        {
            "input_ids": [list(range(10, 50)), list(range(60, 100)), [7, 8]],
            "loss_mask": [[0] * 25 + [1] * 15, [1] * 40, [1, 1]],
        }
    )
    prompts = calibration_prompts(Examples(rows, "k"), 3, 8)
    assert [p.tolist() for p in prompts] == [list(range(10, 35)), list(range(60, 68)), [7, 8]]
