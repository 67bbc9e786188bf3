"""Parameter features that cut across layers: experts, whole placement's state dicts."""
