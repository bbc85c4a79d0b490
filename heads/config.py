"""HeadsConfig: what a drafter is, what target it fits, and its default draft tree."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from selfspec.heads.families import SETTINGS, family
from selfspec.shipped.models import resolve_model

DTYPES = ("float32", "bfloat16", "float16")


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file holding an object, or a ValueError naming the file (and the line of a syntax error)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON ({e}): fix or re-download the file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a JSON object")
    return data


@dataclasses.dataclass
class HeadsConfig:
    """Shapes and provenance of a drafter; saved as `config.json` next to its weights."""

    kind: str = "medusa"
    base_model: str = ""  # hub id or path of the target the heads were trained on
    hidden_size: int = 0  # the target's hidden size (what its lm_head reads)
    vocab_size: int = 0  # the target's vocabulary size
    num_heads: int = 4  # Medusa: head k predicts the token k+1 positions after the target's next token
    num_layers: int = 1  # Medusa: residual blocks per head; EAGLE: decoder layers
    share_lm_head: bool = False  # Medusa: reuse the target's lm_head instead of one projection per head
    dtype: str = (
        "float32"  # the dtype the drafter was trained with and its tree fitted for; the default at inference
    )
    tree: list[list[int]] | None = None  # default static tree ("choices"); None uses infer's default
    # Medusa-2 (trained jointly with a LoRA on the target): the heads decode with the adapted target, not
    # base_model
    adapter: str | None = None  # subfolder holding the LoRA adapter (peft's format) applied to base_model
    merged_target: str | None = None  # subfolder holding the adapted target merged into a full model
    # EAGLE only
    fc_bias: bool = True  # bias on the 2H -> H input projection
    layer: dict[str, Any] | None = (
        None  # LlamaConfig fields of the decoder layer(s) (heads, kv heads, mlp, rope)
    )
    depth: int = 6  # EAGLE-2 dynamic tree: draft steps
    top_k: int = 8  # EAGLE-2 dynamic tree: frontier width and children per expanded node
    total_tokens: int = 32  # EAGLE-2 dynamic tree: drafted nodes kept for verification (root not counted)
    # EAGLE-1/2 and EAGLE-3: the target tokens drafted among (d2t maps draft ids to target ids); 0 = the
    # target's whole vocabulary. EAGLE-3 has an lm_head of this size; EAGLE-1/2 reads these rows of the
    # target's lm_head
    draft_vocab_size: int = 0
    # EAGLE-3 only
    feature_layers: list[int] | None = (
        None  # target hidden_states indices fused by fc (0 = embeddings), low to high
    )
    norm_before_residual: bool = (
        False  # the attention residual is hidden_norm(h), not h (speculators' variant)
    )
    norm_before_fc: bool = (
        False  # an RMSNorm `input_norm` over the concatenated features before fc (speculators)
    )
    # DFlash only (feature_layers: hidden_states indices, the published target_layer_ids + 1; depth, top_k and
    # total_tokens shape the tree built from each block position's top_k: top_k 1 is the chain)
    block_size: int = (
        16  # the block one draft forward fills: the last accepted token, then block_size - 1 masks
    )
    mask_token_id: int | None = (
        None  # the embedding row of the masked positions (a token the target never writes)
    )
    qk_norm: bool = False  # RMSNorm on each head's queries and keys before RoPE (Qwen3-family draft layers)

    def __post_init__(self) -> None:
        self._check_types()
        drafter_family = family(self.kind)  # an unknown kind fails first
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        for name in (
            "hidden_size",
            "vocab_size",
            "num_heads",
            "num_layers",
            "depth",
            "top_k",
            "total_tokens",
        ):
            if getattr(self, name) < (0 if name in ("hidden_size", "vocab_size") else 1):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name, folder in (("adapter", "adapter"), ("merged_target", "target")):
            if getattr(self, name) not in (None, folder):  # the folder names the Hub download fetches
                raise ValueError(
                    f"{name} must be null or {folder!r} (the subfolder of the heads directory), "
                    f"got {getattr(self, name)!r}"
                )
        if self.adapter and self.merged_target:
            raise ValueError("a heads config names either an adapter or a merged target, not both")
        self._check_settings()
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [0, vocab_size={self.vocab_size}] (0: the target's "
                f"vocabulary), got {self.draft_vocab_size}"
            )
        if drafter_family.check is not None:
            drafter_family.check(self)

    def _check_settings(self) -> None:
        """A family-specific field set for a family that does not read it is refused, naming who reads it."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, kinds in SETTINGS.items():
            if self.kind not in kinds and getattr(self, name) != defaults[name]:
                titles = " and ".join(family(k).title for k in kinds)
                raise ValueError(
                    f"{name} is for {titles} drafters ({self.kind} drafters do not read it): leave it "
                    f"at its default ({defaults[name]!r}) or use kind {' or '.join(map(repr, kinds))}"
                )

    def _check_types(self) -> None:
        """A config.json edited by hand (or written by another tool) fails here, naming the field, not deep
        inside."""
        for f in dataclasses.fields(self):
            value, hint = getattr(self, f.name), str(f.type)
            if value is None and "None" in hint:
                continue
            expected = {"str": str, "int": int, "bool": bool}.get(hint.split(" ")[0])
            if hint.startswith("list[list"):
                ok = isinstance(value, list) and all(
                    isinstance(path, list) and all(type(i) is int for i in path) for path in value
                )
                if not ok:
                    raise ValueError(f"{f.name} must be a list of lists of ints (tree paths), got {value!r}")
            elif hint.startswith("list"):
                if not (isinstance(value, list) and all(type(i) is int for i in value)):
                    raise ValueError(f"{f.name} must be a list of ints, got {value!r}")
            elif hint.startswith("dict"):
                if not isinstance(value, dict):
                    raise ValueError(f"{f.name} must be a JSON object, got {value!r}")
            elif expected is not None and not (
                type(value) is expected or (expected is bool and value in (0, 1) and type(value) is int)
            ):
                raise ValueError(
                    f"{f.name} must be {expected.__name__}, got {value!r} ({type(value).__name__})"
                )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadsConfig:
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            published = (
                ""
                if "kind" in data
                else (
                    " Without `kind` this is no selfspec config: a published Medusa/EAGLE checkpoint loads "
                    "as it is with heads.registry.load_heads, SpeculativeModel.from_pretrained or --heads, "
                    "and `selfspec import` writes it in this layout"
                )
            )
            raise ValueError(
                f"unknown key(s) {unknown} in a heads config; valid keys: {sorted(valid)}.{published}"
            )
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def load(cls, directory: str | Path) -> HeadsConfig:
        path = Path(directory, "config.json")
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {directory}: is this a selfspec heads directory?")
        data = read_json_object(path)
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


