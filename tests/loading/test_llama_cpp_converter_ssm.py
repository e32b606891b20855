"""GGUF files of state-space models written by llama.cpp's own converter (``convert_hf_to_gguf.py``,
as ``test_llama_cpp_converter.py`` runs it): ``Mamba2ForCausalLM`` (GGUF ``mamba2``) and the
hybrids it writes as ``granitehybrid`` (``GraniteMoeHybridForCausalLM`` and
``BambaForCausalLM``) must give the logits of the transformers model they were converted from.

The models are ``tests/oracles``' random ones (``ssm_models.save_random``, the configs of
``test_mamba2.py``, ``test_granite_moe_hybrid.py`` and ``test_bamba.py``), with the Llama 2
sentencepiece tokenizer beside them, driven as the oracles drive them (``HybridDriver``: a state
slot and paged KV blocks per request): two prompts prefilled in chunks of odd sizes then decoded
token by token beside each other, so the state is carried across steps. Their ``config.json`` is
written as the published checkpoints' are, which is what the converter reads: Granite 4.0's
``layer_types`` named ``mamba`` / ``attention`` (transformers 5 saves ``linear_attention`` /
``full_attention``, which the converter does not recognise: it then marks every layer a Mamba
layer, and the file is refused naming the first missing Mamba tensor), and Bamba's
``attn_rotary_emb`` (the rotated width, half a head: transformers' Bamba rotates half of each
head whatever its config says, the converter writes ``rope.dimension_count`` from this key or
else the whole head). The Granite sources are NoPE, as Granite 4.0 is: the converter marks a
``granitehybrid`` file RoPE only for Bamba (``rope.scaling.finetuned``, llama.cpp's switch), so
a Granite source with ``position_embedding_type: rope`` becomes a file without positions, which
foudre runs as llama.cpp does.

``f32`` files give transformers' logits within 1e-4 and the source's weights back (every layout
the converter changes undone: ``A = -exp(A_log)``, the squeezed conv1d, the grouped norm, the
permuted q/k rows); ``bf16`` files within what rounding the source's matrices to bfloat16 moves
the logits; ``q8_0`` files within a relative bound, with the mixers' projections kept quantized.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from foudre.loading.errors import ModelLoadError
from foudre.loading.gguf import gguf_config, read_gguf
from foudre.loading.loader import load_model
from tests.loading.test_llama_cpp_converter import LLAMA2_TOKENIZER, convert, rel
from tests.loading.test_llama_cpp_converter import pytestmark as pytestmark
from tests.oracles.hybrid_driver import HybridDriver
from tests.oracles.ssm_models import hf_logits, prompt, save_random
from tests.oracles.test_bamba import BASE as BAMBA
from tests.oracles.test_bamba import CASES as BAMBA_CASES
from tests.oracles.test_granite_moe_hybrid import BASE as GRANITE
from tests.oracles.test_mamba2 import BASE as MAMBA2
from tests.oracles.test_mamba2 import CASES as MAMBA2_CASES

CPU = torch.device("cpu")
MAX_POSITIONS = 128  # (the NoPE files' context_length, 2**20, would size a large RoPE table)
# family -> (transformers family, config, the keys of its published config.json)
FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "mamba2": ("Mamba2", MAMBA2, {}),
    # one group, a tied head, no conv bias, projections with biases
    "mamba2_tied_biases": ("Mamba2", {**MAMBA2, **MAMBA2_CASES["tied-onegroup"]}, {}),
    "granite_moe": ("GraniteMoeHybrid", GRANITE, {}),
    # the shared MLP alone, attention first, a tied head
    "granite_dense": ("GraniteMoeHybrid", {
        **GRANITE, "num_local_experts": 0, "layer_types": ["attention", "mamba", "mamba"],
        "num_hidden_layers": 3, "tie_word_embeddings": True,
    }, {}),
    # RoPE over half of each head; attention first, one group, a tied head, projection biases
    "bamba": ("Bamba", {**BAMBA, **BAMBA_CASES["attn-0-tied"]}, {"attn_rotary_emb": 8}),
}  # fmt: skip
# the GGUF's model is foudre's Granite 4.0 hybrid for Bamba too: its parameters' other names
_BAMBA_NAMES = (("feed_forward.", "mlp."), ("pre_ff_layernorm.", "post_attention_layernorm."))
# two requests: prompt chunks (then single tokens) per step, the second starting later
LONG, SHORT = prompt(37, 3), prompt(9, 4)
SCHEDULE = [(5, 0), (11, 4), (1, 3), (9, 1), (3, 1), *[(1, 0)] * 8]


def published_config(path: Path, extra: dict[str, Any]) -> None:
    """Rewrite ``path``'s config.json with the keys the published checkpoints carry."""
    raw = json.loads((path / "config.json").read_text())
    if "layer_types" in raw:
        names = {"linear_attention": "mamba", "full_attention": "attention"}
        raw["layer_types"] = [names.get(t, t) for t in raw["layer_types"]]
    (path / "config.json").write_text(json.dumps({**raw, **extra}, indent=2))


