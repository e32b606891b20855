"""GGUF files written by llama.cpp's own converter (``convert_hf_to_gguf.py``), for each family
foudre loads: the GGUF must give the logits of the safetensors model it was converted from.

The converter is llama.cpp's source as ``scripts/setup.sh`` fetches it (llama-cpp-python's sdist,
``~/.cache/foudre-bench/llama.cpp/src``; ``FOUDRE_LLAMA_CPP_SRC`` names another); without it the
module skips. It runs in a child process on small random models (``tests/conftest.py
make_hf_model``), with the Llama 2 sentencepiece tokenizer beside them (its first pieces: the
converter keeps those below the model's vocabulary), or for the families whose converter takes
only a byte-level BPE (gpt-oss, DeepSeek-V3) a BPE of the 256 bytes: the converter recognises a
BPE's pre-tokenizer by the hash of its tokens on a test text, which a made-up BPE cannot match,
so the child names it ``gpt-2`` (``_CHILD``); the tokenizer is not what these tests are about.

``f32`` files give the safetensors logits within 1e-4; ``bf16`` within bfloat16's rounding of the
weights; ``q8_0`` within a relative bound, with its linears kept quantized (``QuantLinear``) where
foudre keeps Q8_0.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from foudre.loading.loader import load_model
from foudre.quant.calib import run_sequence
from tests.conftest import SHARED, make_hf_model

SRC = Path(
    os.environ.get(
        "FOUDRE_LLAMA_CPP_SRC", Path.home() / ".cache" / "foudre-bench" / "llama.cpp" / "src"
    )
)
CONVERTER = SRC / "convert_hf_to_gguf.py"
LLAMA2_TOKENIZER = SHARED / "models" / "llama2-tokenizer" / "tokenizer.model"
pytestmark = pytest.mark.skipif(
    not CONVERTER.is_file() or not LLAMA2_TOKENIZER.is_file(),
    reason=f"llama.cpp's converter ({CONVERTER}: scripts/setup.sh fetches it) or the Llama 2 "
    "tokenizer is absent",
)
CPU = torch.device("cpu")
PROMPT = [1, 17, 250, 3, 99, 180, 42, 42, 7, 200, 12, 5, 211, 64, 128, 33, 9, 100, 2, 77]

# The converter in one child process a test worker, which imports it (torch, transformers,
# gguf: seconds) once and then converts as asked, a job a line (a JSON list of the arguments
# and the pre-tokenizer name: the BPE pre-tokenizer check answered with that name, the module's
# docstring), each job in a fork of it; it answers a line with the job's exit status, the log
# going to the file the parent gave.
_CHILD = """
import json, os, runpy, sys, traceback
sys.path.insert(0, sys.argv[1])
from conversion import base
from transformers import AutoConfig, AutoTokenizer  # (what each job would import again)
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: os.environ["PRE"]
script = sys.argv[1] + "/convert_hf_to_gguf.py"
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # (what the converter prints goes to the log)
for line in sys.stdin:
    args, os.environ["PRE"] = json.loads(line)
    pid = os.fork()  # a job in a fork: what the converter sets on its classes dies with it
    if pid == 0:
        sys.argv = [script, *args]
        try:
            runpy.run_path(script, run_name="__main__")
            status = 0
        except SystemExit as e:
            status = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    answers.write(json.dumps(status) + "\\n")
    answers.flush()
"""
_converter: list[Any] = []  # [the child, its log file] once started


def _child() -> tuple[subprocess.Popen[str], Path]:
    """The converter's child process of this test process (started on first use)."""
    if not _converter or _converter[0].poll() is not None:
        log = Path(tempfile.mkstemp(prefix="foudre-convert-", suffix=".log")[1])
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(SRC)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
        )
        atexit.register(child.kill)
        atexit.register(log.unlink, missing_ok=True)
        _converter[:] = [child, log]
    return _converter[0], _converter[1]


def convert(src: Path, outtype: str, out: Path, *args: str, pre: str = "gpt-2") -> Path:
    """``src`` converted by llama.cpp's converter to ``out`` (``--outtype outtype``)."""
    child, log = _child()
    start = log.stat().st_size
    job = [str(src), "--outtype", outtype, *args, "--outfile", str(out)]
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(json.dumps([job, pre]) + "\n")
    child.stdin.flush()
    if not select.select([child.stdout], [], [], 600)[0]:  # (as subprocess.run's would)
        child.kill()
        raise AssertionError(f"convert_hf_to_gguf.py hung on {src}")
    answer = child.stdout.readline()
    if answer.strip() != "0":
        with log.open() as f:
            f.seek(start)
            raise AssertionError(f"convert_hf_to_gguf.py failed:\n{f.read()[-4000:]}")
    return out


