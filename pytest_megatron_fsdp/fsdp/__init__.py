"""The Megatron-FSDP domain: config, model, training, checkpoints. Imports no pytest."""
