"""The MegatronFSDP wrapper module: its configuration, attribute resolution and Megatron-FSDP compatibility."""
