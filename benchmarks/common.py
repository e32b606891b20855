"""Helpers shared by the benchmark scripts: random-weight models, the memory roofline, and
llama.cpp (the CPU peer) built from llama-cpp-python's sdist, its converter, quantizer and
``llama-bench``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import torch

from foudre.bench.roofline import machine, measure_bandwidth, weight_bytes

__all__ = [
    "CACHE",
    "LLAMA_CPP_PYTHON",
    "MEDIUM",
    "MEDIUM_32K",
    "SMALL",
    "TINY",
    "build_llama_cpp",
    "gguf_of",
    "has_amx",
    "llama_bench",
    "llama_bench_retry",
    "llama_bench_rows",
    "llama_cpp_bindings",
    "machine",
    "measure_bandwidth",
    "peer_options",
    "random_llama",
    "random_model",
    "recorded",
    "run_child",
    "weight_bytes",
]

# The "medium" model of ../shared/BASELINES.md: 494.7M parameters.
MEDIUM: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=1536,
    intermediate_size=4096,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
SMALL: dict[str, Any] = dict(
    MEDIUM, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=2048
)
# A few megabytes a matrix, its widths multiples of 256 so that the K-quants apply to every one
TINY: dict[str, Any] = dict(
    MEDIUM,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
# The medium model with its context raised to 32k tokens by Llama-3.1-style RoPE scaling.
MEDIUM_32K: dict[str, Any] = dict(
    MEDIUM,
    max_position_embeddings=32768,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 4096,
    },
)
CACHE = Path(os.environ.get("FOUDRE_BENCH_CACHE", Path.home() / ".cache" / "foudre-bench"))


def random_llama(name: str = "medium", dtype: torch.dtype = torch.float32) -> Path:
    """A random-weight Llama saved as safetensors (built once with transformers, then cached)."""
    import transformers

    path = CACHE / f"llama-{name}-{str(dtype).removeprefix('torch.')}"
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        **{"medium": MEDIUM, "small": SMALL, "tiny": TINY, "medium-32k": MEDIUM_32K}[name]
    )
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    return path


def with_llama2_tokenizer(model: Path) -> Path:
    """``model`` (a random Llama of vocabulary 32,000) beside the Llama 2 tokenizer that its
    vocabulary stands for: a directory of links to its files plus ``tokenizer.model``, for what
    needs a tokenizer (the server)."""
    out = model.parent / f"{model.name}-llama2-tokenizer"
    if not (out / "tokenizer.model").exists():
        out.mkdir(exist_ok=True)
        for f in model.iterdir():
            if not (out / f.name).exists():
                (out / f.name).symlink_to(f.resolve())
        tok = Path(__file__).resolve().parents[2] / "shared" / "models" / "llama2-tokenizer"
        (out / "tokenizer.model").write_bytes((tok / "tokenizer.model").read_bytes())
    return out


LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"


# llama.cpp's AMX kernels (its extra buffer type for Q4_0, Q8_0 and the K types, chosen at build
# time where -march=native has AMX) died on prompts of a Q8_0 file on an Intel Xeon VM whose AMX
# works for oneDNN and for a plain tile program (2026-12-03: SIGILL at tilezero in
# tinygemm_kernel_amx, or SIGSEGV, not every run); a benchmark's measurement that dies runs
# again on a build without them, with its AVX-512 kernels
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def build_llama_cpp(
    root: Path, targets: tuple[str, ...] = ("llama-bench",), amx: bool = True
) -> Path:
    """The directory of llama.cpp's programs built under ``root`` (``root/build/bin``; without
    AMX, ``amx=False``: ``root/build-noamx/bin``): the ``targets`` missing there are built from
    llama-cpp-python's sdist (downloaded with pip, its vendored llama.cpp moved to
    ``root/src``), ``-DGGML_NATIVE=ON``, about 6 minutes on 2 cores for ``llama-bench`` and
    ``llama-quantize``."""
    build = root / ("build" if amx else "build-noamx")
    bin_dir = build / "bin"
    missing = [t for t in targets if not (bin_dir / t).exists()]
    if not missing:
        return bin_dir
    root.mkdir(parents=True, exist_ok=True)
    src = root / "src"
    if not (src / "CMakeLists.txt").exists():
        dl = root / "download"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             LLAMA_CPP_PYTHON, "-d", str(dl)],
            check=True,
        )  # fmt: skip
        archive = next(dl.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(dl, filter="data")
        vendored = next(dl.glob("llama_cpp_python-*/vendor/llama.cpp"))
        shutil.move(str(vendored), src)
    if not (build / "build.ninja").exists():
        flags = [] if amx else [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
        subprocess.run(
            ["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DGGML_NATIVE=ON",
             "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", *flags],
            check=True,
        )  # fmt: skip
    subprocess.run(["ninja", "-C", str(build), *missing], check=True)
    return bin_dir


def llama_cpp_bindings(root: Path = CACHE / "llama.cpp") -> Any:
    """llama.cpp's C API (``llama_cpp.llama_cpp``: llama-cpp-python's ctypes bindings) over the
    ``libllama.so`` of ``build_llama_cpp(root)``, the bindings imported from the same sdist as the
    library's source (``root/download``: their ABI matches), nothing compiled. Raises
    ``FileNotFoundError`` saying what is absent. Their package imports ``diskcache`` for a cache
    class never used here: where it is not installed, an empty module stands for it."""
    lib = root / "build" / "bin"
    sdist = next(iter(sorted((root / "download").glob("llama_cpp_python-*/llama_cpp"))), None)
    if not (lib / "libllama.so").exists() or sdist is None:
        raise FileNotFoundError(
            f"llama.cpp's libllama.so ({lib}) or llama-cpp-python's unpacked sdist "
            f"({root / 'download'}) is absent: common.build_llama_cpp(root, ('llama',)) makes both"
        )
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib)
    if str(sdist.parent) not in sys.path:
        sys.path.insert(0, str(sdist.parent))
    try:
        import diskcache  # noqa: F401
    except ImportError:
        import types

        sys.modules["diskcache"] = types.ModuleType("diskcache")
    import llama_cpp.llama_cpp as capi

    return capi


def run_child(script: str, *args: str, what: str) -> dict[str, Any]:
    """``script --child *args`` in a fresh Python process from the repository's root (one
    configuration per process: no state carried between measurements); its last line of stdout
    is one JSON object. ``SystemExit`` naming ``what``, with the end of its stderr, if it fails."""
    proc = subprocess.run(
        [sys.executable, script, "--child", *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    if proc.returncode:
        raise SystemExit(f"{what} failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def peer_options(ap: argparse.ArgumentParser) -> None:
    """The options of a benchmark run beside llama.cpp: where its build is, the record to write
    and a note for it, and the hidden ones its per-model child processes are given."""
    ap.add_argument("--llama-cpp", type=Path, default=Path("~/.cache/foudre-bench/llama.cpp"))
    ap.add_argument("--out", type=Path, help="write results.json and results.md here")
    ap.add_argument("--note", default="", help="a line for the record (e.g. a shared host)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)


def recorded(
    runs: list[dict[str, Any]],
    errors: dict[str, str],
    key: str,
    tags: dict[str, Any],
    fn: Any,
    *a: Any,
) -> dict[str, Any] | None:
    """``fn(*a)``'s figures, appended to ``runs`` with ``tags`` and the host's 1-minute load
    average as it started; a failure recorded in ``errors[key]`` (the run goes on): None."""
    load = os.getloadavg()[0]
    try:
        r = fn(*a)
    except (Exception, SystemExit) as e:
        errors[key] = f"{type(e).__name__}: {e}"[-1500:]
        print(f"{key}: FAILED {errors[key][:300]}", flush=True)
        return None
    runs.append(r | tags | {"load_avg": load})
    return dict(r)


def has_amx() -> bool:
    """Whether this CPU reports AMX's int8 tiles (where llama.cpp's native build takes its AMX
    kernels: ``NO_AMX``)."""
    try:
        return " amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def llama_bench(
    bench: Path, gguf: Path, prompt: int = 0, generate: int = 0, repeats: int = 1, depth: int = 0
) -> float:
    """``llama-bench``'s tokens/s on ``gguf`` with flash attention, on every core: prefill of a
    ``prompt``-token prompt (pp) or ``generate`` tokens of decode (tg), one of the two, after
    ``depth`` tokens already in the context (``-d``: tg at 2048 keys, say)."""
    threads = os.cpu_count() or 1
    proc = subprocess.run(
        [str(bench), "-m", str(gguf), "-p", str(prompt), "-n", str(generate), "-fa", "1",
         "-t", str(threads), "-r", str(repeats), "-d", str(depth), "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    )  # fmt: skip
    return float(json.loads(proc.stdout)[0]["avg_ts"])


def random_model(model_type: str, config: dict[str, Any], path: Path) -> Path:
    """A random-weight ``transformers`` model of ``model_type`` and ``config`` saved as bf16
    safetensors at ``path`` (built once in float32 with transformers' own initialisation, then
    cached)."""
    import transformers

    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


# llama.cpp's converter run on a model of the Llama 2 vocabulary's 32,000 ids: every family
# made to write that sentencepiece vocabulary (the BPE ones would read tokenizer.json)
_SPM_CONVERT = """
import sys
sys.path.insert(0, {src!r})
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outtype", "bf16", "--outfile", {out!r},
            "--model-name", "random-weights"]
