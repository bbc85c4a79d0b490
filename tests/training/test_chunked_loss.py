"""The recipes' losses are computed a chunk of positions at a time, so their memory does not grow with
batch x length x vocabulary: each equals the straightforward formula (value, logged parts, gradients of
every trainable parameter, also under bf16 autocast), and at a 32K vocabulary it needs clearly less memory."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from conftest import VOCAB
from selfspec.train.methods.chunked_loss import labels_ahead
from selfspec.train.methods.eagle import Eagle3Method, EagleMethod
from selfspec.train.methods.medusa import MedusaMethod
from selfspec.train.methods.step_loss import STEP_DECAY
from train_methods import KINDS, make_batch, make_method

# ------------------------------------------------------------- the straightforward formulas (before chunking)


def medusa_reference(method: MedusaMethod, batch):
    """Every head's logits over every position (B, T, V), the masked rows in float32."""
    hidden = method._hidden(batch)
    total, logs = 0.0, {}
    for k, logits in enumerate(method.trainable(hidden, method.lm_head)):
        labels, mask = labels_ahead(batch["input_ids"], batch["loss_mask"], k)
        ce = F.cross_entropy(logits[mask].float(), labels[mask])
        total = total + method.cfg.head_decay**k * ce
        logs[f"head{k}_loss"] = ce.detach()
    return total, logs | {"loss": total.detach()}


def eagle_reference(method: EagleMethod, batch):
    """The target's and the drafter's float32 logits over the whole vocabulary at every kept pair at once."""
    pred, true = method._predict(batch, method.cfg.noise)
    with torch.no_grad():
        target_logits = method.logits(true)  # (N, V)
    reg = F.smooth_l1_loss(pred.float(), true.float())
    cls = -(target_logits.softmax(-1) * method.logits(pred).log_softmax(-1)).sum(-1).mean()
    total = reg + method.cfg.w_cls * cls
    return total, {"loss": total.detach(), "reg_loss": reg.detach(), "cls_loss": cls.detach()}


def eagle3_reference(method: Eagle3Method, batch):
    """The target's float32 logits (B, T, V) and its distributions over the draft vocabulary at every
    position."""
    _, outputs, states = method._unroll(batch)
    draft = method.trainable
    with torch.no_grad():
        logits = method.logits(states)[
            :, 1:
        ]  # the label of step i at t is the target's prediction at t + 1 + i
    argmax, probs = logits.argmax(-1), torch.softmax(logits.index_select(-1, draft.draft_ids), dim=-1)
    ids, attn = batch["input_ids"], batch["attention_mask"]
    total, logs = outputs[0].sum() * 0.0, {}
    for i, out in enumerate(outputs):
        length = argmax.shape[1] - i
        visible = attn[:, 2 + i :].bool()
        keep = labels_ahead(ids, batch["loss_mask"], i)[1][:, :length] & F.pad(
            visible, (0, length - visible.shape[1])
        )
        keep = keep & draft.t2d[argmax[:, i:]]
        logq = torch.log_softmax(draft.logits(out[:, :length][keep]).float(), dim=-1)
        ce = -(probs[:, i:][keep] * logq).sum(-1).mean()
        total = total + STEP_DECAY**i * ce
        logs[f"step{i}_loss"] = ce.detach()
    return total, logs | {"loss": total.detach()}


REFERENCE = {
    "medusa": medusa_reference,
    "medusa-own-heads": medusa_reference,
    "eagle": eagle_reference,
    "eagle3": eagle3_reference,
}


def loss_and_grads(loss_fn, method, batch):
    torch.manual_seed(0)  # EAGLE's input noise: the same draw for both
    loss, logs = loss_fn(method, batch)
    params = [p for p in method.trainable.parameters() if p.requires_grad]
    return loss, logs, torch.autograd.grad(loss, params)


def kept_positions(batch) -> int:
    """Positions the loss projects (head 0's, EAGLE's pairs, EAGLE-3's step 0): the precondition for
    chunking."""
    return int(labels_ahead(batch["input_ids"], batch["loss_mask"], 0)[1].sum())


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_loss_and_gradients_equal_the_straightforward_formula(kind):
    method = make_method(kind)
    batch = make_batch(VOCAB, 3, 24)
    method.chunk = 5
    assert kept_positions(batch) > 4 * method.chunk  # several chunks, one of them partial
    loss, logs, grads = loss_and_grads(type(method).loss, method, batch)
    ref_loss, ref_logs, ref_grads = loss_and_grads(REFERENCE[kind], method, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert logs.keys() == ref_logs.keys()
    for name in logs:
        torch.testing.assert_close(logs[name], ref_logs[name], rtol=1e-5, atol=1e-6, msg=name)
    assert len(grads) == len(ref_grads) and all(g.abs().sum() > 0 for g in ref_grads)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6)


