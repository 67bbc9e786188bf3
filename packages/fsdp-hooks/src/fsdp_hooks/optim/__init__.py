"""Optimizers over the sharded main weights: patching, state initialisation, gradient norm."""