def _byte_bpe(path: Path) -> None:
    """A byte-level BPE of the 256 bytes (no merges) saved as a Hugging Face tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="!", eos_token='"')
    fast.save_pretrained(path)


def hf_model(path: Path, arch: str, bpe: bool = False, **overrides: Any) -> Path:
    """A random ``make_hf_model`` with a tokenizer the converter takes."""
    make_hf_model(path, arch, **overrides)
    if bpe:
        _byte_bpe(path)
    else:
        (path / "tokenizer.model").write_bytes(LLAMA2_TOKENIZER.read_bytes())
    return path


def logits(path: Path, **kwargs: Any) -> torch.Tensor:
    model = load_model(str(path), None, "float32", CPU, None, **kwargs).model
    with torch.no_grad():
        return model.compute_logits(run_sequence(model, PROMPT)).float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# family -> (make_hf_model's arch, BPE tokenizer, config overrides). Where the converter writes
# no key for a setting, the config keeps llama.cpp's value for it (what its graph assumes):
# Gemma 3's query_pre_attn_scalar = head_dim, gpt-oss's swiglu_limit 7, Qwen3-MoE's renormalised
# top-k; Phi-3's vocabulary at least its tokenizer's (the converter indexes it by piece).
FAMILIES: dict[str, tuple[str, bool, dict[str, Any]]] = {
    "llama": ("llama", False, {}),
    "qwen2": ("qwen2", False, {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", False, {"head_dim": 32}),
    "mixtral": ("mixtral", False, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("qwen2_moe", True, {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    }),
    "qwen3_moe": ("qwen3_moe", True, {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    }),
    # the 4B-27B models' RoPE: linear scaling (factor 8) on the global layers only
    "gemma3": ("gemma3_text", False, {
        "num_hidden_layers": 6, "sliding_window": 8, "head_dim": 16,
        "query_pre_attn_scalar": 16, "tie_word_embeddings": True, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }),
    "phi3": ("phi3", False, {"vocab_size": 32000, "pad_token_id": 0}),
    # Phi-4-mini's shape: LongRoPE (the prompt longer than its original context) over 3/4 of
    # each head
    "phi4_longrope_partial": ("phi3", False, {
        "vocab_size": 32000, "pad_token_id": 0, "max_position_embeddings": 128,
        "original_max_position_embeddings": 16, "partial_rotary_factor": 0.75,
        "rope_scaling": {
            "rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
            "long_factor": [1.5 + 0.4 * i for i in range(6)],
        },
    }),
    "gpt_oss": ("gpt_oss", True, {
        "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
        "intermediate_size": 32, "head_dim": 24, "sliding_window": 8,
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 8.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32,
        },
    }),
    "deepseek_v3": ("deepseek_v3", True, {
        "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8,
        "n_group": 2, "topk_group": 1, "num_experts_per_tok": 4, "n_shared_experts": 1,
        "moe_intermediate_size": 32, "q_lora_rank": 32, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    }),
    # YaRN with DeepSeek's mscale (yarn_log_multiplier), one query projection
    "deepseek_v3_yarn": ("deepseek_v3", True, {
        "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 4,
        "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 24, "routed_scaling_factor": 1.5, "rope_scaling": {
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
            "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
        },
    }),
}  # fmt: skip
# foudre's architecture for each family's file
ARCHITECTURE = {"phi4_longrope_partial": "phi3", "deepseek_v3_yarn": "deepseek_v3"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.Tensor]]:
    """Each family's random model (made on first use) and its logits from the safetensors."""
    root = tmp_path_factory.mktemp("families")

    class Lazy(dict[str, tuple[Path, torch.Tensor]]):
        def __missing__(self, family: str) -> tuple[Path, torch.Tensor]:
            arch, bpe, overrides = FAMILIES[family]
            path = hf_model(root / family, arch, bpe, **overrides)
            self[family] = (path, logits(path))
            return self[family]

    return Lazy()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_f32_file_gives_the_safetensors_logits(
    family: str, sources: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    src, ref = sources[family]
    out = convert(src, "f32", tmp_path / f"{family}.gguf")
    loaded = load_model(str(out), None, "float32", CPU, None)
    assert loaded.config.architecture == ARCHITECTURE.get(family, family)
    assert loaded.config.torch_dtype == "float32"
    if "yarn" in family or "longrope" in family or family == "gemma3":
        assert loaded.config.rope_scaling is not None
    torch.testing.assert_close(logits(out), ref, rtol=0, atol=1e-4)


def _bf16_rounded(src: Path) -> torch.Tensor:
    """The logits of ``src`` with every matrix rounded to bfloat16: how much this random model
    moves with its weights' rounding (Gemma 3's, with its four norms a layer, about 18x a
    Llama's)."""
    model = load_model(str(src), None, "float32", CPU, None).model
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(p.to(torch.bfloat16))
        return model.compute_logits(run_sequence(model, PROMPT)).float()


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_and_q8_0_files(
    family: str, sources: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    """bf16: within what rounding the matrices to bfloat16 moves the logits (the converter keeps
    some in float32: routers, norms). q8_0, dequantized: every weight within Q8_0's rounding of
    the source's (relative 0.5%; a misplaced row or head would be about 140%), the logits
    within 20x bfloat16's move (Q8_0 rounds four times as coarsely, and a mixture of experts
    may route a token differently); kept quantized where foudre keeps Q8_0 (``QuantLinear``,
    not gpt-oss's float experts: the values dequantized at load), the same bound."""
    from foudre.quant.qlinear import QuantLinear, uses_native_kernels

    src, ref = sources[family]
    bound = rel(_bf16_rounded(src), ref)
    got = logits(convert(src, "bf16", tmp_path / "bf16.gguf"))
    assert rel(got, ref) <= 1.5 * bound + 1e-6, (rel(got, ref), bound)
    q8 = convert(src, "q8_0", tmp_path / "q8_0.gguf")
    source = load_model(str(src), None, "float32", CPU, None).model.state_dict()
    loaded = load_model(str(q8), None, "float32", CPU, None, gguf_dequantize=True).model
    ours = loaded.state_dict()
    assert ours.keys() == source.keys()
    errors = {k: rel(ours[k].float(), source[k].float()) for k in source if source[k].numel()}
    assert max(errors.values()) < 0.008, max(errors.items(), key=lambda kv: kv[1])
    assert sum(e > 1e-3 for e in errors.values()) >= 4  # (the matrices were rounded)
    with torch.no_grad():
        dequantized = loaded.compute_logits(run_sequence(loaded, PROMPT)).float()
    assert rel(dequantized, ref) < 20 * bound
    model = load_model(str(q8), None, "float32", CPU, None).model
    kept = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if uses_native_kernels(torch.bfloat16):  # Q8_0 has a kernel here: kept quantized
        assert any(n.endswith("o_proj") for n in kept), kept
        if family.startswith("deepseek"):  # its RoPE rows reordered in the codes
            assert any(n.endswith("kv_a_proj_with_mqa") for n in kept), kept
            assert any(n.endswith("q_b_proj") for n in kept), kept
    for name, mod in kept.items():  # the same weights as dequantized at load, rows in order
        if f"{name}.weight" in ours:  # (not the experts' QuantExperts)
            assert rel(mod.dequantize().float(), ours[f"{name}.weight"].float()) < 1e-6, name
    with torch.no_grad():
        quant = model.compute_logits(run_sequence(model, PROMPT)).float()
    assert rel(quant, ref) < 20 * bound  # the activations rounded too (int8 blocks, bfloat16)


def test_gpt_oss_mxfp4_experts_stay_packed(
    sources: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    """An MXFP4 gpt-oss checkpoint: the converter writes its experts as GGUF's MXFP4 (gate and
    up split), which load packed (``MXFP4Experts``, the checkpoint's very blocks and scales,
    gate and up rows re-interleaved), giving the checkpoint's logits."""
    from foudre.loading.gguf import read_gguf
    from foudre.quant.mxfp4 import MXFP4Experts
    from tests.oracles.test_gpt_oss import _mxfp4_checkpoint

    src, _ = sources["gpt_oss"]
    packed = _mxfp4_checkpoint(src, tmp_path / "mxfp4")
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (packed / f.name).write_bytes(f.read_bytes())
    out = convert(packed, "f32", tmp_path / "mxfp4.gguf")
    types = {t.name: t.type_name for t in read_gguf(out).tensors.values()}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.0.ffn_down_exps.weight"] == "MXFP4"
    ref = load_model(str(packed), None, "float32", CPU, None).model
    ours = load_model(str(out), None, "float32", CPU, None).model
    assert ours.config.mxfp4_experts
    for mine, theirs in zip(ours.model.layers, ref.model.layers, strict=True):
        assert isinstance(mine.mlp.experts, MXFP4Experts)
        for name, buf in theirs.mlp.experts.named_buffers():
            assert torch.equal(getattr(mine.mlp.experts, name), buf), name
    torch.testing.assert_close(logits(out), logits(packed), rtol=0, atol=1e-4)


# the pre-tokenizers of gpt-oss's (o200k) and DeepSeek-V3's tokenizer.json, as they declare them
_HF_PRE_TOKENIZERS = {
    "gpt-4o": [
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}"
        "\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}"
        "\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}|"
        " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
    ],
    "deepseek-v3": [
        "\\p{N}{1,3}",
        "[一-龥぀-ゟ゠-ヿ]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?"
        "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ],
}
TEXTS = [
    "Hello World, it's THE fox's DAY: 12345 stars and 3.14159!",
    "日本語のテキストと中文 mixed with English, ひらがな カタカナ",
    "  two  spaces\n\nand a newline\tand a tab; don't WON'T I'LL",
    "Café naïve 🦊 emoji —dashes— and ‘quotes’ /path/to\r\n",
]


@pytest.mark.parametrize("pre", list(_HF_PRE_TOKENIZERS))
def test_bpe_pre_tokenizers_of_gpt_oss_and_deepseek(pre: str, tmp_path: Path) -> None:
    """A byte-level BPE trained with gpt-oss's or DeepSeek-V3's pre-tokenizer, written by the
    converter under its name (``--vocab-only``): foudre's tokenizer from the file encodes as
    the Hugging Face one does."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    from foudre.loading.loader import load_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _HF_PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=480, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(TEXTS * 3, trainer)
    src = tmp_path / "model"
    make_hf_model(src, "gpt_oss", vocab_size=512, num_hidden_layers=1, num_local_experts=2,
                  num_experts_per_tok=1, intermediate_size=32)  # fmt: skip
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.save_pretrained(src)
    out = convert(src, "f32", tmp_path / "vocab.gguf", "--vocab-only", pre=pre)
    ours = load_tokenizer(out)
    for text in [*TEXTS, "unseen WORDS like Zebra's CamelCase HTTPServer 9876543 漢字かな"]:
        assert ours.encode(text, add_special_tokens=False) == fast.encode(text), text


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3", "gemma3"])
def test_engine_serves_a_converted_file_as_its_source(
    family: str, sources: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    """Through ``LLM`` (paged KV: gpt-oss's sinks and windows, DeepSeek's latent cache, Gemma
    3's windows), with shared prefixes, few blocks (preemptions) and a small token budget
    (chunked prompts): the f32 file's greedy ids are its source's."""
    from foudre import LLM, SamplingParams

    src, _ = sources[family]
    out = convert(src, "f32", tmp_path / f"{family}.gguf")
    shared = list(range(3, 40))
    prompts = [[*shared, 50 + i, 60 + i] for i in range(4)] + [[7, 8, 9], shared[:20]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids = []
    for path in (src, out):
        llm = LLM(
            str(path), dtype="float32", skip_tokenizer_init=True, block_size=4, num_kv_blocks=20,
            max_model_len=80, max_num_batched_tokens=24, enable_prefix_caching=True,
        )  # fmt: skip
        ids.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert llm.metrics()["num_preemptions"] > 0 and llm.metrics()["prefix_cache_hits"] > 0
    assert ids[0] == ids[1]


def test_deepseek2_file_errors_name_the_key_or_tensor(
    sources: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    """A deepseek2 file routed by softmax (DeepSeek-V2's, which foudre does not run) is refused
    naming the key; one with ``attn_k_b`` but not its ``attn_v_b`` names both."""
    from foudre.loading.errors import ModelLoadError
    from foudre.loading.gguf import gguf_config, iter_gguf_weights, read_gguf

    src, _ = sources["deepseek_v3"]
    out = convert(src, "f32", tmp_path / "deepseek.gguf")
    f = read_gguf(out)
    f.metadata["deepseek2.expert_gating_func"] = 1
    with pytest.raises(ModelLoadError, match=r"deepseek2\.expert_gating_func=1"):
        gguf_config(f)
    f = read_gguf(out)
    del f.tensors["blk.1.attn_v_b.weight"]
    with pytest.raises(ModelLoadError, match=r"'blk\.1\.attn_k_b\.weight' without its pair"):
        list(iter_gguf_weights(f, gguf_config(f)))
