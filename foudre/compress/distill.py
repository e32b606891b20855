"""Knowledge distillation: logit matching when teacher and student share a vocabulary,
sequence-level distillation (train on the teacher's samples) when they do not.

Logit distillation minimises, per predicted token::

    loss = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * CE

The ``T^2`` factor keeps the soft term's gradient scale independent of the temperature T.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from foudre.compress.data import SEPARATOR, Split, fixed_batches, read_split, token_stream
from foudre.compress.model import causal_logits, load_trainable, new_model, num_parameters
from foudre.compress.train import (
    LossFn,
    RunConfig,
    TrainConfig,
    TrainResult,
    evaluate_loss,
    load_run_config,
    model_config_from,
    run_training,
)
from foudre.loading.loader import load_tokenizer
from foudre.loading.tokenizer import Tokenizer
from foudre.loading.writer import copy_tokenizer, save_hf
from foudre.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    targets: torch.Tensor,
    alpha: float,
    temperature: float,
) -> torch.Tensor:
    """``alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE``, mean over tokens."""
    vocab = student_logits.shape[-1]
    s = student_logits.reshape(-1, vocab).float()
    t = teacher_logits.reshape(-1, vocab).float()
    kl = F.kl_div(
        F.log_softmax(s / temperature, dim=-1),
        F.log_softmax(t / temperature, dim=-1),
        log_target=True,
        reduction="batchmean",
    )
    if alpha >= 1.0:
        return kl * temperature**2
    ce = F.cross_entropy(s, targets.reshape(-1))
    return alpha * temperature**2 * kl + (1 - alpha) * ce


def distill_loss_fn(teacher: LlamaForCausalLM, alpha: float, temperature: float) -> LossFn:
    """A training loss for ``run_training`` that runs the frozen teacher on each batch."""

    def loss(student: LlamaForCausalLM, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            teacher_logits = causal_logits(teacher, x)
        return kd_loss(causal_logits(student, x), teacher_logits, y, alpha, temperature)

    return loss


def kl_fn(teacher: LlamaForCausalLM) -> LossFn:
    """Mean per-token KL(teacher || student) at temperature 1 (nats): the distillation gap."""

    def loss(student: LlamaForCausalLM, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return kd_loss(causal_logits(student, x), causal_logits(teacher, x), y, 1.0, 1.0)

    return loss


def same_vocabulary(a: Tokenizer, b: Tokenizer) -> bool:
    """True when both tokenizers map every id to the same piece (so logits align)."""
    if a.vocab_size != b.vocab_size:
        return False
    return all(
        a.decode([i], skip_special_tokens=False) == b.decode([i], skip_special_tokens=False)
        for i in range(a.vocab_size)
    )


def mean_kl(
    teacher: LlamaForCausalLM,
    student: LlamaForCausalLM,
    stream: torch.Tensor,
    batch_size: int = 8,
    seq_len: int = 128,
    max_batches: int = 4,
) -> float:
    """Mean per-token KL(teacher || student) over fixed windows of ``stream``."""
    teacher.eval()
    seq_len = min(seq_len, teacher.model.rotary.max_positions, student.model.rotary.max_positions)
    batches = fixed_batches(stream, batch_size, seq_len, max_batches)
    return evaluate_loss(student, batches, "fp32", kl_fn(teacher))


def _sample_shard(
    teacher: str,
    teacher_tokenizer: str | None,
    indices: range,
    max_tokens: int,
    temperature: float,
    seed: int,
    threads: int | None = None,
) -> list[str]:
    """Teacher samples number ``indices`` (sample ``i`` uses seed ``seed + i``)."""
    from foudre.engine.llm import LLM
    from foudre.sampling_params import SamplingParams

    if threads is not None:
        torch.set_num_threads(threads)
    llm = LLM(model=teacher, tokenizer=teacher_tokenizer, dtype="float32", seed=seed)
    tok = llm.get_tokenizer()
    if tok.bos_token_id is None:
        raise ValueError(f"{teacher}: the teacher's tokenizer has no BOS token to start from")
    stops = [tok.bos_token_id] + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
    params = [
        SamplingParams(
            temperature=temperature, max_tokens=max_tokens, seed=seed + i, stop_token_ids=stops
        )
        for i in indices
    ]
    outputs = llm.generate([[tok.bos_token_id]] * len(params), params)
    return [o.outputs[0].text.strip() for o in outputs]


def generate_documents(
    teacher: str,
    teacher_tokenizer: str | None,
    num_samples: int,
    max_tokens: int,
    temperature: float,
    seed: int,
    workers: int = 1,
) -> list[str]:
    """``num_samples`` texts sampled by the teacher from BOS with foudre's engine (each ends at
    EOS, at a new BOS, or after ``max_tokens`` tokens), empty ones dropped.

    A small teacher is bound by the engine's Python step, not by its matrix products, so
    ``workers`` > 1 splits the samples over that many processes with one share of the CPU
    threads each; the samples are the same whatever the number of workers.
    """
    if workers <= 1:
        texts = _sample_shard(
            teacher, teacher_tokenizer, range(num_samples), max_tokens, temperature, seed
        )
    else:
        import concurrent.futures
        import multiprocessing

        threads = max(1, torch.get_num_threads() // workers)
        bounds = [num_samples * w // workers for w in range(workers + 1)]
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            shards = [
                pool.submit(
                    _sample_shard,
                    teacher,
                    teacher_tokenizer,
                    range(bounds[w], bounds[w + 1]),
                    max_tokens,
                    temperature,
                    seed,
                    threads,
                )
                for w in range(workers)
            ]
            texts = [text for shard in shards for text in shard.result()]
    return [t for t in texts if t]


def _load_teacher(teacher: str, teacher_tokenizer: str | None) -> tuple[LlamaForCausalLM, str]:
    """The frozen teacher and the path of its tokenizer."""
    teacher_model, teacher_tok_path = load_trainable(teacher, teacher_tokenizer)
    teacher_model.eval().requires_grad_(False)
    if teacher_tok_path is None:
        raise ValueError(f"{teacher}: no teacher tokenizer found; pass --teacher-tokenizer")
    return teacher_model, teacher_tok_path


def _train_config(run: RunConfig | None, config: str | None, steps: int | None) -> TrainConfig:
    """The student config's training section (or the defaults), replaced by ``config``'s when
    given, with ``steps`` overriding its step count."""
    train_cfg = run.train if run else TrainConfig()
    if config is not None:
        train_cfg = load_run_config(config).train
    if steps is not None:
        train_cfg = dataclasses.replace(train_cfg, steps=steps)
    return train_cfg


def _prepare_student(
    out: Path,
    student: str | None,
    tokenizer: str | None,
    train_tokenizer_vocab: int | None,
    teacher_tok_path: str,
    split: Split,
    resume: bool,
) -> LlamaForCausalLM | None:
    """Put the student's tokenizer in ``out``: its own, a given one, a trained one, or else the
    teacher's. Returns the loaded student when ``student`` names one (else None: a new one)."""
    from foudre.compress.tokenizer_train import train_tokenizer

    student_model: LlamaForCausalLM | None = None
    if student is not None:
        student_model, student_tok_path = load_trainable(student, tokenizer)
        if student_tok_path is None:
            raise ValueError(f"{student}: no student tokenizer found; pass --tokenizer")
        copy_tokenizer(student_tok_path, out)
    elif tokenizer is not None:
        copy_tokenizer(tokenizer, out)
    elif train_tokenizer_vocab is not None:
        if not (resume and (out / "tokenizer.json").is_file()):
            train_tokenizer(split.train, train_tokenizer_vocab, out)
    else:
        copy_tokenizer(teacher_tok_path, out)
    return student_model


