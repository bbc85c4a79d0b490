"""Packing (train/data/packing.py): rows of several examples train exactly as the examples one by one.

The losses are means over their terms' label positions (Medusa: per head; EAGLE-3: per draft step; EAGLE-1 and
DFlash: one normaliser). So "a packed batch equals its examples one by one" is, per term, the sum of per-token
losses: packed mean_k == sum_e n_ek mean_ek / sum_e n_ek, values and gradients. Each term of an example alone
is isolated by making the decay's k-th power one-hot (`Power`). Dropping the boundaries (the drafters' and the
labels', or the target's) must break that equality: the mutation tests show the check can fail."""

import json
import math
import re
import time

import pytest
import torch

import selfspec.train.methods.step_loss as eagle3_module
from conftest import TOKENIZER_TEXT, VOCAB, tiny_model
from dflash_drafts import random_draft as random_dflash_draft
from selfspec.train.data.eagle_features import target_features
from selfspec.train.data.examples import examples_from_lists, pad_batch
from selfspec.train.data.packing import PackedExamples, check_packed_target, pack_rows
from selfspec.train.data.vocabulary import draft_vocabulary
from selfspec.train.methods.chunked_loss import labels_ahead
from selfspec.train.methods.dflash import DFlashMethod
from selfspec.train.methods.dflash_loss import anchor_carries, block_labels, decay_weights, sample_anchors
from selfspec.train.methods.step_loss import Labels
from selfspec.train.recipes.dflash import DFlashConfig
from train_methods import make_method

LENGTHS = [9, 6, 11, 4, 7, 5, 8]
MAX_LENGTH = 20
KINDS = ("medusa", "medusa-own-heads", "eagle", "eagle3", "dflash")


def examples(seed: int = 5):
    """Examples of LENGTHS: random tokens, a random loss mask that is 1 on each example's first two tokens (so
    a label read across a boundary would count)."""
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    masks = [[1, 1] + (torch.rand(n - 2, generator=gen) > 0.3).long().tolist() for n in LENGTHS]
    return examples_from_lists(ids, masks)


def packed_batch(data) -> dict[str, torch.Tensor]:
    rows = PackedExamples(data, MAX_LENGTH, seed=0)
    assert all(len(r) >= 2 for r in rows.rows)  # every row packs several examples
    batch = pad_batch([rows[r] for r in range(len(rows))])
    assert not batch["attention_mask"].all()  # and one row is padded after its last example
    return batch


def alone(data, i: int) -> dict[str, torch.Tensor]:
    return pad_batch([data[i]])


class Power:
    """Stands in for a decay d in `d ** k`: its k-th power is weights[k] (one-hot: one term of a loss
    alone)."""

    def __init__(self, weights: list[float]) -> None:
        self.weights = weights

    def __pow__(self, k: int) -> float:
        return self.weights[k]


