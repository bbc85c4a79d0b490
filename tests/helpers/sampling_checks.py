"""The sampled-distribution check: the exact joint distribution of a tiny target's first two sampled tokens
(by enumeration), counts of speculative runs, and a chi-square test between them; with speculative models
of each drafter kind on a tiny target whose distribution is flat enough to give many outcomes."""

import itertools

import torch

from conftest import tiny_model
from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.eagle import EagleDraft
from selfspec.heads.medusa import MedusaHeads
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.drafters.draft_model import DraftModelProposer
from selfspec.infer.drafters.eagle import EagleProposer
from selfspec.infer.drafters.prompt_lookup import PromptLookupProposer
from selfspec.infer.drafters.proposers import MedusaProposer

V = 8
STEPS = 2  # the joint distribution of the first two tokens: 64 outcomes
RUNS = 3000
CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Plain sampling's distribution, written independently of infer.verify."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    keep = order[:top_k] if top_k else order
    kept = probs[keep] / probs[keep].sum()
    mass, nucleus = 0.0, []
    for tok, q in zip(keep, kept.tolist()):
        nucleus.append(tok)
        mass += q
        if mass >= top_p:
            break
    out = torch.zeros_like(probs)
    out[nucleus] = probs[nucleus]
    return out / out.sum()


def exact_joint(model, prompt, params) -> dict[tuple[int, ...], float]:
    joint = {}
    for seq in itertools.product(range(V), repeat=STEPS):
        prob = 1.0
        for i in range(STEPS):
            ids = torch.cat([prompt[0], torch.tensor(seq[:i], dtype=torch.long)])[None]
            with torch.no_grad():
                logits = model(ids).logits[0, -1]
            prob *= float(reference_probs(logits, *params)[seq[i]])
        joint[seq] = prob
    return joint


def chi_square(counts: dict, expected: dict, runs: int) -> tuple[float, int]:
    """Pearson chi-square over cells with expected count >= 5 (the rest pooled into one cell)."""
    assert set(counts) <= set(expected) and sum(counts.values()) == runs  # every run is an enumerated outcome
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0.0, 0.0
    for key, p in expected.items():
        e, o = p * runs, counts.get(key, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            dof += 1
        else:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        dof += 1
    return stat, dof


def run_sampling(spec, prompt, params, accepted: list | None = None) -> dict:
    gen = torch.Generator().manual_seed(1234)
    counts = {}
    for _ in range(RUNS):
        out = spec.generate(
            prompt,
            max_new_tokens=STEPS,
            do_sample=True,
            temperature=params[0],
            top_k=params[1],
            top_p=params[2],
            eos_token_id=[],
            generator=gen,
        )
        key = tuple(out[0, prompt.shape[1] :].tolist())
        counts[key] = counts.get(key, 0) + 1
        if accepted is not None:
            accepted.extend(spec.last_stats.accepted_drafts)
    return counts


def make_spec(seed: int, kind: str = "medusa"):
    model = tiny_model("llama", vocab=V, seed=seed, scale=0.08)  # a flat-ish p: many outcomes
    if (
        kind == "draft_model"
    ):  # another random model: q differs from p, so min(1, p/q) and (p - q)+ both matter
        draft = tiny_model("gpt2", vocab=V, seed=seed + 1, scale=0.08)
        return model, SpeculativeModel(model, DraftModelProposer(draft, num_tokens=3))
    if kind == "prompt_lookup":
        return model, SpeculativeModel(model, PromptLookupProposer(num_tokens=3, max_ngram=2))
    if kind == "eagle":
        torch.manual_seed(seed)
        draft = EagleDraft(
            HeadsConfig(
                kind="eagle",
                hidden_size=48,
                vocab_size=V,
                layer=layer_fields(model.config),
                depth=3,
                top_k=3,
                total_tokens=8,
            )
        )
        with (
            torch.no_grad()
        ):  # fc passes the feature through, so the drafter proposes the target's own top tokens
            draft.fc.weight.zero_()
            draft.fc.weight[:, 48:].copy_(torch.eye(48))
            draft.fc.bias.zero_()
        proposer = EagleProposer(draft, model.get_input_embeddings(), model.get_output_embeddings())
        return model, SpeculativeModel(model, proposer)
    heads = MedusaHeads(HeadsConfig(hidden_size=48, vocab_size=V, num_heads=3))
    heads.init_from_lm_head(model.get_output_embeddings())  # drafts the target's own top tokens: many accepts
    return model, SpeculativeModel(model, MedusaProposer(heads, model.get_output_embeddings(), CHOICES))


# Chi-square critical values at p = 0.001 are below dof + 3.3 * sqrt(2 dof) + 6 for these sizes.
def critical(dof: int) -> float:
    return dof + 3.3 * (2 * dof) ** 0.5 + 6
