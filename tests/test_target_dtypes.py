"""bf16 targets saved and loaded again run on every supported transformers (issue 45, item 6).

transformers' loader keeps V4's ``*norm*`` weights in fp32 (``_keep_in_fp32_modules_strict``).  5.18+'s
``DeepseekV4RMSNorm`` returns its input's dtype, ``(weight * x).to(input_dtype)``; 5.17's returns
``weight * x.to(input_dtype)``, fp32 under an fp32 weight, and the next bf16 projection fails ("expected m1 and m2
to have the same dtype").  ``norms_to_compute_dtype`` casts those weights where the installed RMSNorm needs it;
the packed target's loaders call it themselves.

The oracle is the loaded model run with 5.18+'s RMSNorm formula (patched in here).  Where the installed
transformers computes that formula nothing is cast and the results are the same bit for bit.  On 5.17 the norm's
input is rounded to bf16 before the weight multiplies it: the result is then as close to the same weights in fp32
as the oracle is (random tiny models in bf16 are 2-15% off fp32: each rounding difference grows)."""

import pytest
import torch
from transformers import DeepseekV4ForCausalLM
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

from dsv4_mtp_hf import pack_fp4_experts
from dsv4_mtp_hf.target_runtime.dtypes import norms_to_compute_dtype
from dsv4_mtp_hf.target_runtime.experts import DeepseekV4PackedExpertsForCausalLM

from .helpers import tiny_pair

pytestmark = pytest.mark.tf_internals
SEED = 45


def rmsnorm_518(self, hidden_states):
    """transformers >= 5.18's DeepseekV4RMSNorm.forward."""
    input_dtype = hidden_states.dtype
    h = hidden_states.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (self.weight * h).to(input_dtype)


def installed_norm_returns_fp32() -> bool:
    with torch.no_grad():
        return DeepseekV4RMSNorm(4)(torch.ones(1, 4, dtype=torch.bfloat16)).dtype == torch.float32


def logits(model):
    ids = torch.randint(3, model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        return model(ids).logits


def reference(load, monkeypatch):
    """(logits of ``load()`` in bf16 computed with 5.18+'s RMSNorm, of ``load(dtype=float32)``)."""
    with monkeypatch.context() as m:
        m.setattr(DeepseekV4RMSNorm, "forward", rmsnorm_518)
        return logits(load().eval()), logits(load(dtype=torch.float32).eval())


def check(got, want, cast):
    want, fp32 = want
    assert got.dtype == torch.bfloat16
    if installed_norm_returns_fp32():  # 5.17: the weights were cast; as accurate as what 5.18+ computes
        assert cast and all("norm" in n for n in cast)
        err = [float((x.float() - fp32).norm() / fp32.norm()) for x in (got, want)]
        assert err[0] <= 2 * err[1] + 0.02, err
    else:
        assert cast == [] and torch.equal(got, want)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    target, mtp = tiny_pair(seed=SEED)
    target = target.to(torch.bfloat16)
    path = tmp_path_factory.mktemp("t")
    target.save_pretrained(path / "dense")
    pack_fp4_experts(target)
    target.save_pretrained(path / "packed")
    return path, mtp


def test_a_saved_bf16_target_runs_after_norms_to_compute_dtype(saved, monkeypatch):
    path, _ = saved
    want = reference(lambda **kw: DeepseekV4ForCausalLM.from_pretrained(path / "dense", **kw), monkeypatch)
    for kwargs in ({}, {"dtype": torch.bfloat16}):
        model = DeepseekV4ForCausalLM.from_pretrained(path / "dense", **kwargs).eval()
        assert model.get_input_embeddings().weight.dtype == torch.bfloat16
        assert any(p.dtype == torch.float32 for n, p in model.named_parameters() if "norm" in n)  # the loader's doing
        cast = norms_to_compute_dtype(model)
        check(logits(model), want, cast)
        assert norms_to_compute_dtype(model) == []  # idempotent


def test_a_packed_bf16_target_loads_back_and_runs(saved, monkeypatch):
    path, mtp = saved
    want = reference(lambda **kw: DeepseekV4PackedExpertsForCausalLM.from_pretrained(path / "packed", **kw),
                     monkeypatch)
    model = DeepseekV4PackedExpertsForCausalLM.from_pretrained(path / "packed").eval()
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    check(logits(model), want, [n for n, p in model.named_parameters() if "norm" in n and p.dtype == torch.bfloat16])
    mtp.bind(model)
    ids = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(SEED))
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=mtp), plain)


def test_packing_a_reloaded_bf16_target_gives_a_model_that_runs(saved, monkeypatch):
    path, _ = saved
    want = reference(lambda **kw: pack_fp4_experts(DeepseekV4ForCausalLM.from_pretrained(path / "dense", **kw)),
                     monkeypatch)
    model = pack_fp4_experts(DeepseekV4ForCausalLM.from_pretrained(path / "dense").eval())
    check(logits(model), want, [n for n, p in model.named_parameters() if "norm" in n and p.dtype == torch.bfloat16])
