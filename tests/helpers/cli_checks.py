"""The CLI run as a user runs it: a user error's one line, and the transformers greedy output to compare the
CLI's with."""

import pytest
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from selfspec.cli import main as cli


def user_error(capsys, argv: list[str]) -> str:
    """Run the CLI expecting a user error: exit status 2 and one line on stderr, no traceback. Returns the
    line."""
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars share stderr
    try:
        with pytest.raises(SystemExit) as exit_:
            cli(argv)
    finally:
        transformers.utils.logging.enable_progress_bar()
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("selfspec") and ": error: " in err
    return err.strip()


def greedy_reference(model_dir, prompt: str, max_new_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = AutoTokenizer.from_pretrained(model_dir)(prompt, return_tensors="pt").input_ids
    return model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1] :].tolist()
