"""Regenerate a dataset with the target: the answers become the target's own.

    accelerate launch train/regenerate.py --model M --dataset D --output_dir OUT [--temperature T] \
        [--backend transformers|vllm]

A drafter learns to guess what the *target* will say, so training it on the target's own answers rather than
the corpus's raises acceptance (Medusa-2, EAGLE). The work items of a dataset (any source
train/data/examples.py reads):

- a conversation: its system and user turns are replayed through the target's chat template and every
  assistant turn is replaced by the target's answer to all that precedes it, turn by turn, so a later user
  turn follows the regenerated answers. An answer ends at a stop token: the tokenizer's EOS, the generation
  config's eos_token_id(s), and the template's end-of-turn token (found by rendering a one-answer conversation
  and taking the special token right after the answer: `<|im_end|>`, `<|eot_id|>`, ...). Assistant turns
  before the first user turn, or right after another assistant turn, are dropped; trailing user turns get an
  answer. A conversation stops before a prompt reaches `max_length` tokens (its later turns are dropped);
- a window of `max_length` tokens of the packed plain text (the examples train/data/examples.py makes): its
  first `prompt_tokens` are kept and the target writes exactly the rest, or `max_new_tokens` of it (the
  end-of-text tokens are held back).

The rows carry the exact token stream the target read and wrote, so training uses the target's own tokens:

    prompt (the template's)          answer    template text after the answer           answer
    [<|user|>Hi<eos><|assistant|>] + [a0 a1] + [<eos> <|user|>More<eos><|assistant|>] + [b0 b1] + [<eos>]
    loss_mask  0 ... 0                1  1      1     0 ...                              1  1      1

(the end-of-turn token is trained on when the target wrote it, not when the answer hit its token limit). Each
later prompt is the stream so far plus the template's text after the previous answer (rendered with a stand-in
for each earlier answer), so every answer is conditioned on exactly the tokens stored before it.

Work is written in shards of `shard_size` items (OUT/shards/NNNNN.arrow, each renamed into place when
complete) and merged at the end; a killed run started again with the same command redoes only the missing
shards, and each shard's sampling is seeded from (seed, shard index), so the result equals an uninterrupted
run's. With several processes rank r takes shards r, r + n, ...; rank 0 merges after a barrier.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from selfspec.shipped.models import WEIGHTS_CHECKSUM
from selfspec.train.data.records import REGENERATION_FILE, unfinished_regeneration
from selfspec.train.loop.config import ConfigError
from selfspec.train.regeneration.backends import (
    Generator,
    TransformersGenerator,
    VllmGenerator,
    derived_seed,
    vllm_missing,
)
from selfspec.train.regeneration.chat import Chat, conversation, stop_token_ids
from selfspec.train.regeneration.config import RegenerateConfig
from selfspec.train.regeneration.items import Items, load_items, random_subset
from selfspec.train.regeneration.output import (
    check_output_dir,
    describe_run,
    merge,
    open_output,
    shard_path,
    write_json,
    write_shard,
)
from selfspec.train.regeneration.shards import write_manifest


def regenerate_shard(
    generator: Generator,
    tokenizer,
    rows: dict[str, list],
    cfg: RegenerateConfig,
    stops: list[int],
    progress: Callable[[int], None],
) -> list[dict[str, Any]]:
    """The regenerated rows of one shard's items (one row per item; a skipped item's says why in
    `skipped`)."""
    n = len(rows["item"])
    out: list[dict[str, Any]] = [
        {
            "item": rows["item"][i],
            "messages": None,
            "text": None,
            "input_ids": None,
            "loss_mask": None,
            "skipped": None,
            "dropped_turns": 0,
        }
        for i in range(n)
    ]
    windows = [i for i in range(n) if rows["input_ids"][i] is not None]
    for start in range(0, len(windows), cfg.batch_size):  # prompts alike in length: one budget, no padding
        batch = windows[start : start + cfg.batch_size]
        prompts = [rows["input_ids"][i][: cfg.prompt_tokens] for i in batch]
        new = min(cfg.max_new_tokens, len(rows["input_ids"][batch[0]]) - cfg.prompt_tokens)
        for i, prompt, (tokens, _) in zip(
            batch, prompts, generator(prompts, [new] * len(prompts), exact=True)
        ):
            ids = prompt + tokens
            out[i] |= {
                "text": tokenizer.decode(ids),
                "input_ids": ids,
                "loss_mask": [0] * len(prompt) + [1] * len(tokens),
            }
        progress(len(batch))
    chats = []
    for i in range(n):
        if rows["messages"][i] is not None:
            slots, why = conversation(rows["messages"][i])
            if slots is None:
                out[i]["skipped"] = why
                progress(1)
            else:
                chats.append(Chat(i, slots))
    for chat, why in regenerate_chats(generator, tokenizer, chats, cfg, set(stops)):
        if why is None:
            out[chat.index] |= chat.row(tokenizer, set(stops))
        else:
            out[chat.index]["skipped"] = why
        progress(1)
    return out


def regenerate_chats(
    generator: Generator, tokenizer, chats: list[Chat], cfg: RegenerateConfig, stops: set[int]
):
    """Answer the chats' turns round by round, batched across conversations (prompts sorted by length); yields
    (chat, None) for each finished chat, (chat, reason) for one that gives no row."""
    import jinja2

    active = chats
    while active:
        asks: list[tuple[Chat, list[int], list[int]]] = []
        for chat in active:
            try:
                prompt, mask = chat.follow(tokenizer, chat.next_text(tokenizer), stops)
            except jinja2.TemplateError as e:
                yield chat, f"the chat template refused it: {e}"
                continue
            if (
                len(prompt) >= cfg.max_length
            ):  # the conversation outgrew the window: it ends with its last answer
                chat.dropped = chat.slots.count(None) - len(chat.answers)
                yield (
                    chat,
                    (None if chat.answers else f"the first prompt has {len(prompt)} >= max_length tokens"),
                )
                continue
            asks.append((chat, prompt, mask))
        asks.sort(key=lambda a: len(a[1]))
        answers = generator(
            [p for _, p, _ in asks],
            [min(cfg.max_new_tokens, cfg.max_length - len(p)) for _, p, _ in asks],
            exact=False,
        )
        active = []
        for (chat, prompt, mask), (tokens, stopped) in zip(asks, answers):
            chat.ids, chat.mask = prompt + tokens, mask + [1] * len(tokens)
            chat.answers.append(tokenizer.decode(tokens))
            chat.stopped = stopped
            if len(chat.answers) == chat.slots.count(None):
                yield chat, None
            else:
                active.append(chat)


def regenerate(
    make_generator: Callable[[], Generator],
    tokenizer,
    items: Items,
    cfg: RegenerateConfig,
    out: Path,
    target: dict[str, str],
    stops: list[int],
    rank: int = 0,
    world: int = 1,
    barrier: Callable[[], None] | None = None,
    show_progress: bool = True,
) -> Path:
    """Regenerate `items` into `out` (see the module docstring); every rank calls it, `barrier` waits for all.
    The generator is made only when this rank has shards left to write. Returns `out`."""
    barrier = barrier or (lambda: None)
    record = describe_run(cfg, tokenizer, items, target, stops)
    state = open_output(out, record)
    barrier()  # every rank checked the folder before anything is written into it
    if state == "new" and rank == 0:
        write_json(out / REGENERATION_FILE, record)
    if state == "complete":
        if rank == 0 and show_progress:
            print(f"{out} already holds this regeneration, complete")
        return out
    shards = math.ceil(len(items) / cfg.shard_size)
    mine = [s for s in range(rank, shards, world)]
    todo = [s for s in mine if not shard_path(out, s, cfg.output_format).is_file()]
    if todo:
        generator = make_generator()
        share = sum(min(cfg.shard_size, len(items) - s * cfg.shard_size) for s in mine)
        done = share - sum(min(cfg.shard_size, len(items) - s * cfg.shard_size) for s in todo)
        desc = "regenerate" + (f" (rank 0 of {world})" if world > 1 else "")
        with tqdm(
            total=share,
            initial=done,
            unit="item",
            desc=desc,
            dynamic_ncols=True,
            disable=not show_progress or rank != 0,
        ) as bar:
            for s in todo:
                generator.start(derived_seed(cfg.seed, s))
                rows = items.rows[s * cfg.shard_size : (s + 1) * cfg.shard_size]
                regenerated = regenerate_shard(generator, tokenizer, rows, cfg, stops, bar.update)
                write_shard(regenerated, shard_path(out, s, cfg.output_format))
                if cfg.output_format == "shards":  # what is done so far can be committed and read
                    write_manifest(out)
    barrier()  # every shard is on disk
    if rank == 0:
        merge(out, shards, cfg.output_format, record, show_progress)
    barrier()  # the merged result is there for every rank
    return out


def regenerate_with_model(
    model,
    tokenizer,
    items: Items,
    cfg: RegenerateConfig,
    out: Path,
    target: dict[str, str],
    rank: int = 0,
    world: int = 1,
    barrier: Callable[[], None] | None = None,
) -> Path:
    """Regenerate with a target already loaded in this process (self-distillation in train/data/run_data.py);
    progress is shown by the launch's first process only."""
    stops = stop_token_ids(tokenizer, model.generation_config.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    return regenerate(
        lambda: TransformersGenerator(model, cfg, stops, pad),
        tokenizer,
        items,
        cfg,
        out,
        target,
        stops,
        rank,
        world,
        barrier,
        show_progress=os.environ.get("RANK", "0") == "0",
    )


def model_files(path: str) -> str:
    """A digest naming the target's files: the checked weights' sha256 of a folder built here (the same on
    every machine), else sizes and times of a local folder's files, else the hub revision."""
    folder = Path(path)
    if (folder / WEIGHTS_CHECKSUM).is_file():  # a folder built here (make real-model): its checked weights
        return (folder / WEIGHTS_CHECKSUM).read_text().split()[0]
    if folder.is_dir():
        h = hashlib.sha1()
        for f in sorted(folder.iterdir()):
            if f.is_file():
                h.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
        return h.hexdigest()[:16]
    from transformers import AutoConfig

    return str(getattr(AutoConfig.from_pretrained(path), "_commit_hash", None) or path)


def written_by(source: str, model: str) -> bool | None:
    """For a finished train/regenerate.py folder: whether `model` (the same files) wrote it; None for other
    data."""
    from selfspec.shipped.models import resolve_model

    folder = Path(source)
    if not (folder / REGENERATION_FILE).is_file() or unfinished_regeneration(folder):
        return None
    target = json.loads((folder / REGENERATION_FILE).read_text()).get("target") or {}
    if "files" not in target:  # self-distillation's own cache names the target by its weights, not its files
        return target.get("model") == model
    try:
        return target["files"] == model_files(resolve_model(model))
    except OSError:  # a model that cannot be found is reported where it is loaded
        return False


def finished(out: Path) -> bool:
    """Whether `out` holds a complete regeneration (whose settings `regenerate` still checks against the
    run's)."""
    try:
        return bool(json.loads((out / REGENERATION_FILE).read_text()).get("complete"))
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def run(cfg: RegenerateConfig) -> Path:
    """The script: check the folder and the backend, read the items (rank 0 first), regenerate, merge."""
    from accelerate import PartialState
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from selfspec.shipped.models import resolve_model
    from selfspec.train.parallel.distributed import check_launch

    check_launch()  # a launch this machine cannot run is refused before any model or data loads
    out = Path(cfg.output_dir)
    check_output_dir(out)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.backend == "vllm" and not finished(out):  # a finished folder (the shipped data) needs no engine
        if (why := vllm_missing()) is not None:
            raise ConfigError(why)
        if world > 1:
            raise ConfigError(
                "--backend vllm runs in one process (vLLM batches on its own; "
                "--tensor_parallel_size spans GPUs): launch it without several processes"
            )
    multi_cpu = world > 1 and not torch.cuda.is_available()  # several CPU processes talk over gloo
    state = PartialState(cpu=multi_cpu, **({"backend": "gloo"} if multi_cpu else {}))
    path = resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = within_positions(cfg, AutoConfig.from_pretrained(path), state.is_main_process)
    with state.main_process_first():
        items = random_subset(
            load_items(cfg.dataset, cfg.split, tokenizer, cfg.max_length), cfg.max_examples, cfg.seed
        )
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    stops = stop_token_ids(tokenizer, eos)
    dtype = cfg.dtype if cfg.dtype == "auto" else getattr(torch, cfg.dtype)

    def make_generator() -> Generator:
        if cfg.backend == "vllm":
            return VllmGenerator(path, cfg, stops)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(state.device).eval()
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
        return TransformersGenerator(model, cfg, stops, pad)

    target = {"model": cfg.model, "files": model_files(path)}
    return regenerate(
        make_generator,
        tokenizer,
        items,
        cfg,
        out,
        target,
        stops,
        state.process_index,
        state.num_processes,
        state.wait_for_everyone,
    )


def within_positions(cfg: RegenerateConfig, config, report: bool = True) -> RegenerateConfig:
    """`cfg` with `max_length` at most the positions the target embeds (`max_position_embeddings` /
    `n_positions`): prompt + answer never ask for a position the model does not have (GPT-2-style models raise
    an IndexError past theirs); a conversation that outgrows them ends there, its later turns dropped."""
    from selfspec.infer.core.arguments import max_positions

    limit = max_positions(config)
    if limit is None or cfg.max_length <= limit:
        return cfg
    if cfg.prompt_tokens >= limit:
        raise ConfigError(
            f"--prompt_tokens ({cfg.prompt_tokens}) must be below the model's {limit} positions"
        )
    if report:
        print(
            f"note: --max_length {cfg.max_length} is more than the model's {limit} positions: prompts and "
            f"answers are kept within {limit} tokens (conversations end there, text windows are {limit} "
            "tokens)"
        )
    return dataclasses.replace(cfg, max_length=limit)
