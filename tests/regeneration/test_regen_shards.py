"""train/regenerate.py --output_format shards: zstd Parquet shards kept with a manifest of checksums, so that
a long regeneration is committed shard by shard, resumed from what was committed, and read by training as it
grows."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from transformers import AutoTokenizer

from conftest import TOKENIZER_TEXT
from regen_helpers import CHATS, ROOT, options, rows_of, save_target, write_jsonl
from selfspec.train.data.examples import load_examples
from selfspec.train.data.records import (
    DataError,
    check_shards,
    check_source,
    iter_records,
    load_shards,
    unfinished_regeneration,
)
from selfspec.train.regeneration.config import RegenerateConfig
from selfspec.train.regeneration.run import run, written_by
from selfspec.train.regeneration.shards import main, write_manifest


@pytest.fixture
def target_dir(tmp_path, monkeypatch):
    return save_target(tmp_path, monkeypatch)


def regenerate(target_dir, tmp_path, name: str, **extra):
    data = write_jsonl(tmp_path / "mixed.jsonl", CHATS + [{"text": TOKENIZER_TEXT * 2}] * 3)
    out = tmp_path / name
    run(RegenerateConfig(**options(target_dir, data, out, max_length=40, **extra)))
    return out


def test_shards_hold_the_rows_a_dataset_run_writes_and_training_reads_them_alike(target_dir, tmp_path):
    shards = regenerate(target_dir, tmp_path, "shards", output_format="shards")
    merged = regenerate(target_dir, tmp_path, "dataset")
    manifest = check_shards(shards)
    n = manifest["shards_total"]  # 16 items (8 text windows, 8 chats) in shards of 2
    assert n == 8 and sorted(p.name for p in (shards / "shards").iterdir()) == [
        f"{i:05d}.parquet" for i in range(n)
    ]
    assert [dict(r) for r in load_shards(shards)] == rows_of(merged)
    rows = rows_of(merged)
    assert manifest["complete"] and manifest["shards_done"] == n
    assert (
        manifest["counts"]["rows"] == len(rows) and manifest["counts"]["skipped"] == 2
    )  # as the dataset run said
    assert manifest["counts"]["answer_tokens"] == sum(sum(r["loss_mask"]) for r in rows)
    assert manifest["target"] == json.loads((shards / "regeneration.json").read_text())["target"]
    tok = AutoTokenizer.from_pretrained(target_dir)
    a, b = load_examples(str(shards), tok, 24), load_examples(str(merged), tok, 24)
    assert [a[i]["input_ids"].tolist() for i in range(len(a))] == [
        b[i]["input_ids"].tolist() for i in range(len(b))
    ]
    assert written_by(str(shards), str(target_dir))
    check_source(
        str(shards)
    )  # a training run's first check takes the folder (it read manifest.json as records)
    assert list(iter_records(str(shards))) == list(iter_records(str(merged)))  # another tokenizer reads these


def test_a_run_cut_short_is_read_as_far_as_it_went_and_resumes_from_its_shards(
    target_dir, tmp_path, monkeypatch
):
    full = regenerate(target_dir, tmp_path, "full", output_format="shards")
    part = tmp_path / "part"
    shutil.copytree(full, part)
    for name in ("00003.parquet", "00006.parquet"):  # as two ranks killed after a few shards left it
        (part / "shards" / name).unlink()
    record = json.loads((part / "regeneration.json").read_text())
    (part / "regeneration.json").write_text(json.dumps(record | {"complete": False}))
    manifest = write_manifest(part)
    assert (manifest["shards_done"], manifest["complete"]) == (6, False)
    kept = {e["file"]: e["rows"] for e in check_shards(full)["shards"]}
    lost = kept["shards/00003.parquet"] + kept["shards/00006.parquet"]
    assert not unfinished_regeneration(part) and len(load_shards(part)) == len(load_shards(full)) - lost
    written = {p.name: p.stat().st_mtime_ns for p in (part / "shards").iterdir()}
    run(
        RegenerateConfig(
            **options(target_dir, tmp_path / "mixed.jsonl", part, max_length=40, output_format="shards")
        )
    )
    assert all((part / "shards" / n).stat().st_mtime_ns == t for n, t in written.items())  # kept, not redone
    assert [dict(r) for r in load_shards(part)] == [dict(r) for r in load_shards(full)]
    assert json.loads((part / "manifest.json").read_text())["shards"] == check_shards(full)["shards"]


def test_a_changed_or_missing_shard_is_a_one_line_error(target_dir, tmp_path, capsys):
    out = regenerate(target_dir, tmp_path, "shards", output_format="shards")
    shard = out / "shards" / "00001.parquet"
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(DataError, match="00001.parquet does not match its sha256"):
        load_shards(out)
    with pytest.raises(SystemExit, match="does not match"):
        main([str(out)])
    shard.unlink()
    with pytest.raises(DataError, match="00001.parquet is listed in .* but missing"):
        check_shards(out)
    main([str(out), "--write"])  # the manifest written anew from the shards there
    assert "7 of 8 shards, all checksums match" in capsys.readouterr().out


def test_the_shipped_data_is_found_complete_without_its_engine(monkeypatch, capsys):
    """The recipe names vLLM; a machine without it still runs the recipe's command over the shipped folder,
    which is complete and needs no engine (and its checksums match)."""
    from selfspec.train.loop.config import load_config
    from selfspec.train.regeneration import run as regen_module

    monkeypatch.setattr(regen_module, "vllm_missing", lambda: "no vLLM here")
    shipped = ROOT / "shipped" / "smollm2-chat"
    assert check_shards(shipped)["complete"]
    assert regen_module.finished(shipped)
    cfg = load_config(RegenerateConfig, ["--config", str(ROOT / "configs/regenerate/smollm2-chat.yaml")])
    assert cfg.backend == "vllm" and cfg.output_dir == "shipped/smollm2-chat"


def test_a_shards_folder_keys_its_cache_by_content_not_file_times(target_dir, tmp_path, monkeypatch):
    """A fresh clone gives every file a new time: the tokenised copy and the EAGLE feature cache (5 GB for the
    shipped chats) must still be found, and a changed manifest must not be."""
    from selfspec.train.data.examples import source_fingerprint

    shards = regenerate(target_dir, tmp_path, "shards", output_format="shards")
    monkeypatch.chdir(tmp_path)
    tok = AutoTokenizer.from_pretrained(target_dir)
    key = source_fingerprint("shards", "train", tok, 24)
    for path in shards.rglob("*"):
        os.utime(path, (1_000_000, 1_000_000))
    assert source_fingerprint("shards", "train", tok, 24) == key
    manifest = json.loads((shards / "manifest.json").read_text())
    (shards / "manifest.json").write_text(json.dumps(manifest | {"counts": {}}))
    assert source_fingerprint("shards", "train", tok, 24) != key
