"""``foudre train``: the loss falls; the output loads in foudre and transformers alike; resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from foudre import LLM, SamplingParams
from foudre.compress.model import full_sequence_logits, load_for_eval
from foudre.compress.train import train

from .conftest import write_config


def test_training_lowers_the_loss(trained: Path) -> None:
    log = json.loads((trained / "train_log.json").read_text())
    losses = [r["loss"] for r in log["history"]]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0
    heldout = [r["heldout_loss"] for r in log["history"] if "heldout_loss" in r]
    assert len(heldout) == 2 and heldout[-1] < torch.log(torch.tensor(300.0)).item() - 1.0
    # keep_best selects on validation windows carved from the training text; the held-out
    # loss reported is that of the kept step
    evals = [r for r in log["history"] if "val_loss" in r]
    assert len(evals) == 2
    kept = min(evals, key=lambda r: r["val_loss"])
    assert log["final_heldout_loss"] == kept["heldout_loss"]
    assert log["train_config"]["keep_best"] is True
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (trained / name).is_file(), name
    cfg = json.loads((trained / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == 300


def test_output_loads_in_foudre_and_transformers_with_identical_logits(trained: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model, tok = load_for_eval(str(trained))
    text = "Once upon a time, there was a little dog."
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == tok.eos_token_id
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(trained))
    assert hf_tok(text)["input_ids"] == ids
    ours = full_sequence_logits(model, ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(trained), dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)

    llm = LLM(str(trained), max_model_len=128, num_kv_blocks=32)
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    greedy = ids[:]
    for _ in range(8):
        greedy.append(int(full_sequence_logits(model, greedy)[-1].argmax()))
    assert list(out[0].outputs[0].token_ids) == greedy[len(ids) :]


def test_resume_continues_the_step_count_and_matches_an_uninterrupted_run(
    tmp_path: Path, corpus: Path, trained: Path
) -> None:
    config = write_config(tmp_path / "c.json", steps=6, checkpoint_every=2, eval_every=3)
    common = dict(tokenizer=str(trained), progress=False)
    first = train(config, [str(corpus)], tmp_path / "a", stop_at=4, **common)  # type: ignore[arg-type]
    assert first.step == 4
    state = json.loads((tmp_path / "a/checkpoint/state.json").read_text())
    assert state["step"] == 4
    resumed = train(config, [str(corpus)], tmp_path / "a", resume=True, **common)  # type: ignore[arg-type]
    assert resumed.step == 6 and [r["step"] for r in resumed.history] == [1, 2, 3, 4, 5, 6]
    assert json.loads((tmp_path / "a/checkpoint/state.json").read_text())["step"] == 6
    straight = train(config, [str(corpus)], tmp_path / "b", **common)  # type: ignore[arg-type]
    assert [r["loss"] for r in straight.history] == pytest.approx(
        [r["loss"] for r in resumed.history], rel=1e-5
    )
    a, b = load_file(tmp_path / "a/model.safetensors"), load_file(tmp_path / "b/model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-5)


def test_keep_best_restores_the_weights_of_the_lowest_validation_loss(tmp_path: Path) -> None:
    from foudre.compress.model import new_model
    from foudre.compress.train import TrainConfig, run_training
    from foudre.models.config import ModelConfig

    shape = ModelConfig(
        architecture="llama",
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=32,
    )
    model = new_model(shape, seed=0)
    stream = torch.randint(0, 40, (4000,))
    cfg = TrainConfig(
        steps=6,
        batch_size=2,
        seq_len=16,
        warmup_steps=1,
        autocast="fp32",
        eval_every=2,
        eval_batches=1,
    )
    # the validation loss is scripted: lowest at the second evaluation (step 4), not the last
    scripted = iter([3.0, 1.0, 2.0])
    snapshots: list[dict[str, torch.Tensor]] = []

    def val_loss(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        snapshots.append({k: v.clone() for k, v in m.state_dict().items()})
        return torch.tensor(next(scripted))

    result = run_training(model, cfg, stream, None, tmp_path, eval_fn=val_loss, progress=False)
    assert [r.get("val_loss") for r in result.history if "val_loss" in r] == [3.0, 1.0, 2.0]
    assert result.validation_tokens == 1 * 2 * 16 + 1
    for name, value in model.state_dict().items():
        assert torch.equal(value, snapshots[1][name]), name
