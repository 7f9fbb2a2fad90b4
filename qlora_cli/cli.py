"""The `qlora` command: parse arguments, call one function, turn errors into one line and an exit code."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from qlora_cli import __version__
from qlora_cli.errors import QLoraError

app = typer.Typer(
    name="qlora",
    help="QLoRA fine-tuning of Qwen2, Qwen2.5 and Qwen3 models on fused Triton kernels.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
)
console = Console(stderr=True)

ConfigArg = Annotated[
    Path, typer.Argument(help="Training config (YAML, Axolotl key names).", show_default=False)
]
SetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set", help="Override a config key, e.g. --set lora_r=8 (repeatable; dotted keys reach into lists)."
    ),
]


def _version(value: bool) -> None:
    if value:
        print(f"qlora {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """QLoRA fine-tuning of Qwen2, Qwen2.5 and Qwen3 models."""


@app.command()
def train(config: ConfigArg, set_: SetOption = None) -> None:
    """Train LoRA adapters on an NF4-quantized base model, as CONFIG says."""
    from qlora_cli.config import load_config
    from qlora_cli.train import train as run_training

    result = run_training(load_config(config, set_ or ()), console=console)
    console.print(f"[green]done[/]: {result.step} steps, adapter in {result.output_dir}")


@app.command()
def resume(
    output_dir: Annotated[
        Path, typer.Argument(help="The output_dir of the run to continue.", show_default=False)
    ],
    checkpoint: Annotated[
        Path | None,
        typer.Option(help="Continue from this checkpoint folder instead of the newest complete one."),
    ] = None,
    set_: SetOption = None,
) -> None:
    """Continue an interrupted run exactly where its last checkpoint left it."""
    from qlora_cli.train import resume as resume_training

    result = resume_training(output_dir, checkpoint=checkpoint, overrides=set_ or (), console=console)
    console.print(f"[green]done[/]: {result.step} steps, adapter in {result.output_dir}")


def main() -> None:
    """Entry point: every error a user can cause ends in one line, never a traceback."""
    try:
        app()
    except QLoraError as err:
        console.print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        console.print("[bold red]interrupted[/]")
        sys.exit(130)
