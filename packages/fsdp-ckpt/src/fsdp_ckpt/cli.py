"""``fsdp-consolidate``: a sharded checkpoint directory to one full model file.

Every failure a user can act on (a damaged or missing checkpoint, an output that
exists as a directory, a missing ``--hf`` config) exits 1 with one line,
``fsdp-consolidate: error: ...``, and leaves nothing behind."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fsdp_ckpt.consolidate import consolidate_checkpoint
from fsdp_ckpt.errors import CheckpointError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fsdp-consolidate",
        description=(
            "Convert a checkpoint directory written by fsdp_ckpt.save_checkpoint (any world "
            "size) into one unsharded model state dict file that "
            "nn.Module.load_state_dict accepts. Runs in this process; no ranks needed."
        ),
    )
    p.add_argument("checkpoint", help="the checkpoint directory")
    p.add_argument(
        "output",
        help="the file to write (.safetensors selects safetensors); with --hf, a directory",
    )
    p.add_argument(
        "--hf",
        metavar="CONFIG_DIR",
        default=None,
        help=(
            "write a Hugging Face save_pretrained directory instead (transformers' on-disk "
            "names, sharded safetensors with an index), with the config.json in CONFIG_DIR"
        ),
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="with --hf: the largest safetensors file (default 5GB)",
    )
    p.add_argument(
        "--format",
        choices=("torch", "safetensors"),
        default=None,
        help="file format (default: from the output's suffix; torch.save otherwise)",
    )
    return p


# CheckpointError: the checkpoint; OSError: files (also transformers' missing config);
# ValueError: arguments and models; ImportError: transformers missing.
_USER_ERRORS = (CheckpointError, OSError, ValueError, ImportError)


def _fail(exc: BaseException) -> int:
    message = " ".join(str(exc).split())  # one line
    print(f"fsdp-consolidate: error: {message}", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.hf is not None:
        from fsdp_ckpt.hf_export import export_hf_checkpoint

        try:
            summary = export_hf_checkpoint(
                args.checkpoint, args.hf, args.output, max_shard_size=args.max_shard_size
            )
        except _USER_ERRORS as exc:
            return _fail(exc)
        print(f"wrote {summary['tensors']} tensors to {args.output} (save_pretrained format)")
        return 0
    try:
        summary = consolidate_checkpoint(args.checkpoint, args.output, args.format)
    except _USER_ERRORS as exc:
        return _fail(exc)
    print(
        f"wrote {summary['tensors']} tensors ({summary['bytes'] / 2**20:.1f} MiB) to {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
