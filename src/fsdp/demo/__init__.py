"""``fsdp-demo``: train a small GPT with ``fully_shard`` on a few CPU ranks or GPUs.

``cli`` (the command), ``options`` (its arguments), ``launch`` (the elastic launcher),
``train`` (what each rank runs), ``data`` and ``corpus`` (the shipped text and its
generator), ``metrics`` and ``plot`` (what is shown).
"""
