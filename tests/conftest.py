"""Fixtures: tiny random-weight causal LMs of five architectures, and the shipped demo target."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

# fixtures shared across folders: the 8-layer targets of the EAGLE-3 layout tests, the recording hub
pytest_plugins = ["eagle3_checkpoints", "hub_recorder"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the cores shared among pytest-xdist's workers (`make test` runs two), at most 2 threads each
torch.set_num_threads(
    max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
)

VOCAB = 96
ARCHS = ("llama", "qwen2", "mistral", "gpt2", "gemma")


def tiny_config(arch: str, vocab: int = VOCAB):
    common = dict(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "gpt2":
        return GPT2Config(n_embd=48, n_layer=2, n_head=4, n_positions=512, **common)
    llama_like = dict(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **common,
    )
    if arch == "llama":
        return LlamaConfig(**llama_like)
    if arch == "qwen2":
        return Qwen2Config(**llama_like)
    if arch == "mistral":
        return MistralConfig(sliding_window=None, **llama_like)
    if arch == "gemma":
        return GemmaConfig(head_dim=12, **llama_like)
    raise ValueError(arch)


def randomized(model: torch.nn.Module, scale: float = 0.3) -> torch.nn.Module:
    """`model` with every weight matrix drawn from N(0, scale) (so its greedy output is not one repeated
    token), in eval mode."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, scale)
    return model.eval()


WEIGHT_FILES = {"bin": "pytorch_model.bin", "safetensors": "model.safetensors"}


def write_checkpoint(path, config: dict, state: dict, weights: str) -> None:
    """A published-style checkpoint written by hand: config.json and the state dict as `weights`
    (bin/safetensors)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if weights == "bin":
        torch.save(state, path / WEIGHT_FILES["bin"])
    else:
        save_file(state, str(path / WEIGHT_FILES["safetensors"]))


def prefill_one(target, prompt: torch.Tensor, cache, hidden: bool = True):
    """One prompt (1, T) through a `Target` -> its last logits (V,) and features (T, ·) (None without
    `hidden`)."""
    logits, features = target.prefill_rows(prompt, cache, hidden=hidden)
    return logits[0], features[0] if hidden else None


def verify_one(target, tokens: torch.Tensor, tree, prefix_len: int, cache):
    """One tree's tokens (N,) through a `Target` after a cached prefix -> logits (N, V) and features
    (N, ·)."""
    from selfspec.infer.core.mask import RowMask

    mask = RowMask(1, tree.size, prefix_len + tree.size, target.dtype, target.device)
    mask.open(torch.zeros(1, dtype=torch.long, device=target.device), prefix_len)
    logits, features = target.verify_rows(
        tokens[None], (prefix_len + tree.depths)[None], mask.at(prefix_len, tree.ancestors[None]), cache
    )
    return logits[0], features[0]


def propose_one(drafter, context: torch.Tensor, hiddens: torch.Tensor, max_length: int = 64):
    """A drafter's first draft for one sequence: a batch of one row, started afresh."""
    from selfspec.infer.core.verify import SamplingParams
    from selfspec.infer.drafters.drafter import as_drafter

    drafter = as_drafter(drafter)
    drafter.start(1, max_length, SamplingParams(), [None])
    return drafter.propose([True], [context], [hiddens])[0]


def tiny_model(
    arch: str, vocab: int = VOCAB, seed: int = 0, attn: str = "sdpa", scale: float = 0.3
) -> torch.nn.Module:
    """A 2-layer, 48-wide random model; weights of std `scale` so its greedy output is not one repeated
    token."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, vocab), attn_implementation=attn)
    return randomized(model, scale)


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture
def model(arch) -> torch.nn.Module:
    return tiny_model(arch)


@pytest.fixture(scope="session")
def demo_target():
    from selfspec.shipped.models import MODELS_DIR

    path = MODELS_DIR / "demo-target"
    if not (path / "config.json").is_file():
        pytest.skip("the demo target is not built")
    from transformers import AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32
    ).eval(), AutoTokenizer.from_pretrained(path)


TOKENIZER_TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    x = 0\n    y = 1\n"
    "for i in range(10):\n    print(i, 'hello world')\n"
)


def tiny_tokenizer(vocab: int = VOCAB):
    """A character-level BPE tokenizer of exactly `vocab` entries, with bos/eos/pad and a chat template."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
        initial_alphabet=list(
            " \n:()+,.'=<>|/abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"
        ),
    )
    tok.train_from_iterator([TOKENIZER_TEXT] * 4, trainer)
    tok.decoder = decoders.Fuse()  # tokens are plain substrings: decode by concatenation
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    fast.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    assert len(fast) <= vocab, len(fast)
    return fast


