"""Regenerate a dataset with the target: the answers become the target's own.

    accelerate launch train/regenerate.py --model M --dataset D --output_dir OUT [--temperature T] \\
        [--backend transformers|vllm]

A drafter learns to guess what the *target* will say, so training it on the target's own answers rather than
the corpus's raises acceptance (Medusa-2, EAGLE). The work items of a dataset (any source train/data.py reads):

- a conversation: its system and user turns are replayed through the target's chat template and every assistant
  turn is replaced by the target's answer to all that precedes it, turn by turn, so a later user turn follows the
  regenerated answers. An answer ends at a stop token: the tokenizer's EOS, the generation config's
  eos_token_id(s), and the template's end-of-turn token (found by rendering a one-answer conversation and taking
  the special token right after the answer: `<|im_end|>`, `<|eot_id|>`, ...). Assistant turns before the first
  user turn, or right after another assistant turn, are dropped; trailing user turns get an answer. A conversation
  stops before a prompt reaches `max_length` tokens (its later turns are dropped);
- a window of `max_length` tokens of the packed plain text (the examples train/data.py makes): its first
  `prompt_tokens` are kept and the target writes exactly the rest, or `max_new_tokens` of it (the end-of-text
  tokens are held back).

The rows carry the exact token stream the target read and wrote, so training uses the target's own tokens:

    prompt = the template's generation prompt      answer (target)   template text after the answer
    [<|user|>Hi<eos><|assistant|>]               + [a0 a1 a2]       + [<eos> <|user|>More<eos><|assistant|>] + [b0 b1] + [<eos>]
    loss_mask  0 ... 0                              1  1  1            1     0 ...                                1  1      1

(the end-of-turn token is trained on when the target wrote it, not when the answer hit its token limit). Each
later prompt is the stream so far plus the template's text after the previous answer (rendered with a stand-in
for each earlier answer), so every answer is conditioned on exactly the tokens stored before it.

Work is written in shards of `shard_size` items (OUT/shards/NNNNN.arrow, each renamed into place when complete)
and merged at the end; a killed run started again with the same command redoes only the missing shards, and each
shard's sampling is seeded from (seed, shard index), so the result equals an uninterrupted run's. With several
processes rank r takes shards r, r + n, ...; rank 0 merges after a barrier.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import shutil
from collections import Counter
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from tqdm.auto import tqdm

from selfspec.heads.errors import run_main
from selfspec.heads.io import atomic_write
from selfspec.train.config import ConfigError, check_at_least, check_finite, load_config
from selfspec.train.data import (
    RECORD_FEATURES,
    REGENERATION_FILE,
    WRITE_BATCH,
    DataError,
    cache_dir,
    iter_records,
    require_chat_template,
    save_examples,
    source_fingerprint,
    tokenizer_fingerprint,
    unfinished_regeneration,
    write_arrow,
)
from selfspec.train.regen_backends import (
    Generator,
    TransformersGenerator,
    VllmGenerator,
    derived_seed,
    vllm_missing,
)
from selfspec.train.regen_chat import Chat, conversation, stop_token_ids

BACKENDS = ("transformers", "vllm")
FORMATS = ("dataset", "jsonl")
DTYPES = ("auto", "float32", "bfloat16", "float16")
JSONL_FILE = "regenerated.jsonl"
# a work item: a conversation (its messages as JSON) or a text window (its token ids); `item` numbers them in order
ITEM_FEATURES = datasets.Features({"messages": datasets.Value("string"),
                                   "input_ids": datasets.List(datasets.Value("int32")),
                                   "item": datasets.Value("int64")})
PACKED_FEATURES = datasets.Features({k: v for k, v in ITEM_FEATURES.items() if k != "item"})  # before numbering
# a regenerated row: messages (conversations) or text (windows), the exact tokens and where the loss is taken
ROW_FEATURES = datasets.Features({
    "item": datasets.Value("int64"),
    "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
    "text": datasets.Value("string"),
    "input_ids": datasets.List(datasets.Value("int32")),
    "loss_mask": datasets.List(datasets.Value("int8")),
    "skipped": datasets.Value("string"),  # in shards only: why an item gave no row
    "dropped_turns": datasets.Value("int32"),  # in shards only: later answers cut because the chat outgrew the window
})


@dataclasses.dataclass
class RegenerateConfig:
    """Regenerate a dataset's answers with the target, for a drafter to learn what the target itself says."""

    model: str = "demo"  # the target: any HF causal LM name or path; `demo` is the shipped one
    dataset: str = "stdlib"  # any source train/data.py reads: stdlib | .txt | folder | .json(l) | saved dataset | name
    split: str = "train"  # the split of a `datasets` name or a saved DatasetDict (stdlib: train | validation)
    output_dir: str = "outputs/regenerated-demo"  # the regenerated dataset, regeneration.json and (while running) shards/
    output_format: str = "dataset"  # dataset (save_to_disk, with the exact tokens) | jsonl (messages / text rows)
    backend: str = "transformers"  # transformers | vllm (vLLM's offline engine, one process)
    temperature: float = 0.3  # sampling temperature of the target's answers (Medusa's recipe); 0 is greedy
    top_p: float = 1.0  # nucleus sampling: draw from the smallest set of tokens holding this much probability
    max_new_tokens: int = 512  # most tokens of one answer (text: of one window's continuation)
    max_length: int = 512  # text: windows of this many tokens; a conversation stops before a prompt reaches it
    prompt_tokens: int = 32  # text: the tokens of each window kept as the prompt (the target writes the rest, up to max_new_tokens)
    max_examples: int = 0  # > 0: a seeded random subset of this many items (conversations and text windows)
    batch_size: int = 64  # prompts per generate call (vLLM also schedules within a call on its own)
    shard_size: int = 256  # items per shard: the unit written to disk, resumed, and shared among processes
    seed: int = 0  # seeds the subset and the sampling (each shard from (seed, shard index))
    dtype: str = "auto"  # the target's weights: auto (as saved) | float32 | bfloat16 | float16
    tensor_parallel_size: int = 1  # --backend vllm: GPUs one vLLM engine spans

    def __post_init__(self) -> None:
        check_finite(self)
        for name, allowed in (("backend", BACKENDS), ("output_format", FORMATS), ("dtype", DTYPES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"--{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top_p must be in (0, 1], got {self.top_p}")
        check_at_least(self, ("max_new_tokens", "max_length", "prompt_tokens", "batch_size", "shard_size",
                              "tensor_parallel_size"), 1)
        check_at_least(self, ("max_examples",), 0)
        if self.prompt_tokens >= self.max_length:
            raise ConfigError(f"--prompt_tokens ({self.prompt_tokens}) must be below --max_length ({self.max_length}):"
                              " the rest of each text window is what the target writes")


# ---------------------------------------------------------------- work items


@dataclasses.dataclass
class Items:
    """A source's work items (a memory-mapped dataset of ITEM_FEATURES rows); `key` names them and every selection,
    like train.data.Examples, so train.loop's `subset` and train.data's `split_examples` select them the same way."""

    rows: datasets.Dataset
    key: str

    def __len__(self) -> int:
        return self.rows.num_rows

    def select(self, indices: Iterable[int] | np.ndarray, what: str) -> Items:
        """The items at `indices`, in that order; `what` (e.g. "subset 64 seed 0") extends the key."""
        return Items(self.rows.select(indices, keep_in_memory=True),
                     hashlib.sha1(f"{self.key}|{what}".encode()).hexdigest()[:16])


class ItemPacker:
    """The batched `map` function that turns records into items, in order (one process): plain text joins one
    token stream (EOS after each document) cut into full max_length windows, as train.data.Packer packs it; a
    conversation is one item, kept as its messages."""

    def __init__(self, tokenizer, max_length: int) -> None:
        self.tokenizer, self.max_length = tokenizer, max_length
        self.stream: list[int] = []

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        texts = [t for t in batch["text"] if t is not None]
        for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []:
            self.stream += ids + ([self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])
        full = len(self.stream) // self.max_length * self.max_length
        windows = [self.stream[i : i + self.max_length] for i in range(0, full, self.max_length)]
        del self.stream[:full]
        chats = [m for m in batch["messages"] if m is not None]
        if chats:
            require_chat_template(self.tokenizer)
        return {"messages": [None] * len(windows) + chats, "input_ids": windows + [None] * len(chats)}


def load_items(source: str, split: str, tokenizer, max_length: int) -> Items:
    """A source's work items, built once and cached under cache_dir() (keyed like its tokenised examples)."""
    key = "items-" + source_fingerprint(source, split, tokenizer, max_length)
    path = cache_dir() / key
    if (path / "state.json").is_file():
        return Items(datasets.load_from_disk(str(path), keep_in_memory=False), key)

    def make(scratch: Path) -> datasets.Dataset:
        records = ({"text": r.get("text"), "messages": json.dumps(r["messages"]) if "messages" in r else None}
                   for r in iter_records(source, split))
        table = write_arrow(records, scratch / "records.arrow", RECORD_FEATURES)
        items = table.map(ItemPacker(tokenizer, max_length), batched=True, batch_size=WRITE_BATCH,
                          remove_columns=table.column_names, features=PACKED_FEATURES,
                          cache_file_name=str(scratch / "items.arrow"), new_fingerprint=key,
                          writer_batch_size=WRITE_BATCH, desc="reading items")
        if len(items) == 0:
            raise DataError(f"{source} yields no conversation and no text window of {max_length} tokens; "
                            "lower --max_length or add data")
        return items.add_column("item", np.arange(len(items), dtype=np.int64))

    return Items(save_examples(make, path), key)


def random_subset(items: Items, count: int, seed: int) -> Items:
    """A seeded random subset of `count` items in their order (all when there are fewer): train.loop.subset's."""
    n = len(items)
    if count <= 0 or count >= n:
        return items
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:count].sort().values
    return items.select(idx.numpy(), f"subset {count} seed {seed}")


