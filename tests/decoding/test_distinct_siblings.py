"""Sampled verification assumes a node's children are distinct tokens. Trees draw them as a node's top-k draft
ids, mapped to target ids through d2t: a d2t that maps two draft ids to one target id would repeat a token
among siblings. Such a map is refused where a drafter is loaded, in our layout and on import."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_model
from eagle3_drafts import reduced_draft
from selfspec.heads.draft_layers import draft_targets
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.heads.formats.eagle3_config import draft_vocab_maps
from selfspec.infer.drafters.eagle import EagleProposer


def test_a_one_to_one_map_gives_its_target_ids():
    d2t = torch.tensor([0, 1, 1, 4])  # draft ids 0..3 -> 0, 2, 3, 7
    assert draft_targets(d2t, 8, "x").tolist() == [0, 2, 3, 7]


@pytest.mark.parametrize(
    "d2t, message",
    [
        (torch.tensor([0, 0, -1, 4]), "maps two draft ids to one target id"),  # 1 -> 1 and 2 -> 1
        (torch.tensor([0, 1, 1, 9]), r"outside \[0, 8\)"),
    ],
)
def test_a_map_that_is_not_one_to_one_is_refused(d2t, message):
    with pytest.raises(ValueError, match=message):
        draft_targets(d2t, 8, "x")


def test_a_saved_drafter_with_a_repeating_map_is_refused_when_loaded(tmp_path):
    draft = reduced_draft(tiny_model("llama"), size=12)
    draft.save_pretrained(tmp_path)
    Eagle3Draft.from_pretrained(tmp_path)  # as saved: fine
    state = load_file(tmp_path / "model.safetensors")
    targets = torch.arange(12) + state["d2t"]
    state["d2t"][1] = targets[0] - 1  # draft id 1 now means draft id 0's target
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="maps two draft ids to one target id"):
        Eagle3Draft.from_pretrained(tmp_path)


def test_an_imported_repeating_map_is_refused(tmp_path):
    with pytest.raises(ValueError, match="maps two draft ids to one target id"):
        draft_vocab_maps(torch.tensor([0, 0, -1]), None, 3, 8, tmp_path)


def test_an_in_memory_drafter_with_a_repeating_map_is_refused_by_its_proposer():
    model = tiny_model("llama")
    draft = reduced_draft(model, size=12)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    EagleProposer(draft, embed, lm_head)  # as built: fine
    with torch.no_grad():
        draft.d2t[1] = draft.d2t[0] - 1  # draft id 1 now means draft id 0's target
    with pytest.raises(ValueError, match="this EAGLE drafter: d2t maps two draft ids to one target id"):
        EagleProposer(draft, embed, lm_head)
