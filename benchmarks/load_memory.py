"""Loading by memory map: peak resident growth and time to first token of ``LLM(...)`` per format.

One random Llama (``--size``: ``bench``, 199M parameters, by default; ``medium``, the 494.7M
model of the llama.cpp comparisons; ``test``, 49M, what ``tests/loading/test_load_memory.py``
loads) written once as bfloat16 safetensors, as a
foudre int8 and int4 checkpoint (``save_quantized``) and as Q8_0 and Q4_0 GGUF files (the
``gguf`` package's writer and quantizer; every 2-D tensor in the type, norms in float32). Each
format loads in a fresh process (``--child``), which prints one JSON line:

- ``file_bytes``: the bytes of the weights' file(s);
- ``weights_bytes``: the bytes of the model's parameters and buffers once loaded and its first
  token computed (each storage once: kernels' layouts built at load included), what any loader
  must hold;
- ``peak_growth``: the process's peak resident memory (``VmHWM``, reset just before) over its
  resident memory before ``LLM(...)``, through ``LLM(...)`` and one generated token (a KV cache
  of a few blocks), so everything the load allocates, copies and frees counts;
- ``ratio``: ``peak_growth / weights_bytes``; the target (issue 51) is
  ``peak_growth <= 1.1 weights_bytes + 64 MB``;
- ``load_s`` and ``ttft_s``: seconds from ``LLM(...)`` to its return, and to the first token of
  a 16-token prompt; ``cpu_s``: the CPU seconds (user and system, every thread) the process
  spent over the same span, which other processes on a shared host disturb less than the wall
  time;
- ``next_s``: seconds to generate ``NEXT_TOKENS`` more tokens right after (another prompt), while
  the weights move into 2 MiB pages in the background (``huge_pages.promote_later``).

``--llama-cpp PATH`` (a ``llama-cli`` or ``llama-bench`` binary, in a llama.cpp tree whose
converter turns the bf16 checkpoint into a bf16 GGUF file) also runs llama.cpp on each GGUF
file and on that one: ``llama-bench -p 16 -n 1 --no-warmup`` timed from its start to its exit
(load and first token, wall clock: its process's start and end counted, foudre's imports not)
with its peak RSS (``getrusage`` of the child), printed beside foudre's, with foudre's time to
first token over llama.cpp's in the same round; the formats
run in turns (``--rounds``), each under every ``FOUDRE_HUGE_PAGES`` value of ``--huge-pages``,
each run ``--sleep`` seconds after the last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import MEDIUM, gguf_of

HERE = Path(__file__).resolve().parent
_SHAPE = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
FORMATS = ("bf16", "int8", "int4", "Q8_0", "Q4_0")
MB = 1 << 20
NEXT_TOKENS = 32
SIZES: dict[str, dict[str, Any]] = {
    "bench": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
    # the 494.7M Llama of the llama.cpp comparisons (its shape; build_models sets the rest)
    "medium": {k: v for k, v in MEDIUM.items() if k in _SHAPE},
    "tiny": dict(  # loaded first in each process, so that imports and libraries are not counted
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
    "test": dict(  # 49M parameters: bfloat16 98 MB, Q4_0 28 MB
        vocab_size=16000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=12,
        num_key_value_heads=4,
    ),
}


def _permute(w: Any, heads: int) -> Any:
    """Hugging Face q/k rows to llama.cpp's rotary order (its converter's ``permute``)."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "attn_q",
    "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "ffn_gate",
    "mlp.up_proj.weight": "ffn_up",
    "mlp.down_proj.weight": "ffn_down",
}


def write_gguf(src: Path, out: Path, qtype: str) -> Path:
    """The Llama in ``src`` (safetensors) as a GGUF file of ``qtype`` (``Q8_0``, ``Q4_0``):
    every 2-D tensor quantized, norms float32; a filler vocabulary (``_add_tokenizer``)."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    cfg = json.loads((src / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    _add_tokenizer(w, cfg["vocab_size"])
    qt = gguf.GGMLQuantizationType[qtype]
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118  (safe_open is not iterable)
            x = f.get_tensor(name).float().numpy()
            if name.startswith("model.layers."):
                layer, _, leaf = name.removeprefix("model.layers.").partition(".")
                gname = f"blk.{layer}.{_GGUF_NAMES[leaf]}.weight"
                if leaf.startswith("self_attn.q_proj"):
                    x = _permute(x, heads)
                elif leaf.startswith("self_attn.k_proj"):
                    x = _permute(x, kv)
            else:
                gname = {
                    "model.embed_tokens.weight": "token_embd.weight",
                    "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight",
                }[name]
            if x.ndim == 2:
                w.add_tensor(gname, gguf.quants.quantize(x, qt), raw_dtype=qt)
            else:
                w.add_tensor(gname, np.ascontiguousarray(x, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w: Any, vocab: int) -> None:
    """A sentencepiece-style vocabulary of ``vocab`` tokens (``<unk>``, ``<s>``, ``</s>``, the
    256 byte tokens, then fillers): what llama.cpp needs to load the file at all."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(vocab - len(tokens))]
    kinds = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    kinds += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (vocab - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens[:vocab])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(kinds[:vocab])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def build_models(root: Path, size: str, formats: tuple[str, ...] = FORMATS) -> dict[str, Path]:
    """Each of ``formats`` of the random Llama ``size`` under ``root`` (written once; kept)."""
    import torch
    import transformers

    root.mkdir(parents=True, exist_ok=True)
    src = root / f"llama-{size}-bf16"
    if not (src / "config.json").exists():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(
            **SIZES[size],
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        )
        transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(
            src, safe_serialization=True
        )
    paths: dict[str, Path] = {}
    for fmt in formats:
        if fmt == "bf16":
            paths[fmt] = src
        elif fmt in ("int8", "int4"):
            paths[fmt] = root / f"llama-{size}-{fmt}"
            if not (paths[fmt] / "config.json").exists():
                _save_quantized(src, paths[fmt], fmt)
        else:
            paths[fmt] = root / f"llama-{size}-{fmt}.gguf"
            if not paths[fmt].exists():
                write_gguf(src, paths[fmt], fmt)
    return paths


