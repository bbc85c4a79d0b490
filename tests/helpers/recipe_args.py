"""Command-line options for seconds-long recipe runs on a tiny target: what every recipe's run shares, and
each family's additions (overrides in `extra`)."""

from typing import Any


def short_run(model_dir, data, out, **extra: Any) -> dict[str, Any]:
    """A 6-step run with checkpoints at steps 2/4/6, validation every 3 steps and no time cap, float32, on
    the data as it is (no self-distillation)."""
    return {
        "model": model_dir,
        "dataset": data,
        "output_dir": out,
        "max_length": 32,
        "max_steps": 6,
        "per_device_train_batch_size": 4,
        "eval_steps": 3,
        "save_steps": 2,
        "learning_rate": 3e-3,
        "max_minutes": 0,
        "logging_steps": 1,
        "self_distill": False,
        "max_train_examples": 0,
        "mixed_precision": "no",
    } | extra


def argv(args: dict[str, Any]) -> list[str]:
    """The options as a command line: --name value."""
    return [x for k, v in args.items() for x in (f"--{k}", str(v))]


def eagle_args(model_dir, data, out, **extra):
    """An EAGLE recipe run with a depth-3 tree of 6 tokens."""
    return argv(short_run(model_dir, data, out, **({"depth": 3, "top_k": 2, "total_tokens": 6} | extra)))