def make(kind: str):
    if kind != "dflash":
        method = make_method(kind)
        if kind == "eagle":
            method.cfg.noise = 0.0  # no input noise: the packed and the lone pairs read the same features
        if kind == "eagle3":  # a draft vocabulary of the target's most frequent choices on these examples
            batch = pad_batch([examples()[i] for i in range(len(LENGTHS))])
            with torch.no_grad():
                choices = method.logits(method._unroll(batch)[2]).argmax(-1)
            method.trainable.set_draft_vocab(
                draft_vocabulary([(choices, batch["attention_mask"])], VOCAB, VOCAB // 4)
            )
        return method
    target = tiny_model("llama").requires_grad_(False)
    draft = random_dflash_draft(target, block=4).train()
    return DFlashMethod(DFlashConfig(block_size=4), target, draft, [])


def every_anchor(batch):
    """DFlash's anchors at every position that carries one (B, N), and which are real: the same blocks whether
    the examples are packed or alone."""
    carries = anchor_carries(batch)
    return sample_anchors(carries, carries.shape[1], torch.Generator().manual_seed(0))


def loss_of(method, kind: str, batch) -> tuple[torch.Tensor, dict]:
    if kind == "dflash":
        return method.block_loss(batch, *every_anchor(batch))
    return method.loss(batch)


def terms(method, kind: str, batch, monkeypatch) -> list[tuple[float, torch.Tensor, int]]:
    """Each term of the loss of a batch of one example: (its weight in the loss, its mean with gradients, its
    label positions)."""
    if kind in ("eagle", "dflash"):  # one normaliser: the pairs / the summed position weights
        loss, _ = loss_of(method, kind, batch)
        if kind == "eagle":
            return [(1.0, loss, method._predict(batch, 0.0)[0].shape[0])]
        labels = block_labels(batch, *every_anchor(batch), method.block)[1]
        return [
            (
                1.0,
                loss,
                float((decay_weights(method.block, method.cfg.decay_gamma, labels.device) * labels).sum()),
            )
        ]
    count = method.cfg.num_heads if kind.startswith("medusa") else method.cfg.ttt_steps
    decay = method.cfg.head_decay if kind.startswith("medusa") else eagle3_module.STEP_DECAY
    out = []
    for k in range(count):
        one_hot = Power([float(j == k) for j in range(count)])
        if kind.startswith("medusa"):
            monkeypatch.setattr(method.cfg, "head_decay", one_hot)
            n = int(labels_ahead(batch["input_ids"], batch["loss_mask"], k)[1].sum())
        else:
            monkeypatch.setattr(eagle3_module, "STEP_DECAY", one_hot)
            with torch.no_grad():
                ttt, _, states = method._unroll(batch)
            labels = Labels(states, batch, ttt.target_logits, ttt.chunk)
            n = int(method.trainable.t2d[labels.argmax[labels.step(k)[0]]].sum())
        out.append((decay**k, loss_of(method, kind, batch)[0], n))
        monkeypatch.undo()
    return out


def one_by_one(method, kind: str, data, monkeypatch) -> torch.Tensor:
    """The packed loss rebuilt from the examples alone: per term, their means weighted by their label
    positions."""
    per_example = [terms(method, kind, alone(data, i), monkeypatch) for i in range(len(data))]
    total = 0.0
    for k, (weight, _, _) in enumerate(per_example[0]):
        n = sum(ex[k][2] for ex in per_example)
        total = total + weight * sum(ex[k][1] * ex[k][2] for ex in per_example) / n
    return total


def grads(method, loss: torch.Tensor) -> list[torch.Tensor]:
    return torch.autograd.grad(loss, [p for p in method.trainable.parameters() if p.requires_grad])


def test_rows_hold_every_example_once_within_max_length():
    lengths = torch.randint(1, 60, (500,), generator=torch.Generator().manual_seed(0)).numpy()
    rows = pack_rows(lengths, 64, seed=1)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert max(sum(lengths[i] for i in row) for row in rows) <= 64
    assert len(rows) <= 1.08 * lengths.sum() / 64  # best fit: within 8% of the fewest rows possible
    assert rows == pack_rows(lengths, 64, seed=1) and rows != pack_rows(lengths, 64, seed=2)
    with pytest.raises(ValueError, match="does not fit a row of 8"):
        pack_rows(lengths, 8, seed=0)


def test_packed_rows_restart_positions_and_keep_loss_masks_and_features():
    data = examples()
    rows = PackedExamples(data, MAX_LENGTH, seed=0)
    batch = packed_batch(data)
    for r, members in enumerate(rows.rows):
        at = 0
        for j, i in enumerate(members):
            n = LENGTHS[i]
            assert batch["input_ids"][r, at : at + n].tolist() == data[i]["input_ids"].tolist()
            assert batch["loss_mask"][r, at : at + n].tolist() == data[i]["loss_mask"].bool().tolist()
            assert batch["position_ids"][r, at : at + n].tolist() == list(range(n))
            assert (batch["seq_ids"][r, at : at + n] == j).all()
            at += n
        assert not batch["attention_mask"][r, at:].any() and not batch["loss_mask"][r, at:].any()
        assert (batch["seq_ids"][r, at:] == -1).all() and batch["position_ids"][r, at:].tolist() == list(
            range(batch["input_ids"].shape[1] - at)
        )
    with_features = type(data)(data.rows, data.key, lambda i: torch.full((LENGTHS[i], 3), float(i)))
    row = PackedExamples(with_features, MAX_LENGTH, seed=0)[0]
    assert row["features"][:, 0].tolist() == [float(i) for i in rows.rows[0] for _ in range(LENGTHS[i])]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_target_features_of_a_packed_row_are_each_examples_alone(arch, attn):
    """transformers keeps packed examples apart when given restarting position_ids and no 2D mask, on every
    tested architecture and attention backend; the hidden states EAGLE-3 fuses too."""
    target = tiny_model(arch, attn=attn)
    check_packed_target(target)
    data = examples()
    batch = packed_batch(data)
    rows = PackedExamples(data, MAX_LENGTH, seed=0).rows
    for layers in (None, [1]):
        packed = target_features(target, batch["input_ids"], None, layers, batch["position_ids"])
        for r, members in enumerate(rows):
            at = 0
            for i in members:
                one = target_features(
                    target, data[i]["input_ids"][None].long(), torch.ones(1, LENGTHS[i]), layers
                )
                torch.testing.assert_close(packed[r, at : at + LENGTHS[i]], one[0], rtol=1e-4, atol=1e-5)
                at += LENGTHS[i]


def test_a_target_that_lets_packed_examples_see_each_other_is_refused(monkeypatch):
    target = tiny_model("llama")
    forward = target.base_model.forward
    monkeypatch.setattr(target.base_model, "forward", lambda position_ids=None, **kw: forward(**kw))
    with pytest.raises(ValueError, match="lets packed examples see each other"):
        check_packed_target(target)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_loss_equals_its_examples_one_by_one(kind, monkeypatch):
    method = make(kind)
    method.chunk = 5  # several chunks per term, as in test_chunked_loss
    data = examples()
    packed, packed_logs = loss_of(method, kind, packed_batch(data))
    reference = one_by_one(method, kind, data, monkeypatch)
    torch.testing.assert_close(packed, reference, rtol=1e-5, atol=1e-6)
    for g, ref in zip(grads(method, packed), grads(method, reference), strict=True):
        assert ref.abs().sum() > 0
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6)
    # and the same examples padded one per row (the unpacked batch) give the packed loss and logs
    padded, padded_logs = loss_of(method, kind, pad_batch([data[i] for i in range(len(data))]))
    assert padded_logs.keys() == packed_logs.keys()
    for name in padded_logs:
        torch.testing.assert_close(packed_logs[name], padded_logs[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("dropped", ["seq_ids", "position_ids"])
@pytest.mark.parametrize("kind", KINDS)
def test_dropping_the_boundaries_breaks_the_equality(kind, dropped):
    """Without seq_ids the drafters attend and the labels reach across examples (the target still runs
    packed); without position_ids the target attends across them and the positions run on. Either way the
    packed loss is no longer its examples' (so the test above can fail)."""
    method = make(kind)
    batch = packed_batch(examples())
    right = loss_of(method, kind, batch)[0]
    blind = {k: v for k, v in batch.items() if k != dropped}
    wrong = loss_of(method, kind, blind)[0]
    assert not torch.allclose(right, wrong, rtol=1e-3, atol=1e-4)


def chat_file(path):
    """Conversations of varied lengths (the tiny tokenizer's chat template)."""
    lines = [line for line in TOKENIZER_TEXT.splitlines() if line]
    rows = [
        {
            "messages": [
                {"role": "user", "content": lines[i % len(lines)]},
                {"role": "assistant", "content": "\n".join(lines[: 1 + i * 7 % len(lines)])},
            ]
        }
        for i in range(48)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


REPORT = re.compile(
    r"throughput: ([\d,]+) tok/s, padding ([\d.]+)%; step time (\d+) ms: target forward (\d+) ms, "
    r"drafter forward\+backward (-?\d+) ms, optimizer (\d+) ms"
)


@pytest.mark.parametrize("recipe", ["eagle", "medusa"])
def test_a_packed_run_trains_and_reports_less_padding(recipe, tiny_model_dir, tmp_path, monkeypatch, capsys):
    from conftest import medusa_args
    from recipe_args import eagle_args
    from selfspec.train.eagle import run as run_eagle
    from selfspec.train.loop.config import load_config
    from selfspec.train.medusa import run as run_medusa
    from selfspec.train.recipes.eagle import EagleConfig
    from selfspec.train.recipes.medusa import MedusaConfig

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    data = chat_file(tmp_path / "chats.jsonl")
    padding = {}
    for packing in (False, True):
        extra = {"max_length": 96, "max_steps": 3, "eval_steps": 3, "packing": packing, "eval_fraction": 0.1}
        args = (eagle_args if recipe == "eagle" else medusa_args)(
            tiny_model_dir, data, tmp_path / f"{packing}", **extra
        )
        history = (
            run_eagle(load_config(EagleConfig, args))
            if recipe == "eagle"
            else run_medusa(load_config(MedusaConfig, args))
        )["history"]
        assert all(math.isfinite(metrics["loss"]) for _, metrics in history)
        printed = capsys.readouterr().out
        assert ("packed into" in printed) == packing
        report = REPORT.search(printed)
        assert report is not None, printed
        padding[packing] = float(report.group(2))
        assert float(report.group(1).replace(",", "")) > 0 and int(report.group(4)) > 0
        # the split adds up: validation's target forwards are not counted as a training step's
        assert int(report.group(5)) >= 0 and int(report.group(4)) <= int(report.group(3)), report.group(0)
    assert padding[True] < padding[False] / 2, padding


def test_the_step_timer_counts_nothing_while_paused():
    from selfspec.train.loop.step_timer import StepTimer

    timer = StepTimer()
    with timer.section("target"):
        pass
    counted = timer.seconds()["target"]
    with timer.paused(), timer.section("target"):
        time.sleep(0.05)
    assert timer.seconds()["target"] == counted and timer.enabled


def test_the_first_validation_is_no_part_of_the_step_split(
    tiny_model_dir, text_data, tmp_path, monkeypatch, capsys
):
    """A fresh run validates before step 1; its target forwards once counted as training steps' (the drafter's
    share came out negative). A validation made slow inside a target section must leave the split alone."""
    from conftest import medusa_args
    from selfspec.train.loop import training
    from selfspec.train.loop.config import load_config
    from selfspec.train.medusa import run as run_medusa
    from selfspec.train.recipes.medusa import MedusaConfig

    validate = training.validate

    def slow(run, write):
        with run.timer.section("target"):
            time.sleep(0.5)
        validate(run, write)

    monkeypatch.setattr(training, "validate", slow)
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    args = medusa_args(tiny_model_dir, text_data, tmp_path / "out", max_steps=2, eval_steps=2, save_steps=2)
    run_medusa(load_config(MedusaConfig, args))
    report = REPORT.search(capsys.readouterr().out)
    assert report is not None and int(report.group(4)) < 100, report.group(
        0
    )  # 2 steps: 250 ms each if counted
