"""Train Medusa heads on a frozen causal LM.

    accelerate launch train/medusa.py                        # demo target, stdlib corpus, CPU, < 10 min
    accelerate launch train/medusa.py --config configs/medusa/llama3-8b-sharegpt.yaml

Head k (0-based) learns the token k + 2 positions ahead from the target's last hidden state; the
loss is cross-entropy weighted by head_decay**k, on loss-mask positions only. At the end the heads
are saved with a default tree fitted to how often each path of their top-k candidates was right in validation.
"""

from __future__ import annotations

from selfspec.heads.errors import run_main
from selfspec.train.data.run_data import datasets_for
from selfspec.train.loop.config import ConfigError, load_config
from selfspec.train.loop.training import start_run, train
from selfspec.train.methods.medusa import MedusaMethod
from selfspec.train.parallel.distributed import gathers_weights, unpartitioned
from selfspec.train.parallel.target_shard import load_training_target
from selfspec.train.recipes.medusa import MedusaConfig, new_heads


def run(cfg: MedusaConfig) -> dict:
    """Set up, train and save; returns the target, the trained heads and the validation history."""
    accelerator = start_run(cfg)
    if cfg.medusa2 and gathers_weights(accelerator):  # before any heavy work
        raise ConfigError(
            "Medusa-2 trains a LoRA inside the target, which stays whole on every rank: use DDP "
            "or DeepSpeed ZeRO-2 (configs/accelerate/ddp.yaml, deepspeed-zero2.yaml), not ZeRO-3/FSDP"
        )
    target, tokenizer = load_training_target(cfg, accelerator)
    with unpartitioned(accelerator, cfg.seed):  # built whole and alike on every rank; prepare() shards it
        heads = new_heads(cfg, target)
        heads.init_from_lm_head(target.get_output_embeddings())
        heads.to(accelerator.device)
    initial = {k: v.detach().clone() for k, v in heads.state_dict().items()}
    train_data, eval_data = datasets_for(cfg, tokenizer, target, accelerator)
    if cfg.medusa2:
        from selfspec.train.methods.medusa2 import medusa2_method

        method = medusa2_method(cfg, target, heads, tokenizer)
    else:
        method = MedusaMethod(cfg, target, heads)
    history, trained = train(cfg, accelerator, method, train_data, eval_data)
    trained = trained.heads if cfg.medusa2 else trained
    return {"target": method.target, "heads": trained, "initial": initial, "history": history}


def main(argv: list[str] | None = None) -> None:
    """The script: options from the command line; a user error ends in one line (exit 2)."""
    run_main(lambda args: run(load_config(MedusaConfig, args)), argv, prog="train/medusa.py")


if __name__ == "__main__":
    main()
