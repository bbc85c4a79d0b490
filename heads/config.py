"""HeadsConfig: what a drafter is, what target it fits, and its default draft tree."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

KINDS = ("medusa", "eagle")
DTYPES = ("float32", "bfloat16", "float16")


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
    dtype: str = "float32"  # the dtype the drafter was trained with and its tree fitted for; the default at inference
    tree: list[list[int]] | None = None  # default static tree ("choices"); None uses infer's default
    # EAGLE only
    fc_bias: bool = True  # bias on the 2H -> H input projection
    layer: dict[str, Any] | None = None  # LlamaConfig fields of the decoder layer(s) (heads, kv heads, mlp, rope)
    depth: int = 6  # EAGLE-2 dynamic tree: draft steps
    top_k: int = 8  # EAGLE-2 dynamic tree: frontier width and children per expanded node
    total_tokens: int = 32  # EAGLE-2 dynamic tree: drafted nodes kept for verification (root not counted)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown heads kind {self.kind!r}; supported: {', '.join(KINDS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers", "depth", "top_k", "total_tokens"):
            if getattr(self, name) < (0 if name in ("hidden_size", "vocab_size") else 1):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kind == "eagle" and not self.layer:
            raise ValueError("an eagle config needs `layer`: the decoder layer's LlamaConfig fields")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadsConfig:
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise ValueError(
                f"unknown key(s) {unknown} in a heads config; valid keys: {sorted(valid)}. "
                "Published Medusa/EAGLE checkpoints need importing first."
            )
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def load(cls, directory: str | Path) -> HeadsConfig:
        path = Path(directory, "config.json")
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {directory}: is this a selfspec heads directory?")
        return cls.from_dict(json.loads(path.read_text()))