SHAPE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _local_config(name: str):
    """The named model's config if it is on this machine (a directory, `demo`, or the HF cache), else None."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(resolve_model(name), local_files_only=True)
    except (OSError, ValueError):
        return None


def check_compatible(config: HeadsConfig, target: Any) -> None:
    """Fail with both values named when heads were trained for a target of another shape, or when the base
    model their config names is on this machine and its architecture differs from the target's."""
    named = _local_config(config.base_model) if config.base_model else None
    if named is not None:
        theirs, ours = named.get_text_config(), target.config.get_text_config()
        differ = [
            f"{f} {getattr(theirs, f, None)} vs {getattr(ours, f, None)}"
            for f in SHAPE_FIELDS
            if getattr(theirs, f, None) != getattr(ours, f, None)
        ]
        if differ:
            raise ValueError(
                f"these heads were trained on {config.base_model}, whose architecture differs from the "
                f"target's ({'; '.join(differ)}): use them with the model they were trained on"
            )
    hidden = target.config.get_text_config().hidden_size
    vocab = target.get_output_embeddings().weight.shape[0]
    if config.hidden_size != hidden:
        raise ValueError(
            f"heads expect hidden size {config.hidden_size} but the target {config.base_model or ''} has "
            f"hidden size {hidden}: these heads were trained for another model"
        )
    if config.vocab_size != vocab:
        raise ValueError(
            f"heads expect vocabulary size {config.vocab_size} but the target has {vocab} "
            "(lm_head rows): these heads were trained for another model or tokenizer"
        )
