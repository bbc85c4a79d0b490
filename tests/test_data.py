import json

import pytest
import torch

from conftest import TOKENIZER_TEXT, tiny_model, tiny_tokenizer
from train.data import DataError, build_examples, chat_example, load_examples, load_records
from train.distill import regenerate


def test_text_is_packed_with_eos_between_documents(tmp_path):
    tok = tiny_tokenizer()
    (tmp_path / "a.txt").write_text(TOKENIZER_TEXT)
    (tmp_path / "b.txt").write_text(TOKENIZER_TEXT)
    ex = build_examples(load_records(str(tmp_path)), tok, 16)
    stream = tok(TOKENIZER_TEXT, add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert ex["input_ids"][0].tolist() == stream[:16]
    assert ex["loss_mask"].all() and ex["attention_mask"].all()
    assert ex["input_ids"].shape[0] == (2 * len(stream)) // 16


def test_chat_loss_mask_covers_assistant_turns_only(tmp_path):
    tok = tiny_tokenizer()
    msgs = [{"role": "user", "content": "add a b"}, {"role": "assistant", "content": "return a + b"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "x = 1"}]
    ids, mask = chat_example(tok, msgs)
    assert len(ids) == len(mask)
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "<|assistant|>return a + b<eos><|assistant|>x = 1<eos>"
    sharegpt = tmp_path / "chats.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": "add a b"},
                                                       {"from": "gpt", "value": "return a + b"}]}]))
    openai = tmp_path / "chats.jsonl"
    openai.write_text(json.dumps({"messages": msgs[:2]}) + "\n")
    a = build_examples(load_records(str(sharegpt)), tok, 64)
    b = build_examples(load_records(str(openai)), tok, 64)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    assert a["attention_mask"].sum() < 64  # right padding is masked out


def test_bad_inputs_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_records(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(DataError, match="need a `text`, `messages` or `conversations`"):
        load_records(str(bad))
    tok = tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(DataError, match="chat template"):
        chat_example(tok, [{"role": "user", "content": "hi"}])
    with pytest.raises(DataError, match="no example of 4096 tokens"):
        build_examples([{"text": "short"}], tiny_tokenizer(), 4096)


def test_tokenised_data_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "code.txt"
    data.write_text(TOKENIZER_TEXT * 5)
    first = load_examples(str(data), tiny_tokenizer(), 16)
    assert len(list((tmp_path / "cache" / "tokenized").glob("*.pt"))) == 1
    again = load_examples(str(data), tiny_tokenizer(), 16)
    assert torch.equal(first["input_ids"], again["input_ids"])
    data.write_text(TOKENIZER_TEXT * 6)  # a changed file is a new cache entry
    load_examples(str(data), tiny_tokenizer(), 16)
    assert len(list((tmp_path / "cache" / "tokenized").glob("*.pt"))) == 2


def test_self_distillation_keeps_prompts_and_regenerates_the_rest():
    model = tiny_model("llama")
    ids = torch.randint(3, 90, (3, 12), generator=torch.Generator().manual_seed(0))
    ex = {"input_ids": ids, "loss_mask": torch.ones_like(ids).bool(), "attention_mask": torch.ones_like(ids)}
    out = regenerate(model, ex, prompt_tokens=4, batch_size=2, show_progress=False)
    ref = model.generate(ids[:, :4], max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(out["input_ids"], ref)
    assert not out["loss_mask"][:, :4].any() and out["loss_mask"][:, 4:].all()
