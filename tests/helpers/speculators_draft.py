"""Run inside speculators' own virtual environment (tests/families/test_speculators.py): load a
speculators-eagle3 checkpoint with speculators' `SpeculatorModel.from_pretrained` and write the draft logits
of each training-time step for the given target features and tokens.

usage: python speculators_draft.py CHECKPOINT INPUTS.safetensors OUT.safetensors STEPS
"""

import sys

import torch
from safetensors.torch import load_file, save_file
from speculators import SpeculatorModel
from speculators.models.eagle3 import Eagle3SpeculatorConfig


def main(checkpoint: str, inputs: str, out: str, steps: int) -> None:
    config = Eagle3SpeculatorConfig.from_pretrained(checkpoint)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention's block masks want a GPU
    model = SpeculatorModel.from_pretrained(checkpoint, config=config).eval()
    data = load_file(inputs)
    logits = []
    handle = model.lm_head.register_forward_hook(lambda module, args, output: logits.append(output.detach()))
    with torch.no_grad():
        model(
            hidden_states=data["features"],
            input_ids=data["input_ids"],
            document_ids=torch.zeros_like(data["input_ids"]),
            ttt_steps=steps,
        )
    handle.remove()
    save_file(
        {f"step{i}": x[0].contiguous() for i, x in enumerate(logits)}
        | {"embed_tokens": model.embed_tokens.weight.detach().contiguous()},
        out,
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