def _new_student(
    run: RunConfig | None, student_tok: Tokenizer, train_cfg: TrainConfig
) -> LlamaForCausalLM:
    """A freshly initialised student of the student config's shape, for ``student_tok``."""
    assert run is not None
    return new_model(
        model_config_from(run.model, student_tok, train_cfg.seq_len), seed=train_cfg.seed
    )


def _resolve_mode(mode: str, shared: bool) -> str:
    """``"auto"`` becomes logits when the vocabularies agree (``shared``), else sequence."""
    if mode == "auto":
        mode = "logits" if shared else "sequence"
    if mode == "logits" and not shared:
        raise ValueError("logit distillation needs teacher and student to share a vocabulary")
    if mode not in ("logits", "sequence"):
        raise ValueError(f"unknown distillation mode {mode!r}")
    return mode


def _teacher_samples(
    out: Path,
    resume: bool,
    teacher: str,
    teacher_tokenizer: str | None,
    num_samples: int,
    gen_max_tokens: int,
    gen_temperature: float,
    seed: int,
    gen_workers: int,
) -> list[str]:
    """The teacher's samples for sequence distillation, written to (or, on resume, read back
    from) ``out/teacher_samples.txt``."""
    samples_path = out / "teacher_samples.txt"
    if resume and samples_path.is_file():
        samples = samples_path.read_text(encoding="utf-8").split(SEPARATOR)
        samples = [s.strip() for s in samples if s.strip()]
    else:
        samples = generate_documents(
            teacher,
            teacher_tokenizer,
            num_samples,
            gen_max_tokens,
            gen_temperature,
            seed,
            gen_workers,
        )
        samples_path.write_text("".join(f"{s}\n{SEPARATOR}\n" for s in samples), encoding="utf-8")
    log.info("teacher wrote %d samples", len(samples))
    return samples