def test_eagle3_leaves_out_targets_choices_outside_the_draft_vocabulary():
    """The precondition that makes the EAGLE-3 case above test the draftable filter."""
    method = make_method("eagle3")
    batch = make_batch(VOCAB, 3, 24)
    with torch.no_grad():
        _, _, states = method._unroll(batch)
        choices = method.logits(states).argmax(-1)[batch["loss_mask"]]
    assert 0 < int(method.trainable.t2d[choices].sum()) < choices.numel()


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_loss_under_bf16_autocast_with_a_bf16_target(kind):
    """The loop's mixed precision: autocast, and the target (its lm_head too) loaded in bf16."""
    method = make_method(kind, target_dtype=torch.bfloat16)
    batch = make_batch(VOCAB, 3, 24)
    method.chunk = 5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, logs, grads = loss_and_grads(type(method).loss, method, batch)
        ref_loss, ref_logs, ref_grads = loss_and_grads(REFERENCE[kind], method, batch)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-4)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_evaluation_without_autocast_reads_a_bf16_target(kind):
    """The loop validates outside autocast: a bf16 target's features and lm_head meet a float32 drafter, whose
    forward accelerate runs under autocast (as it prepares it for mixed precision)."""
    from accelerate import Accelerator

    from selfspec.train.loop.method import RunContext

    method = make_method(kind, target_dtype=torch.bfloat16)
    method.start(RunContext(Accelerator(mixed_precision="bf16", cpu=True).prepare_model(method.trainable)))
    method.chunk = 5
    with torch.no_grad():
        metrics = method.evaluate([make_batch(VOCAB, 3, 24)])
    assert metrics["loss"] > 0 and all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


@pytest.mark.parametrize("kind", ["medusa", "medusa-own-heads"])
def test_medusa_validation_counts_each_rank_path_as_a_walk_over_every_position_does(kind, tmp_path):
    """The path frequencies validation keeps (chunked, rank vectors binned) equal ranks read off every head's
    whole logits position by position, and the saved tree is the most frequent of those paths."""
    from selfspec.infer.core.tree import best_choices, path_frequencies
    from selfspec.train.methods.medusa import PATHS_KEPT, RANKS, measured_paths

    vocab = 16  # a small vocabulary: labels often among the first RANKS, so paths of every depth occur
    method = make_method(kind, vocab=vocab)
    method.trainable.eval()
    method.chunk = 7  # several chunks per head
    batches = [make_batch(vocab, 2, 20 + s, seed=s) for s in range(3)]
    rows = []
    with torch.no_grad():
        metrics = method.evaluate(batches)
        for batch in batches:
            logits = method.trainable(method._hidden(batch), method.lm_head)  # K x (B, T, V)
            labels = [labels_ahead(batch["input_ids"], batch["loss_mask"], k) for k in range(3)]
            every = torch.stack([mask for _, mask in labels]).all(0)
            for b, t in every.nonzero().tolist():
                order = [logits[k][b, t].argsort(descending=True)[:RANKS].tolist() for k in range(3)]
                token = [int(labels[k][0][b, t]) for k in range(3)]
                rows.append([order[k].index(token[k]) if token[k] in order[k] else RANKS for k in range(3)])
    expected = path_frequencies(torch.tensor(rows), RANKS)
    kept = {tuple(path): expected[tuple(path)] for path in best_choices(expected, PATHS_KEPT)}
    measured = measured_paths(metrics)
    assert len(kept) > 20 and max(map(len, kept)) == 3 and measured.keys() == kept.keys()
    assert all(measured[path] == pytest.approx(f, abs=1e-12) for path, f in kept.items())
    method.cfg.tree_nodes = 6
    method.save(method.trainable, tmp_path, metrics)
    assert method.trainable.config.tree == best_choices(expected, 6)


# ------------------------------------------------------------------ memory


def peak_bytes(fn) -> int:
    """Peak CPU memory torch allocated while running fn, above what was allocated before: the running sum of
    every op's own allocations and frees, in the order they happened."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    now = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        now += event.self_cpu_memory_usage
        peak = max(peak, now)
    return peak


LESS_MEMORY = 3  # how many times less memory chunking needs at least


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_loss_needs_clearly_less_memory_at_a_32k_vocabulary(kind):
    vocab = 32768
    method = make_method(kind, vocab=vocab)
    batch = make_batch(vocab, 2, 160)
    method.chunk = 32
    assert kept_positions(batch) > 4 * method.chunk

    def step(loss_fn):
        torch.manual_seed(0)
        loss_fn(method, batch)[0].backward()

    step(type(method).loss)  # warm up: one-time allocations are not the loss's
    chunked, straightforward = (
        peak_bytes(lambda: step(type(method).loss)),
        peak_bytes(lambda: step(REFERENCE[kind])),
    )
    print(
        f"\n{kind}: peak memory of loss + backward at vocabulary {vocab}, {kept_positions(batch)} kept "
        f"positions: chunked ({method.chunk} positions) {chunked / 2**20:.0f} MiB, straightforward "
        f"{straightforward / 2**20:.0f} MiB"
    )
    assert chunked < straightforward / LESS_MEMORY
