"""Self-checks of the float64 DSpark oracle (tests/dspark_reference.py) and the tiny release
writer (tests/dspark_release.py).  CPU only, fast.  Spec: /work/shared/DSPARK.md, SPEC.md."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import DeepseekV4Config

from dsv4_mtp_hf.fp4 import dequantize_fp4
from dsv4_mtp_hf.fp8 import dequantize_fp8_block

from .dspark_reference import DSparkOracle, block_attention, hc_pre, rms_norm, sinkhorn
from .dspark_release import (
    decoded_dspark_weights,
    random_dspark_tensors,
    random_target_shared,
    tiny_dspark_config,
    write_dspark_release,
)

SEED = 20260731


@pytest.fixture(scope="module")
def release():
    cfg = tiny_dspark_config()
    tensors = random_dspark_tensors(cfg, SEED)
    shared = random_target_shared(cfg, SEED + 1)
    weights = {**decoded_dspark_weights(tensors), **decoded_dspark_weights(shared)}
    return cfg, tensors, shared, weights


def _features(cfg, rows, seed):
    g = torch.Generator().manual_seed(seed)
    n_layers = len(cfg["dspark_target_layer_ids"])
    return torch.randn(rows, n_layers, cfg["hc_mult"], cfg["hidden_size"], generator=g, dtype=torch.float64)


def _oracle(release, rows, seed, **kw):
    cfg, _, _, weights = release
    oracle = DSparkOracle(cfg, weights, **kw)
    oracle.commit(_features(cfg, rows, seed), range(rows))
    return oracle


def test_config_is_a_v4_config_with_dspark_fields():
    cfg = tiny_dspark_config()
    tc = DeepseekV4Config(**cfg)
    assert tc.qk_rope_head_dim == 16 and tc.layer_types[1] == "compressed_sparse_attention"
    assert (tc.dspark_block_size, tc.dspark_target_layer_ids, tc.dspark_markov_rank) == (5, [0, 1, 2], 16)
    assert 0 <= tc.dspark_noise_token_id < tc.vocab_size and tc.num_nextn_predict_layers == 1
    assert tiny_dspark_config(num_hidden_layers=6)["dspark_target_layer_ids"] == [3, 4, 5]
    DeepseekV4Config(**tiny_dspark_config(num_hidden_layers=6))


def test_tensor_names_dtypes_and_scale_grids(release):
    cfg, tensors, _, _ = release
    e = cfg["n_routed_experts"]
    per_layer = 29 + 6 * e  # 1565 at 256 experts (DSPARK.md §e)
    counts = [sum(k.startswith(f"mtp.{i}.") for k in tensors) for i in range(3)]
    assert counts == [per_layer + 3, per_layer, per_layer + 7] and len(tensors) == 3 * per_layer + 10
    assert tensors["mtp.0.main_proj.weight"].shape == (256, 768)
    assert tensors["mtp.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert tensors["mtp.1.attn.wq_a.scale"].shape == (1, 2)  # [64, 256]: a partial 128-row block
    assert tensors["mtp.1.attn.wo_a.scale"].shape == (1, 1) and tensors["mtp.1.attn.wo_b.scale"].shape == (2, 1)
    assert tensors["mtp.2.ffn.experts.7.w2.weight"].dtype == torch.int8
    assert tensors["mtp.2.ffn.experts.7.w2.weight"].shape == (256, 32)
    assert tensors["mtp.2.ffn.experts.7.w2.scale"].shape == (256, 2)
    assert tensors["mtp.2.ffn.experts.7.w2.scale"].dtype == torch.float8_e8m0fnu
    assert tensors["mtp.2.markov_head.markov_w2.weight"].shape == (320, 16)
    assert tensors["mtp.2.confidence_head.proj.weight"].shape == (1, 256 + 16)
    assert tensors["mtp.0.hc_ffn_fn"].dtype == torch.float32 and tensors["mtp.0.ffn.gate.bias"].dtype == torch.float32
    assert not any(".e_proj" in k or "enorm" in k for k in tensors)


def test_release_round_trip(release, tmp_path):
    print("seed", SEED)
    cfg, tensors, shared, weights = release
    write_dspark_release(tmp_path, cfg, tensors, shared, shards=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert json.loads((tmp_path / "config.json").read_text()) == cfg
    assert set(index) == set(tensors) | set(shared)
    assert {index[k] for k in tensors} == {"model-00002-of-00002.safetensors"}
    assert {index[k] for k in shared} == {"model-00001-of-00002.safetensors"}
    back = {}
    for fname in set(index.values()):
        with safe_open(str(tmp_path / fname), "pt") as f:
            back.update({k: f.get_tensor(k) for k in f.keys()})
    for k, t in {**tensors, **shared}.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k].view(torch.uint8), t.view(torch.uint8)), k
    decoded = {**decoded_dspark_weights(back), **decoded_dspark_weights(shared)}
    assert decoded.keys() == weights.keys()
    assert all(torch.equal(decoded[k], weights[k]) and decoded[k].dtype == torch.float64 for k in weights)


def test_decoders_agree_with_the_package(release):
    _, tensors, _, weights = release
    for name in ("mtp.0.main_proj", "mtp.1.attn.wq_a", "mtp.1.attn.wq_b", "mtp.2.ffn.shared_experts.w2"):
        ref = dequantize_fp8_block(tensors[name + ".weight"], tensors[name + ".scale"], torch.float64)
        assert torch.equal(weights[name + ".weight"], ref), name
    for name in ("mtp.0.ffn.experts.0.w1", "mtp.2.ffn.experts.5.w2"):
        ref = dequantize_fp4(tensors[name + ".weight"], tensors[name + ".scale"], "mxfp4", dtype=torch.float64)
        assert torch.equal(weights[name + ".weight"], ref), name
    assert weights["mtp.0.attn.attn_sink"].abs().min() > 0 and weights["mtp.0.ffn.gate.bias"].abs().min() > 0


def test_sinkhorn_comb_is_doubly_stochastic(release):
    print("seed", SEED)
    cfg, _, _, weights = release
    g = torch.Generator().manual_seed(SEED)
    c = sinkhorn(torch.randn(64, 4, 4, generator=g, dtype=torch.float64), 20, 1e-6)
    x = torch.randn(6, 4, cfg["hidden_size"], generator=g, dtype=torch.float64)
    _, post, comb = hc_pre(x, weights["mtp.1.hc_ffn_fn"], weights["mtp.1.hc_ffn_base"], weights["mtp.1.hc_ffn_scale"],
                           cfg)
    for m in (c, comb):
        assert (m > 0).all()
        torch.testing.assert_close(m.sum(-2), torch.ones_like(m.sum(-2)), atol=1e-5, rtol=0)
        torch.testing.assert_close(m.sum(-1), torch.ones_like(m.sum(-1)), atol=1e-3, rtol=0)  # 20 iters: ~1e-4
    assert ((post > 0) & (post < 2)).all() and comb.std() > 0.01


def test_block_attention_is_order_invariant_in_the_context(release):
    print("seed", SEED)
    cfg, _, _, weights = release
    g = torch.Generator().manual_seed(SEED)
    h = torch.randn(5, cfg["hidden_size"], generator=g, dtype=torch.float64)
    ctx = torch.randn(8, cfg["head_dim"], generator=g, dtype=torch.float64)
    pos = torch.arange(20, 25)
    base = block_attention(weights, 1, h, pos, ctx, cfg)
    perm = torch.randperm(8, generator=g)
    torch.testing.assert_close(block_attention(weights, 1, h, pos, ctx[perm], cfg), base, atol=1e-12, rtol=1e-12)
    assert (block_attention(weights, 1, h, pos, ctx[:-1], cfg) - base).abs().max() > 1e-3


def test_noise_rows_change_row_zero(release):
    print("seed", SEED)
    oracle = _oracle(release, 12, SEED)
    a = oracle.draft(7, 12)
    b = oracle.draft(7, 12, noise_token_id=301)
    assert (a["hidden"][0][0] - b["hidden"][0][0]).abs().max() > 1e-4  # non-causal block (DSPARK.md b4)
    assert (a["logits"][0] - b["logits"][0]).abs().max() > 1e-4


def test_context_older_than_the_window_has_no_effect(release):
    print("seed", SEED)
    cfg = release[0]
    rows, win = 14, cfg["sliding_window"]
    oracle = _oracle(release, rows, SEED)
    base = oracle.draft(7, rows)
    assert base["window"] == list(range(rows - win, rows))
    other = _features(cfg, 1, SEED + 7)
    oracle.commit(other, [rows - win - 1])  # outside max(0, P - window)..P-1
    same = oracle.draft(7, rows)
    assert torch.equal(same["logits"], base["logits"]) and torch.equal(same["confidences"], base["confidences"])
    oracle.commit(other, [rows - win])  # the oldest entry inside the window
    assert (oracle.draft(7, rows)["logits"] - base["logits"]).abs().max() > 1e-4
    with pytest.raises(KeyError):
        oracle.draft(7, rows + 2)  # positions rows, rows+1 never committed


def test_greedy_tokens_are_the_argmax_of_z(release):
    print("seed", SEED)
    _, _, _, weights = release
    out = _oracle(release, 10, SEED).draft(11, 10)
    assert out["logits"].dtype == torch.float64 and out["logits"].shape == (5, 320)
    assert torch.equal(out["tokens"], out["logits"].argmax(-1))
    prev = torch.cat([torch.tensor([11]), out["tokens"][:-1]])
    w1, w2 = weights["mtp.2.markov_head.markov_w1.weight"], weights["mtp.2.markov_head.markov_w2.weight"]
    torch.testing.assert_close(out["logits"], out["base_logits"] + w1[prev] @ w2.T, atol=1e-12, rtol=0)


def test_sampled_draws_are_reproducible(release):
    print("seed", SEED)
    _, _, _, weights = release
    oracle = _oracle(release, 10, SEED)
    draws = [oracle.draft(11, 10, temperature=0.8, generator=torch.Generator().manual_seed(s)) for s in (1, 1, 2, 3)]
    assert torch.equal(draws[0]["tokens"], draws[1]["tokens"])
    assert len({tuple(d["tokens"].tolist()) for d in draws}) > 1
    for d in draws:
        prev = torch.cat([torch.tensor([11]), d["tokens"][:-1]])  # B_k uses the SAMPLED x_{k-1}
        torch.testing.assert_close(d["markov_embed"], weights["mtp.2.markov_head.markov_w1.weight"][prev])
        torch.testing.assert_close(d["probs"], torch.softmax(d["logits"] / 0.8, -1))


def test_confidences_and_activations_are_not_degenerate(release):
    print("seed", SEED)
    out = _oracle(release, 10, SEED).draft(11, 10)
    c = out["confidences"]
    assert ((c > 0) & (c < 1)).all() and c.std() > 0.02 and c.max() - c.min() > 0.1
    rms = [float(h.pow(2).mean().sqrt()) for h in out["hidden"]]
    assert all(0.3 < r < 10 for r in rms), rms
    assert 1.0 < float(out["logits"].std(-1).min()) < 5.0
    assert 0.02 < float(torch.softmax(out["logits"], -1).max(-1).values.min())


def test_kv_fp8_roundtrip_knob(release):
    print("seed", SEED)
    cfg = release[0]
    exact, rounded = _oracle(release, 10, SEED), _oracle(release, 10, SEED, kv_fp8_roundtrip=True)
    a, b = exact.window_kv(0, 10), rounded.window_kv(0, 10)
    rd = 16
    assert torch.equal(a[:, -rd:], b[:, -rd:]) and not torch.equal(a[:, :-rd], b[:, :-rd])
    scale = torch.pow(2.0, torch.ceil(torch.log2(a[:, :-rd].abs().amax(-1, keepdim=True) / 448)))
    q = b[:, :-rd] / scale
    assert torch.equal(q, q.to(torch.float8_e4m3fn).double())
    torch.testing.assert_close(b, a, atol=0.1, rtol=0.07)
    da, db = exact.draft(11, 10), rounded.draft(11, 10)
    same_route = torch.stack([(ea == eb).all(-1) for ea, eb in zip(da["experts"], db["experts"])]).all(0)
    assert same_route.any()  # a rounding may flip a top-k; rows that route alike stay close
    diff = (da["base_logits"] - db["base_logits"]).abs().amax(-1)[same_route]  # U: no token feedback
    assert 0 < diff.max() < 0.5
    assert cfg["head_dim"] - rd == 48


def test_rms_norm_and_main_projection_shapes(release):
    cfg, _, _, weights = release
    x = torch.randn(3, cfg["hidden_size"], dtype=torch.float64)
    y = rms_norm(x, None, 1e-6)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(3, dtype=torch.float64), atol=1e-5, rtol=0)
    oracle = _oracle(release, 3, SEED)
    assert [len(c) for c in oracle.context] == [3, 3, 3]
    assert oracle.window_kv(2, 3).shape == (3, cfg["head_dim"])
