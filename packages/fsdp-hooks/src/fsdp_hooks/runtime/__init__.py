"""The per-step runtime: unit hooks, autograd plumbing, parameter swapping, training state. Imports nothing above it."""