# ---------------------------------------------------------------- one shard


def regenerate_shard(generator: Generator, tokenizer, rows: dict[str, list], cfg: RegenerateConfig,
                     stops: list[int], progress: Callable[[int], None]) -> list[dict[str, Any]]:
    """The regenerated rows of one shard's items (one row per item; a skipped item's says why in `skipped`)."""
    n = len(rows["item"])
    out: list[dict[str, Any]] = [{"item": rows["item"][i], "messages": None, "text": None, "input_ids": None,
                                  "loss_mask": None, "skipped": None, "dropped_turns": 0} for i in range(n)]
    windows = [i for i in range(n) if rows["input_ids"][i] is not None]
    for start in range(0, len(windows), cfg.batch_size):  # prompts alike in length: one budget, no padding
        batch = windows[start : start + cfg.batch_size]
        prompts = [rows["input_ids"][i][: cfg.prompt_tokens] for i in batch]
        new = min(cfg.max_new_tokens, len(rows["input_ids"][batch[0]]) - cfg.prompt_tokens)
        for i, prompt, (tokens, _) in zip(batch, prompts, generator(prompts, [new] * len(prompts), exact=True)):
            ids = prompt + tokens
            out[i] |= {"text": tokenizer.decode(ids), "input_ids": ids,
                       "loss_mask": [0] * len(prompt) + [1] * len(tokens)}
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


