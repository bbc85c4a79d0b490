"""selfspec: train Medusa / EAGLE-1/2/3 / P-EAGLE / DFlash drafters on a frozen Hugging Face causal LM, or
fine-tune its own MTP layers, and decode with them losslessly (a draft model and prompt lookup run in the same
loop).

    from selfspec import SpeculativeModel
    spec = SpeculativeModel.from_pretrained("outputs/eagle3-llama3.1-8b", device_map="cuda", dtype="bfloat16")
    out = spec.generate(input_ids, max_new_tokens=256)

The subpackages are `selfspec.heads` (drafters and their files), `selfspec.infer` (speculative decoding),
`selfspec.train` (the `accelerate launch` recipes) and `selfspec.shipped` (the demo models, the chat prompts).
The public names below load on first use, so `import selfspec` and the console script stay fast.
"""

from __future__ import annotations

import importlib
from typing import Any

PUBLIC = {
    "SpeculativeModel": "selfspec.infer.core.generate",
    "GenerationStats": "selfspec.infer.core.generate",
    "GenerateOutput": "selfspec.infer.core.generate",
    "HeadsConfig": "selfspec.heads.config",
    "MedusaHeads": "selfspec.heads.medusa",
    "EagleDraft": "selfspec.heads.eagle",
    "Eagle3Draft": "selfspec.heads.eagle3",
    "DFlashDraft": "selfspec.heads.dflash",
    "PEagleDraft": "selfspec.heads.peagle",
    "MtpDraft": "selfspec.heads.mtp",
    "load_heads": "selfspec.heads.registry",
    "import_heads": "selfspec.heads.formats",
    "export_heads": "selfspec.heads.formats",
    "load_target": "selfspec.heads.target",
}
__all__ = [*PUBLIC, "__version__"]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (`selfspec.SpeculativeModel`, `from selfspec import
    ...`)."""
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("selfspec")
        except PackageNotFoundError:
            return "0+checkout"
    if name in PUBLIC:
        return getattr(importlib.import_module(PUBLIC[name]), name)
    raise AttributeError(f"module 'selfspec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
