"""train/regenerate.py's shards: a killed run started again with the same command equals an uninterrupted one
(sampling included), and two processes, or two ranks meeting at a barrier, share the shards and equal one
process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import selfspec.train.regeneration.run as regen_module
from regen_helpers import CHATS, ROOT, args_of, options, rows_of, save_target, write_jsonl
from selfspec.train.data.records import DataError, iter_records
from selfspec.train.regenerate import main
from selfspec.train.regeneration.config import RegenerateConfig
from selfspec.train.regeneration.items import load_items
from selfspec.train.regeneration.run import run


@pytest.fixture
def target_dir(tmp_path, monkeypatch):
    return save_target(tmp_path, monkeypatch)


def test_killed_run_resumes_to_the_uninterrupted_result(target_dir, tmp_path, capsys):
    chats = [
        {
            "messages": [
                {"role": "user", "content": "def f(a):"},
                {"role": "assistant", "content": "pass"},
                {"role": "user", "content": "again"},
            ]
        }
    ] * 14  # alike: only sampling tells them apart
    data = write_jsonl(tmp_path / "chats.jsonl", chats)
    opts = options(target_dir, data, tmp_path / "resumed", temperature=0.8, top_p=0.9)
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    job = subprocess.Popen(
        [sys.executable, str(ROOT / "train/regenerate.py"), *args_of(opts)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    shards = tmp_path / "resumed" / "shards"
    deadline = time.time() + 120
    while not list(shards.glob("*.arrow")) and job.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    job.send_signal(signal.SIGKILL)
    stderr = job.communicate()[1]
    done = list(shards.glob("*.arrow"))
    assert 0 < len(done) < 7, f"kill after the first of 7 shards, got {len(done)}:\n{stderr[-2000:]}"
    assert not json.loads((tmp_path / "resumed" / "regeneration.json").read_text())["complete"]
    with pytest.raises(DataError, match="unfinished regeneration: run the same train/regenerate.py command"):
        list(iter_records(str(tmp_path / "resumed")))  # not yet a dataset
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the killed process, so the same arithmetic
    try:
        main(args_of(opts))  # the same command again
        main(args_of(opts | {"output_dir": str(tmp_path / "whole")}))
    finally:
        torch.set_num_threads(threads)
    resumed, whole = rows_of(tmp_path / "resumed"), rows_of(tmp_path / "whole")
    assert resumed == whole and [r["item"] for r in resumed] == list(range(14))
    answers = [r["messages"][1]["content"] for r in whole]
    assert len(set(answers)) > 1 and all(
        len(r["messages"]) == 4 for r in whole
    )  # sampled: alike prompts differ
    assert not shards.exists()
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:  # resuming with other settings is refused
        main(args_of(opts | {"temperature": 0.5}))
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "\n" not in err, err
    assert "holds a regeneration with other settings (temperature 0.8 there, 0.5 now)" in err


def test_two_processes_share_the_shards_and_equal_one(target_dir, tmp_path):
    data = write_jsonl(tmp_path / "chats.jsonl", CHATS * 2)
    one, two = tmp_path / "one", tmp_path / "two"
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        str(Path(sys.executable).with_name("accelerate")),
        "launch",
        "--config_file",
        "configs/accelerate/cpu-2proc.yaml",
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        "train/regenerate.py",
        *args_of(options(target_dir, data, two, temperature=0.7)),
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(RegenerateConfig(**options(target_dir, data, one, temperature=0.7)))
    finally:
        torch.set_num_threads(threads)
    assert rows_of(one) == rows_of(two) and len(rows_of(one)) == 8


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_split_the_shards_and_rank_0_merges(target_dir, tmp_path, monkeypatch):
    """Two ranks as two threads meeting at a barrier: rank 1 writes shards 1 and 3, rank 0 writes 0, 2 and 4
    and merges; the result equals one process's."""
    import threading

    data = write_jsonl(tmp_path / "chats.jsonl", CHATS * 2)
    tok = AutoTokenizer.from_pretrained(target_dir)
    items = load_items(str(data), "train", tok, 160)
    cfg = RegenerateConfig(**options(target_dir, data, tmp_path / "x"))
    written: dict[str, list[str]] = {}
    original = regen_module.write_shard
    monkeypatch.setattr(
        regen_module,
        "write_shard",
        lambda rows, path: (
            written.setdefault(threading.current_thread().name, []).append(path.name),
            original(rows, path),
        ),
    )
    barrier, errors = threading.Barrier(2, timeout=120), []
    # a model each, loaded here: from_pretrained's meta-device context is process-wide, not for two threads at
    # once
    models = [AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval() for _ in range(2)]

    def rank(r: int) -> None:
        try:
            regen_module.regenerate_with_model(
                models[r], tok, items, cfg, tmp_path / "two", {"model": "m"}, r, 2, barrier.wait
            )
        except Exception as e:  # reported by the test below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,), name=str(r)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert written == {
        "0": ["00000.arrow", "00002.arrow", "00004.arrow"],
        "1": ["00001.arrow", "00003.arrow"],
    }
    regen_module.regenerate_with_model(models[0], tok, items, cfg, tmp_path / "one", {"model": "m"})
    assert len(written["MainThread"]) == 5
    assert rows_of(tmp_path / "one") == rows_of(tmp_path / "two")