def _train_student(
    teacher_model: LlamaForCausalLM,
    student_model: LlamaForCausalLM,
    student_tok: Tokenizer,
    split: Split,
    mode: str,
    train_cfg: TrainConfig,
    out: Path,
    *,
    alpha: float,
    temperature: float,
    resume: bool,
    progress: bool,
) -> dict[str, float | int | str | None]:
    """Train the student in ``mode`` on ``split``, save it and its log in ``out``, and return
    ``distill``'s summary (the KL before and after around the training in logits mode)."""
    log.info("student: %s parameters", f"{num_parameters(student_model):,}")
    train_stream = token_stream(student_tok, split.train)
    heldout_stream = token_stream(student_tok, split.heldout) if split.heldout else None
    kl_stream = heldout_stream if heldout_stream is not None else train_stream
    summary: dict[str, float | int | str | None] = {"mode": mode}
    if mode == "logits":
        summary["kl_before"] = mean_kl(teacher_model, student_model, kl_stream)
        loss_fn = distill_loss_fn(teacher_model, alpha, temperature)
    else:
        from foudre.compress.train import lm_loss

        loss_fn = lm_loss
    result: TrainResult = run_training(
        student_model,
        train_cfg,
        train_stream,
        heldout_stream,
        out,
        loss_fn=loss_fn,
        resume=resume,
        progress=progress,
    )
    if mode == "logits":
        summary["kl_after"] = mean_kl(teacher_model, student_model, kl_stream)
    summary["steps"] = result.step
    summary["final_heldout_loss"] = result.final_heldout_loss
    summary["parameters"] = num_parameters(student_model)
    save_hf(student_model, out)
    report = {**summary, "alpha": alpha, "temperature": temperature, "history": result.history}
    (out / "distill_log.json").write_text(json.dumps(report, indent=1) + "\n")
    return summary


def distill(
    teacher: str,
    data: list[str],
    output: str | Path,
    *,
    teacher_tokenizer: str | None = None,
    student: str | None = None,
    student_config: str | None = None,
    config: str | None = None,
    tokenizer: str | None = None,
    train_tokenizer_vocab: int | None = None,
    alpha: float = 0.5,
    temperature: float = 2.0,
    mode: str = "auto",
    num_samples: int = 2000,
    gen_max_tokens: int = 256,
    gen_temperature: float = 1.0,
    gen_workers: int = 1,
    steps: int | None = None,
    resume: bool = False,
    progress: bool = True,
) -> dict[str, float | int | str | None]:
    """``foudre distill``: train a student (new from ``student_config``, or ``student``) from
    ``teacher``, writing it to ``output`` as a Hugging Face directory.

    ``mode="logits"`` matches the teacher's logits (needs one vocabulary); ``"sequence"`` trains
    on ``num_samples`` teacher samples plus the training part of ``data``; ``"auto"`` picks
    logits when the vocabularies agree. Returns a summary (mode, KL before/after in logits mode,
    held-out losses).
    """
    if (student is None) == (student_config is None):
        raise ValueError("give exactly one of --student DIR and --student-config CONFIG")
    if not 0.0 <= alpha <= 1.0 or temperature <= 0:
        raise ValueError("need 0 <= alpha <= 1 and temperature > 0")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    teacher_model, teacher_tok_path = _load_teacher(teacher, teacher_tokenizer)
    teacher_tok = load_tokenizer(teacher_tok_path)

    run = load_run_config(student_config) if student_config else None
    train_cfg = _train_config(run, config, steps)
    split = read_split(data) if data else Split([], [])

    student_model = _prepare_student(
        out, student, tokenizer, train_tokenizer_vocab, teacher_tok_path, split, resume
    )
    student_tok = load_tokenizer(out)
    mode = _resolve_mode(mode, same_vocabulary(teacher_tok, student_tok))
    if mode == "sequence":
        samples = _teacher_samples(
            out,
            resume,
            teacher,
            teacher_tokenizer,
            num_samples,
            gen_max_tokens,
            gen_temperature,
            train_cfg.seed,
            gen_workers,
        )
        split = Split(train=split.train + samples, heldout=split.heldout)
    if not split.train:
        raise ValueError("no training documents: give --data")

    if student_model is None:
        student_model = _new_student(run, student_tok, train_cfg)
    return _train_student(
        teacher_model,
        student_model,
        student_tok,
        split,
        mode,
        train_cfg,
        out,
        alpha=alpha,
        temperature=temperature,
        resume=resume,
        progress=progress,
    )