def _save_quantized(src: Path, out: Path, scheme: str) -> None:
    import torch

    from foudre.loading.loader import load_model
    from foudre.loading.quantized import save_quantized

    loaded = load_model(str(src), None, "bfloat16", torch.device("cpu"), None, quantization=scheme)
    save_quantized(loaded.model, out, scheme)


def file_bytes(path: Path) -> int:
    """The bytes of a model's weights files (a GGUF file, or a directory's safetensors)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def storage_bytes(model: Any) -> int:
    """The bytes the model's parameters and buffers span, each byte once: the union of their
    extents (a storage's bytes that no tensor of the model covers, such as the room of a tied
    head or of tables replaced in a map of weights placed at load, are not counted)."""
    import itertools

    spans = sorted(
        (t.data_ptr(), t.data_ptr() + _extent(t))
        for t in itertools.chain(model.parameters(), model.buffers())
        if t.numel()
    )
    total, end = 0, 0
    for first, last in spans:
        if last > end:
            total += last - max(first, end)
            end = last
    return total


def _extent(t: Any) -> int:
    """The bytes from ``t``'s first element to just past its last (strides included)."""
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(path: Path, warm: Path | None = None) -> dict[str, Any]:
    """Peak RSS growth and times of ``LLM(path)`` and its first token, in this process (after
    one of ``warm``, a tiny model of the same format, so that what the first load of a process
    imports and maps, code and libraries, is not counted)."""
    import gc

    from foudre import LLM
    from foudre.bench.offline import peak_rss_bytes, reset_peak_rss
    from foudre.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    if warm is not None:
        tiny = LLM(
            str(warm),
            dtype="bfloat16",
            skip_tokenizer_init=True,
            num_kv_blocks=8,
            max_model_len=128,
        )
        tiny.generate([list(range(1, 17))], params)
        del tiny
    gc.collect()
    base = _rss()
    reset_peak_rss()
    c0 = time.process_time()
    t0 = time.perf_counter()
    llm = LLM(
        str(path), dtype="bfloat16", skip_tokenizer_init=True, num_kv_blocks=8, max_model_len=128
    )
    load_s = time.perf_counter() - t0
    llm.generate([list(range(1, 17))], params)
    ttft_s = time.perf_counter() - t0
    cpu_s = time.process_time() - c0
    growth = peak_rss_bytes() - base
    weights = storage_bytes(llm.engine.runner.model)
    t1 = time.perf_counter()  # the next tokens: beside the weights' move into 2 MiB pages
    follow = SamplingParams(temperature=0.0, max_tokens=NEXT_TOKENS, ignore_eos=True)
    llm.generate([list(range(2, 18))], follow)
    next_s = time.perf_counter() - t1
    return {
        "file_bytes": file_bytes(path),
        "weights_bytes": weights,
        "peak_growth": growth,
        "ratio": growth / weights,
        "bound": 1.1 * weights + 64 * MB,
        "load_s": load_s,
        "ttft_s": ttft_s,
        "cpu_s": cpu_s,
        "next_s": next_s,
    }