def driven_logits(model: Any) -> torch.Tensor:
    """The logits of every position of ``LONG`` then ``SHORT``, run by ``SCHEDULE``."""
    driver = HybridDriver(model, 2, 48)
    got: list[list[torch.Tensor]] = [[], []]
    at = [0, 0]
    for a, b in SCHEDULE:
        rows = [(r, p[at[r] : at[r] + n]) for r, (p, n) in enumerate(((LONG, a), (SHORT, b))) if n]
        for (r, ids), out in zip(rows, driver.step(rows), strict=True):
            got[r].append(out)
            at[r] += len(ids)
    assert at == [len(LONG), len(SHORT)]
    return torch.cat([torch.cat(got[0]), torch.cat(got[1])]).float()


def load(path: Path, **kwargs: Any) -> Any:
    return load_model(str(path), None, "float32", CPU, MAX_POSITIONS, **kwargs).model


def source_state(family: str, src: Path) -> dict[str, torch.Tensor]:
    """The source's weights as foudre loads them, named as in the GGUF's model."""
    state = load(src).state_dict()
    if FAMILIES[family][0] != "Bamba":
        return state
    renamed = {}
    for name, tensor in state.items():
        for theirs, ours in _BAMBA_NAMES:
            name = name.replace(theirs, ours)
        renamed[name] = tensor
    return renamed


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.Tensor]]:
    """Each family's random model (made on first use) and transformers' logits of the two
    prompts."""
    import transformers

    root = tmp_path_factory.mktemp("ssm")

    class Lazy(dict[str, tuple[Path, torch.Tensor]]):
        def __missing__(self, family: str) -> tuple[Path, torch.Tensor]:
            hf_family, config, extra = FAMILIES[family]
            path = save_random(hf_family, config, root / family)
            published_config(path, extra)
            (path / "tokenizer.model").write_bytes(LLAMA2_TOKENIZER.read_bytes())
            cls = getattr(transformers, f"{hf_family}ForCausalLM")
            hf = cls.from_pretrained(path, dtype=torch.float32).eval()
            ref = torch.cat([hf_logits(hf, LONG), hf_logits(hf, SHORT)])
            self[family] = (path, ref)
            return self[family]

    return Lazy()