def regenerate_chats(generator: Generator, tokenizer, chats: list[Chat], cfg: RegenerateConfig, stops: set[int]):
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
            if len(prompt) >= cfg.max_length:  # the conversation outgrew the window: it ends with its last answer
                chat.dropped = chat.slots.count(None) - len(chat.answers)
                yield chat, (None if chat.answers else f"the first prompt has {len(prompt)} >= max_length tokens")
                continue
            asks.append((chat, prompt, mask))
        asks.sort(key=lambda a: len(a[1]))
        answers = generator([p for _, p, _ in asks],
                            [min(cfg.max_new_tokens, cfg.max_length - len(p)) for _, p, _ in asks], exact=False)
        active = []
        for (chat, prompt, mask), (tokens, stopped) in zip(asks, answers):
            chat.ids, chat.mask = prompt + tokens, mask + [1] * len(tokens)
            chat.answers.append(tokenizer.decode(tokens))
            chat.stopped = stopped
            if len(chat.answers) == chat.slots.count(None):
                yield chat, None
            else:
                active.append(chat)


# ---------------------------------------------------------------- the run: output folder, shards, merge


def describe_run(cfg: RegenerateConfig, tokenizer, items: Items, target: dict[str, str],
                 stops: list[int]) -> dict[str, Any]:
    """What regeneration.json records; a resume must match it in everything but `versions` and the counts."""
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "output_dir"}
    return {"target": target, "tokenizer": tokenizer_fingerprint(tokenizer),
            "settings": settings | {"items": len(items), "items_key": items.key, "stop_token_ids": stops},
            "backend": cfg.backend, "versions": versions(cfg.backend), "complete": False}


