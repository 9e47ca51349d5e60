"""``ddpkit export``: a checkpoint's weights and model config for inference.

::

    ddpkit export runs/latest/checkpoints/best-000000940 exported/
    ddpkit export runs/latest exported/ readable_by=all   # the newest verified checkpoint
    ddpkit export s3://my-bucket/run exported/            # the same, from object storage

torch is imported only when the command runs, so ``ddpkit --help`` stays quick.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from ddpkit.commands.checkpoints import split_paths
from ddpkit.commands.help import CommandHelp
from ddpkit.errors import UserError
from ddpkit.keyvalue import check_choice, parse
from ddpkit.train.storage_url import url_scheme


@dataclasses.dataclass
class ExportConfig:
    """Options of ``ddpkit export``."""

    readable_by: str = "user"
    """Who may read the exported files: user (mode 0600), group (0640) or all (0644)."""

    def __post_init__(self) -> None:
        check_choice("readable_by", self.readable_by, ("user", "group", "all"))


EXPORT_HELP = CommandHelp(
    usage="ddpkit export CHECKPOINT OUT [key=value ...]",
    summary="Write a checkpoint's weights and model config for inference: OUT/model.pt (the weights, loadable "
    "with torch.load(weights_only=True)) and OUT/model.json (model name, task, source checkpoint).",
    schema="ddpkit.commands.export:ExportConfig",
    positional=(
        (
            "CHECKPOINT",
            "a checkpoint folder, or a run's folder / checkpoints folder (its newest verified checkpoint); "
            "or their URL (s3://...)",
        ),
        ("OUT", "the folder to write"),
    ),
    examples=(
        "ddpkit export runs/latest exported/",
        "ddpkit export runs/latest/checkpoints/best-000000940 out/",
        "ddpkit export s3://my-bucket/run/checkpoints/step-000000940 out/",
    ),
)


def export_command(args: Sequence[str]) -> int:
    """``ddpkit export CHECKPOINT OUT``: write OUT/model.pt and OUT/model.json for inference."""
    from ddpkit.checkpoint import export_checkpoint

    (checkpoint, out), words = split_paths(args, EXPORT_HELP, 2)
    config = parse(ExportConfig, words)
    if url_scheme(out):
        raise UserError(f"OUT={out}: the export is written to a local folder; export there, then copy it to the store")
    folder = export_checkpoint(checkpoint, out, config.readable_by)
    source = json.loads((folder / "model.json").read_text())["source"]["checkpoint"]
    print(f"exported {source} to {folder} (model.pt, model.json)")
    return 0
