"""GGUF files of Falcon-H1 (``falcon-h1``) and Qwen3-Next (``qwen3next``) written by llama.cpp's
own converter (as ``test_llama_cpp_converter.py`` runs it) must give the logits of the
transformers model they were converted from.

The models are the oracles' random ones (``ssm_models.save_random`` with the configs of
``tests/oracles/test_falcon_h1.py`` and ``test_qwen3_next.py``), with a byte-level BPE beside them
(the converter reads only that for these two), driven as ``test_llama_cpp_converter_ssm.py``
drives the Mamba-2 files: two prompts prefilled in chunks, then decoded beside each other.

What the converter cannot write, and so the sources avoid:

- Falcon-H1: it folds every muP multiplier into the weights, and its in_proj multiplier
  indexes rows, so a mixer with an ``in_proj`` bias (``mamba_proj_bias``) fails to convert
  (``IndexError: too many indices for tensor of dimension 1``); the file does not keep
  ``mamba_norm_before_gate`` (llama.cpp norms after the gate, as foudre runs such a file); a
  tied head carries the embedding's multiplier, not ``lm_head_multiplier`` (equal here); a
  config whose ``mamba_d_ssm`` is null (the width from ``mamba_expand``) fails to convert
  (``TypeError: unsupported operand type(s) for *: 'int' and 'NoneType'``).
- Qwen3-Next: a checkpoint without multi-token-prediction weights converts only with
  ``--no-mtp`` (else ``assert self.opt_num_mtp_layers != 0``); the file does not keep
  ``norm_topk_prob`` (llama.cpp renormalises the top-k weights; true here); a dense MLP layer
  (``mlp_only_layers``) fails to convert (``Can not map tensor 'model.layers.1.mlp.down_proj
  .weight'``: llama.cpp's qwen3next has experts in every layer).

``f32`` files give transformers' logits within 1e-4, and the source's weights back: Qwen3-Next's
exactly but for the norms stored as ``1 + w`` (within a rounding), Falcon-H1's with each
multiplier folded as transformers applies it. ``bf16`` and ``q8_0`` as the Mamba-2 files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from foudre.loading.errors import ModelLoadError
from foudre.loading.gguf import gguf_config, read_gguf
from tests.loading.test_llama_cpp_converter import _byte_bpe, convert, rel
from tests.loading.test_llama_cpp_converter import pytestmark as pytestmark
from tests.loading.test_llama_cpp_converter_ssm import _bf16_rounded, driven_logits, load
from tests.oracles.ssm_models import hf_logits, prompt, save_random
from tests.oracles.test_falcon_h1 import BASE as FALCON
from tests.oracles.test_falcon_h1 import CASES as FALCON_CASES
from tests.oracles.test_falcon_h1 import DROP
from tests.oracles.test_qwen3_next import BASE as QWEN
from tests.oracles.test_qwen3_next import CASES as QWEN_CASES

# family -> (transformers family, config, the converter's extra arguments)
FAMILIES: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    # every multiplier set, the norm after the gate, an out_proj bias, no in_proj bias
    "falcon_h1": ("FalconH1", {
        **FALCON, "mamba_norm_before_gate": False, "mamba_proj_bias": False,
    }, ()),
    # no norm, one group, a tied head, no conv bias, the multipliers' defaults, 3 layers (and
    # mamba_d_ssm given: the converter reads no mamba_expand)
    "falcon_h1_tied": ("FalconH1", {
        **FALCON, **FALCON_CASES["no-norm-tied"], "mamba_d_ssm": 64,
    }, ()),
    # DeltaNet layers around an attention layer, experts with a gated shared expert
    "qwen3_next": ("Qwen3Next", QWEN, ("--no-mtp",)),
    # attention first, one key head per value head, a tied head, RoPE over a quarter
    "qwen3_next_tied": ("Qwen3Next", {
        **QWEN, **QWEN_CASES["dense-layer-tied"], "norm_topk_prob": True, "mlp_only_layers": [],
    }, ("--no-mtp",)),
}  # fmt: skip


def _config(family: str) -> dict[str, Any]:
    return {k: v for k, v in FAMILIES[family][1].items() if v is not DROP}


def folded(family: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Falcon-H1 source's weights (as foudre loads them) with its multipliers folded in as
    transformers applies them: what the file must give back."""
    if not family.startswith("falcon"):
        return state
    ones = ("embedding", "lm_head", "key", "attention_in", "attention_out", "ssm_in", "ssm_out")
    c = {
        **{f"{m}_multiplier": 1.0 for m in ones},
        "mlp_multipliers": [1.0, 1.0],
        "ssm_multipliers": [1.0] * 5,
        **_config(family),
    }
    inner, bc = c["mamba_d_ssm"], c["mamba_n_groups"] * c["mamba_d_state"]
    bounds = [0, inner, 2 * inner, 2 * inner + bc, 2 * inner + 2 * bc, None]
    q, kv = c["num_attention_heads"] * 16, c["num_key_value_heads"] * 16
    out = {}
    for name, w in state.items():
        w = w.clone()
        if name.endswith("embed_tokens.weight"):
            w *= c["embedding_multiplier"]
        elif name == "lm_head.weight":
            w *= c["lm_head_multiplier"]
        elif name.endswith("qkv_proj.weight"):
            w *= c["attention_in_multiplier"]
            w[q : q + kv] *= c["key_multiplier"]
        elif name.endswith("o_proj.weight"):
            w *= c["attention_out_multiplier"]
        elif name.endswith("mamba.in_proj.weight"):
            w *= c["ssm_in_multiplier"]
            for i, m in enumerate(c["ssm_multipliers"]):
                w[bounds[i] : bounds[i + 1]] *= m
        elif ".mamba.out_proj." in name:
            w *= c["ssm_out_multiplier"]
        elif name.endswith("gate_up_proj.weight"):
            w[: c["intermediate_size"]] *= c["mlp_multipliers"][0]
        elif name.endswith("down_proj.weight"):
            w *= c["mlp_multipliers"][1]
        out[name] = w
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.Tensor]]:
    """Each family's random model (made on first use) and transformers' logits of the two
    prompts of ``driven_logits``."""
    import transformers

    from tests.loading.test_llama_cpp_converter_ssm import LONG, SHORT

    root = tmp_path_factory.mktemp("hybrid")

    class Lazy(dict[str, tuple[Path, torch.Tensor]]):
        def __missing__(self, family: str) -> tuple[Path, torch.Tensor]:
            hf_family = FAMILIES[family][0]
            path = save_random(hf_family, _config(family), root / family)
            _byte_bpe(path)
            cls = getattr(transformers, f"{hf_family}ForCausalLM")
            hf = cls.from_pretrained(path, dtype=torch.float32).eval()
            ref = torch.cat([hf_logits(hf, LONG), hf_logits(hf, SHORT)])
            self[family] = (path, ref)
            return self[family]

    return Lazy()


