"""Every benchmark's numbers as JSON beside its text: `--json FILE`, with the command, date and device."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the numbers as JSON here")


def write_json(path: Path | None, module: str, results, device: str = "cuda") -> None:
    """Write `results` with what RESULTS.md records beside every number; nothing without a path."""
    if path is None:
        return
    payload = {
        "command": " ".join(["python", "-m", module, *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "torch": torch.__version__,
        "results": results,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
