"""The ``foudre`` command line: generate, chat, serve.

Engine flags map one to one onto ``EngineConfig`` fields (``--max-num-seqs`` -> max_num_seqs).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from foudre.engine.options import PROFILES, add_engine_args, engine_config_from, profile_defaults
from foudre.loading.errors import ModelLoadError
from foudre.sampling_params import BeamSearchParams, SamplingParams

# `foudre generate` and `foudre chat` decode greedily unless told otherwise (the same command
# prints the same text), and write more than the API's default max_tokens: a command line asks
# for a continuation to read. Every other default is SamplingParams'.
CLI_TEMPERATURE = 0.0
CLI_MAX_TOKENS = 128


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    defaults = SamplingParams()
    parser.add_argument("--max-tokens", type=int, default=CLI_MAX_TOKENS)
    parser.add_argument("--temperature", type=float, default=CLI_TEMPERATURE)
    parser.add_argument("--top-p", type=float, default=defaults.top_p)
    parser.add_argument("--top-k", type=int, default=defaults.top_k)
    parser.add_argument("--min-p", type=float, default=defaults.min_p)
    parser.add_argument("--repetition-penalty", type=float, default=defaults.repetition_penalty)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args: argparse.Namespace, seed: int | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        seed=seed,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    """Print the prompt, then its continuation as it is generated (with ``--beam-width``, each
    beam's prompt and continuation on its own line)."""
    from foudre.engine.llm import LLM

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    llm = LLM.from_config(engine_config_from(args))
    if args.beam_width is not None:
        params = BeamSearchParams(
            beam_width=args.beam_width,
            max_tokens=args.max_tokens,
            length_penalty=args.length_penalty,
            ignore_eos=args.ignore_eos,
        )
        [out] = llm.beam_search([prompt], params)
        for i, seq in enumerate(out.sequences):
            print(f"[{i}] score {seq.score:.4f} ({seq.finish_reason}): {prompt}{seq.text}")
        return 0
    pieces = llm.stream(prompt, _sampling_params(args, args.seed))
    first = next(pieces, "")  # the engine has accepted the prompt: nothing printed for a refusal
    for piece in itertools.chain([prompt, first], pieces):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from foudre.engine.llm import LLM

    llm = LLM.from_config(engine_config_from(args))
    tok = llm.get_tokenizer()
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("foudre chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        prompt_ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        reply = ""
        for piece in llm.stream(prompt_ids, _sampling_params(args, args.seed)):
            sys.stdout.write(piece)
            sys.stdout.flush()
            reply += piece
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from foudre.loading.errors import ModelLoadError
    from foudre.server.launch import run_server
    from foudre.server.reasoning import OFF, REASONING_PARSERS, HarmonyUnavailableError

    if args.reasoning_parser not in (None, OFF, *REASONING_PARSERS):
        choices = ", ".join([*sorted(REASONING_PARSERS), OFF])
        print(
            f"foudre: error: unknown --reasoning-parser {args.reasoning_parser!r}; choose one "
            f"of {choices}",
            file=sys.stderr,
        )
        return 2
    config = engine_config_from(args)
    if args.profile is not None:
        chosen = ", ".join(f"{k}={getattr(config, k)}" for k in args.profile_fields)
        print(f"foudre: profile {args.profile}: {chosen}", file=sys.stderr)
    try:
        return run_server(
            config,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            served_model_name=args.served_model_name,
            max_queue=args.max_queue,
            log_level="info" if args.verbose else "warning",
            max_n=args.max_n,
            max_request_bytes=args.max_request_bytes,
            request_timeout=args.request_timeout,
            tool_call_parser=args.tool_call_parser,
            shutdown_timeout=args.shutdown_timeout,
            responses_store_size=args.responses_store_size,
            responses_store_bytes=args.responses_store_bytes,
            reasoning_parser=args.reasoning_parser,
        )
    except (ModelLoadError, HarmonyUnavailableError) as e:
        print(f"foudre: error: {e}", file=sys.stderr)
        return 2


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from foudre.bench.serve import run_bench_serve

    return run_bench_serve(args)


def cmd_train(args: argparse.Namespace) -> int:
    from foudre.compress.train import iter_train_report, train

    result = train(
        args.config,
        args.data,
        args.output,
        tokenizer=args.tokenizer,
        train_tokenizer_vocab=args.train_tokenizer,
        resume=args.resume,
        steps=args.steps,
        stop_at=args.stop_at,
        progress=not args.no_progress,
    )
    for line in iter_train_report(result):
        print(line)
    print(f"wrote {args.output}")
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    from foudre.compress.distill import distill

    summary = distill(
        args.teacher,
        args.data,
        args.output,
        teacher_tokenizer=args.teacher_tokenizer,
        student=args.student,
        student_config=args.student_config,
        config=args.config,
        tokenizer=args.tokenizer,
        train_tokenizer_vocab=args.train_tokenizer,
        alpha=args.alpha,
        temperature=args.temperature,
        mode=args.mode,
        num_samples=args.num_samples,
        gen_max_tokens=args.gen_max_tokens,
        gen_temperature=args.gen_temperature,
        gen_workers=args.gen_workers,
        steps=args.steps,
        resume=args.resume,
        progress=not args.no_progress,
    )
    print(" ".join(f"{k}={v}" for k, v in summary.items()))
    print(f"wrote {args.output}")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    from foudre.compress.prune import prune

    summary = prune(
        args.model,
        args.output,
        tokenizer=args.tokenizer,
        heads=args.heads,
        ffn=args.ffn,
        layers=args.layers,
        calibration=args.calibration,
        calibration_tokens=args.calibration_tokens,
        distill_steps=args.distill_steps,
        config=args.config,
        alpha=args.alpha,
        temperature=args.temperature,
        progress=not args.no_progress,
    )
    for key, value in summary.items():
        print(f"{key}: {value}")
    print(f"wrote {args.output}")
    return 0


def cmd_eval_perplexity(args: argparse.Namespace) -> int:
    from foudre.compress.data import read_documents
    from foudre.compress.eval import perplexity
    from foudre.compress.model import load_for_eval

    model, tok = load_for_eval(args.model, args.tokenizer, args.quantization)
    docs = read_documents(args.data, args.split)
    if not docs:
        raise ValueError(f"{args.data}: no documents in split {args.split!r}")
    result = perplexity(model, tok, docs, args.max_length, args.kv_cache_dtype)
    print(f"documents={len(docs)} nats_per_token={result.nats_per_token:.4f}")
    print(result.line())
    return 0


def add_compress_parsers(sub: Any) -> None:
    """The model-compression subcommands: train, distill, prune, eval."""
    train = sub.add_parser("train", help="train a Llama from scratch into a HF directory")
    train.add_argument("--config", required=True, help="JSON: {model: {...}, train: {...}}")
    train.add_argument("--data", nargs="+", required=True, help="<|endoftext|>-separated text")
    tok = train.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", help="directory or file of an existing tokenizer")
    tok.add_argument("--train-tokenizer", type=int, metavar="VOCAB_SIZE", help="train a BPE")
    train.add_argument("--output", required=True)
    train.add_argument("--resume", action="store_true", help="continue from OUTPUT/checkpoint")
    train.add_argument("--steps", type=int, default=None, help="override train.steps")
    train.add_argument(
        "--stop-at", type=int, default=None, help="stop after this step (checkpointed); --resume"
    )
    train.add_argument("--no-progress", action="store_true")
    train.set_defaults(func=cmd_train)

    dist = sub.add_parser("distill", help="distil a teacher into a (new or existing) student")
    dist.add_argument("--teacher", required=True, help="HF directory or llama2.c .bin")
    dist.add_argument("--teacher-tokenizer", default=None)
    student = dist.add_mutually_exclusive_group(required=True)
    student.add_argument("--student-config", help="JSON config of a new student")
    student.add_argument("--student", help="an existing student model")
    dist.add_argument("--config", default=None, help="JSON whose 'train' section is used")
    dist.add_argument("--data", nargs="*", default=[], help="text files")
    stok = dist.add_mutually_exclusive_group()
    stok.add_argument("--tokenizer", default=None, help="the new student's tokenizer")
    stok.add_argument("--train-tokenizer", type=int, default=None, metavar="VOCAB_SIZE")
    dist.add_argument("--output", required=True)
    dist.add_argument("--alpha", type=float, default=0.5, help="weight of the KL term (0.5)")
    dist.add_argument("--temperature", type=float, default=2.0, help="softmax temperature (2)")
    dist.add_argument("--mode", choices=("auto", "logits", "sequence"), default="auto")
    dist.add_argument("--num-samples", type=int, default=2000, help="sequence mode (2000)")
    dist.add_argument("--gen-max-tokens", type=int, default=256)
    dist.add_argument("--gen-temperature", type=float, default=1.0)
    dist.add_argument(
        "--gen-workers", type=int, default=1, help="processes sampling the teacher (1)"
    )
    dist.add_argument("--steps", type=int, default=None)
    dist.add_argument("--resume", action="store_true")
    dist.add_argument("--no-progress", action="store_true")
    dist.set_defaults(func=cmd_distill)

    prune = sub.add_parser("prune", help="remove heads, FFN channels and layers")
    prune.add_argument("--model", required=True)
    prune.add_argument("--tokenizer", default=None)
    prune.add_argument("--heads", type=float, default=0.0, help="fraction of KV groups to remove")
    prune.add_argument("--ffn", type=float, default=0.0, help="fraction of FFN channels to remove")
    prune.add_argument("--layers", type=int, default=0, help="number of layers to remove")
    prune.add_argument("--calibration", default=None, help="text file for importance scores")
    prune.add_argument("--calibration-tokens", type=int, default=16384)
    prune.add_argument("--distill-steps", type=int, default=0)
    prune.add_argument("--config", default=None, help="JSON whose 'train' section is used")
    prune.add_argument("--alpha", type=float, default=0.5)
    prune.add_argument("--temperature", type=float, default=2.0)
    prune.add_argument("--output", required=True)
    prune.add_argument("--no-progress", action="store_true")
    prune.set_defaults(func=cmd_prune)

    ev = sub.add_parser("eval", help="evaluations: perplexity")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True)
    ppl = ev_sub.add_parser("perplexity", help="token perplexity and bits per byte")
    ppl.add_argument("--model", required=True)
    ppl.add_argument("--tokenizer", default=None)
    ppl.add_argument("--data", required=True)
    ppl.add_argument("--max-length", type=int, default=None)
    ppl.add_argument("--split", choices=("all", "train", "heldout"), default="all")
    from foudre.attention.kv_quant import KV_CACHE_DTYPES
    from foudre.quant.api import METHODS

    ppl.add_argument("--quantization", default=None, choices=METHODS)
    ppl.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="round K/V as the quantized KV cache stores them",
    )
    ppl.set_defaults(func=cmd_eval_perplexity)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="foudre", description="fast LLM inference")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parsers(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_compress_parsers(sub)

    from foudre.compress.quantize import add_quantize_args, cmd_quantize

    quant = sub.add_parser("quantize", help="quantize a model's weights and save the checkpoint")
    add_quantize_args(quant)
    quant.set_defaults(func=cmd_quantize)
    return parser


def add_generate_parsers(sub: Any) -> None:
    """The offline subcommands: generate, chat."""
    gen = sub.add_parser("generate", help="complete one prompt (stdin when --prompt is absent)")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--prompt", default=None)
    gen.add_argument(
        "--beam-width", type=int, default=None, help="beam search: print the N best sequences"
    )
    length_penalty = BeamSearchParams(beam_width=1).length_penalty
    gen.add_argument(
        "--length-penalty", type=float, default=length_penalty, help="beam search scoring"
    )
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", default=None)
    chat.set_defaults(func=cmd_chat)


def add_serve_parser(sub: Any) -> None:
    """``serve``: the OpenAI-compatible server."""
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="(default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port (default: 8000)")
    serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*"
    )
    serve.add_argument(
        "--served-model-name", default=None, help="(default: the model path's basename)"
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="most unfinished requests before answering 503 (default: 1024)",
    )
    serve.add_argument(
        "--max-n", type=int, default=16, help="most choices (n) one request may ask (default: 16)"
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=8 << 20,
        help="larger request bodies get 413 (default: 8 MiB)",
    )
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds before a request is aborted and answered 408 (default: none)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may run after the first SIGTERM/SIGINT (new ones get "
        "503) before they end with finish_reason 'abort'; a second signal aborts at once "
        "(default: 30)",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        default=None,
        help="how tool calls are read from the output with tool_choice 'auto' (default: the "
        "format the chat template uses)",
    )
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="how a thinking model's output is split into reasoning (reasoning_content, "
        "Responses reasoning items) and answer: deepseek_r1, qwen3 (<think>...</think>), "
        "gpt_oss (harmony channels), or none (default: detected from the chat template)",
    )
    serve.add_argument(
        "--responses-store-size",
        type=int,
        default=1024,
        help="most responses /v1/responses keeps for GET and previous_response_id, the least "
        "recently used evicted first; 0 keeps none (default: 1024)",
    )
    serve.add_argument(
        "--responses-store-bytes",
        type=int,
        default=64 << 20,
        help="most bytes of responses (their JSON, with the conversation they end) that "
        "/v1/responses keeps, the least recently used evicted first (default: 64 MiB)",
    )
    serve.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=None,
        help="engine options for a scenario (realtime, throughput, edge); flags still override",
    )
    serve.set_defaults(func=cmd_serve, profile_fields=[])


