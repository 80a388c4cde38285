"""Parallelism around the stages: tied copies across ranks, DDP replicas, FSDP sharding, tensor parallelism."""
