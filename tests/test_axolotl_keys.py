"""Axolotl's keys where they take effect: per-epoch evals and saves, eval packing, the optimizer, special
tokens, resuming a named checkpoint, starting from a PEFT adapter, the loss watchdog, and notes once."""

import json
from pathlib import Path

import pytest
import yaml
from checkpoints import write_run
from safetensors.torch import load_file

from qlora_cli.config.loading import config_from_dict, load_config
from qlora_cli.core.errors import QLoraError, TrainingStopped
from qlora_cli.rundir.adapter import adopt_adapter_shape, trainable_tensors
from qlora_cli.sources.tokenizer import ChatTokenizer
from qlora_cli.train.loop import train
from qlora_cli.train.run import build_run

pytestmark = pytest.mark.usefixtures("reference_ops")


def _records(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(output_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in Path(output_dir).glob("checkpoint-*"))


def test_evals_and_saves_per_epoch_and_the_first_step(tmp_path):
    """24 rows, 4 held out, 2 per micro-batch: 10 steps an epoch, so 2 evals and 5 saves an epoch."""
    path = write_run(
        tmp_path,
        rows=24,
        max_steps=None,
        num_epochs=1,
        val_set_size=4,
        evals_per_epoch=2,
        saves_per_epoch=5,
        save_first_step=True,
    )
    result = train(load_config(path))
    assert result.step == 10
    assert [r["step"] for r in _records(result.output_dir) if "eval_loss" in r] == [5, 10]
    assert _checkpoints(result.output_dir) == [1, 2, 4, 6, 8, 10]


@pytest.mark.parametrize(("max_steps", "evaluated"), [(None, [10, 20]), (4, [4])])
def test_a_validation_set_without_an_eval_schedule_is_evaluated_each_epoch(tmp_path, max_steps, evaluated):
    """Rows held out by val_set_size are evaluated, at each epoch's end (or the run's, if sooner), with a
    note saying so: they were held out and never evaluated."""
    path = write_run(tmp_path, rows=24, max_steps=max_steps, num_epochs=2, val_set_size=4)
    config = load_config(path)
    every = 10 if max_steps is None else 4
    assert f"evaluating every {every} steps (each epoch's end, or the run's)" in " ".join(
        build_run(config).notes
    )
    result = train(config)
    assert [r["step"] for r in _records(result.output_dir) if "eval_loss" in r] == evaluated


def test_eval_packing_and_the_optimizer_follow_the_config(tmp_path):
    path = write_run(tmp_path, val_set_size=8, sample_packing=True)
    run = build_run(load_config(path))
    assert run.train_plan.sample_packing and run.eval_plan.sample_packing
    assert run.optimizer.param_groups[0]["fused"] is True
    run = build_run(load_config(path, ["eval_sample_packing=false", "optimizer=adamw_torch"]))
    assert run.train_plan.sample_packing and not run.eval_plan.sample_packing
    assert not run.optimizer.param_groups[0]["fused"]
    run = build_run(load_config(path, ["sample_packing=false", "eval_sample_packing=true"]))
    assert not run.train_plan.sample_packing and run.eval_plan.sample_packing


@pytest.mark.parametrize(
    ("written", "recomputed"), [("false", 0), ("False", 0), ("true", "all"), ("offload", "all")]
)
def test_gradient_checkpointing_as_axolotl_writes_it_reaches_the_model(tmp_path, written, recomputed):
    """An Axolotl config's `gradient_checkpointing: false` recomputes no layer; true and offload every one."""
    path = write_run(tmp_path)
    path.write_text(
        path.read_text().replace("gradient_checkpointing: false", f"gradient_checkpointing: {written}")
    )
    config = load_config(path)
    run = build_run(config)
    layers = len(run.model.layers)
    assert config.gradient_checkpointing is (written.lower() != "false")
    assert run.model.checkpoint_layers == (layers if recomputed == "all" else recomputed)


def test_special_tokens_take_tokens_of_the_vocabulary(tmp_path, run_cli):
    path = write_run(tmp_path)
    default = build_run(load_config(path)).train_plan.pad_token_id
    chosen = build_run(load_config(path, ["special_tokens.pad_token=<|im_start|>"])).train_plan.pad_token_id
    assert chosen != default and chosen == ChatTokenizer.from_folder(tmp_path / "model").token_to_id(
        "<|im_start|>"
    )
    code, _, err = run_cli("train", path, "--set", "special_tokens.pad_token=<|end_of_text|>")
    assert code == 2 and "Traceback" not in err
    assert "config key 'special_tokens.pad_token': '<|end_of_text|>' is not in the vocabulary" in err
    assert "qlora cannot add tokens" in err


def test_resume_from_checkpoint_continues_that_checkpoint(tmp_path):
    """A new output_dir that continues another run's checkpoint ends with that run's exact adapter."""
    path = write_run(tmp_path, max_steps=4, save_steps=2)
    first = train(load_config(path))
    resumed = [f"output_dir={tmp_path / 'b'}", f"resume_from_checkpoint={first.output_dir / 'checkpoint-2'}"]
    second = train(load_config(path, resumed))
    assert [r["step"] for r in _records(second.output_dir)] == [3, 4]
    a = load_file(first.output_dir / "adapter_model.safetensors")
    b = load_file(second.output_dir / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    with pytest.raises(QLoraError, match="'resume_from_checkpoint': .* is not a checkpoint folder"):
        train(load_config(path, [f"resume_from_checkpoint={tmp_path / 'none'}"]))
    with pytest.raises(QLoraError, match="'lora_r' changed from 4 to 8"):
        train(load_config(path, [*resumed, "lora_r=8"]))


def test_auto_resume_continues_the_newest_checkpoint(tmp_path, capsys):
    path = write_run(tmp_path, max_steps=2, auto_resume_from_checkpoints=True)
    train(load_config(path))
    assert "resuming" not in capsys.readouterr().err
    result = train(load_config(path, ["max_steps=3"]))
    err = capsys.readouterr().err
    assert "resuming from" in err and "at step 2" in err
    assert [r["step"] for r in _records(result.output_dir)] == [1, 2, 3]
    assert _checkpoints(result.output_dir) == [2, 3]


def test_lora_model_dir_starts_from_the_adapter_with_its_shape(tmp_path):
    first = train(load_config(write_run(tmp_path / "a", max_steps=2, lora_r=4, lora_alpha=8)))
    path = write_run(tmp_path / "b", lora_model_dir=str(first.output_dir), lora_r=8, lora_alpha=16)
    run = build_run(load_config(path))
    assert (run.config.lora_r, run.config.lora_alpha) == (4, 8.0)
    assert any(
        n.startswith("lora_model_dir: training continues the adapter's shape (lora_r 8 -> 4")
        for n in run.notes
    )
    saved = load_file(first.output_dir / "adapter_model.safetensors")
    live = trainable_tensors(run.model)
    assert live.keys() == saved.keys()
    assert all(torch_equal(live[k], saved[k]) for k in saved)
    with pytest.raises(QLoraError, match="lora_model_dir .*: no adapter_config.json"):
        build_run(load_config(path, [f"lora_model_dir={tmp_path}"]))


def _expert_adapter(dropout: float) -> dict:
    return {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "lora_dropout": dropout,
        "target_modules": ["q_proj", "v_proj"],
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    }


def test_lora_model_dir_takes_the_adapters_dropout_as_peft_does():
    """An adapter with LoRA on routed experts holds no dropout (PEFT loads none there); the config's
    0.05 gives way to it, with a note, so the adapter the run writes loads in PEFT."""
    base = {"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}], "lora_dropout": 0.05}
    config, notes = adopt_adapter_shape(config_from_dict(base), _expert_adapter(0.0), "a")
    assert config.lora_dropout == 0.0 and config.expert_targets == ("gate_up_proj", "down_proj")
    assert "lora_dropout 0.05 -> 0.0" in notes[0]
    with pytest.raises(
        QLoraError,
        match=r"lora_model_dir a: .*lora_dropout 0\.1, .*set lora_dropout to 0 in its adapter_config",
    ):
        adopt_adapter_shape(config_from_dict(base), _expert_adapter(0.1), "a")


def torch_equal(live, saved) -> bool:
    return bool((live.detach().float().cpu() == saved).all())


def test_loss_watchdog_stops_a_run_whose_loss_stays_high(tmp_path):
    path = write_run(
        tmp_path, max_steps=6, save_steps=1, loss_watchdog_threshold=0.01, loss_watchdog_patience=2
    )
    with pytest.raises(TrainingStopped) as err:
        train(load_config(path))
    assert "loss above loss_watchdog_threshold 0.01 for 2 steps in a row" in str(err.value)
    assert "at step 2" in str(err.value) and str(err.value).endswith("checkpoint-1")
    assert _checkpoints(Path(load_config(path).output_dir)) == [1]


def test_notes_are_printed_once_per_run(tmp_path, run_cli):
    path = write_run(tmp_path, max_steps=1)
    raw = yaml.safe_load(path.read_text())
    raw.update(optimizer="adamw_bnb_8bit", lora_mlp_kernel=True, lora_qkv_kernel=True, wandb_project=None)
    path.write_text(yaml.safe_dump(raw))
    code, _, err = run_cli("train", path)
    assert code == 0, err
    assert err.count("note: optimizer: adamw_bnb_8bit runs as fused AdamW") == 1
    assert err.count("note: lora_mlp_kernel, lora_qkv_kernel:") == 1
    assert "wandb" not in err
    saved = yaml.safe_load((Path(raw["output_dir"]) / "checkpoint-1" / "config.yaml").read_text())
    assert saved["optimizer"] == "adamw_torch_fused" and "lora_mlp_kernel" not in saved


def test_axolotl_conversation_key_is_its_chat_template_or_a_hint():
    """`conversation:` named type: sharegpt's FastChat template in older Axolotl configs."""
    dataset = {"path": "chats.jsonl", "type": "sharegpt", "conversation": "chatml"}
    config = config_from_dict({"base_model": "m", "datasets": [dataset]})
    assert config.datasets[0].chat_template == "chatml"
    assert config.notes == ["datasets[0].conversation: chatml is chat_template: chatml"]
    with pytest.raises(
        QLoraError,
        match=r"^config key 'test_datasets\[0\]\.conversation' is Axolotl's older FastChat template name "
        r"for type: sharegpt; write chat_template: .* instead of conversation: vicuna_v1\.1$",
    ):
        config_from_dict(
            {
                "base_model": "m",
                "datasets": [dataset],
                "test_datasets": [{**dataset, "conversation": "vicuna_v1.1"}],
            }
        )
