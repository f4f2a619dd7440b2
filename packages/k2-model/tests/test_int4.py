"""INT4 routed experts (compressed-tensors pack-quantized, K2-Thinking's layout) against the reference
library: its compress writes what k2 reads, k2's loaded weights equal its decompression exactly, k2's
writer produces its bytes, and transformers loads the same directory to the same logits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

ct = pytest.importorskip("compressed_tensors")  # a declared test dependency (fails under CI if absent)
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from k2_model import K2ForCausalLM  # noqa: E402
from k2_model.checkpoint import save_pretrained  # noqa: E402
from k2_model.int4 import (  # noqa: E402
    Int4Format,
    dequantize_int4,
    k2_thinking_quantization_config,
    parse_quantization_config,
    quantize_int4,
)
from k2_model.testing import tiny_model  # noqa: E402

ARGS = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
SCHEME = QuantizationScheme(targets=["Linear"], weights=ARGS)


def _expert(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith(".weight")


def _library_checkpoint(model: K2ForCausalLM, out: Path) -> dict[str, torch.Tensor]:
    """`model` saved by k2 in full precision, then its routed experts compressed by compressed-tensors
    (scales from its own calculate_qparams) and the rest cast to bf16, with K2-Thinking's
    quantization_config. Returns the library's decompressed expert weights by name."""
    save_pretrained(model, str(out))
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        dense = {n: f.get_tensor(n) for n in f.keys()}
    tensors, decompressed = {}, {}
    for name, t in dense.items():
        if not _expert(name):
            tensors[name] = t.to(torch.bfloat16) if name.endswith(".weight") else t
            continue
        w = t.to(torch.bfloat16)
        groups = w.reshape(w.shape[0], -1, ARGS.group_size)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), ARGS)
        sd = PackedQuantizationCompressor.compress(
            {"weight": w, "weight_scale": scale, "weight_zero_point": zero}, SCHEME
        )
        base = name.removesuffix(".weight")
        tensors.update({f"{base}.{k}": v for k, v in sd.items()})
        decompressed[name] = PackedQuantizationCompressor.decompress(dict(sd), SCHEME)["weight"]
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = k2_thinking_quantization_config()
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    return decompressed


def _hf_name(name: str, j: int | None = None) -> str:
    return name if j is None else name.replace(".mlp.experts.", f".mlp.experts.{j}.") + ".weight"


def _loaded_experts(model: K2ForCausalLM) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in model.state_dict().items():
        if ".mlp.experts." in name:
            for j in range(t.shape[0]):
                out[_hf_name(name, j)] = t[j]
    return out


