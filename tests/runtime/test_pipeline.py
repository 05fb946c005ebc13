"""Pipeline parallelism on the CPU with gloo: the layers split over stages (each a TP group, with
DP attention and EP as without stages), hidden states passed stage to stage, the last stage
sampling; several steps in flight over disjoint requests (micro-batches). Greedy tokens are
transformers'; each stage holds only its layers."""

from __future__ import annotations

import time

import pytest
import torch

from dserve.runtime import Engine, SamplingParams
from tests.conftest import random_prompts
from tests.reference import hf_greedy

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
SHAPES = {
    "pp2": (3, dict(pp_size=2)),
    "pp2-tp2": (3, dict(pp_size=2, tp_size=2)),
    "pp2-dp2": (3, dict(pp_size=2, tp_size=2, dp_size=2, ep_size=2)),
    "pp3-uneven": (5, dict(pp_size=3, pp_layer_partition="2,1,2")),
}
CASES = [("deepseek_v3", s) for s in SHAPES] + [("glm4_moe", "pp2-tp2"), ("glm4_moe", "pp3-uneven")]


@pytest.mark.parametrize("arch,shape", CASES, ids=[f"{a}-{s}" for a, s in CASES])
def test_stages_give_the_reference_tokens(arch, shape, tiny_dir, make_engine):
    layers, kwargs = SHAPES[shape]
    path = tiny_dir(arch, layers=layers)
    engine = make_engine(path, max_total_tokens=4096, **kwargs)
    prompts = random_prompts(5, engine.model_config.vocab_size, [5, 23, 40, 17, 9], seed=41)
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    for prompt, result in zip(prompts, results):
        assert result.output_ids == hf_greedy(path, prompt, 12)


def test_each_stage_holds_its_layers(tiny_dir, make_engine):
    """Five layers as 2, 1, 2: each stage has exactly its layers (the embedding on the first, the
    final norm and LM head on the last) and together they hold the model once."""
    path = tiny_dir("deepseek_v3", layers=5)
    whole = make_engine(path).executor.runner.parameter_bytes
    engine = make_engine(path, pp_size=3, pp_layer_partition="2,1,2")
    info = engine.executor.rank_info
    names = [set(i.parameter_shapes) for i in info]
    layers = [{n.split(".")[1] for n in stage if n.startswith("layers.")} for stage in names]
    assert layers == [{"0", "1"}, {"0"}, {"0", "1"}]  # each stage numbers its own layers
    assert "embed_tokens.weight" in names[0] and "embed_tokens.weight" not in names[1] | names[2]
    assert {"norm.weight", "lm_head.weight"} <= names[2] and "norm.weight" not in names[0]
    assert sum(i.parameter_bytes for i in info) == whole
    assert info[1].parameter_bytes < 0.4 * whole  # one MoE layer of five


def test_micro_batches_keep_the_tokens(tiny_dir, make_engine):
    """Two steps in flight over disjoint requests, or one at a time: the same tokens (and a seeded
    request draws the same)."""
    path = tiny_dir("glm4_moe")
    prompts = random_prompts(6, 512, [7, 12, 30, 5, 19, 11], seed=3)
    params = [GREEDY] * 5 + [SamplingParams(max_new_tokens=12, seed=5, ignore_eos=True)]
    outputs = []
    for micro in (1, 2):
        engine = make_engine(path, pp_size=2, pp_micro_batches=micro)
        seen, step = [], engine.step

        def counted(step=step, engine=engine, seen=seen):
            out = step()
            seen.append(len(engine.in_flight))
            return out

        engine.step = counted
        outputs.append(
            [r.output_ids for r in engine.generate(input_ids=prompts, sampling_params=params)]
        )
        assert max(seen) == micro - 1  # steps left in flight between calls
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pp_size=2, pp_layer_partition="2,2"), "does not split the 3 layers into 2 stages"),
        (dict(pp_size=4), "pp_size = 4 is more stages than the 3 layers"),
        (dict(pp_size=2, pp_layer_partition="3"), "must give 2 layer counts"),
    ],
)
def test_bad_pipeline_settings_fail_before_loading(kwargs, message, tiny_dir):
    path = tiny_dir("deepseek_v3")  # written before the clock starts
    start = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        Engine(path, device="cpu", load_progress=False, **kwargs)
    assert time.perf_counter() - start < 5, "the check runs before any rank starts"


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)"
)
@pytest.mark.parametrize("shape", ["pp2", "pp2-tp2"])
@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_stages_on_gpus_with_nccl(arch, shape, tiny_dir, make_engine):
    """pp 2 on two GPUs (hidden states over NCCL), and pp 2 x tp 2 on four, float32:
    transformers' tokens; with MTP the same tokens (the draft on the last stage's GPUs)."""
    layers, shape_kwargs = SHAPES[shape]
    ranks = shape_kwargs["pp_size"] * shape_kwargs.get("tp_size", 1)
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"{shape} needs {ranks} GPUs")
    path = tiny_dir(arch, layers=layers, mtp=True)
    kwargs = dict(device="cuda", dtype="float32", max_total_tokens=4096, **shape_kwargs)
    prompts = random_prompts(4, 512, [5, 23, 40, 17], seed=41)
    plain = make_engine(path, **kwargs).generate(input_ids=prompts, sampling_params=GREEDY)
    for prompt, result in zip(prompts, plain):
        assert result.output_ids == hf_greedy(path, prompt, 12)
    spec = make_engine(path, speculative_algorithm="mtp", speculative_num_steps=2, **kwargs)
    drafted = spec.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [r.output_ids for r in drafted] == [r.output_ids for r in plain]
