"""``python -m fsdp``: print the version of every layer."""

from fsdp._versions import versions

for name, version in versions().items():
    print(f"{name:<13} {version}")
