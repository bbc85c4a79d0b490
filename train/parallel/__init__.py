"""Several processes: DDP / ZeRO / FSDP2 set-up, the sharded target, and the memory plan per GPU."""
