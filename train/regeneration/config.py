"""The options of train/regenerate.py (RegenerateConfig), also built by self-distillation
(train/data/run_data.py) and read by the engines that write the answers (train/regeneration/backends.py)."""

from __future__ import annotations

import dataclasses

from selfspec.train.loop.config import ConfigError, check_at_least, check_finite, option

BACKENDS = ("transformers", "vllm")
FORMATS = ("dataset", "jsonl", "shards")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclasses.dataclass
class RegenerateConfig:
    """Regenerate a dataset's answers with the target, for a drafter to learn what the target itself says."""

    model: str = option("demo", "the target: any HF causal LM name or path; `demo` is the shipped one")
    dataset: str = option(
        "stdlib",
        "any source train/data/examples.py reads: stdlib | .txt | folder | .json(l) | saved dataset | name",
    )
    split: str = option(
        "train",
        "the split of a `datasets` name or a saved DatasetDict (stdlib: train | validation)",
    )
    output_dir: str = option(
        "outputs/regenerated-demo",
        "the regenerated dataset, regeneration.json and (while running) shards/",
    )
    output_format: str = option(
        "dataset",
        "dataset (save_to_disk, with the exact tokens) | jsonl (messages / text rows) | shards (zstd "
        "Parquet shards kept, with a manifest of checksums: commit them as they complete)",
    )
    backend: str = option("transformers", "transformers | vllm (vLLM's offline engine, one process)")
    temperature: float = option(
        0.3,
        "sampling temperature of the target's answers (Medusa's recipe); 0 is greedy",
    )
    top_p: float = option(
        1.0,
        "nucleus sampling: draw from the smallest set of tokens holding this much probability",
    )
    max_new_tokens: int = option(512, "most tokens of one answer (text: of one window's continuation)")
    max_length: int = option(
        512,
        "text: windows of this many tokens; a conversation stops before a prompt reaches it",
    )
    prompt_tokens: int = option(
        32,
        "text: the tokens of each window kept as the prompt (the target writes the rest, up to "
        "max_new_tokens)",
    )
    max_examples: int = option(
        0,
        "> 0: a seeded random subset of this many items (conversations and text windows)",
    )
    batch_size: int = option(64, "prompts per generate call (vLLM also schedules within a call on its own)")
    shard_size: int = option(
        256,
        "items per shard: the unit written to disk, resumed, and shared among processes",
    )
    seed: int = option(0, "seeds the subset and the sampling (each shard from (seed, shard index))")
    dtype: str = option("auto", "the target's weights: auto (as saved) | float32 | bfloat16 | float16")
    tensor_parallel_size: int = option(1, "--backend vllm: GPUs one vLLM engine spans")

    def __post_init__(self) -> None:
        check_finite(self)
        for name, allowed in (("backend", BACKENDS), ("output_format", FORMATS), ("dtype", DTYPES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"--{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top_p must be in (0, 1], got {self.top_p}")
        check_at_least(
            self,
            (
                "max_new_tokens",
                "max_length",
                "prompt_tokens",
                "batch_size",
                "shard_size",
                "tensor_parallel_size",
            ),
            1,
        )
        check_at_least(self, ("max_examples",), 0)
        if self.prompt_tokens >= self.max_length:
            raise ConfigError(
                f"--prompt_tokens ({self.prompt_tokens}) must be below --max_length ({self.max_length}):"
                " the rest of each text window is what the target writes"
            )