def test_the_declared_config_is_what_the_library_reads():
    qc = k2_thinking_quantization_config()
    parsed = QuantizationConfig.model_validate(qc)  # the library's own schema
    assert parsed.format == "pack-quantized" and parsed.config_groups["group_0"].weights.group_size == 32
    fmt = parse_quantization_config(qc)
    assert fmt == Int4Format(group_size=32)
    assert fmt.quantizes("model.layers.1.mlp.experts.7.gate_proj.weight")
    for name in (
        "lm_head.weight",
        "model.layers.1.self_attn.q_b_proj.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    ):
        assert not fmt.quantizes(name), name


def test_k2_loads_what_the_library_compressed_exactly(tmp_path):
    torch.manual_seed(0)
    model = tiny_model()
    expected = _library_checkpoint(model, tmp_path / "int4")
    loaded = K2ForCausalLM.from_pretrained(str(tmp_path / "int4"))
    experts = _loaded_experts(loaded)
    assert set(experts) == set(expected) and expected
    for name, w in expected.items():
        assert torch.equal(experts[name], w.float()), name  # bitwise: bf16 values held in fp32
    # the rest: bf16 copies of the original weights
    for name, t in loaded.state_dict().items():
        if ".mlp.experts." not in name and name.endswith("weight"):
            assert torch.equal(t, model.state_dict()[name].to(torch.bfloat16).float()), name


def test_k2_writes_the_library_bytes_and_reads_them_back(tmp_path):
    torch.manual_seed(1)
    model = tiny_model()
    save_pretrained(model, str(tmp_path / "k2"), quantize=Int4Format())
    _library_checkpoint(model, tmp_path / "ref")
    with (
        safe_open(str(tmp_path / "k2" / "model.safetensors"), framework="pt") as a,
        safe_open(str(tmp_path / "ref" / "model.safetensors"), framework="pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        for n in a.keys():
            assert torch.equal(a.get_tensor(n), b.get_tensor(n)), n
    config = json.loads((tmp_path / "k2" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
    again = _loaded_experts(K2ForCausalLM.from_pretrained(str(tmp_path / "k2")))
    with safe_open(str(tmp_path / "k2" / "model.safetensors"), framework="pt") as a:
        for name, w in again.items():
            base = name.removesuffix(".weight")
            parts = [a.get_tensor(f"{base}.{s}") for s in ("weight_packed", "weight_scale", "weight_shape")]
            assert torch.equal(w, dequantize_int4(parts[0], parts[1], tuple(parts[2].tolist()), 32).float())


def test_transformers_loads_the_same_directory_to_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(2)
    save_pretrained(tiny_model(), str(tmp_path / "int4"), quantize=Int4Format())
    ours = K2ForCausalLM.from_pretrained(str(tmp_path / "int4")).to(torch.bfloat16).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "int4"), dtype=torch.bfloat16
    ).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids).logits.float(), theirs(ids).logits.float()
    # bf16 on both sides, the same dequantised weights: the two forwards' kernels may differ in
    # reduction order, so a bf16-sized tolerance
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_quantize_matches_the_library_bitwise():
    torch.manual_seed(3)
    for shape in ((64, 128), (96, 256)):
        w = torch.randn(*shape)
        packed, scale, wshape = quantize_int4(w, 32)
        groups = w.bfloat16().reshape(shape[0], -1, 32)
        ref_scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), ARGS)
        sd = PackedQuantizationCompressor.compress(
            {"weight": w.bfloat16(), "weight_scale": ref_scale, "weight_zero_point": zero}, SCHEME
        )
        assert torch.equal(scale, ref_scale) and torch.equal(packed, sd["weight_packed"])
        assert torch.equal(wshape, sd["weight_shape"])
        ref = PackedQuantizationCompressor.decompress(dict(sd), SCHEME)["weight"]
        assert torch.equal(dequantize_int4(packed, scale, shape, 32), ref)


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("format", "float-quantized", "quantization_config.format = 'float-quantized'"),
        ("num_bits", 8, "weights.num_bits = 8"),
        ("symmetric", False, "weights.symmetric = False"),
        ("strategy", "channel", "weights.strategy = 'channel'"),
        ("group_size", 20, "weights.group_size = 20"),
    ],
)
def test_unsupported_configs_are_refused_by_field(field, value, needle, tmp_path):
    qc = k2_thinking_quantization_config()
    if field == "format":
        qc["format"] = value
    else:
        qc["config_groups"]["group_0"]["weights"][field] = value
    with pytest.raises(ValueError, match="not supported") as e:
        parse_quantization_config(qc)
    assert needle in str(e.value)


def test_a_missing_scale_names_the_tensor(tmp_path):
    torch.manual_seed(4)
    save_pretrained(tiny_model(), str(tmp_path / "int4"), quantize=Int4Format())
    path = tmp_path / "int4" / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    victim = next(n for n in tensors if n.endswith(".weight_scale"))
    del tensors[victim]
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=f"has no {re.escape(victim)}"):
        K2ForCausalLM.from_pretrained(str(tmp_path / "int4"))


def test_serving_footprint_of_int4_experts():
    """k2 model stats' rows: bf16 is 2 bytes a weight; INT4 routed experts are 4 bits plus a bf16
    scale per 32 weights with the rest in bf16 (K2-Thinking's ~594 GB for the 1.03T model)."""
    from k2_model import K2Config
    from k2_model.stats import param_breakdown, serving_bytes

    cfg = K2Config.preset("kimi-k2")
    b = param_breakdown(cfg)
    bf16, fp8, int4 = serving_bytes(cfg)
    assert bf16.total_bytes == 2 * b.total_params and bf16.active_bytes == 2 * b.active_params
    routed = b.routed_experts.total
    assert int4.total_bytes == int(routed * (0.5 + 2 / 32) + (b.total_params - routed) * 2)
    assert 590e9 < int4.total_bytes < 600e9
    assert fp8.total_bytes > int4.total_bytes and fp8.total_bytes < bf16.total_bytes / 1.9