@pytest.fixture(scope="module")
def f32_files(
    sources: dict[str, tuple[Path, torch.Tensor]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Each family's f32 file (converted on first use)."""
    root = tmp_path_factory.mktemp("f32")

    class Lazy(dict[str, Path]):
        def __missing__(self, family: str) -> Path:
            self[family] = convert(sources[family][0], "f32", root / f"{family}.gguf")
            return self[family]

    return Lazy()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_f32_file_gives_the_source_logits(
    family: str, sources: dict[str, tuple[Path, torch.Tensor]], f32_files: dict[str, Path]
) -> None:
    src, ref = sources[family]
    out = f32_files[family]
    model = load(out)
    cfg = model.config
    assert cfg.architecture == ("mamba2" if family.startswith("mamba2") else "granitemoehybrid")
    assert cfg.torch_dtype == "float32"
    if cfg.architecture == "granitemoehybrid":
        assert cfg.use_rope == (family == "bamba")
    assert cfg.mamba_layers == load(src).config.mamba_layers
    torch.testing.assert_close(driven_logits(model), ref, rtol=0, atol=1e-4)
    ours, theirs = model.state_dict(), source_state(family, src)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():  # the converter's layouts undone, exactly
        torch.testing.assert_close(ours[name], tensor, rtol=1e-6, atol=0, msg=name)


def _bf16_rounded(src: Path) -> torch.Tensor:
    """The logits of ``src`` with the matrices the converter writes in bfloat16 rounded to it
    (it keeps the conv1d filters, norms, A, D and routers in float32)."""
    model = load(src)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "conv1d" not in name and not name.endswith("mlp.gate.weight"):
                p.copy_(p.to(torch.bfloat16))
    return driven_logits(model)


QUANTIZED = [
    "granite_moe",
    "mamba2",
    *(
        pytest.param(f, marks=pytest.mark.slow)
        for f in FAMILIES
        if f not in ("granite_moe", "mamba2")
    ),
]


@pytest.mark.parametrize("family", QUANTIZED)
def test_bf16_and_q8_0_files(
    family: str, sources: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    """bf16: within 1.5x what rounding the matrices to bfloat16 moves the logits. q8_0,
    dequantized at load: every weight within Q8_0's rounding of the source's (relative 0.5%),
    the logits within 20x bfloat16's move; kept quantized (the mixers' in_proj / out_proj as
    ``QuantLinear`` where foudre has Q8_0 kernels), the same bound."""
    from foudre.quant.qlinear import QuantLinear, uses_native_kernels

    src, ref = sources[family]
    bound = rel(_bf16_rounded(src), ref)
    got = driven_logits(load(convert(src, "bf16", tmp_path / "bf16.gguf")))
    assert rel(got, ref) <= 1.5 * bound + 1e-6, (rel(got, ref), bound)
    q8 = convert(src, "q8_0", tmp_path / "q8_0.gguf")
    dequantized = load(q8, gguf_dequantize=True)
    ours, theirs = dequantized.state_dict(), source_state(family, src)
    assert ours.keys() == theirs.keys()
    errors = {k: rel(ours[k].float(), v.float()) for k, v in theirs.items()}
    assert max(errors.values()) < 0.008, max(errors.items(), key=lambda kv: kv[1])
    assert sum(e > 1e-3 for e in errors.values()) >= 4  # (the matrices were rounded)
    assert rel(driven_logits(dequantized), ref) < 20 * bound
    model = load(q8)
    kept = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if uses_native_kernels(torch.bfloat16):  # Q8_0 has a kernel here: kept quantized
        for part in ("in_proj", "out_proj"):
            assert any(n.endswith((f"mamba.{part}", f"mixer.{part}")) for n in kept), kept
        if not family.startswith("mamba2"):  # q/k rows un-permuted in the codes
            assert any(n.endswith("qkv_proj") for n in kept), kept
    for name, mod in kept.items():  # the same weights as dequantized at load, rows in order
        if f"{name}.weight" in ours:
            assert rel(mod.dequantize().float(), ours[f"{name}.weight"].float()) < 1e-6, name
    assert rel(driven_logits(model), ref) < 20 * bound


@pytest.mark.parametrize(
    ("family", "change", "named"),
    [
        ("mamba2", {"mamba2.ssm.state_size": 32}, r"'blk\.0\.ssm_in\.weight' has shape"),
        ("mamba2", {"mamba2.ssm.conv_kernel": 3}, r"'blk\.0\.ssm_conv1d\.weight' has shape"),
        ("mamba2", {"mamba2.ssm.group_count": 1}, r"'blk\.0\.ssm_in\.weight' has shape"),
        ("mamba2", {"mamba2.ssm.time_step_rank": 16}, r"'blk\.0\.ssm_in\.weight' has shape"),
        ("mamba2", {"mamba2.ssm.inner_size": 100}, r"time_step_rank \(heads\) dividing"),
        ("mamba2", {"-blk.1.ssm_conv1d.bias": None}, r"'blk\.1\.ssm_conv1d\.bias' is missing"),
        ("mamba2", {"-blk.1.ssm_a": None}, r"'blk\.1\.ssm_a' is missing"),
        # what the converter writes from transformers 5's layer_types: every layer a Mamba one
        (
            "granite_moe",
            {"granitehybrid.attention.head_count_kv": [0, 0, 0, 0]},
            r"'blk\.1\.ssm_in\.weight' is missing; layer 1 has attention tensors but "
            r"head_count_kv\[1\] = 0",
        ),
        (
            "granite_moe",
            {"granitehybrid.attention.head_count_kv": [2, 2, 0, 2]},
            r"'blk\.0\.ssm_in\.weight' in layer 0, an attention layer",
        ),
        (
            "granite_moe",
            {"granitehybrid.attention.head_count_kv": [0, 2, 0, 4]},
            r"head_count_kv must give",
        ),
        ("mamba2", {"general.architecture": "rwkv7"}, r"'rwkv7' \(recurrent layers\)"),
        ("mamba2", {"general.architecture": "nemotron_h"}, r"'nemotron_h' \(recurrent layers\)"),
        ("mamba2", {"general.architecture": "mamba"}, r"'mamba' \(recurrent layers\)"),
    ],
)
def test_a_file_disagreeing_with_itself_names_the_tensor_or_key(
    family: str,
    change: dict[str, Any],
    named: str,
    f32_files: dict[str, Path],
) -> None:
    """State tensors whose shapes disagree with the ``ssm.*`` keys, missing ones, layers the
    KV head counts misplace, and recurrent architectures foudre does not read: refused before
    anything is built, naming the tensor, key or architecture."""
    f = read_gguf(f32_files[family])
    for key, value in change.items():
        if key.startswith("-"):
            del f.tensors[key[1:]]
        else:
            f.metadata[key] = value
    with pytest.raises(ModelLoadError, match=named):
        gguf_config(f)


def test_a_positive_a_names_the_tensor(f32_files: dict[str, Path], tmp_path: Path) -> None:
    """``ssm_a`` holds ``A = -exp(A_log)``: a value that is not negative has no ``A_log``."""
    import numpy as np

    from foudre.loading.gguf import iter_gguf_weights

    out = tmp_path / "positive_a.gguf"
    out.write_bytes(f32_files["mamba2"].read_bytes())
    tensor = read_gguf(out).tensors["blk.1.ssm_a"]
    data = np.memmap(out, dtype=np.float32, mode="r+", offset=tensor.offset, shape=(2,))
    data[1] = 0.5
    data.flush()
    del data
    f = read_gguf(out)
    with pytest.raises(ModelLoadError, match=r"'blk\.1\.ssm_a' holds A = -exp\(A_log\)"):
        list(iter_gguf_weights(f, gguf_config(f)))


@pytest.mark.parametrize("family", ["mamba2", "granite_moe", "bamba"])
def test_engine_serves_a_converted_file_as_its_source(
    family: str, sources: dict[str, tuple[Path, torch.Tensor]], f32_files: dict[str, Path]
) -> None:
    """Through ``LLM``, prompts of other lengths sharing a prefix, batched: the f32 file's
    greedy ids are its source's with few blocks (preemptions), a small token budget (chunked
    prompts) and prefix caching with state snapshots (hits), as without prefix caching; two
    seeded samples of a prompt (``n`` = 2, the state forked) are the source's."""
    from foudre import LLM, SamplingParams

    src, _ = sources[family]
    shared = prompt(30, 7)
    prompts = [[*shared, 50 + i, 60 + i] for i in range(3)] + [prompt(5, 1), prompt(21, 2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, n=2, seed=3)

    def run(path: Path, **kwargs: Any) -> tuple[list[list[int]], list[list[int]], Any]:
        llm = LLM(
            str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=64,
            block_size=4, **kwargs,
        )  # fmt: skip
        ids = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
        samples = [list(c.token_ids) for c in llm.generate([prompts[4]], sampled)[0].outputs]
        return ids, samples, llm.engine.metrics()

    want, want_samples, _ = run(src)
    small = dict(num_kv_blocks=20, max_num_batched_tokens=24, state_snapshot_interval=8)
    got, samples, metrics = run(f32_files[family], enable_prefix_caching=True, **small)
    assert metrics["num_preemptions"] > 0 and metrics["prefix_cache_hits"] > 0, metrics
    assert got == want
    assert samples == want_samples and all(len(s) == 8 for s in samples)
    got, _, _ = run(f32_files[family], enable_prefix_caching=False, **small)
    assert got == want
