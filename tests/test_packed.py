"""GGUF-packed decode weights (spd_fast/packed.py, spd_fast/csrc/gguf_linear.cpp)."""
from __future__ import annotations

import os

import pytest
import torch

from conftest import tiny_target
from spd_fast import cpp_ops, packed

pytestmark = pytest.mark.skipif(not cpp_ops.available(), reason="needs a C++ compiler for the packed ops")


def _random_packed(kind: str, N: int, K: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(N, K // 32, generator=g) * 0.02 + 0.001).half().float()  # fp16 scales, as in a GGUF file
    if kind == "q4_1":
        m = (torch.rand(N, K // 32, generator=g) * -0.1).half().float()
        qs = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
        return {"kind": kind, "qs": qs, "d": d, "m": m}
    return {"kind": kind, "qs": torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8), "d": d}


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("N", [40, 41])
def test_packed_linear_matches_dequantised_reference(kind, M, N):
    p = _random_packed(kind, N, 96)
    x = torch.randn(M, 96)
    torch.testing.assert_close(packed.packed_linear(x, p), packed.reference_linear(x, p), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("N", [64, 41])  # 41: a last output row without a partner
def test_packed_rows_do_not_depend_on_batch(kind, N):
    """Row i of an M-row call equals a 1-row call, bit for bit: SPD stage steps and AR agree."""
    p = _random_packed(kind, N, 576, seed=1)
    x = torch.randn(16, 576)
    full = packed.packed_linear(x, p)
    for M in (2, 5, 16):
        assert torch.equal(packed.packed_linear(x[:M], p), full[:M])
    for i in range(16):
        assert torch.equal(packed.packed_linear(x[i:i + 1], p), full[i:i + 1])


def test_packed_op_rejects_bad_inputs():
    p = _random_packed("q4_1", 8, 64)
    with pytest.raises(RuntimeError, match="1 <= M <= 16"):
        packed.packed_linear(torch.randn(17, 64), p)
    with pytest.raises(RuntimeError, match="x must be a contiguous fp32"):
        packed.packed_linear(torch.randn(2, 64).double(), p)
    with pytest.raises(RuntimeError, match="x has K=32, weights K=64"):
        packed.packed_linear(torch.randn(2, 32), p)


def test_default_model_packed_weights_equal_the_fp32_copy(default_target):
    """The blocks attached to the default model dequantise to exactly its fp32 weights (Q/K rows
    unpermuted, q/k/v and gate/up fused in the right order, the tied LM head from token_embd)."""
    net = default_target.model
    attached = {n: m.packed for n, m in net.named_modules() if getattr(m, "packed", None) is not None}
    assert len(attached) == 4 * net.cfg.num_layers + 1
    for name in ("layers.0.attn.wqkv", "layers.17.mlp.w_gate_up", "layers.29.attn.wo", "lm_head"):
        mod = dict(net.named_modules())[name]
        K = mod.weight.shape[1]
        eye = torch.eye(K)
        w = packed.reference_linear(eye, mod.packed).T  # dequantised weight [N, K]
        assert torch.equal(w, mod.weight), name
    # the decode path reads them (the C++ op runs on the blocks) and agrees with the fp32 GEMM
    x = torch.randn(1, 1, net.cfg.hidden_size)
    lm = net.lm_head
    read = []
    real = packed.packed_linear
    try:
        packed.packed_linear = lambda x_, p_: read.append(p_) or real(x_, p_)
        with torch.no_grad():
            y = lm(x)
    finally:
        packed.packed_linear = real
    assert len(read) == 1 and read[0] is lm.packed
    torch.testing.assert_close(y, torch.nn.functional.linear(x, lm.weight), rtol=1e-4, atol=1e-4)


def test_packed_path_can_be_turned_off(monkeypatch, default_target):
    monkeypatch.setenv("SPD_FAST_PACKED", "0")
    assert packed.maybe_attach(default_target.model, default_target.path) == 0
    monkeypatch.setenv("SPD_FAST_PACKED", "1")
    assert packed.maybe_attach(default_target.model, default_target.path) == 4 * default_target.cfg.num_layers + 1


def test_packed_rejects_mismatched_shapes(default_target):
    before = default_target.model.lm_head.packed
    with pytest.raises(ValueError, match="packed weights for lm_head have shape"):
        packed.attach(default_target.model, {"lm_head": _random_packed("q8_0", 8, 64)})
    assert default_target.model.lm_head.packed is before  # untouched after the error


def test_fused_decode_ops_match_the_aten_path():
    """rms_norm_rows and decode_attention (spd_fast/csrc/gguf_linear.cpp) against the model's ATen code."""
    from spd_fast.model import RMSNorm, attention_mask, few_query_attention

    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.rand(64) + 0.5
    x = torch.randn(3, 2, 64) * 3
    with torch.no_grad():
        ref = norm(x)
        norm.fused = True
        torch.testing.assert_close(norm(x), ref, rtol=1e-6, atol=1e-6)
    B, T, nh, nkv, D, S = 2, 3, 6, 2, 16, 40
    q = torch.randn(B, T, nh, D)
    kc, vc = torch.randn(B + 1, nkv, S, D), torch.randn(B + 1, nkv, S, D)
    positions = torch.tensor([[5, 6, 7], [30, 31, S - 1]])
    for bound in (8, 32, S):
        got = torch.ops.spd_fast.decode_attention(q, kc, vc, positions, bound)
        # the model's few-query path: GQA matmuls over slots < bound, slot <= position
        want = few_query_attention(q, kc[:B, :, :bound], vc[:B, :, :bound], attention_mask(positions, bound))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="decode_attention: fp32 tensors"):
        torch.ops.spd_fast.decode_attention(q.double(), kc, vc, positions, 8)


def test_fused_ops_check_their_shapes():
    """Shapes the C++ ops cannot serve raise (they used to read past positions, or die of SIGFPE); the model
    broadcasts one row of positions over the batch as its ATen path does."""
    from spd_fast.config import ModelConfig
    from spd_fast.model import Transformer

    q, kc = torch.randn(3, 2, 2, 16), torch.randn(3, 1, 8, 16)
    with pytest.raises(RuntimeError, match=r"decode_attention: int64 positions \[B, T\] = \[3, 2\], got Long \[1, 2\]"):
        torch.ops.spd_fast.decode_attention(q, kc, kc, torch.tensor([[5, 6]]), 8)
    with pytest.raises(RuntimeError, match=r"int64 positions \[B, T\] = \[3, 2\], got Int \[3, 2\]"):  # the dtype named
        torch.ops.spd_fast.decode_attention(q, kc, kc, torch.tensor([[5, 6]] * 3, dtype=torch.int32), 8)
    with pytest.raises(RuntimeError, match="decode_attention: shapes disagree"):  # no KV heads
        torch.ops.spd_fast.decode_attention(q, torch.empty(3, 0, 8, 16), torch.empty(3, 0, 8, 16),
                                            torch.zeros(3, 2, dtype=torch.long), 8)
    with pytest.raises(RuntimeError, match="rms_norm_rows: H must be >= 1"):
        torch.ops.spd_fast.rms_norm_rows(torch.empty(3, 0), torch.empty(0), 1e-5)
    torch.manual_seed(0)
    net = Transformer(ModelConfig("llama", 100, 64, 128, 2, 4, 2, 16)).eval()
    net.setup_caches(3, 64)
    ids, pos = torch.randint(0, 100, (3, 4)), torch.arange(4)[None]
    with torch.no_grad():
        ref = net(ids, pos)
        packed.enable_fused_ops(net)
        assert net.layers[0].attn.fused
        torch.testing.assert_close(net(ids, pos), ref, rtol=1e-5, atol=1e-5)


def test_cpp_argmax_treats_nan_as_torch_does():
    """A NaN logit: torch.argmax returns its index; the vector max used to drop it and name another token."""
    x = torch.full((24,), -5.0)
    x[0], x[8], x[16] = 10.0, float("nan"), 1.0
    for v in (x, x[:5], x.bfloat16()):
        assert int(torch.ops.spd_fast.verify_greedy_cpp(v, torch.tensor(0))[1]) == int(torch.argmax(v))
    x[8] = 0.0
    assert int(torch.ops.spd_fast.verify_greedy_cpp(x, torch.tensor(0))[1]) == 0


def test_cpp_sampling_ops_refuse_top_p_outside_0_1():
    logits, q, u = torch.randn(10), torch.full((10,), 0.1), torch.rand(2)
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(RuntimeError, match=r"verify_sampling_cpp: top_p must be in \(0, 1\]"):
            torch.ops.spd_fast.verify_sampling_cpp(logits, torch.tensor(0), q, 1.0, 0, bad, u)


def test_cpp_build_is_kept_per_cpu_kind(tmp_path):
    avx2, avx512 = tmp_path / "a", tmp_path / "b"
    avx2.write_text("processor : 0\nflags : fpu sse avx avx2 fma\n")
    avx512.write_text("processor : 0\nflags : fpu sse avx avx2 fma avx512f avx512bw\n")
    keys = {cpp_ops._cpu_key(str(avx2)), cpp_ops._cpu_key(str(avx512))}
    assert len(keys) == 2  # another instruction set, another build
    assert cpp_ops.build_dir().name == f"{cpp_ops._cpu_key()}-{cpp_ops._source_key()}"


def test_cpp_build_directory_follows_the_sources_and_torch(tmp_path, monkeypatch):
    """ninja decides by mtime and does not track torch's headers: a source put back with an older mtime, or a
    torch upgraded in place, kept the old library. The build directory's name now holds their key."""
    src = tmp_path / "a.cpp"
    src.write_text("int f() { return 1; }\n")
    monkeypatch.setattr(cpp_ops, "SOURCES", (src,))
    k1 = cpp_ops._source_key()
    mtime = src.stat().st_mtime_ns
    src.write_text("int f() { return 2; }\n")
    os.utime(src, ns=(mtime, mtime))  # an older-or-equal mtime: ninja would not rebuild
    k2 = cpp_ops._source_key()
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    k3 = cpp_ops._source_key()
    # another checkout's sources: torch's build file names them by absolute path, so two checkouts sharing one
    # directory rebuilt it for each other (a CI clone's distributed ranks timed out loading, waiting on a rebuild)
    monkeypatch.setattr(cpp_ops, "CSRC", tmp_path / "other-checkout" / "csrc")
    assert len({k1, k2, k3, cpp_ops._source_key()}) == 4


def test_packed_cpp_ops_have_fakes_for_torch_compile():
    """Each C++ op of spd_fast/csrc/gguf_linear.cpp has a schema and a fake that agree with the real op."""
    check = ("test_schema", "test_faketensor")
    p4, p8 = _random_packed("q4_1", 8, 64), _random_packed("q8_0", 8, 64)
    x = torch.randn(2, 64)
    torch.library.opcheck(torch.ops.spd_fast.q4_1_linear, (x, p4["qs"], p4["d"], p4["m"]), test_utils=check)
    torch.library.opcheck(torch.ops.spd_fast.q8_0_linear, (x, p8["qs"], p8["d"]), test_utils=check)
    torch.library.opcheck(torch.ops.spd_fast.rms_norm_rows, (x, torch.rand(64) + 0.5, 1e-5), test_utils=check)
    q, kc = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 16, 8)
    torch.library.opcheck(torch.ops.spd_fast.decode_attention, (q, kc, kc.clone(), torch.tensor([[3, 4]]), 16),
                          test_utils=check)


def test_fused_ops_can_be_turned_off(monkeypatch, default_target):
    net = default_target.model
    monkeypatch.setenv("SPD_FAST_FUSED", "0")
    assert packed.enable_fused_ops(net) is False and not net.layers[0].attn.fused and not net.norm.fused
    monkeypatch.setenv("SPD_FAST_FUSED", "1")
    assert packed.enable_fused_ops(net) is True and net.layers[3].mlp_norm.fused


# ---- the draft head decodes from packed weights too (packed.pack_draft) ---------------------------
def test_quantize_q8_0_stays_within_half_a_step():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 96, generator=g) * torch.rand(24, 1, generator=g)
    w[5, 32:64] = 0.0  # an all-zero block: scale 0, every weight exactly 0
    p = packed.quantize_q8_0(w)
    assert p["qs"].dtype == torch.int8 and p["d"].shape == (24, 3)
    wq = packed.reference_linear(torch.eye(96), p).T
    step = p["d"].repeat_interleave(32, dim=1)
    assert ((wq - w).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(wq[5, 32:64], torch.zeros(32))
    assert (p["qs"].abs().amax(-1) == 127).all()  # each row's largest block uses the whole int8 range
    with pytest.raises(ValueError, match="divisible by 32"):
        packed.quantize_q8_0(torch.randn(4, 40))


def _shipped_fp32_head(tg):
    from spd_fast.api import shipped_head
    from spd_fast.pdm import load_draft

    d = shipped_head(tg, 3)
    assert d is not None, "the default model ships an n=3 head"
    return load_draft(d, tg.model, tg.fingerprint, 3)


def test_packed_draft_head_matches_the_fp32_head(default_target):
    """pack_draft: the LM head takes the target's own blocks (lossless); the Q8_0 tower and
    aggregation stay close to fp32 and draft the same tokens on real decode rows; greedy SPD with
    the packed head is still exactly AR."""
    from spd_fast.ar import decode_ar
    from spd_fast.config import uniform_boundaries
    from spd_fast.drafters import PdmDrafter
    from spd_fast.engine import SPDEngine
    from spd_fast.ops import aggregate_torch
    from spd_fast.sampling import SamplingParams

    tg, net = default_target, default_target.model
    ref_head, head = _shipped_fp32_head(tg), _shipped_fp32_head(tg)
    assert packed.pack_draft(head, net) is True
    assert head.layers[-1].mlp.w_down.packed["kind"] == "q8_0" and head.layers[0].attn.fused
    w_lm = packed.reference_linear(torch.eye(net.cfg.hidden_size), head.lm_head.packed).T
    assert torch.equal(w_lm, head.lm_head.weight)  # the target's rows of V_d, bit for bit
    g = torch.Generator().manual_seed(0)
    rows, types = torch.randn(5, head.dcfg.num_types, 576, generator=g), torch.tensor([3, 0, 2, 1, 3])
    with torch.no_grad():
        want = aggregate_torch(rows, types, ref_head.padded_proj())
        got = head.aggregate(rows, types)
    assert (got - want).norm() < 0.02 * want.norm()
    ids = tg.encode([{"role": "user", "content": "Write a Python function that reverses a string."}])
    ar = decode_ar(net, ids, 40, SamplingParams(), tg.eos_ids).token_ids
    runs = {}
    tower = {id(m.packed) for m in head.modules() if getattr(m, "packed", None) is not None and m is not head.lm_head}
    read: list[int] = []
    real = packed.packed_linear
    for name, h in (("fp32", ref_head), ("packed", head)):
        eng = SPDEngine(net, PdmDrafter(h), uniform_boundaries(30, 3), h.dcfg.anchors)
        read.clear()
        packed.packed_linear = lambda x_, p_: read.append(id(p_)) or real(x_, p_)
        try:
            runs[name] = eng.run(ids, 40, SamplingParams(), tg.eos_ids)
        finally:
            packed.packed_linear = real
        assert runs[name].token_ids == ar, name
        assert bool(tower & set(read)) == (name == "packed"), name  # the packed head drafts from its Q8_0 tower
    a, b = runs["fp32"].metrics["accepted"], runs["packed"].metrics["accepted"]
    assert a > 10 and abs(a - b) <= 2, (a, b)  # the same drafts, give or take a near-tie


def test_packed_draft_can_be_turned_off_and_needs_a_packed_target(monkeypatch, default_target, tiny_checkpoint):
    tg = default_target
    monkeypatch.setenv("SPD_FAST_PACKED_DRAFT", "0")
    head = _shipped_fp32_head(tg)
    assert packed.pack_draft(head, tg.model) is False
    assert head.lm_head.packed is None and "_packed_proj" not in head.__dict__
    monkeypatch.delenv("SPD_FAST_PACKED_DRAFT")
    tiny = tiny_target(tiny_checkpoint("llama"))  # not a GGUF model: its target is not packed
    from spd_fast.pdm import DraftConfig, DraftHead, init_from_target

    dcfg = DraftConfig.make(tiny.cfg, (0, tiny.cfg.num_layers // 2, tiny.cfg.num_layers))
    small = init_from_target(DraftHead(dcfg, tiny.cfg, tiny.norm), tiny).eval()
    assert packed.pack_draft(small, tiny) is False and small.lm_head.packed is None
    # a packed target whose head has a width Q8_0 blocks (32 inputs each) cannot hold: that head stays fp32 (it
    # raised ValueError at load, for method="ar" too)
    import dataclasses

    with torch.no_grad():
        tiny.lm_head.packed = packed.quantize_q8_0(tiny.lm_head.weight)
    try:
        assert packed.pack_draft(init_from_target(DraftHead(dcfg, tiny.cfg, tiny.norm), tiny).eval(), tiny) is True
        odd = dataclasses.replace(tiny.cfg, intermediate_size=80)
        head80 = DraftHead(dcfg, odd, tiny.norm).eval()
        assert packed.pack_draft(head80, tiny) is False and head80.layers[0].mlp.w_down.packed is None
    finally:
        tiny.lm_head.packed = None


def test_cpu_name_names_the_simd_level_the_decode_ops_compile_for():
    from spd_fast.runtime import cpu_name

    assert cpu_name("model name\t: AMD EPYC\nflags\t\t: sse2 avx avx2 fma\n") == "AMD EPYC [avx2]"
    assert cpu_name("model name\t: Xeon\nflags\t\t: avx2 fma avx512f avx512bw\n") == "Xeon [avx512]"
    assert cpu_name("model name\t: Old\nflags\t\t: sse2 avx avx2\n") == "Old [portable]"  # AVX2 without FMA
    assert cpu_name("Features\t: fp asimd\n").endswith("[portable]")  # Arm: no model name line


def test_a_packed_linear_takes_zero_rows():
    """An empty input went to the C++ op ("gguf linear: 1 <= M <= 16, got 0") where F.linear returns an empty
    result."""
    from spd_fast.model import Linear

    lin = Linear(96, 40, bias=False)
    lin.packed = _random_packed("q8_0", 40, 96)
    with torch.no_grad():
        assert lin(torch.zeros(0, 96)).shape == (0, 40)
        assert lin(torch.zeros(1, 0, 96)).shape == (1, 0, 40)
        assert torch.allclose(lin(torch.ones(1, 96)), packed.reference_linear(torch.ones(1, 96), lin.packed), atol=1e-5)
