"""A target spread over two GPUs by accelerate (`device_map`), the MTP beside its lm head."""

import pytest
import torch

from dsv4_mtp_hf import graph_target, pack_fp4_experts, ungraph_target
from dsv4_mtp_hf.generation import speculative_generate

from .helpers import generate_recording_session, tiny_pair

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (the nvidia-h200-x2 machine)")


def split_pair(seed: int):
    """Layers 0-1 and the embedding on cuda:0; layer 2, the head and the MTP on cuda:1.
    Sizes the Triton FP4 MoE tiles, so the MTP's kernels run on cuda:1 (Triton launches
    on the *current* device unless the op sets it: that bug would surface here)."""
    from accelerate import dispatch_model

    target, mtp = tiny_pair(seed=seed, target_overrides=dict(hidden_size=256, moe_intermediate_size=256))
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                  "model.layers.2": 1, "model.hc_head": 1, "model.norm": 1, "lm_head": 1}
    target = dispatch_model(target, device_map=device_map)
    mtp = mtp.to("cuda:1")
    mtp.bind(target)
    return target, mtp


@pytest.mark.gpu
@two_gpus
def test_split_target_greedy_assisted_and_batched_equal_plain():
    target, mtp = split_pair(seed=51)
    assert {p.device.index for p in target.parameters()} == {0, 1}
    assert mtp.get_output_embeddings().weight.device == mtp.e_proj.weight.device == torch.device("cuda:1")
    g = torch.Generator().manual_seed(51)
    prompts = [torch.randint(3, 320, (n,), generator=g) for n in (9, 17)]
    kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)
    plain = [target.generate(p[None].to("cuda:0"), **kw)[0, p.numel():].cpu() for p in prompts]
    for p, want in zip(prompts, plain):
        got = target.generate(p[None].to("cuda:0"), assistant_model=mtp, num_assistant_tokens=3, **kw)
        assert torch.equal(got[0, p.numel():].cpu(), want)
        assert mtp.last_generation_stats.rounds > 0
    out = speculative_generate(target, mtp, prompts, max_new_tokens=40, num_assistant_tokens=3, eos_token_id=[])
    for got, want in zip(out.new_tokens, plain):
        assert torch.equal(got, want)
    # Nothing was copied: the MTP reads the target's own embedding and head.
    assert mtp.get_input_embeddings() is target.get_input_embeddings()
    assert mtp.get_output_embeddings() is target.get_output_embeddings()


@pytest.mark.gpu
@two_gpus
def test_graphed_split_target_replays_per_device_segment_and_stays_exact():
    """V4-Flash with packed experts needs two H200s. The embedding sits beside the lm head and the MTP on
    cuda:1, so the MTP's rounds replay as graphs too; the target's step is three segment graphs (embedding
    on 1, layers 0-1 on 0, layer 2 on 1) with the streams handed between the devices."""
    from accelerate import dispatch_model

    target, mtp = tiny_pair(seed=52, target_overrides=dict(hidden_size=256, moe_intermediate_size=256))
    target = target.to(torch.bfloat16)
    pack_fp4_experts(target)
    device_map = {"model.embed_tokens": 1, "model.rotary_emb": 1, "model.layers.0": 0, "model.layers.1": 0,
                  "model.layers.2": 1, "model.hc_head": 1, "model.norm": 1, "lm_head": 1}
    target = dispatch_model(target, device_map=device_map)
    mtp = mtp.to("cuda:1")
    mtp.bind(target)
    ids = torch.randint(3, 320, (1, 13), generator=torch.Generator().manual_seed(52)).to("cuda:1")
    kw = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)
    graphs = graph_target(target, max_length=128, max_rollback=3)
    assert [(sg.device.index, sg.layers) for sg in graphs.segments] == [(1, []), (0, [0, 1]), (1, [2])]
    assert torch.equal(target.generate(ids, **kw), plain)
    got, session = generate_recording_session(target, mtp, ids, num_assistant_tokens=3, **kw)
    assert torch.equal(got, plain)
    assert session.drafter is not None and session.drafter.round_graphs  # the MTP's rounds graphed too
    assert {1, 4} <= set(graphs._graphs) and all(len(gs) == 3 for gs in graphs._graphs.values())
    ungraph_target(target)