def test_fake_quantize_is_the_library_s_qdq_with_a_straight_through_gradient():
    """QAT's forward weight equals compressed-tensors' own fake_quantize (bf16 scales from its
    calculate_qparams) bitwise, for stacked experts too; the gradient passes straight through."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from k2_model.int4 import fake_quantize_int4

    torch.manual_seed(5)
    w = torch.randn(3, 64, 128, requires_grad=True)
    fq = fake_quantize_int4(w, 32)
    for e in range(3):
        x = w[e].detach().bfloat16()
        groups = x.reshape(64, -1, 32)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), ARGS)
        ref = fake_quantize(x, scale, zero, ARGS)
        assert torch.equal(fq[e].detach(), ref.float()), e
    (fq * torch.arange(fq.numel()).reshape(fq.shape)).sum().backward()
    assert torch.equal(w.grad, torch.arange(fq.numel(), dtype=torch.float32).reshape(fq.shape))


def test_qat_forward_is_the_int4_export_s_forward(tmp_path):
    """With set_expert_qat(32) the full-precision model's logits equal those of its INT4 export
    loaded back with the non-expert weights kept in fp32 (QAT trains the model it exports)."""
    torch.manual_seed(6)
    model = tiny_model().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    save_pretrained(model, str(tmp_path / "int4"), quantize=Int4Format())
    loaded = K2ForCausalLM.from_pretrained(str(tmp_path / "int4")).eval()
    # the INT4 export keeps the rest in bf16; put the originals back to compare the experts alone
    with torch.no_grad():
        for name, t in loaded.state_dict().items():
            if ".mlp.experts." not in name:
                t.copy_(model.state_dict()[name])
        model.set_expert_qat(32)
        qat = model(ids).logits
        model.set_expert_qat(0)
        plain = model(ids).logits
        assert torch.equal(qat, loaded(ids).logits)
        assert not torch.equal(qat, plain)  # the fake quantisation does change the forward


@pytest.mark.parametrize("bits", [3, 2])
def test_coarser_fake_quantisation_follows_the_int4_rule(bits):
    """`fake_quantize_int` at 3 or 2 bits: the INT4 rule with 2^(bits-1) levels each side (at most
    2^bits values per group, the group's max |w| at the top level's scale), straight-through
    gradient; at 4 bits it is `fake_quantize_int4` exactly. Compared against compressed-tensors'
    own qdq at that width."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from k2_model.int4 import fake_quantize_int, fake_quantize_int4

    torch.manual_seed(7)
    w = torch.randn(2, 16, 64, requires_grad=True)
    assert torch.equal(fake_quantize_int(w, 4, 32), fake_quantize_int4(w, 32))
    fq = fake_quantize_int(w, bits, 32)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group", group_size=32)
    for e in range(2):
        x = w[e].detach().bfloat16()
        groups = x.reshape(16, -1, 32)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        assert torch.equal(fq[e].detach(), fake_quantize(x, scale, zero, args).float()), e
    for g in fq.detach().reshape(-1, 32):
        assert g.unique().numel() <= 2**bits
    fq.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))
    with pytest.raises(ValueError, match="bits must be in"):
        fake_quantize_int(w, 1, 32)


def test_qat_schemes_set_the_experts_bits():
    from k2_model.spec import ModelSpec

    assert (ModelSpec(qat="int4").qat_group_size, ModelSpec(qat="int4").qat_bits) == (32, 4)
    assert (ModelSpec(qat="int2").qat_group_size, ModelSpec(qat="int2").qat_bits) == (32, 2)
    assert ModelSpec().qat_group_size == 0
    model = tiny_model()
    model.set_expert_qat(32, 3)
    experts = [m for m in model.modules() if hasattr(m, "qat_bits")]
    assert experts and all((m.qat_group_size, m.qat_bits) == (32, 3) for m in experts)
    with pytest.raises(ValueError, match="qat='int5'"):
        ModelSpec(qat="int5").validate("test")
