"""Floor 1: FSDP2 / DDP helpers (weight-access windows, amax all-reduce); filled in by the FSDP2 work."""
