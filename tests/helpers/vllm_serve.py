"""Run by tests/formats/test_vllm.py with the vLLM virtual environment's python (not the project's).

    python vllm_serve.py MODEL_DIR SPEC_JSON PROMPTS_JSON MAX_TOKENS

Prints one JSON line: the greedy token ids per prompt (one prompt per generate call, as batch 1)
and vLLM's speculative-decoding counters.
"""

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    model, spec, prompts, max_tokens = (
        sys.argv[1],
        json.loads(sys.argv[2]),
        json.loads(sys.argv[3]),
        int(sys.argv[4]),
    )
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        disable_log_stats=False,
        speculative_config=spec or None,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = [
        list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids)
        for p in prompts
    ]
    metrics = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            metrics[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    print("RESULT " + json.dumps({"outputs": outputs, "metrics": metrics}), flush=True)


if __name__ == "__main__":
    main()
