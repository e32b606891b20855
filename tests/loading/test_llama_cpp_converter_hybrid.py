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
  tied head carries the embedding's multiplier, not ``lm_head_multiplier`` (equal here).
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

from tests.loading.test_llama_cpp_converter import _byte_bpe, convert
from tests.loading.test_llama_cpp_converter import pytestmark as pytestmark
from tests.loading.test_llama_cpp_converter_ssm import driven_logits, load
from tests.oracles.ssm_models import hf_logits, save_random
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
    # no norm, one group, a tied head, no conv bias, the multipliers' defaults, 3 layers
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
