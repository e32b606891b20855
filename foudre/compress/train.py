"""Training a Llama from scratch: config, optimiser, schedule, checkpoints, held-out loss.

``run_training`` is the one loop; distillation and post-pruning recovery reuse it with their
own loss. A run in ``OUTPUT`` keeps its resumable state in ``OUTPUT/checkpoint/``::

    checkpoint/model.safetensors   weights (foudre names)     checkpoint/optimizer.pt  AdamW state
    checkpoint/state.json          step, model config, train config, loss history

Batches are a pure function of ``(seed, step)``, so a resumed run sees the batches that the
uninterrupted run would have seen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from foudre.compress.data import fixed_batches, random_batch, read_split, token_stream
from foudre.compress.model import causal_logits, new_model, num_parameters
from foudre.loading.loader import load_tokenizer
from foudre.loading.tokenizer import Tokenizer
from foudre.loading.writer import save_hf
from foudre.models.config import ModelConfig
from foudre.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

LossFn = Callable[[LlamaForCausalLM, torch.Tensor, torch.Tensor], torch.Tensor]

_MODEL_KEYS = {
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
}


@dataclass(slots=True)
class TrainConfig:
    """Training hyper-parameters (the ``"train"`` object of a config JSON)."""

    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 1e-3
    min_lr: float | None = None  # cosine floor; None: lr / 10
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    autocast: str = "bf16"  # bf16 | fp32
    eval_every: int = 200
    eval_batches: int = 8
    checkpoint_every: int = 200
    # the written model is the one with the lowest loss on validation windows carved from the
    # training text (the held-out split only reports)
    keep_best: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.autocast not in ("bf16", "fp32"):
            raise ValueError(f"autocast must be bf16 or fp32, got {self.autocast!r}")
        for name in ("steps", "batch_size", "seq_len", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be positive, got {getattr(self, name)}")

    def lr_at(self, step: int) -> float:
        """Linear warmup over ``warmup_steps`` to ``lr``, then cosine decay to ``min_lr``."""
        min_lr = self.lr / 10 if self.min_lr is None else self.min_lr
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return min_lr + 0.5 * (self.lr - min_lr) * (1 + math.cos(math.pi * progress))


@dataclass(slots=True)
class RunConfig:
    """A config JSON: ``{"model": {...Llama shape...}, "train": {...TrainConfig...}}``."""

    model: dict[str, Any] = field(default_factory=dict)
    train: TrainConfig = field(default_factory=TrainConfig)


def load_run_config(path: str | Path) -> RunConfig:
    """Parse a config JSON; unknown keys raise ``ValueError`` naming them."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(raw, dict) or not set(raw) <= {"model", "train"}:
        raise ValueError(f"{path}: expected an object with 'model' and/or 'train' keys")
    model = dict(raw.get("model") or {})
    unknown = set(model) - _MODEL_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown model keys {sorted(unknown)}")
    train_raw = dict(raw.get("train") or {})
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    if set(train_raw) - known:
        raise ValueError(f"{path}: unknown train keys {sorted(set(train_raw) - known)}")
    return RunConfig(model=model, train=TrainConfig(**train_raw))


