"""Run a training script with each rank's tensor peak measured at its second step
(tests/helpers/live_bytes.py):

    accelerate launch --config_file configs/accelerate/fsdp.yaml tests/helpers/rank_peak.py
        --kind eagle --output_dir out ...

Each rank writes {"rank": r, "peak": bytes} to <output_dir>/peak-rank<r>.json.
tests/training/test_memory_plan.py launches it to check the memory plan's per-rank prediction under ZeRO-3 and
FSDP2 with the target sharded.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import selfspec.train.loop.training as loop  # noqa: E402
from live_bytes import measuring_step  # noqa: E402
from selfspec.train.loop.config import load_config  # noqa: E402


def main(kind: str, argv: list[str]) -> None:
    if kind == "eagle":
        from selfspec.train.eagle import run
        from selfspec.train.recipes.eagle import EagleConfig as Config
    else:
        from selfspec.train.medusa import run
        from selfspec.train.recipes.medusa import MedusaConfig as Config
    cfg = load_config(Config, argv)
    found: dict = {}
    loop.batches_keeping_rng = measuring_step(found)
    run(cfg)
    rank = int(os.environ.get("RANK", "0"))
    Path(cfg.output_dir, f"peak-rank{rank}.json").write_text(
        json.dumps({"rank": rank, "peak": found["peak"]})
    )


if __name__ == "__main__":
    assert sys.argv[1] == "--kind", "usage: rank_peak.py --kind eagle|medusa <training options>"
    main(sys.argv[2], sys.argv[3:])
