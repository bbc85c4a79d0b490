"""Benchmark decoding methods on the same prompts, in one process, against `model.generate` greedy.

Prompts run in batches of a given size (left-padded; 1: one prompt at a time). Reports per method:
tokens/s (all rows' new tokens, each row's up to and including its EOS, over the wall time), speedup
vs the baseline measured in the same run at the same batch size (aggregate and median per batch), tau
(tokens per decode-phase target forward of a row), target forwards, and whether every row's output
equals the baseline's token ids. Methods run interleaved batch by batch so that machine noise hits
them alike. The tables and the plot of these results are infer/measure/bench_report.py's.
"""

from __future__ import annotations

import contextlib
import json
import re
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from selfspec.infer.core.arguments import eos_set
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.core.tree import LatencyCurve, tree_from_parents
from selfspec.infer.measure.launches import LaunchCounter
from selfspec.shipped.stdlib_corpus import stdlib_files

# a method under test: (ids (B, T) left-padded, attention_mask (B, T)) -> each row's new tokens (up to and
# including its first EOS), and the call's stats (None: it keeps none)
Runner = Callable[[torch.Tensor, torch.Tensor], tuple[list[list[int]], dict | None]]


def default_prompts(n: int = 16, context_lines: int = 12) -> list[str]:
    """Openings of functions from the demo corpus's test split: some lines of context, the `def` line
    and its next line (often the docstring's start). Spread over files, deterministic."""
    prompts = []
    files = stdlib_files("test")
    for path in files:
        lines = path.read_text(errors="replace").splitlines(keepends=True)
        defs = [i for i, line in enumerate(lines) if re.match(r"\s*def \w+\(.*\):\s*$", line)]
        if len(defs) < 2:
            continue
        i = defs[len(defs) // 2]  # one function from the middle of each file
        prompts.append("".join(lines[max(0, i - context_lines) : i + 2]))
    step = max(1, len(prompts) // n)
    return prompts[::step][:n]


def encode_prompt(tokenizer, text: str) -> torch.Tensor:
    """A prompt's ids (1, T) with the tokenizer's special tokens, except where the text already starts with
    the BOS token (a prompt rendered by a chat template carries its own; adding another would double it)."""
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos):
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tokenizer(text, return_tensors="pt").input_ids


Prompt = str | list[dict[str, str]]  # a text to continue, or a chat (OpenAI messages) to answer


def load_prompts(path: str | Path) -> list[Prompt]:
    """A .jsonl file with one {"prompt": "..."} or one {"messages": [{"role": ..., "content": ...}, ...]} per
    line (a chat, answered through the tokenizer's chat template by `render_prompts`); a bad line is an error
    naming it."""
    layout = 'write one {"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]} per line'
    try:
        text = Path(path).read_text(
            encoding="utf-8-sig"
        )  # a byte-order mark, as some editors write, is skipped
    except (OSError, UnicodeDecodeError) as e:
        reason = (e.strerror or str(e)) if isinstance(e, OSError) else "not UTF-8 text"
        raise ValueError(f"--prompts {path}: cannot read it ({reason})") from None
    prompts: list[Prompt] = []
    # lines end at \n only, as JSONL's do: JSON text may hold U+2028 and other characters
    # splitlines() breaks at
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--prompts {path}:{n} is not JSON ({e.msg}): {layout}") from None
            if isinstance(record, dict) and isinstance(record.get("prompt"), str):
                if not record["prompt"].strip():
                    raise ValueError(
                        f"--prompts {path}:{n} has an empty prompt: give each line some text to continue"
                    )
                prompts.append(record["prompt"])
            elif isinstance(record, dict) and "messages" in record:
                prompts.append(checked_messages(record["messages"], f"--prompts {path}:{n}"))
            else:
                raise ValueError(f'--prompts {path}:{n} has no "prompt" string or "messages" list: {layout}')
    if not prompts:
        raise ValueError(f"--prompts {path} holds no prompts: {layout}")
    return prompts


def checked_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """A chat to answer: a non-empty list of {"role", "content"} text turns that does not end on the
    answer."""
    fine = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )
    if not fine:
        raise ValueError(
            f'{where}: "messages" must be a non-empty list of {{"role": ..., "content": "..."}} turns'
        )
    if messages[-1]["role"] == "assistant":
        raise ValueError(
            f"{where}: the chat ends on an assistant turn; end it on the turn to answer (a user turn)"
        )
    return messages