def _env() -> dict[str, str]:
    """This environment with this repository's root first on ``PYTHONPATH``: the child imports
    the ``foudre`` beside this script (a worktree's), not the one an editable install names."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH")) if p)
    return env


def run_child(path: Path, warm: Path | None = None, huge_pages: str = "") -> dict[str, Any]:
    """``measure(path, warm)`` in a fresh process (from the repository's root), with
    ``FOUDRE_HUGE_PAGES=huge_pages`` where given."""
    extra = [] if warm is None else ["--warm", str(warm)]
    env = _env()
    env.pop("FOUDRE_HUGE_PAGES", None)  # "": the default
    if huge_pages:
        env["FOUDRE_HUGE_PAGES"] = huge_pages
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(path), *extra],
        capture_output=True,
        text=True,
        cwd=HERE.parent,
        env=env,
    )
    if proc.returncode:
        raise RuntimeError(f"loading {path} failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _threads() -> str:
    """foudre's torch threads (``OMP_NUM_THREADS``, set by ``main`` for the children), which
    llama.cpp gets too."""
    return os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))


def llama_cpp(binary: Path, gguf: Path, repack: bool = True) -> dict[str, Any]:
    """llama.cpp's wall time from start to exit on ``gguf`` for one 16-token prompt and one
    token (``llama-bench -p 16 -n 1 -r 1 --no-warmup`` or ``llama-cli -n 1``), and its peak RSS.
    ``repack=False``: ``llama-bench --repack 0`` (weights used as the file lays them out; its
    AMX repacked path stops with SIGILL where the system grants no AMX tile state)."""
    if "bench" in binary.name:
        cmd = [str(binary), "-m", str(gguf), "-p", "16", "-n", "1", "-r", "1", "--no-warmup"]
        cmd += ["-t", _threads()]
        cmd += [] if repack else ["--repack", "0"]
    else:
        cmd = [str(binary), "-m", str(gguf), "-p", "hello", "-n", "1", "-no-cnv", "-t", _threads()]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status:
        raise RuntimeError(f"{' '.join(cmd)} failed (status {status})")
    return {"ttft_s": wall, "peak_rss": usage.ru_maxrss * 1024}


def report(results: dict[str, list[dict[str, Any]]]) -> None:
    """A line per run; foudre's time to first token over llama.cpp's in the same round."""
    print(f"{'format':<22}{'file MB':>9}{'weights MB':>12}{'peak MB':>9}{'ratio':>7}{'bound':>7}"
          f"{'load s':>8}{'TTFT s':>8}{'next s':>8}{'/ llama.cpp':>12}")  # fmt: skip
    for name, runs in results.items():
        peer = results.get(f"llama.cpp {name.split()[0]}", [])
        for i, r in enumerate(runs):
            if name.startswith("llama.cpp"):
                peak = r["peak_rss"] / MB
                print(f"{name:<22}{'':>21}{peak:>9.0f}{'':>30}{r['ttft_s']:>8.2f}")
                continue
            ok = "ok" if r["peak_growth"] <= r["bound"] else "OVER"
            versus = f"{r['ttft_s'] / peer[i]['ttft_s']:>11.2f}x" if i < len(peer) else ""
            print(f"{name:<22}{r['file_bytes'] / MB:>9.0f}{r['weights_bytes'] / MB:>12.0f}"
                  f"{r['peak_growth'] / MB:>9.0f}{r['ratio']:>7.2f}{ok:>7}{r['load_s']:>8.2f}"
                  f"{r['ttft_s']:>8.2f}{r['next_s']:>8.2f}{versus}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--warm", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--size", choices=sorted(SIZES), default="bench")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--llama-cpp", type=Path, help="a llama-cli or llama-bench binary")
    ap.add_argument(
        "--llama-cpp-no-repack", action="store_true", help="llama-bench --repack 0 (no AMX here)"
    )
    ap.add_argument("--root", type=Path, default=Path.home() / ".cache" / "foudre-bench" / "load")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    ap.add_argument(
        "--huge-pages",
        default="",
        help="FOUDRE_HUGE_PAGES values to run each format with, in turns (e.g. ',eager,0': the "
        "default, the weights advised before their first touch, none)",
    )
    ap.add_argument(
        "--sleep",
        type=float,
        default=0.0,
        help="seconds before each run (a VM's host takes freed 2 MiB blocks back after a few: "
        "each run then meets fresh memory, as a process started on a busy machine does)",
    )
    args = ap.parse_args()
    if args.child is not None:
        import foudre

        assert Path(foudre.__file__).resolve().parents[1] == HERE.parent, foudre.__file__
        print(json.dumps(measure(args.child, args.warm)), flush=True)
        return
    formats = tuple(args.formats.split(","))
    paths = build_models(args.root, args.size, formats)
    warm = build_models(args.root, "tiny", formats)
    modes = args.huge_pages.split(",")
    # llama.cpp's file per format: the GGUF files themselves, bf16 converted by its converter
    peers = {fmt: paths[fmt] for fmt in formats if fmt.startswith("Q")}
    # (bf16 through llama.cpp's converter: the Llama 2 vocabulary of 32,000 pieces)
    if args.llama_cpp is not None and "bf16" in formats and SIZES[args.size]["vocab_size"] == 32000:
        llama_cpp_root = args.llama_cpp.resolve().parents[2]  # (its build/bin/)
        peers["bf16"] = gguf_of(paths["bf16"], llama_cpp_root, out_dir=args.root)
    results: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for fmt in formats:
            for mode in modes:
                time.sleep(args.sleep)
                name = fmt + (f" [{mode or 'default'}]" if len(modes) > 1 else "")
                results.setdefault(name, []).append(run_child(paths[fmt], warm[fmt], mode))
            if args.llama_cpp is not None and fmt in peers:
                time.sleep(args.sleep)
                results.setdefault(f"llama.cpp {fmt}", []).append(
                    llama_cpp(args.llama_cpp, peers[fmt], not args.llama_cpp_no_repack)
                )
    report(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    main()