def model_config_from(shape: dict[str, Any], tokenizer: Tokenizer, seq_len: int) -> ModelConfig:
    """A Llama ``ModelConfig`` from the config's model shape and the tokenizer's special ids."""
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in shape:
            raise ValueError(f"model.{key} is required")
    heads = shape["num_attention_heads"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return ModelConfig(
        architecture="llama",
        vocab_size=tokenizer.vocab_size,
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=shape.get("num_key_value_heads", heads),
        head_dim=shape.get("head_dim", shape["hidden_size"] // heads),
        max_position_embeddings=shape.get("max_position_embeddings", max(seq_len, 512)),
        rms_norm_eps=shape.get("rms_norm_eps", 1e-5),
        rope_theta=shape.get("rope_theta", 10000.0),
        tie_word_embeddings=shape.get("tie_word_embeddings", True),
        bos_token_id=bos,
        eos_token_ids=[] if eos is None else [eos],
    )


def autocast_context(kind: str) -> contextlib.AbstractContextManager[Any]:
    if kind == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lm_loss(model: LlamaForCausalLM, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats)."""
    logits = causal_logits(model, x)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))


def _optimizer(model: LlamaForCausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    params = {id(p): (n, p) for n, p in model.named_parameters() if p.requires_grad}
    decay = [p for n, p in params.values() if p.dim() >= 2]
    no_decay = [p for n, p in params.values() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
    )


def _weights(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def save_checkpoint(
    directory: Path,
    model: LlamaForCausalLM,
    optimizer: torch.optim.Optimizer,
    step: int,
    train_cfg: TrainConfig,
    history: list[dict[str, float]],
) -> None:
    """Write the resumable state of a run after ``step`` completed steps (atomically per file)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "model.safetensors.tmp"
    save_file(_weights(model), str(tmp))
    tmp.replace(directory / "model.safetensors")
    torch.save(optimizer.state_dict(), directory / "optimizer.pt.tmp")
    (directory / "optimizer.pt.tmp").replace(directory / "optimizer.pt")
    state = {
        "step": step,
        "model_config": dataclasses.asdict(model.config),
        "train_config": dataclasses.asdict(train_cfg),
        "history": history,
    }
    (directory / "state.json.tmp").write_text(json.dumps(state, indent=1))
    (directory / "state.json.tmp").replace(directory / "state.json")


def load_checkpoint_weights(directory: Path, model: LlamaForCausalLM) -> dict[str, Any]:
    """Load a checkpoint's weights into ``model``; return its ``state.json``.

    Raises ``ValueError`` when the checkpoint was written for another model shape.
    """
    state: dict[str, Any] = json.loads((directory / "state.json").read_text())
    if ModelConfig(**state["model_config"]) != model.config:
        raise ValueError(f"{directory}: checkpoint is for another model config; cannot resume")
    weights = load_file(str(directory / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    allowed = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if unexpected or set(missing) - allowed:
        raise ValueError(f"{directory}: checkpoint does not match: {missing or unexpected}")
    return state


@torch.no_grad()
def evaluate_loss(
    model: LlamaForCausalLM,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    autocast: str = "fp32",
    loss_fn: LossFn = lm_loss,
) -> float:
    """Mean of ``loss_fn`` over ``batches`` (weighted by tokens), in eval mode."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with autocast_context(autocast):
        for x, y in batches:
            total += float(loss_fn(model, x, y)) * y.numel()
            count += y.numel()
    model.train(was_training)
    return total / max(1, count)


@dataclass(slots=True)
class TrainResult:
    step: int
    history: list[dict[str, float]]
    final_heldout_loss: float | None
    heldout_line: str | None = None  # eval.PerplexityResult.line() on the held-out stories
    validation_tokens: int = 0  # carved from the end of the training stream for keep_best


def _resume_state(
    ckpt: Path, model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, resume: bool
) -> tuple[int, list[dict[str, float]]]:
    """The step and loss history to start from: a checkpoint's (its weights and optimiser state
    loaded) with ``resume`` and a checkpoint in ``ckpt``, else a fresh start."""
    if resume and (ckpt / "state.json").is_file():
        state = load_checkpoint_weights(ckpt, model)
        opt_state = torch.load(ckpt / "optimizer.pt", weights_only=True)
        optimizer.load_state_dict(opt_state)
        log.info("resumed from %s at step %d", ckpt, int(state["step"]))
        return int(state["step"]), list(state["history"])
    return 0, []


def _carve_validation(
    train_stream: torch.Tensor, cfg: TrainConfig
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], int]:
    """``(train_stream, val_batches, n_val)``: with ``keep_best``, validation windows carved
    from the last ``n_val`` tokens of the training stream (at most a tenth of it), which are
    then not trained on.

    keep_best picks a checkpoint on these, never on the held-out split the results are
    reported on."""
    val_batches: list[tuple[torch.Tensor, torch.Tensor]] = []
    n_val = 0
    if cfg.keep_best:
        n_val = min(cfg.eval_batches * cfg.batch_size * cfg.seq_len + 1, len(train_stream) // 10)
        if n_val > cfg.seq_len:
            val_batches = fixed_batches(
                train_stream[-n_val:], cfg.batch_size, cfg.seq_len, cfg.eval_batches
            )
            train_stream = train_stream[:-n_val]
    return train_stream, val_batches, n_val


def _train_step(
    model: LlamaForCausalLM,
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    train_stream: torch.Tensor,
    step: int,
    loss_fn: LossFn,
) -> dict[str, float]:
    """One optimiser step (index ``step``) on the batch of ``(seed, step)``; its history record."""
    t0 = time.perf_counter()
    lr = cfg.lr_at(step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    x, y = random_batch(train_stream, cfg.batch_size, cfg.seq_len, cfg.seed * 1_000_003 + step)
    with autocast_context(cfg.autocast):
        loss = loss_fn(model, x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
    optimizer.step()
    dt = time.perf_counter() - t0
    return {
        "step": step + 1,
        "loss": float(loss.detach()),
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": cfg.batch_size * cfg.seq_len / dt,
    }


def _evaluate_windows(
    model: LlamaForCausalLM,
    cfg: TrainConfig,
    eval_fn: LossFn,
    eval_batches: list[tuple[torch.Tensor, torch.Tensor]],
    val_batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, float]:
    """``heldout_loss`` and ``val_loss`` over the windows there are."""
    losses: dict[str, float] = {}
    if eval_batches:
        losses["heldout_loss"] = evaluate_loss(model, eval_batches, cfg.autocast, eval_fn)
    if val_batches:
        losses["val_loss"] = evaluate_loss(model, val_batches, cfg.autocast, eval_fn)
    return losses


def _save_best(ckpt: Path, model: LlamaForCausalLM) -> None:
    """Keep the weights of the best validation loss so far beside the checkpoint."""
    ckpt.mkdir(parents=True, exist_ok=True)
    save_file(_weights(model), str(ckpt / "best.safetensors.tmp"))
    (ckpt / "best.safetensors.tmp").replace(ckpt / "best.safetensors")


def _restore_best(
    ckpt: Path,
    model: LlamaForCausalLM,
    cfg: TrainConfig,
    history: list[dict[str, float]],
    done: int,
    heldout: float | None,
) -> float | None:
    """With ``keep_best`` and every step done, load the weights of the best validation loss
    back into ``model`` unless the last evaluation was the best; the held-out loss to report."""
    best_path = ckpt / "best.safetensors"
    finished = done == cfg.steps and best_path.is_file()
    evals = [r for r in history if "val_loss" in r]
    kept = min(evals, key=lambda r: r["val_loss"]) if evals else None
    if cfg.keep_best and finished and kept is not None and kept is not evals[-1]:
        log.info("keeping the model of the best validation loss (%.4f)", kept["val_loss"])
        model.load_state_dict(load_file(str(ckpt / "best.safetensors")), strict=False)
        heldout = kept.get("heldout_loss")
    return heldout


def run_training(
    model: LlamaForCausalLM,
    cfg: TrainConfig,
    train_stream: torch.Tensor,
    heldout_stream: torch.Tensor | None,
    output: Path,
    *,
    loss_fn: LossFn = lm_loss,
    eval_fn: LossFn = lm_loss,
    resume: bool = False,
    progress: bool = True,
    stop_at: int | None = None,
) -> TrainResult:
    """Train ``model`` for ``cfg.steps`` steps in total (AdamW, warmup + cosine, clipping).

    With ``resume`` and a checkpoint in ``output/checkpoint``, weights, optimiser state, step
    count and loss history are restored from it first, and training continues from that step.
    A checkpoint is written every ``checkpoint_every`` steps and at the end. With
    ``keep_best``, validation windows are carved from the end of ``train_stream`` (not trained
    on), the weights of the lowest validation loss seen are kept beside the checkpoint and, once
    all steps are done, loaded back into ``model`` (so the returned model is the best one); the
    held-out windows only report, so that a model is never selected on the split its results
    are quoted on.
    ``stop_at`` ends this run early after that many steps in total (checkpointed; the schedule
    is unchanged), so a long run can be done in slices. ``eval_fn`` runs on the fixed held-out
    (and validation) windows every ``eval_every`` steps; the history records every loss.
    """
    ckpt = output / "checkpoint"
    optimizer = _optimizer(model, cfg)
    start, history = _resume_state(ckpt, model, optimizer, resume)
    eval_batches = (
        fixed_batches(heldout_stream, cfg.batch_size, cfg.seq_len, cfg.eval_batches)
        if heldout_stream is not None and len(heldout_stream) > cfg.seq_len
        else []
    )
    train_stream, val_batches, n_val = _carve_validation(train_stream, cfg)
    model.train()
    bar = tqdm(
        total=cfg.steps, initial=start, disable=not progress, unit="step", dynamic_ncols=True
    )
    smoothed_tps = 0.0
    heldout: float | None = None
    best = min((r["val_loss"] for r in history if "val_loss" in r), default=float("inf"))
    done = start
    last = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    for step in range(start, last):
        record = _train_step(model, optimizer, cfg, train_stream, step, loss_fn)
        tps = record["tokens_per_s"]
        smoothed_tps = tps if smoothed_tps == 0 else 0.9 * smoothed_tps + 0.1 * tps
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            record.update(_evaluate_windows(model, cfg, eval_fn, eval_batches, val_batches))
            heldout = record.get("heldout_loss", heldout)
            if "val_loss" in record and record["val_loss"] < best:
                best = record["val_loss"]
                _save_best(ckpt, model)
        history.append(record)
        postfix = {"loss": f"{record['loss']:.3f}", "tok/s": f"{smoothed_tps:,.0f}"}
        if heldout is not None:
            postfix["heldout"] = f"{heldout:.3f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)
        if done % cfg.checkpoint_every == 0 or done == last:
            save_checkpoint(ckpt, model, optimizer, done, cfg, history)
    bar.close()
    model.eval()
    heldout = _restore_best(ckpt, model, cfg, history, done, heldout)
    return TrainResult(
        step=done,
        history=history,
        final_heldout_loss=heldout,
        validation_tokens=0 if not val_batches else n_val,
    )


def iter_train_report(result: TrainResult) -> Iterator[str]:
    """Human-readable summary lines of a run."""
    if result.history:
        last = result.history[-1]
        yield f"step {result.step}: loss {last['loss']:.4f}"
    if result.final_heldout_loss is not None:
        yield f"held-out loss {result.final_heldout_loss:.4f} nats/token (windows)"
    if result.heldout_line is not None:
        yield f"held-out stories: {result.heldout_line}"


def train(
    config_path: str | Path,
    data: list[str],
    output: str | Path,
    *,
    tokenizer: str | None = None,
    train_tokenizer_vocab: int | None = None,
    resume: bool = False,
    steps: int | None = None,
    stop_at: int | None = None,
    progress: bool = True,
) -> TrainResult:
    """``foudre train``: a new Llama on the training part of ``data``, written to ``output``
    as a Hugging Face directory (weights, config, generation config, tokenizer, train log).

    The tokenizer is copied from ``tokenizer`` or trained on the training documents (with
    ``train_tokenizer_vocab`` tokens; an existing one in ``output`` is reused on resume).
    """
    from foudre.compress.tokenizer_train import train_tokenizer
    from foudre.loading.writer import copy_tokenizer

    run = load_run_config(config_path)
    cfg = run.train if steps is None else dataclasses.replace(run.train, steps=steps)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    split = read_split(data)
    if not split.train:
        raise ValueError("no training documents in --data")
    if tokenizer is not None:
        copy_tokenizer(tokenizer, out)
    elif train_tokenizer_vocab is not None:
        if not (resume and (out / "tokenizer.json").is_file()):
            train_tokenizer(split.train, train_tokenizer_vocab, out)
    else:
        raise ValueError("give --tokenizer DIR or --train-tokenizer VOCAB_SIZE")
    tok = load_tokenizer(out)
    model_cfg = model_config_from(run.model, tok, cfg.seq_len)
    model = new_model(model_cfg, seed=cfg.seed)
    log.info("model: %s parameters", f"{num_parameters(model):,}")
    train_stream = token_stream(tok, split.train)
    heldout_stream = token_stream(tok, split.heldout) if split.heldout else None
    result = run_training(
        model,
        cfg,
        train_stream,
        heldout_stream,
        out,
        resume=resume,
        progress=progress,
        stop_at=stop_at,
    )
    save_hf(model, out)
    if split.heldout:
        from foudre.compress.eval import perplexity

        result.heldout_line = perplexity(model, tok, split.heldout).line()
    report = {
        "parameters": num_parameters(model),
        "train_tokens": len(train_stream) - result.validation_tokens,
        "validation_tokens": result.validation_tokens,
        "heldout_tokens": 0 if heldout_stream is None else len(heldout_stream),
        "train_config": dataclasses.asdict(cfg),
        "final_heldout_loss": result.final_heldout_loss,
        "heldout": result.heldout_line,
        "history": result.history,
    }
    (out / "train_log.json").write_text(json.dumps(report, indent=1) + "\n")
    return result