def add_bench_parser(sub: Any) -> None:
    """``bench`` and its subcommands: serve, throughput, latency, ablate, sweep, quant."""
    bench = sub.add_parser(
        "bench", help="benchmarks: serve, throughput, latency, ablate, sweep, quant"
    )
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from foudre.bench.serve import add_bench_serve_args

    bench_serve = bench_sub.add_parser(
        "serve", help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, E2EL, goodput)"
    )
    add_bench_serve_args(bench_serve)
    bench_serve.set_defaults(func=cmd_bench_serve)
    from foudre.bench.commands import add_bench_commands

    add_bench_commands(bench_sub, add_engine_args)  # throughput, latency, ablate, sweep, quant


def _apply_profile(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """With ``serve --profile NAME``, make the profile's engine options the serve command's
    defaults, so that each flag given on the command line still wins."""
    if not argv or argv[0] != "serve":
        return
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--profile", default=None)
    pre.add_argument("--model", default=None)
    known, _ = pre.parse_known_args(argv[1:])
    if known.profile not in PROFILES:
        return  # absent, or unknown: the full parser reports it
    chosen = profile_defaults(known.profile, known.model)
    serve = _subparser(parser, "serve")
    serve.set_defaults(**chosen, profile_fields=sorted(chosen))


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]  # type: ignore[no-any-return]
    raise KeyError(name)


def _is_torchrun_worker(args: argparse.Namespace) -> bool:
    """A command that runs an engine, started by ``torchrun`` (or any launcher that sets
    ``RANK`` and ``WORLD_SIZE``) on a rank other than 0: rank 0 runs the command, the others
    hold shards of its model (``torchrun --nproc-per-node 2 -m foudre serve ...
    --tensor-parallel-size 2``)."""
    if not hasattr(args, "tensor_parallel_size"):
        return False
    return int(os.environ.get("RANK", "0")) > 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _run_torchrun_worker(args: argparse.Namespace) -> int:
    from foudre.distributed.worker import run_worker_from_env

    run_worker_from_env(engine_config_from(args))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    arg_list = list(argv) if argv is not None else sys.argv[1:]
    args_start = next((i for i, a in enumerate(arg_list) if not a.startswith("-")), 0)
    _apply_profile(parser, arg_list[args_start:])
    args = parser.parse_args(arg_list)
    args.argv = arg_list
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        if _is_torchrun_worker(args):
            return _run_torchrun_worker(args)
        return int(args.func(args))
    except (ValueError, OSError, ModelLoadError) as e:
        print(f"foudre: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
