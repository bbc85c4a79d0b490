"""`selfspec draft-vocab`: an EAGLE-1/2 drafter restricted to a dataset's most frequent trained-on tokens,
without training (frequency-ranked drafting); decoding with it stays exact."""

import json

import datasets
import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cli_checks import user_error
from eagle3_drafts import eagle3_config
from selfspec.cli import main as cli
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.heads.registry import load_heads
from selfspec.infer.core.generate import SpeculativeModel

USER, ANSWER = "QQQQ QQQQ QQQQ QQQQ", "return a + b"


@pytest.fixture
def quiet_datasets():
    """No tokenising bar: it shares stderr with the one-line error checked."""
    datasets.disable_progress_bars()
    yield
    datasets.enable_progress_bars()


@pytest.fixture
def chats(tmp_path, monkeypatch):
    """Conversations whose user turns repeat tokens the assistant never writes."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "chats.jsonl"
    record = {"messages": [{"role": "user", "content": USER}, {"role": "assistant", "content": ANSWER}]}
    path.write_text("\n".join(json.dumps(record) for _ in range(40)) + "\n")
    return path


def test_the_drafter_drafts_among_the_answers_tokens_only_and_decodes_exactly(
    eagle_dir, tiny_model_dir, chats, tmp_path, capsys
):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # what the chat template adds for the answer (its header, the text, the end of turn): the trained-on
    # tokens
    answer = set(tokenizer("<|assistant|>" + ANSWER + "<eos>", add_special_tokens=False).input_ids)
    user = set(tokenizer(USER, add_special_tokens=False).input_ids) - answer
    assert user
    out = tmp_path / "restricted"
    cli(
        [
            "draft-vocab",
            "--heads",
            str(eagle_dir),
            "--dataset",
            str(chats),
            "--size",
            str(len(answer)),
            "--out",
            str(out),
        ]
    )
    assert f"drafting among {len(answer)} of" in capsys.readouterr().out
    before, after = load_heads(eagle_dir), load_heads(out)
    assert after.config.draft_vocab_size == len(answer)
    assert set(after.draft_ids.tolist()) == answer
    weights = after.state_dict()
    assert weights.pop("d2t") is not None and weights.keys() == before.state_dict().keys()
    assert all(torch.equal(v, before.state_dict()[k]) for k, v in weights.items())

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    spec = SpeculativeModel.from_pretrained(out, model=model)
    drafted = []
    propose = spec.proposer.propose
    spec.proposer.propose = lambda *a: (
        ds := propose(*a),
        drafted.extend(t for d in ds if d for t in d.tokens[1:].tolist()),
    )[0]
    prompt = torch.tensor([tokenizer("def add(a, b):\n    return").input_ids])
    want = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=[])
    assert torch.equal(spec.generate(prompt, max_new_tokens=20, eos_token_id=[]), want)
    assert drafted and set(drafted) <= answer


def test_a_published_drafter_is_restricted_for_the_target_given(eagle_dir, tiny_model_dir, chats, tmp_path):
    published = tmp_path / "safeailab"
    cli(
        [
            "export",
            "--heads",
            str(eagle_dir),
            "--format",
            "eagle1",
            "--model",
            str(tiny_model_dir),
            "--out",
            str(published),
        ]
    )
    out = tmp_path / "restricted"
    cli(
        [
            "draft-vocab",
            "--heads",
            str(published),
            "--model",
            str(tiny_model_dir),
            "--dataset",
            str(chats),
            "--size",
            "8",
            "--out",
            str(out),
        ]
    )  # published layouts keep no tree: the default top_k 8
    heads = load_heads(out)
    assert heads.config.draft_vocab_size == 8 and heads.config.base_model == str(tiny_model_dir)


def test_a_half_precision_drafter_stays_in_its_dtype_and_can_be_restricted_again(eagle_dir, chats, tmp_path):
    half = tmp_path / "bf16"
    drafter = load_heads(eagle_dir)
    drafter.config.dtype = "bfloat16"
    drafter.to(torch.bfloat16).save_pretrained(half)
    first, second = tmp_path / "first", tmp_path / "second"
    cli(["draft-vocab", "--heads", str(half), "--dataset", str(chats), "--size", "4", "--out", str(first)])
    cli(["draft-vocab", "--heads", str(first), "--dataset", str(chats), "--size", "8", "--out", str(second)])
    for out, size in ((first, 4), (second, 8)):
        weights = safetensors.torch.load_file(out / "model.safetensors")
        assert {v.dtype for k, v in weights.items() if k != "d2t"} == {torch.bfloat16}
        heads = load_heads(out)
        assert heads.config.draft_vocab_size == size and heads.draft_ids.numel() == size
    assert set(load_heads(first).draft_ids.tolist()) < set(load_heads(second).draft_ids.tolist())


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--size", "0"], "--size: must be an integer >= 1, got 0"),
        (["--size", "100000"], "--size 100000 must be below the target's vocabulary size (96)"),
        (
            [],
            (
                "the target's vocabulary has only 96 tokens, at most the default size 2048: "
                "give a --size below 96"
            ),
        ),
        (["--size", "2"], "--size 2 is fewer tokens than the drafter's tree takes per node (3, its top_k"),
        (["--size", "60"], "holds only 16 distinct trained-on tokens, fewer than --size 60: give more data"),
    ],
)
def test_bad_sizes_are_one_line_errors(eagle_dir, chats, tmp_path, extra, message, capsys, quiet_datasets):
    argv = [
        "draft-vocab",
        "--heads",
        str(eagle_dir),
        "--dataset",
        str(chats),
        "--out",
        str(tmp_path / "o"),
        *extra,
    ]
    assert message in user_error(capsys, argv)


def test_what_cannot_be_restricted_is_refused_in_one_line(
    medusa_dir, eagle_dir, tiny_model_dir, chats, tmp_path, capsys
):
    out = ["--size", "16", "--out", str(tmp_path / "o")]
    assert (
        "are medusa heads; draft-vocab restricts drafters that read rows of the target's lm_head, "
        "such as EAGLE-1/2 (they draft over"
        in user_error(capsys, ["draft-vocab", "--heads", str(medusa_dir), "--dataset", str(chats), *out])
    )
    eagle3 = tmp_path / "eagle3"
    Eagle3Draft(eagle3_config(AutoModelForCausalLM.from_pretrained(tiny_model_dir))).save_pretrained(eagle3)
    capsys.readouterr()  # the model's loading bar
    assert (
        "are eagle3 heads; draft-vocab restricts drafters that read rows of the target's lm_head, "
        "such as EAGLE-1/2 (they learn"
        in user_error(capsys, ["draft-vocab", "--heads", str(eagle3), "--dataset", str(chats), *out])
    )
    assert "already holds a checkpoint" in user_error(
        capsys, ["draft-vocab", "--heads", str(eagle_dir), "--dataset", str(chats), "--out", str(eagle_dir)]
    )
    assert f"{chats} is a file, not a folder: give a folder path" in user_error(
        capsys,
        ["draft-vocab", "--heads", str(eagle_dir), "--dataset", str(chats), "--out", str(chats / "sub")],
    )
    assert "give a drafter's folder, not a model's" in user_error(
        capsys, ["draft-vocab", "--heads", str(tiny_model_dir), "--dataset", str(chats), *out]
    )
    # another model's tokenizer would count other ids: a model of another hidden size is refused
    other = tmp_path / "other-model"
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(other)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"hidden_size": 2 * config["hidden_size"]}))
    assert "does not fit the drafter (hidden size" in user_error(
        capsys,
        ["draft-vocab", "--heads", str(eagle_dir), "--model", str(other), "--dataset", str(chats), *out],
    )
    # a published drafter names no target
    published = tmp_path / "safeailab"
    cli(
        [
            "export",
            "--heads",
            str(eagle_dir),
            "--format",
            "eagle1",
            "--model",
            str(tiny_model_dir),
            "--out",
            str(published),
        ]
    )
    capsys.readouterr()
    assert "pass --model" in user_error(
        capsys, ["draft-vocab", "--heads", str(published), "--dataset", str(chats), *out]
    )
    assert not (tmp_path / "o").exists()


def test_a_published_token_map_restricts_a_published_drafter(eagle_dir, tiny_model_dir, tmp_path):
    """The FR-Spec / SGLang token map (token ids, most frequent first) instead of a dataset: export writes one
    for SGLang, and draft-vocab reads it back onto the published layout; --size keeps its first tokens."""
    from selfspec.heads.formats.eagle import export_eagle, import_eagle

    ours = load_heads(eagle_dir).with_draft_vocab(torch.tensor([5, 9, 17, 33, 40, 41, 60, 88]))
    published = tmp_path / "sglang"
    with pytest.warns(UserWarning, match="--speculative-token-map"):
        export_eagle(
            ours, "sglang-eagle", published, torch.randn(ours.config.vocab_size, ours.config.hidden_size)
        )
    assert torch.equal(import_eagle(published).draft_ids, ours.draft_ids)  # imported with its token map
    out = tmp_path / "restricted"
    cli(
        [
            "draft-vocab",
            "--heads",
            str(published),
            "--model",
            str(tiny_model_dir),
            "--token-map",
            str(published / "token_map.pt"),
            "--out",
            str(out),
        ]
    )
    assert torch.equal(load_heads(out).draft_ids, ours.draft_ids)
    ranked = tmp_path / "freq.pt"
    torch.save([70, 3, 12, 50, 7, 2], ranked)  # a list, most frequent first, as FR-Spec publishes them
    cli(
        [
            "draft-vocab",
            "--heads",
            str(eagle_dir),
            "--token-map",
            str(ranked),
            "--size",
            "4",
            "--out",
            str(tmp_path / "first4"),
        ]
    )
    assert load_heads(tmp_path / "first4").draft_ids.tolist() == [3, 12, 50, 70]


@pytest.mark.parametrize(
    "content, message",
    [
        ("not a torch file", "cannot read it as a list of token ids"),
        (
            torch.ones(2, 3, dtype=torch.long),
            "holds a torch.int64 tensor of shape (2, 3): it must be a 1-D list",
        ),
        ([1.5, 2.5, 3.5], "holds a torch.float32 tensor"),
        ([1, 2, 3, 400], "token ids outside the target's vocabulary (0..95): it was made for another model"),
        ([1, 2, 3, 3], "repeats token ids"),
        ([1, 2], "holds 2 tokens, fewer than the drafter's tree takes per node (3"),
    ],
)
def test_a_bad_token_map_is_one_line(eagle_dir, tmp_path, content, message, capsys):
    path = tmp_path / "map.pt"
    if isinstance(content, str):
        path.write_text(content)
    else:
        torch.save(content, path)
    argv = ["draft-vocab", "--heads", str(eagle_dir), "--token-map", str(path), "--out", str(tmp_path / "o")]
    assert message in user_error(capsys, argv)
    assert not (tmp_path / "o").exists()


def test_the_source_is_a_dataset_or_a_token_map(eagle_dir, chats, tmp_path, capsys):
    out = ["--out", str(tmp_path / "o")]
    assert "give --dataset" in user_error(capsys, ["draft-vocab", "--heads", str(eagle_dir), *out])
    assert "not allowed with argument" in user_error(
        capsys,
        ["draft-vocab", "--heads", str(eagle_dir), "--dataset", str(chats), "--token-map", "x.pt", *out],
    )
