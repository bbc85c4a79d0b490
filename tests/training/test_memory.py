"""Memory does not grow with the dataset: a short Medusa run on a generated jsonl of conversations and text,
then on one 10x larger, each in a fresh process from a cold cache (tokenising included); peak RSS
(ru_maxrss) of the 10x run stays within 20% of the 1x run's.

    python tests/training/test_memory.py 1000 10000    # prints peak RSS for each record count
                                                         (demo-sized target)
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORDS = (
    "def",
    "return",
    "class",
    "self",
    "value",
    "x",
    "y",
    "+",
    "=",
    "(",
    ")",
    ":",
    "for",
    "in",
    "range",
    "print",
    "hello",
    "world",
    "point",
    "add",
    "a",
    "b",
    "0",
    "1",
    "10",
    "if",
    "else",
    "not",
)
RUN = """
import resource, sys
from selfspec.train.medusa import main
main(sys.argv[1:])
print("peak_rss_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def write_records(path: Path, count: int, seed: int = 0) -> None:
    """`count` jsonl records, a line at a time: alternately a two-turn conversation and a text snippet."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    with path.open("w") as f:
        for i in range(count):
            if i % 2:
                record = {
                    "messages": [
                        {"role": "user", "content": words(rng.randint(5, 30))},
                        {"role": "assistant", "content": words(rng.randint(20, 80))},
                    ]
                }
            else:
                record = {"text": words(rng.randint(20, 120))}
            f.write(json.dumps(record) + "\n")


def peak_rss_mib(model: Path, data: Path, out: Path, cache: Path, steps: int = 4) -> float:
    """Peak RSS (MiB) of a fresh process that tokenises `data` into an empty cache and trains `steps`
    steps."""
    args = {
        "model": model,
        "dataset": data,
        "output_dir": out,
        "max_length": 128,
        "max_steps": steps,
        "per_device_train_batch_size": 8,
        "eval_steps": steps,
        "save_steps": steps,
        "eval_batches": 2,
        "max_minutes": 0,
        "logging_steps": 1,
        "tree_nodes": 5,
        "self_distill": "false",
        "num_heads": 2,
        "max_train_examples": 0,
        "mixed_precision": "no",
        "share_lm_head": "false",
    }
    argv = [x for k, v in args.items() for x in (f"--{k}", str(v))]
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "SELFSPEC_CACHE": str(cache),
        "TOKENIZERS_PARALLELISM": "false",
    }
    done = subprocess.run(
        [sys.executable, "-c", RUN, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("peak_rss_kib"))
    return int(line.split()[1]) / 1024


@pytest.mark.slow
def test_peak_rss_of_training_does_not_grow_with_the_dataset(tiny_model_dir, tmp_path):
    peaks = {}
    for scale in (1, 10):
        data = tmp_path / f"records-{scale}x.jsonl"
        write_records(data, 2000 * scale)
        peaks[scale] = peak_rss_mib(
            tiny_model_dir, data, tmp_path / f"out-{scale}", tmp_path / f"cache-{scale}"
        )
    print(f"peak RSS: 1x {peaks[1]:.0f} MiB, 10x {peaks[10]:.0f} MiB")
    assert peaks[10] <= 1.2 * peaks[1], peaks


def main() -> None:
    """Print peak RSS for each record count given (a tiny random target; files in a temporary folder)."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from conftest import tiny_model, tiny_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "target"
        tiny_model("llama").save_pretrained(model)
        tiny_tokenizer().save_pretrained(model)
        for count in map(int, sys.argv[1:] or ["2000", "20000"]):
            data = Path(tmp) / f"records-{count}.jsonl"
            write_records(data, count)
            peak = peak_rss_mib(model, data, Path(tmp) / f"out-{count}", Path(tmp) / f"cache-{count}")
            print(
                f"{count} records ({data.stat().st_size / 2**20:.1f} MiB of jsonl): peak RSS {peak:.0f} MiB"
            )


if __name__ == "__main__":
    main()
