"""The `qlora` command: parse arguments, call one function, turn errors into one line and an exit code."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

import qlora_cli
from qlora_cli import __version__
from qlora_cli.core.allocator import prefer_expandable_segments
from qlora_cli.core.console import OutputConsole, survive_closed_pipes
from qlora_cli.core.errors import QLoraError, RunAborted, RunInterrupted
from qlora_cli.core.signals import answer_signals, ignore_signals
from qlora_cli.core.wording import count

app = typer.Typer(
    name="qlora",
    help=qlora_cli.__doc__.removeprefix("qlora: "),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
)
console = OutputConsole(stderr=True)

ConfigArg = Annotated[
    Path, typer.Argument(help="Training config (YAML, Axolotl key names).", show_default=False)
]
SetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set", help="Override a config key, e.g. --set lora_r=8 (repeatable; dotted keys reach into lists)."
    ),
]
BaseModelOption = Annotated[
    str | None,
    typer.Option(
        "--base-model",
        help="Where the local base model the run trained on is now, when it moved; its weights must be "
        "the ones the checkpoint recorded.",
        show_default=False,
    ),
]
AcceptChangedDataOption = Annotated[
    bool,
    typer.Option(
        "--accept-changed-data",
        help="Resume a checkpoint (with train: resume_from_checkpoint or auto_resume_from_checkpoints) even "
        "though its data changed (a local data file, or a key that fixes the batch plan, such as seed or "
        "micro_batch_size); the run continues at the checkpoint's step in the changed data.",
    ),
]
NprocOption = Annotated[
    int,
    typer.Option(
        "--nproc",
        min=1,
        help="Data-parallel processes, one per GPU (gloo processes on the CPU), started through torchrun.",
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
    """Options that come before the command."""


@app.command()
def train(
    config: ConfigArg,
    set_: SetOption = None,
    profile: Annotated[
        bool,
        typer.Option(
            "--profile",
            help="Time every op of every step and print the per-op table after the run "
            "(the first step is left out as warm-up when there are more).",
        ),
    ] = False,
    nproc: NprocOption = 1,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Delete the checkpoints and adapter of an earlier run in output_dir first "
            "(like overwrite_output_dir: true); without it, training into such a folder is refused.",
        ),
    ] = False,
    accept_changed_data: AcceptChangedDataOption = False,
) -> None:
    """Train LoRA adapters on an NF4-quantized base model, as CONFIG says."""
    set_ = [*(set_ or ()), *(["overwrite_output_dir=true"] if overwrite else [])]
    if profile and (nproc > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        raise QLoraError("--profile times a single process; profile without --nproc or torchrun")
    if nproc > 1:
        from qlora_cli.train.distributed import launch_train

        raise typer.Exit(launch_train(nproc, config, set_ or (), accept_changed_data))
    from qlora_cli.config.loading import load_config

    if profile:
        from qlora_cli.profiler.command import profiled_train
        from qlora_cli.profiler.report import print_report

        result, report = profiled_train(load_config(config, set_ or ()), console=console)
        print_report(report)
    else:
        from qlora_cli.train.loop import train as run_training

        result = run_training(
            load_config(config, set_),
            console=console,
            accept_changed_data=accept_changed_data,
            command=["train", str(config), *(option for text in set_ for option in ("--set", text))],
        )
    _done(_trained(result))


def _done(text: str) -> None:
    """The last line of a command that worked; its text is printed as it is (a path may hold brackets).
    The work is done, so a Ctrl-C from here on is ignored: it could only cut this line or the exit."""
    ignore_signals()
    console.print(f"[green]done[/]: {escape(text)}")


def _trained(result) -> str:
    """What a train or resume command did, as its last line says it."""
    if result.steps_run == 0:
        return f"nothing left to train at step {result.step}, adapter in {result.output_dir}"
    return f"{count(result.step, 'step')}{_timing(result)}, adapter in {result.output_dir}"


def _timing(result) -> str:
    """' in 52.1 s (start-up 14.0 s to the first step)', when the run measured both."""
    if result.seconds is None or result.startup_s is None:
        return ""
    return f" in {result.seconds:.1f} s (start-up {result.startup_s:.1f} s to the first step)"


@app.command()
def data(
    config: ConfigArg,
    show: Annotated[
        int, typer.Option("--show", min=0, help="Also print this many examples, trained tokens highlighted.")
    ] = 0,
    set_: SetOption = None,
) -> None:
    """Check CONFIG and tokenize its datasets: rows, tokens, trained tokens, dropped rows, packing (no weights)."""
    from qlora_cli.config.loading import load_config
    from qlora_cli.data.report import data_report, print_data_report

    report = data_report(load_config(config, set_ or ()))
    print_data_report(report, OutputConsole(), show)


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
    nproc: NprocOption = 1,
    accept_changed_data: AcceptChangedDataOption = False,
    base_model: BaseModelOption = None,
) -> None:
    """Continue an interrupted run exactly where its last checkpoint left it."""
    set_ = [*(set_ or ()), *([f"base_model={base_model}"] if base_model else [])]
    if nproc > 1:
        from qlora_cli.train.distributed import launch_resume

        raise typer.Exit(launch_resume(nproc, output_dir, checkpoint, set_ or (), accept_changed_data))
    from qlora_cli.train.loop import resume as resume_training

    result = resume_training(
        output_dir,
        checkpoint=checkpoint,
        overrides=set_ or (),
        console=console,
        accept_changed_data=accept_changed_data,
    )
    _done(_trained(result))


@app.command()
def export(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            help="A checkpoint-<step> folder, or a run's output_dir (its newest complete checkpoint).",
            show_default=False,
        ),
    ],
    out: Annotated[
        str,  # a Path would take "" as the current folder
        typer.Option(
            help="Folder to write; it must be new or empty unless --force.",
            metavar="<path>",
            show_default=False,
        ),
    ],
    merged: Annotated[
        bool,
        typer.Option(
            "--merged", help="Write the base model with the adapter merged in, instead of a PEFT adapter."
        ),
    ] = False,
    base: Annotated[
        str | None,
        typer.Option(
            help="With --merged: merge onto the 'original' base weights (default) or onto their 'nf4' "
            "round trip, the weights the adapter trained against.",
            show_default=False,
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            help="With --merged: dtype of the saved weights, bfloat16 (default), float16 or float32.",
            show_default=False,
        ),
    ] = None,
    max_shard_size: Annotated[
        str | None,
        typer.Option(
            help="With --merged: largest shard file, e.g. 5GB (default), 500MB or 2GiB.", show_default=False
        ),
    ] = None,
    gguf: Annotated[
        bool,
        typer.Option(
            "--gguf",
            help="Write the merged model as one GGUF file (llama.cpp, Ollama, LM Studio) with an Ollama "
            "Modelfile; needs the gguf extra.",
        ),
    ] = False,
    gguf_type: Annotated[
        str | None,
        typer.Option(
            help="With --gguf: bf16 (default), f16 or q8_0 (norms and biases stay f32).", show_default=False
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace --out if it exists and is not empty.")
    ] = False,
    base_model: BaseModelOption = None,
) -> None:
    """Export a checkpoint as a PEFT adapter, with --merged as a full Hugging Face model, or with --gguf
    as one GGUF file."""
    from qlora_cli.export.command import export as run_export

    result = run_export(
        checkpoint,
        out,
        merged=merged,
        base=base,
        dtype=dtype,
        max_shard_size=max_shard_size,
        gguf=gguf,
        gguf_type=gguf_type,
        force=force,
        base_model=base_model,
    )
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    if result.gguf_file:
        what = f"GGUF {result.gguf_file} ({result.base} base, {result.gguf_type}) with an Ollama Modelfile"
    elif result.merged:
        what = f"merged model ({result.base} base, {result.dtype}, {count(result.shards, 'shard')})"
    else:
        what = "PEFT adapter"
    _done(f"{what} of {result.checkpoint} in {result.out}")


SourceArg = Annotated[
    Path,
    typer.Argument(
        help="A run's output_dir (its newest complete checkpoint), a checkpoint-<step> folder, or a config "
        "file (its output_dir's newest checkpoint).",
        show_default=False,
    ),
]
BaseOnlyOption = Annotated[
    bool, typer.Option("--base-only", help="Run the base model alone, without the adapter.")
]
DeviceOption = Annotated[str, typer.Option(help="auto (CUDA when there is one), cpu, cuda or cuda:N.")]
MaxNewTokensOption = Annotated[int, typer.Option(help="Most tokens to generate per answer.")]
TemperatureOption = Annotated[
    float, typer.Option(help="0 picks the likeliest token (greedy); higher samples.")
]
TopPOption = Annotated[float, typer.Option(help="Sample from the likeliest tokens holding this probability.")]
TopKOption = Annotated[int, typer.Option(help="Sample from this many likeliest tokens (0: all).")]
SeedOption = Annotated[
    int, typer.Option(help="Seed of the sampling; the same seed repeats the same answers.")
]
SystemOption = Annotated[
    str | None, typer.Option(help="System message put before every chat.", show_default=False)
]


@app.command()
def generate(
    source: SourceArg,
    prompt: Annotated[
        list[str] | None,
        typer.Option("--prompt", help="A prompt (repeatable); a user turn unless --raw.", show_default=False),
    ] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(
            help="A .jsonl file, one object per line with `prompt` (text) or `messages` (a chat).",
            show_default=False,
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Also write one JSON row per prompt: the prompt, the completion, token counts.",
            show_default=False,
        ),
    ] = None,
    base_only: BaseOnlyOption = False,
    max_new_tokens: MaxNewTokensOption = 256,
    temperature: TemperatureOption = 0.0,
    top_p: TopPOption = 1.0,
    top_k: TopKOption = 0,
    seed: SeedOption = 0,
    system: SystemOption = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Feed the prompt text as it is, without the chat template.")
    ] = False,
    batch_size: Annotated[int, typer.Option(help="Prompts decoded together.")] = 16,
    device: DeviceOption = "auto",
    base_model: BaseModelOption = None,
) -> None:
    """Complete prompts with a trained model: completions to stdout, progress and speed to stderr."""
    from qlora_cli.generate.command import generate as run_generate
    from qlora_cli.generate.sampling import Sampling

    sampling = Sampling(max_new_tokens, temperature, top_p, top_k, seed)
    run_generate(
        source,
        prompts=prompt or [],
        prompt_file=prompts,
        out=out,
        sampling=sampling,
        base_only=base_only,
        raw=raw,
        system=system,
        batch_size=batch_size,
        device=device,
        base_model=base_model,
        console=console,
    )


@app.command()
def chat(
    source: SourceArg,
    base_only: BaseOnlyOption = False,
    max_new_tokens: MaxNewTokensOption = 256,
    temperature: TemperatureOption = 0.0,
    top_p: TopPOption = 1.0,
    top_k: TopKOption = 0,
    seed: SeedOption = 0,
    system: SystemOption = None,
    device: DeviceOption = "auto",
    base_model: BaseModelOption = None,
) -> None:
    """Talk with a trained model, one message a line; answers stream to stdout. /reset, /system TEXT, /exit."""
    from qlora_cli.generate.chat import chat as run_chat
    from qlora_cli.generate.sampling import Sampling

    sampling = Sampling(max_new_tokens, temperature, top_p, top_k, seed)
    run_chat(
        source,
        sampling=sampling,
        base_only=base_only,
        system=system,
        device=device,
        base_model=base_model,
        console=console,
    )


@app.command()
def profile(
    config: ConfigArg,
    steps: Annotated[int, typer.Option(help="Timed optimizer steps; the table averages them.")] = 3,
    warmup: Annotated[
        int, typer.Option(help="Steps run first and left out (kernel compilation, autotuning, allocator).")
    ] = 1,
    json_file: Annotated[
        Path | None,
        typer.Option("--json", help="Also write the table's numbers to this JSON file.", show_default=False),
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option(
            help="Write a Chrome trace (torch.profiler) of one more step to this file; open it in "
            "chrome://tracing or Perfetto.",
            show_default=False,
        ),
    ] = None,
    set_: SetOption = None,
) -> None:
    """Time each op of a training step as CONFIG sets it up, forward and backward; writes no checkpoints."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise QLoraError("qlora profile times a single process; run it without torchrun")
    from qlora_cli.config.loading import load_config
    from qlora_cli.profiler.command import profile as run_profile
    from qlora_cli.profiler.report import print_report

    report = run_profile(
        load_config(config, set_ or ()),
        steps=steps,
        warmup=warmup,
        json_path=json_file,
        trace_path=trace,
        console=console,
    )
    print_report(report)


def main() -> None:
    """Entry point: every error a user can cause ends in one line, never a traceback.

    Under torchrun rank 0 speaks for the run; other ranks print only their own failures, which rank 0
    does not repeat where it failed the same way.
    """
    other_rank = os.environ.get("RANK", "0") != "0"
    console.quiet = other_rank
    survive_closed_pipes()
    prefer_expandable_segments()
    answer_signals()
    try:
        app()
    except QLoraError as err:
        ignore_signals()
        if (not other_rank or hasattr(err, "failed_rank")) and not getattr(err, "same_error", False):
            console.quiet = False
            style = "yellow" if isinstance(err, RunInterrupted) else "red"
            console.print(
                f"[bold {style}]{err.label}:[/] {escape(str(err))}", highlight=False, soft_wrap=True
            )
        sys.exit(err.exit_code)
    except RunAborted as err:
        ignore_signals()
        console.print(f"[bold red]interrupted:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
        sys.exit(err.exit_code)
    except SystemExit:
        # Typer exits this way when a command returns: its work is printed, and a Ctrl-C while the
        # interpreter shuts down (torch's teardown takes a moment) would end it as 130, with no line.
        ignore_signals()
        raise
