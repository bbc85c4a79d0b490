"""Devices by construction (a target split over GPUs by device_map): the decode loop and the drafters make
each tensor on the device of what it meets -- tokens and trees where the drafter is (by the lm_head), what the
model reads where its input embedding is, acceptance where the logits come out -- never on "the model's
device" (its first parameter: under device_map the embedding's GPU, not the lm_head's). The GPU check itself
is tests/decoding/test_cuda.py (2 GPUs)."""

import re
from pathlib import Path

import torch

from conftest import tiny_model
from selfspec.infer.drafters.proposers import Embedding, embedding_for

INFER = Path(__file__).resolve().parents[2] / "infer"
DECODE_PATH = [
    "core/generate.py",
    "core/decode_step.py",
    "drafters/drafter.py",
    "core/rows.py",
    "core/verify.py",
    "core/tree.py",
    "drafters/proposers.py",
    "drafters/eagle.py",
    "drafters/feature_drafter.py",
    "drafters/dflash.py",
    "drafters/peagle.py",
    "drafters/mtp.py",
    "drafters/prompt_lookup.py",
    "drafters/draft_model.py",
]
FIRST_PARAMETER = re.compile(r"next\(\s*[\w.]*parameters\(\)\s*\)\.device|\btarget\.device\b")
# the only places a device is read off weights: each drafter's own (checked to be the lm_head's at
# construction), and the generator check (sampling draws where the logits come out: the input's device under
# accelerate)
ALLOWED = {
    ("drafters/proposers.py", "device = next(heads.parameters()).device"),
    ("drafters/feature_drafter.py", "self.device = self.weights_device = next(draft.parameters()).device"),
    ("drafters/dflash.py", "self.device = self.weights_device = next(draft.parameters()).device"),
    ("drafters/peagle.py", "self.device = self.weights_device = next(draft.parameters()).device"),
    ("core/generate.py", "check_generator(g, self.target.device)"),
}


def test_the_decode_path_never_places_tensors_on_the_models_first_parameter():
    found = set()
    for name in DECODE_PATH:
        # a call the formatter wrapped over lines is read as one line
        source = re.sub(r"\s+\)", ")", re.sub(r"\(\s+", "(", (INFER / name).read_text()))
        for line in source.splitlines():
            if FIRST_PARAMETER.search(line):
                found.add((name, line.split("#")[0].strip()))
    assert found == ALLOWED


def test_a_drafter_on_another_device_embeds_through_the_targets_embedding_and_gets_its_own_device_back():
    model = tiny_model("llama")
    embed = model.get_input_embeddings()
    assert embedding_for(embed, embed.weight.device) is embed  # one device: nothing in between
    assert isinstance(embedding_for(embed, torch.device("meta")), Embedding)
    ids = torch.tensor([[3, 4, 5]])
    torch.testing.assert_close(Embedding(embed)(ids), embed(ids), rtol=0, atol=0)
    assert Embedding(embed)(ids).device == ids.device