def _convert(family: str, src: Path, outtype: str, out: Path) -> Path:
    return convert(src, outtype, out, *FAMILIES[family][2])


@pytest.fixture(scope="module")
def f32_files(
    sources: dict[str, tuple[Path, torch.Tensor]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("f32")

    class Lazy(dict[str, Path]):
        def __missing__(self, family: str) -> Path:
            out = root / f"{family}.gguf"
            self[family] = _convert(family, sources[family][0], "f32", out)
            return self[family]

    return Lazy()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_f32_file_gives_the_source_logits(
    family: str, sources: dict[str, tuple[Path, torch.Tensor]], f32_files: dict[str, Path]
) -> None:
    src, ref = sources[family]
    model, source = load(f32_files[family]), load(src)
    cfg, want = model.config, source.config
    assert cfg.architecture == want.architecture and cfg.torch_dtype == "float32"
    for key in ("mamba_layers", "linear_layers", "mlp_only_layers", "tie_word_embeddings"):
        assert getattr(cfg, key) == getattr(want, key), key
    torch.testing.assert_close(driven_logits(model), ref, rtol=0, atol=1e-4)
    ours, theirs = model.state_dict(), folded(family, source.state_dict())
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():  # the converter's layouts undone
        atol = 3e-7 if "norm" in name else 0  # (1 + w) - 1
        torch.testing.assert_close(ours[name], tensor, rtol=1e-6, atol=atol, msg=name)


QUANTIZED = [
    "falcon_h1",
    "qwen3_next",
    *(pytest.param(f, marks=pytest.mark.slow) for f in ("falcon_h1_tied", "qwen3_next_tied")),
]


@pytest.mark.parametrize("family", QUANTIZED)
def test_bf16_and_q8_0_files(
    family: str, sources: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    """bf16: within 1.5x what rounding the matrices to bfloat16 moves the logits. q8_0,
    dequantized at load: every weight within Q8_0's rounding of the (folded) source's, the
    logits within 20x bfloat16's move; kept quantized where foudre has Q8_0 kernels (Falcon-H1's
    mixer, attention and MLP projections; Qwen3-Next's experts, attention output, in_proj_ba;
    not in_proj_qkvz, joined from two tensors, nor the q_proj split into query and gate; the
    converter writes the matrices of rows not a multiple of 32 in float), the same."""
    from foudre.quant.experts import QuantExperts
    from foudre.quant.qlinear import QuantLinear, uses_native_kernels

    src, ref = sources[family]
    bound = rel(_bf16_rounded(src), ref)
    got = driven_logits(load(_convert(family, src, "bf16", tmp_path / "bf16.gguf")))
    assert rel(got, ref) <= 1.5 * bound + 1e-6, (rel(got, ref), bound)
    q8 = _convert(family, src, "q8_0", tmp_path / "q8_0.gguf")
    dequantized = load(q8, gguf_dequantize=True)
    ours, theirs = dequantized.state_dict(), folded(family, load(src).state_dict())
    assert ours.keys() == theirs.keys()
    errors = {k: rel(ours[k].float(), v.float()) for k, v in theirs.items()}
    assert max(errors.values()) < 0.008, max(errors.items(), key=lambda kv: kv[1])
    assert sum(e > 1e-3 for e in errors.values()) >= 4  # (the matrices were rounded)
    assert rel(driven_logits(dequantized), ref) < 20 * bound
    model = load(q8)
    kept = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if uses_native_kernels(torch.bfloat16):
        parts = ("mamba.in_proj", "mamba.out_proj", "qkv_proj", "o_proj", "gate_up_proj")
        if family.startswith("qwen"):
            parts = ("linear_attn.in_proj_ba", "o_proj", "shared_expert.gate_up_proj")
            experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
            assert len(experts) == len(model.config.linear_layers) + 1
        for part in parts:
            assert any(n.endswith(part) for n in kept), (part, sorted(kept))
    for name, mod in kept.items():  # the same weights as dequantized at load, rows in order
        if f"{name}.weight" in ours:
            assert rel(mod.dequantize().float(), ours[f"{name}.weight"].float()) < 1e-6, name
    assert rel(driven_logits(model), ref) < 20 * bound


@pytest.mark.parametrize(
    ("family", "change", "named"),
    [
        ("falcon_h1", {"falcon-h1.ssm.state_size": 32}, r"'blk\.0\.ssm_in\.weight' has shape"),
        ("falcon_h1", {"falcon-h1.ssm.group_count": 1}, r"'blk\.0\.ssm_in\.weight' has shape"),
        ("falcon_h1", {"falcon-h1.ssm.conv_kernel": 3}, r"'blk\.0\.ssm_conv1d\.weight' has shape"),
        ("falcon_h1", {"-blk.1.ssm_d": None}, r"'blk\.1\.ssm_d' is missing"),
        ("falcon_h1", {"-blk.1.ssm_out.bias": None}, r"'blk\.1\.ssm_out\.bias' is missing"),
        ("falcon_h1", {"+blk.0.attn_q.bias": "blk.0.ssm_dt.bias"}, r"with attention biases"),
        ("qwen3_next", {"qwen3next.ssm.state_size": 4}, r"'blk\.0\.attn_qkv\.weight' has shape"),
        ("qwen3_next", {"qwen3next.ssm.inner_size": 32}, r"'blk\.0\.attn_qkv\.weight' has shape"),
        ("qwen3_next", {"qwen3next.ssm.group_count": 4}, r"'blk\.0\.attn_qkv\.weight' has shape"),
        ("qwen3_next", {"qwen3next.ssm.time_step_rank": 3}, r"group_count \(key heads\)"),
        ("qwen3_next", {"qwen3next.ssm.conv_kernel": 3}, r"'blk\.0\.ssm_conv1d\.weight' has"),
        ("qwen3_next", {"-blk.2.ssm_a": None}, r"'blk\.2\.ssm_a' of DeltaNet layer 2 is missing"),
        (
            "qwen3_next",
            {"qwen3next.attention.recurrent_layers": [True, True, True, True]},
            r"'blk\.1\.attn_qkv\.weight' of DeltaNet layer 1 is missing",
        ),
        (
            "qwen3_next",
            {"qwen3next.attention.recurrent_layers": [False, False, True, True]},
            r"'blk\.0\.attn_qkv\.weight' in layer 0, an attention layer",
        ),
        ("qwen3_next", {"qwen3next.attention.recurrent_layers": [True]}, r"recurrent_layers must"),
    ],
)
def test_a_file_disagreeing_with_itself_names_the_tensor_or_key(
    family: str, change: dict[str, Any], named: str, f32_files: dict[str, Path]
) -> None:
    """State tensors whose shapes disagree with the ``ssm.*`` keys, missing ones, layers the
    recurrent-layer keys misplace, attention biases foudre's Falcon-H1 has not: refused before
    anything is built, naming the tensor or key."""
    f = read_gguf(f32_files[family])
    for key, value in change.items():
        if key.startswith("-"):
            del f.tensors[key[1:]]
        elif key.startswith("+"):  # a tensor the file should not have (another's data)
            f.tensors[key[1:]] = f.tensors[value]
        else:
            f.metadata[key] = value
    with pytest.raises(ModelLoadError, match=named):
        gguf_config(f)


@pytest.mark.parametrize("family", ["falcon_h1", "qwen3_next"])
def test_engine_serves_a_converted_file_as_its_source(
    family: str, sources: dict[str, tuple[Path, torch.Tensor]], f32_files: dict[str, Path]
) -> None:
    """Through ``LLM``, prompts of other lengths sharing a prefix, batched: the f32 file's
    greedy ids are its source's with few blocks (preemptions), a small token budget (chunked
    prompts) and prefix caching (hits)."""
    from foudre import LLM, SamplingParams

    src, _ = sources[family]
    shared = prompt(30, 7)
    prompts = [[*shared, 50 + i, 60 + i] for i in range(3)] + [prompt(5, 1), prompt(21, 2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(path: Path, **kwargs: Any) -> tuple[list[list[int]], Any]:
        llm = LLM(
            str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=64,
            block_size=4, **kwargs,
        )  # fmt: skip
        ids = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
        return ids, llm.engine.metrics()

    want, _ = run(src)
    small = dict(num_kv_blocks=20, max_num_batched_tokens=24, state_snapshot_interval=8)
    got, metrics = run(f32_files[family], enable_prefix_caching=True, **small)
    assert metrics["num_preemptions"] > 0 and metrics["prefix_cache_hits"] > 0, metrics
    assert got == want


def with_mtp(src: Path, dst: Path) -> Path:
    """A copy of Qwen3-Next ``src`` with the multi-token-prediction weights the published
    checkpoints carry (``mtp.*``: one attention layer with experts, ``fc`` and its norms; here
    copies of layer 1's and random ones), which transformers does not load."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    hidden = state["model.embed_tokens.weight"].shape[1]
    for name, tensor in list(state.items()):
        if name.startswith("model.layers.1."):
            state["mtp.layers.0." + name.removeprefix("model.layers.1.")] = tensor.clone()
    state["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden) * 0.05
    for norm in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        state[f"mtp.{norm}.weight"] = torch.zeros(hidden)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_file_with_mtp_blocks_runs_without_them(
    sources: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    """A checkpoint with multi-token-prediction weights converts without ``--no-mtp``: its
    file has ``nextn_predict_layers`` blocks past the model's, which foudre does not run (as
    transformers does not): the source's layers, its logits."""
    src, ref = sources["qwen3_next"]
    out = convert(with_mtp(src, tmp_path / "mtp"), "f32", tmp_path / "mtp.gguf")
    f = read_gguf(out)
    assert f.metadata["qwen3next.nextn_predict_layers"] == 1
    assert f.metadata["qwen3next.block_count"] == 5 and "blk.4.nextn.eh_proj.weight" in f.tensors
    model = load(out)
    assert model.config.num_hidden_layers == 4
    torch.testing.assert_close(driven_logits(model), ref, rtol=0, atol=1e-4)