import convert_hf_to_gguf as c
_get = c.get_model_class
def get_model_class(*args, **kwargs):
    cls = _get(*args, **kwargs)
    cls.set_vocab = lambda self: self._set_vocab_sentencepiece()
    return cls
c.get_model_class = get_model_class
c.main()
"""


def gguf_of(model: Path, root: Path, quant: str = "bf16", out_dir: Path | None = None) -> Path:
    """``model`` (of vocabulary 32,000, or less: the Llama 2 tokenizer's first pieces) as GGUF
    under ``out_dir`` (default ``root``), converted once by the converter of the llama.cpp of
    ``build_llama_cpp(root)`` to bf16 (the Llama 2 sentencepiece vocabulary its vocabulary
    stands for, whatever the family), then, for ``quant`` other than bf16 (``Q8_0``, ``Q4_0``,
    ``Q4_K``, ``Q6_K``, ...), by its ``llama-quantize``. ``RuntimeError`` with the end of the
    tool's stderr."""
    out_dir = out_dir or root
    base = out_dir / f"{model.name}.gguf"
    if not base.exists():
        staged = with_llama2_tokenizer(model)
        src = root / "src"
        if not src.exists():
            src = next(root.glob("**/vendor/llama.cpp"))
        code = _SPM_CONVERT.format(src=str(src), model=str(staged), out=str(base) + ".part")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{proc.stderr[-2000:]}")
        Path(str(base) + ".part").rename(base)
    if quant == "bf16":
        return base
    out = out_dir / f"{model.name}-{quant}.gguf"
    if not out.exists():
        quantize = build_llama_cpp(root, ("llama-quantize",)) / "llama-quantize"
        proc = subprocess.run(
            [str(quantize), str(base), str(out) + ".part", quant], capture_output=True, text=True
        )
        if proc.returncode:
            raise RuntimeError(f"llama-quantize {quant} failed:\n{proc.stderr[-2000:]}")
        Path(str(out) + ".part").rename(out)
    return out


def llama_bench_rows(
    bench: Path,
    gguf: Path,
    *,
    prompts: tuple[int, ...] = (0,),
    generate: int = 0,
    depths: tuple[int, ...] = (0,),
    repeats: int = 1,
    warmup: bool = True,
    repack: bool = True,
    threads: int | None = None,
) -> list[dict[str, Any]]:
    """``llama-bench``'s JSON rows (``n_prompt``, ``n_gen``, ``n_depth``, ``avg_ts`` ...) on
    ``gguf`` with flash attention, on every core: one test per prompt length and depth, the model
    loaded once; with its extra buffer types (AMX, repacked weights) or without
    (``repack=False``); without its warm-up run per test (``warmup=False``: a first, discarded
    test then warms it up); on ``threads`` threads (default: every core).
    ``subprocess.CalledProcessError`` if it fails."""
    threads = threads or os.cpu_count() or 1
    cmd = [str(bench), "-m", str(gguf), "-p", ",".join(map(str, prompts)),
           "-n", str(generate), "-d", ",".join(map(str, depths)), "-fa", "1",
           "-t", str(threads), "-r", str(repeats), "--repack", str(int(repack)),
           "-o", "json"]  # fmt: skip
    if not warmup:
        cmd.append("--no-warmup")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, proc.stdout, proc.stderr)
    return list(json.loads(proc.stdout))


def llama_bench_retry(
    bench: Path, gguf: Path, name: str, no_repack: list[str], **kw: Any
) -> list[dict[str, Any]]:
    """``llama_bench_rows``; where it dies of a signal (its AMX kernels on this Intel Xeon:
    ``NO_AMX``) it runs again with ``repack=False`` (its AVX-512 kernels) and ``name`` is
    appended to ``no_repack``. ``RuntimeError`` with the end of its stderr if that fails too."""
    try:
        return llama_bench_rows(bench, gguf, repack=True, **kw)
    except subprocess.CalledProcessError as e:
        if e.returncode >= 0:
            raise RuntimeError(f"llama-bench {name}: {str(e.stderr)[-1500:]}") from e
    no_repack.append(name)
    try:
        return llama_bench_rows(bench, gguf, repack=False, **kw)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"llama-bench {name}: {str(e.stderr)[-1500:]}") from e