@pytest.fixture
def text_data(tmp_path):
    """A small plain-text training file of code."""
    path = tmp_path / "code.txt"
    path.write_text(TOKENIZER_TEXT * 40)
    return path


@pytest.fixture
def tiny_model_dir(tmp_path):
    """A saved tiny Llama target + tokenizer, loadable with from_pretrained like any hub model."""
    path = tmp_path / "tiny-target"
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps process-wide singletons; tests that build Accelerators of different settings need them
    reset."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def medusa_dir(tiny_model_dir, tmp_path):
    """Untrained Medusa heads for the tiny target, saved (no training: decoding stays exact anyway)."""
    from transformers import AutoConfig

    from selfspec.heads.config import HeadsConfig
    from selfspec.heads.medusa import MedusaHeads

    config = AutoConfig.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    heads = MedusaHeads(
        HeadsConfig(
            kind="medusa",
            base_model=str(tiny_model_dir),
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            num_heads=3,
        )
    )
    heads.save_pretrained(tmp_path / "medusa-heads")
    return tmp_path / "medusa-heads"


@pytest.fixture
def eagle_dir(tiny_model_dir, tmp_path):
    """An untrained EAGLE drafter for the tiny target with a small dynamic tree (at most 8 drafted nodes)."""
    from transformers import AutoConfig

    from selfspec.heads.config import HeadsConfig
    from selfspec.heads.draft_layers import layer_fields
    from selfspec.heads.eagle import EagleDraft

    config = AutoConfig.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    draft = EagleDraft(
        HeadsConfig(
            kind="eagle",
            base_model=str(tiny_model_dir),
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            layer=layer_fields(config),
            depth=3,
            top_k=3,
            total_tokens=8,
        )
    )
    draft.save_pretrained(tmp_path / "eagle-heads")
    return tmp_path / "eagle-heads"


def check_resume(monkeypatch, method_cls, run_to, out_root, key: str) -> None:
    """Crash a run in its 4th loss call (after the step-2 checkpoint), resume it with `resume=latest`,
    and require the result to equal an uninterrupted run. `run_to(out_dir, **overrides)` runs the recipe."""
    import json

    full = run_to(out_root / "full")
    original_loss = method_cls.loss
    calls = {"n": 0}

    def crashing_loss(self, batch, step):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("simulated crash")
        return original_loss(self, batch, step)

    monkeypatch.setattr(method_cls, "loss", crashing_loss)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_to(out_root / "resumed")
    monkeypatch.setattr(method_cls, "loss", original_loss)
    state = json.loads((out_root / "resumed/checkpoints/step-2/trainer_state.json").read_text())
    assert state["step"] == 2
    resumed = run_to(out_root / "resumed", resume="latest")
    for name, value in full[key].state_dict().items():
        torch.testing.assert_close(resumed[key].state_dict()[name], value, rtol=0, atol=1e-6)


def fit_on_own_continuations(model, prompts, method, steps: int, lr: float) -> torch.nn.Module:
    """Train `method.trainable` with the recipe's own loss on the model's 48-token greedy continuations of
    `prompts` (what acceptance at decode time rewards); returns it in eval mode."""
    seqs = model.generate(prompts, max_new_tokens=48, do_sample=False, min_new_tokens=48, pad_token_id=0)
    batch = {
        "input_ids": seqs,
        "attention_mask": torch.ones_like(seqs),
        "loss_mask": torch.ones_like(seqs).bool(),
    }
    opt = torch.optim.Adam(method.trainable.parameters(), lr=lr)
    for _ in range(steps):
        loss, _ = method.loss(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return method.trainable.eval()


def medusa_args(model_dir, data, out, **extra) -> list[str]:
    """Command-line options for a seconds-long Medusa recipe run on a tiny target (overrides in `extra`)."""
    from recipe_args import argv, short_run

    medusa = {"learning_rate": 1e-2, "num_heads": 2, "tree_nodes": 5, "share_lm_head": False}
    return argv(short_run(model_dir, data, out, **(medusa | extra)))