def render_prompts(prompts: list[Prompt], tokenizer) -> list[str]:
    """Each chat rendered by the tokenizer's chat template up to the answer (`add_generation_prompt=True`),
    as `model.generate` users render theirs; texts are kept as they are."""
    if any(not isinstance(p, str) for p in prompts) and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            'the prompts are chats ("messages"), and the model\'s tokenizer has no chat template to '
            'render them with: give {"prompt": "..."} texts instead'
        )
    return [
        p
        if isinstance(p, str)
        else tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]


def left_pad(rows: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as one batch, padded on the left as the tokenizer's left padding does
    (every row's last token is the last column, where generation continues): ids (B, T) and attention_mask
    (B, T), 0 on the padding."""
    width = max(row.numel() for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    for i, row in enumerate(rows):
        ids[i, width - row.numel() :] = row
        mask[i, width - row.numel() :] = 1
    return ids, mask


def new_rows(out: torch.Tensor, prompt_len: int, eos: set[int]) -> list[list[int]]:
    """Each row's new tokens in a `generate` output (B, T + k), cut after the row's first EOS: a row that
    stopped before the others is filled with pad tokens, which are not tokens it generated."""
    rows = []
    for row in out[:, prompt_len:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows


def hf_runner(
    model, max_new_tokens: int, eos: int | list[int] | None, pad: int | None, **generate_kwargs
) -> Runner:
    """`model.generate` greedy (plus e.g. `assistant_model=` or `prompt_lookup_num_tokens=`, which
    transformers runs at batch size 1 only); a forward hook counts the target's forward passes, so its tau is
    measured the same way as ours."""
    stop = eos_set(eos if eos is not None else model.generation_config.eos_token_id)

    def run(ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[list[list[int]], dict | None]:
        calls = [0]
        handle = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            out = model.generate(
                ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=pad,
                **generate_kwargs,
            )
        finally:
            handle.remove()
        rows = new_rows(out, ids.shape[1], stop)
        tokens = sum(len(row) - 1 for row in rows)  # after each row's first, which the prefill chose
        # one row: every forward after the prefill is one of its steps (assisted generation checks several
        # tokens in one); a batch (plain greedy): every forward gives each row that has not stopped one token
        steps = calls[0] - 1 if len(rows) == 1 else tokens
        return rows, {"target_forwards": calls[0], "decode_steps": steps, "decode_tokens": tokens}

    return run


@contextlib.contextmanager
def host_syncs(device: torch.device) -> Iterator[Callable[[], int | None]]:
    """Within: count the host syncs on CUDA (torch's sync debug mode warns at each one). Yields a function
    giving the count so far; None off CUDA, where nothing waits."""
    if device.type != "cuda":
        yield lambda: None
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield lambda: sum("synchronizing" in str(w.message) for w in caught)
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def speculative_runner(
    spec: SpeculativeModel, max_new_tokens: int, eos: int | list[int] | None, pad: int | None = None
) -> Runner:
    stop = eos_set(eos if eos is not None else spec.model.generation_config.eos_token_id)

    def run(ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[list[list[int]], dict | None]:
        # greedy like the baseline; the rest of the target's generation_config applies to both alike
        # (or is refused)
        with host_syncs(ids.device) as syncs:
            out = spec.generate(
                ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos,
                do_sample=False,
                pad_token_id=pad,
            )
        return new_rows(out, ids.shape[1], stop), spec.last_stats.as_dict() | {"host_syncs": syncs()}

    return run


def top2_margin(model, prompt_ids: torch.Tensor, new_ids: list[int], position: int) -> tuple[float, bool]:
    """The target's top-1 minus top-2 logit where the baseline chose new_ids[position], and whether that is
    a near-tie: within 4 units in the last place of the model's dtype at that logit's size, where a
    different but equally valid summation order (a tree forward vs a one-token forward) can flip argmax."""
    ids = torch.cat([prompt_ids[0].cpu(), torch.tensor(new_ids[:position], dtype=torch.long)])[None]
    with torch.no_grad():
        logits = model(ids.to(model.device)).logits[0, -1]
    top = logits.float().topk(2).values
    margin = float(top[0] - top[1])
    ulp = torch.finfo(logits.dtype).eps * max(1.0, abs(float(top[0])))
    return margin, margin <= 4 * ulp


def chain_acceptance(accepted: list[int], drafted: list[int]) -> dict:
    """The per-token acceptance rate alpha of a chain drafter, and the seed paper's tokens per target pass.

    Each step drafts gamma tokens; tokens are accepted up to the first rejection, so alpha is estimated
    as accepted / tried, where a step tried its accepted tokens plus the rejected one (if any). The
    prediction (1 - alpha^(gamma+1)) / (1 - alpha) is averaged over the steps' gamma (prompt lookup
    drafts a varying number; a step with nothing drafted yields exactly one token).
    """
    tried = sum(a + (a < d) for a, d in zip(accepted, drafted))
    alpha = sum(accepted) / tried if tried else 0.0
    per_step = [(d + 1) if alpha == 1 else (1 - alpha ** (d + 1)) / (1 - alpha) for d in drafted]
    return {"alpha": alpha, "predicted_tau": statistics.fmean(per_step) if per_step else 1.0}


DRIFT_STEPS = 100  # steps compared at the start and at the end of long generations


def step_drift(stats: list[dict]) -> dict:
    """Mean step time (ms) over the first and the last DRIFT_STEPS decode steps of the generations with at
    least twice that many: a cache that copies itself per step makes late steps slower than early ones."""
    long = [s["step_times"] for s in stats if len(s.get("step_times", [])) >= 2 * DRIFT_STEPS]
    if not long:
        return {}
    first = statistics.fmean(t for times in long for t in times[:DRIFT_STEPS])
    last = statistics.fmean(t for times in long for t in times[-DRIFT_STEPS:])
    return {"step_ms_first_100": 1e3 * first, "step_ms_last_100": 1e3 * last}


def launches_per_step(model, run: Runner, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """One more run of the first batch, its kernel launches counted (infer/measure/launches.py): per target
    forward, outside and inside the target's forward (a baseline without statistics: per new token of its
    longest row)."""
    with LaunchCounter(model).counting() as counter:
        rows, st = run(ids, mask)
    steps = len(st["step_times"]) if st and "step_times" in st else max(1, max(map(len, rows)))
    return {"outside": counter.outside / steps, "inside": counter.inside / steps}


def run_bench(
    model,
    tokenizer,
    runners: dict[str, Runner],
    prompts: list[str],
    warmup: int = 1,
    chains: frozenset[str] = frozenset(),
    batch_size: int = 1,
    pad_token_id: int | None = None,
) -> dict:
    """Run every method on every batch of `batch_size` consecutive prompts (the last batch may be smaller),
    left-padded with `pad_token_id`; the methods take turns batch by batch, after `warmup` batches that are
    not timed. The first method is the baseline. Methods named in `chains` draft chains and also get alpha and
    the seed paper's predicted tau."""
    if batch_size > 1 and pad_token_id is None:
        raise ValueError(
            "batches of several prompts are left-padded: pass pad_token_id (the tokenizer's pad token, "
            "else its EOS)"
        )
    encoded = [encode_prompt(tokenizer, p) for p in prompts]  # each (1, T_i), unpadded
    batches = []
    for first in range(0, len(encoded), batch_size):
        ids, mask = left_pad(
            [row[0] for row in encoded[first : first + batch_size]],
            pad_token_id if pad_token_id is not None else 0,
        )  # a batch of one has no padding
        batches.append((ids.to(model.device), mask.to(model.device)))
    for ids, mask in batches[:warmup]:
        for run in runners.values():
            run(ids, mask)
    launches = (
        {name: launches_per_step(model, run, *batches[0]) for name, run in runners.items()} if warmup else {}
    )
    names = list(runners)
    outs = {n: [] for n in names}  # each prompt's new tokens, in prompt order
    tokens = {n: [] for n in names}  # per batch
    secs = {n: [] for n in names}  # per batch
    stats = {n: [] for n in names}  # per batch
    memory: dict[str, float] = {}
    cuda = torch.device(model.device).type == "cuda"
    for ids, mask in batches:
        for name in names:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            rows, st = runners[name](ids, mask)
            secs[name].append(time.perf_counter() - t)
            outs[name].extend(rows)
            tokens[name].append(sum(map(len, rows)))
            stats[name].append(st)
            if cuda:  # peak memory is only measured where torch tracks it (CUDA)
                memory[name] = max(memory.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**20)
    base = names[0]
    result = {"baseline": base, "num_prompts": len(prompts), "methods": {}}
    base_tps = sum(tokens[base]) / sum(secs[base])
    for name in names:
        tps = sum(tokens[name]) / sum(secs[name])
        per_batch = [
            (n / s) / (b / bs) for n, s, b, bs in zip(tokens[name], secs[name], tokens[base], secs[base]) if b
        ]
        entry = {
            "tokens_per_s": tps,
            "speedup": tps / base_tps,
            "median_speedup": statistics.median(per_batch),
            "new_tokens": sum(tokens[name]),
            "identical_to_baseline": all(o == b for o, b in zip(outs[name], outs[base])),
        }
        st = [s for s in stats[name] if s]
        steps = sum(s["decode_steps"] for s in st)  # row-steps: one per row per step it was decoding in
        entry |= {
            "tau": sum(s["decode_tokens"] for s in st) / max(1, steps),
            "target_forwards": sum(s["target_forwards"] for s in st),
        }
        if st and "draft_s" in st[0]:
            batched_steps = sum(len(s["step_times"]) for s in st)  # one per step of a whole batch
            entry["ms_per_step"] = {
                k: 1e3 * sum(s[f"{k}_s"] for s in st) / max(1, batched_steps)
                for k in ("draft", "verify", "bookkeeping")
            }
            entry["accept_lengths"] = [n for s in st for n in s["accept_lengths"]]
        if st and st[0].get("host_syncs") is not None:  # CUDA: the prefill's and the output's few included
            entry["host_syncs_per_step"] = sum(s["host_syncs"] for s in st) / max(
                1, sum(len(s["step_times"]) for s in st)
            )
        entry |= step_drift(st)
        if name in launches:
            entry["launches_per_step"] = launches[name]
        if name in chains and st:
            entry |= chain_acceptance(
                [a for s in st for a in s["accepted_drafts"]], [d for s in st for d in s["drafted"]]
            )
        if name in memory:
            entry["peak_memory_mb"] = memory[name]
        mismatches = []
        for i, (o, b) in enumerate(zip(outs[name], outs[base])):
            if o != b:
                pos = next((j for j, (x, y) in enumerate(zip(o, b)) if x != y), min(len(o), len(b)))
                # the prompt as it is, without its batch's padding
                margin, tie = top2_margin(model, encoded[i], b, pos) if pos < len(b) else (None, False)
                mismatches.append(
                    {"prompt": i, "position": pos, "top2_logit_margin": margin, "near_tie": tie}
                )
        if mismatches:
            entry["mismatches"] = mismatches
            entry["all_mismatches_near_ties"] = all(m["near_tie"] for m in mismatches)
        result["methods"][name] = entry
    return result


LATENCY_SIZES = [1, 2, 4, 8, 16, 32, 64]


def latency_report(model, result: dict, tree_nodes: dict[str, int], batch_size: int = 1) -> dict:
    """The target's forward time t(n) against n tokens on a cached prefix, as t(n)/t(1), and per drafter its
    efficiency: the tokens/s it reached over the limit tau * t(1) / t(its tree) for its measured tau (1 means
    drafting and bookkeeping cost nothing). `result` is run_bench's, `tree_nodes` each drafter's largest
    tree."""
    sizes = sorted(set(LATENCY_SIZES) | {n for n in tree_nodes.values() if n})
    curve = forward_latency(model, sizes, batch_size=batch_size)
    t1 = curve.measured[1]
    report = {
        "ms": {n: 1e3 * t for n, t in curve.measured.items()},
        "ratio": {n: t / t1 for n, t in curve.measured.items()},
        "methods": {},
    }
    plain = result["methods"].get("plain")
    for name, nodes in tree_nodes.items():
        m = result["methods"].get(name)
        if not m or not nodes:
            continue
        limit = m["tau"] * t1 / curve.measured[nodes]  # tokens per second of t(1) time, at no drafting cost
        reached = m["tokens_per_s"] * t1 / batch_size
        report["methods"][name] = {"nodes": nodes, "limit_speedup": limit, "efficiency": reached / limit}
    if plain:
        report["plain_ms_per_token"] = 1e3 * batch_size / plain["tokens_per_s"]
    return report


@torch.no_grad()
def forward_latency(
    model,
    sizes: list[int],
    prefix_len: int = 256,
    repeats: int = 15,
    timer: Callable[[], float] = time.perf_counter,
    batch_size: int = 1,
) -> LatencyCurve:
    """Seconds of one target forward of n tree nodes on top of a cached prefix, for each n in `sizes`; with
    `batch_size` B, of B rows' trees of n nodes each in one forward (a batch makes wide trees dearer).

    The sizes take turns: after a warm-up round, each of `repeats` rounds times every size once, so a
    busy spell of the machine lands on several sizes once each instead of on every repeat of one.
    Each size keeps the 20th percentile of its rounds and the curve is made non-decreasing in n
    (tree.LatencyCurve); its `spread` says how disturbed the timings were.
    """
    from selfspec.infer.core.cache import new_cache
    from selfspec.infer.core.mask import RowMask
    from selfspec.infer.core.target import Target

    target = Target(model)
    vocab, largest = target.vocab_size, max(sizes)
    gen = torch.Generator().manual_seed(0)
    B = batch_size
    prefix = torch.randint(0, vocab, (B, prefix_len), generator=gen).to(target.device)
    trees = {
        n: tree_from_parents([-1] + [0] * (n - 1), list(range(n))).to(target.device) for n in sizes
    }  # stars
    tokens = {n: torch.randint(0, vocab, (B, n), generator=gen).to(target.device) for n in sizes}
    cache = new_cache(model, prefix_len + largest)
    target.prefill_rows(prefix, cache, hidden=False)  # once: every timed forward starts from this prefix
    mask = RowMask(B, largest, prefix_len + largest, target.dtype, target.device)
    mask.open(torch.zeros(B, dtype=torch.long, device=target.device), prefix_len)  # every row sees its prefix
    positions = {n: (prefix_len + trees[n].depths)[None].expand(B, -1) for n in sizes}
    sync = torch.cuda.synchronize if target.device.type == "cuda" else lambda: None
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for round_ in range(repeats + 1):  # round 0 warms up the kernels and is not kept
        for n in sizes:
            sync()
            start = timer()
            target.verify_rows(
                tokens[n], positions[n], mask.at(prefix_len, trees[n].ancestors.expand(B, -1, -1)), cache
            )
            sync()
            if round_:
                samples[n].append(timer() - start)
            cache.crop(-n)  # back to the prefix alone
    return LatencyCurve.from_samples(samples)