def versions(backend: str) -> dict[str, str]:
    """The versions that decide the output (vLLM's only with that backend; its CPU build is another package)."""
    found = {"python": platform.python_version()}
    for name in ("selfspec", "torch", "transformers", "datasets"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    if backend == "vllm":
        import vllm

        found["vllm"] = vllm.__version__
    return found


def check_output_dir(out: Path) -> None:
    """Refuse, before any work, an output_dir that is a file or holds something other than a regeneration."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output_dir {out} is a file: give a folder (new or empty, or one to resume)")
    if out.is_dir() and any(out.iterdir()) and not (out / REGENERATION_FILE).is_file():
        raise ConfigError(f"--output_dir {out} already holds other files and no {REGENERATION_FILE}: give a new or "
                          "empty folder (a regeneration resumes only in its own folder)")


def open_output(out: Path, record: dict[str, Any]) -> str:
    """Check that `out` is new or holds this very regeneration (same target, tokenizer and settings): "new",
    "started" or "complete"."""
    check_output_dir(out)
    path = out / REGENERATION_FILE
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise DataError(f"{path} is damaged (not JSON): delete {out} and start again") from None
        differ = [f"{k} {old.get(part, {}).get(k)!r} there, {v!r} now" for part in ("target", "settings")
                  for k, v in record[part].items() if old.get(part, {}).get(k) != v]
        if old.get("tokenizer") != record["tokenizer"]:
            differ.append("another tokenizer")
        if differ:
            raise ConfigError(f"--output_dir {out} holds a regeneration with other settings ({'; '.join(differ[:3])}):"
                              " resume it with the same options, or give another --output_dir")
        return "complete" if old.get("complete") else "started"
    return "new"


def write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2) + "\n"))


def shard_path(out: Path, shard: int) -> Path:
    return out / "shards" / f"{shard:05d}.arrow"


def regenerate(make_generator: Callable[[], Generator], tokenizer, items: Items, cfg: RegenerateConfig, out: Path,
               target: dict[str, str], stops: list[int], rank: int = 0, world: int = 1,
               barrier: Callable[[], None] | None = None, show_progress: bool = True) -> Path:
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
    todo = [s for s in mine if not shard_path(out, s).is_file()]
    if todo:
        generator = make_generator()
        share = sum(min(cfg.shard_size, len(items) - s * cfg.shard_size) for s in mine)
        done = share - sum(min(cfg.shard_size, len(items) - s * cfg.shard_size) for s in todo)
        desc = "regenerate" + (f" (rank 0 of {world})" if world > 1 else "")
        with tqdm(total=share, initial=done, unit="item", desc=desc, dynamic_ncols=True,
                  disable=not show_progress or rank != 0) as bar:
            for s in todo:
                generator.start(derived_seed(cfg.seed, s))
                rows = items.rows[s * cfg.shard_size : (s + 1) * cfg.shard_size]
                regenerated = regenerate_shard(generator, tokenizer, rows, cfg, stops, bar.update)
                write_shard(regenerated, shard_path(out, s))
    barrier()  # every shard is on disk
    if rank == 0:
        merge(out, shards, cfg.output_format, record, show_progress)
    barrier()  # the merged result is there for every rank
    return out


def write_shard(rows: list[dict[str, Any]], path: Path) -> None:
    """The shard's rows as one Arrow file, renamed into place only when complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write_arrow(rows, tmp, ROW_FEATURES)
    os.replace(tmp, path)


def merge(out: Path, shards: int, output_format: str, record: dict[str, Any], report: bool = True) -> None:
    """Join the shards into the saved dataset (or JSONL), mark the record complete, delete the shards."""
    parts = datasets.concatenate_datasets([datasets.Dataset.from_file(str(shard_path(out, s))) for s in range(shards)])
    skipped = Counter(r for r in parts["skipped"] if r is not None)
    dropped = parts.filter(lambda why, n: why is None and n > 0, input_columns=["skipped", "dropped_turns"])
    kept = parts.filter(lambda why: why is None, input_columns="skipped").remove_columns(["skipped", "dropped_turns"])
    if len(kept) == 0:
        raise DataError(f"no item could be regenerated ({', '.join(f'{n} x {why}' for why, n in skipped.items())})")
    if output_format == "jsonl":
        def lines(tmp: str) -> None:
            with open(tmp, "w") as f:
                for row in kept.select_columns(["messages", "text"]):
                    f.write(json.dumps({"messages": row["messages"]} if row["messages"] is not None
                                       else {"text": row["text"]}) + "\n")
        atomic_write(out / JSONL_FILE, lines)
    else:
        save_dataset(kept, out)
    cut = {"conversations": len(dropped), "turns": sum(dropped["dropped_turns"])}
    write_json(out / REGENERATION_FILE, record | {"complete": True, "rows": len(kept), "skipped": dict(skipped),
                                                  "dropped_turns": cut})
    shutil.rmtree(out / "shards")
    if report:
        print(f"regenerated {len(kept)} items into {out}" + (f" ({sum(skipped.values())} skipped: "
              + ", ".join(f"{n} x {why}" for why, n in skipped.items()) + ")" if skipped else ""))
        if cut["turns"]:
            print(f"note: {cut['conversations']} conversations outgrew --max_length or the model's positions and end "
                  f"early: {cut['turns']} later answers were not regenerated")


def save_dataset(rows: datasets.Dataset, out: Path) -> None:
    """save_to_disk into `out` beside regeneration.json: saved aside, then moved in with state.json last."""
    aside = out / ".merging"
    shutil.rmtree(aside, ignore_errors=True)
    quiet = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        rows.save_to_disk(str(aside))
    finally:
        if not quiet:
            datasets.enable_progress_bars()
    names = {p.name for p in aside.iterdir()}
    for stale in out.glob("data-*.arrow"):
        if stale.name not in names:
            stale.unlink()
    for name in sorted(names, key=lambda n: n == "state.json"):
        os.replace(aside / name, out / name)
    aside.rmdir()


# ---------------------------------------------------------------- entry points


def regenerate_with_model(model, tokenizer, items: Items, cfg: RegenerateConfig, out: Path, target: dict[str, str],
                          rank: int = 0, world: int = 1, barrier: Callable[[], None] | None = None) -> Path:
    """Regenerate with a target already loaded in this process (self-distillation in train/loop.py); progress is
    shown by the launch's first process only."""
    stops = stop_token_ids(tokenizer, model.generation_config.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    return regenerate(lambda: TransformersGenerator(model, cfg, stops, pad), tokenizer, items, cfg, out, target,
                      stops, rank, world, barrier, show_progress=os.environ.get("RANK", "0") == "0")


def model_files(path: str) -> str:
    """A digest naming the target's files: sizes and times of a local folder's files, else the hub revision."""
    folder = Path(path)
    if folder.is_dir():
        h = hashlib.sha1()
        for f in sorted(folder.iterdir()):
            if f.is_file():
                h.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
        return h.hexdigest()[:16]
    from transformers import AutoConfig

    return str(getattr(AutoConfig.from_pretrained(path), "_commit_hash", None) or path)


def written_by(source: str, model: str) -> bool | None:
    """For a finished train/regenerate.py folder: whether `model` (the same files) wrote it; None for other data."""
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


def run(cfg: RegenerateConfig) -> Path:
    """The script: check the folder and the backend, read the items (rank 0 first), regenerate, merge."""
    from accelerate import PartialState
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from selfspec.shipped.models import resolve_model

    out = Path(cfg.output_dir)
    check_output_dir(out)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.backend == "vllm":
        if (why := vllm_missing()) is not None:
            raise ConfigError(why)
        if world > 1:
            raise ConfigError("--backend vllm runs in one process (vLLM batches on its own; "
                              "--tensor_parallel_size spans GPUs): launch it without several processes")
    multi_cpu = world > 1 and not torch.cuda.is_available()  # several CPU processes talk over gloo
    state = PartialState(cpu=multi_cpu, **({"backend": "gloo"} if multi_cpu else {}))
    path = resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = within_positions(cfg, AutoConfig.from_pretrained(path), state.is_main_process)
    with state.main_process_first():
        items = random_subset(load_items(cfg.dataset, cfg.split, tokenizer, cfg.max_length), cfg.max_examples,
                              cfg.seed)
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
    return regenerate(make_generator, tokenizer, items, cfg, out, target, stops, state.process_index,
                      state.num_processes, state.wait_for_everyone)


def within_positions(cfg: RegenerateConfig, config, report: bool = True) -> RegenerateConfig:
    """`cfg` with `max_length` at most the positions the target embeds (`max_position_embeddings` /
    `n_positions`): prompt + answer never ask for a position the model does not have (GPT-2-style models raise
    an IndexError past theirs); a conversation that outgrows them ends there, its later turns dropped."""
    from selfspec.infer.arguments import max_positions

    limit = max_positions(config)
    if limit is None or cfg.max_length <= limit:
        return cfg
    if cfg.prompt_tokens >= limit:
        raise ConfigError(f"--prompt_tokens ({cfg.prompt_tokens}) must be below the model's {limit} positions")
    if report:
        print(f"note: --max_length {cfg.max_length} is more than the model's {limit} positions: prompts and "
              f"answers are kept within {limit} tokens (conversations end there, text windows are {limit} tokens)")
    return dataclasses.replace(cfg, max_length=limit)


def main(argv: list[str] | None = None) -> None:
    """Options from the command line; a user error ends in one line (exit 2)."""
    run_main(lambda args: run(load_config(RegenerateConfig, args)), argv, prog="train/regenerate.py")


if __name__ == "__main__":
    main()
