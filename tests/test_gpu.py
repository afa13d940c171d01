"""The GPU path: benchmarks/gpu_check.py runs (as a dry run on a CPU here), and the CUDA tests,
which skip where torch sees no GPU: greedy chains and trees equal plain decoding on the device,
tree logits equal each path run alone, and the sampling walk keeps to one transfer per step."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

from hdcli.engine.decode.loop import Decoder
from hdcli.engine.decode.tree import tree_forward
from hdcli.engine.model.target import as_target
from hdcli.engine.decode.verify import Sampling

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_check  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")


def test_gpu_check_dry_run_on_cpu(tmp_path):
    """The check's every section on tiny models; fp32 must be identical, the oracle exact and
    fully accepted (each step keeps k drafted tokens and the target's own)."""
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--device", "cpu", "--quick", "--dtypes", "fp32", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["machine"]["cpu"] and r["device"] == "cpu"
    for key in ("tiny-llama/fp32", "tiny-gemma3/fp32"):
        for mode in ("chains", "trees"):
            ex = r["exactness"][key][mode]
            assert ex["identical"] == ex["prompts"] == 2, (key, mode, ex)
            assert 1.0 < ex["mean_accepted"]  # drafts were kept, not only rejected
        assert r["exactness"][key]["trees"]["max_tree_nodes"] > 8  # branches went in beside the chain
    cost = r["cost"]["tiny-llama/fp32"]
    assert cost["tree_mask"]["1"] == 1.0 and set(cost["tree_mask"]) == {"1", "2", "3", "4", "8", "16"}
    speed = r["speed"]["tiny-llama/fp32"]
    assert set(speed["tokens_per_second"]) == {"plain", "transformers_generate", "oracle_4", "oracle_8"}
    assert speed["transformers_first_difference"] is None
    for k, o in speed["oracle"].items():
        assert o["identical"]
        assert o["mean_accepted"] >= int(k)  # k + 1 tokens a step; the budget cuts the last short


def test_gpu_check_refuses_cuda_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert gpu_check.main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--device cpu" in err


def test_gpu_check_shapes_are_the_models_they_stand_for():
    """Built on the meta device (no memory): parameter counts of SmolLM2-135M and Llama-3.2-1B."""
    assert round(sum(p.numel() for p in gpu_check.build("smollm2-135m-shape", "meta").parameters()) / 1e6, 1) == 134.5
    assert round(sum(p.numel() for p in gpu_check.build("llama-1b-shape", "meta").parameters()) / 1e9, 2) == 1.24


@cuda
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
@pytest.mark.parametrize("branches", [0, 3])
def test_cuda_greedy_chains_and_trees_equal_plain(name, branches):
    model = gpu_check.build(name, "cuda")
    for i, prompt in enumerate(gpu_check.prompts(512, 3, 24, seed=2)):
        ref = Decoder(model, eos_ids=()).generate(prompt, max_new_tokens=64).tokens
        oracle = gpu_check.Oracle(ref, len(prompt), k=8, corrupt=0.25, branches=branches, vocab=512, seed=i)
        assert Decoder(model, eos_ids=(), drafter=oracle).generate(prompt, max_new_tokens=64).tokens == ref


@cuda
@torch.inference_mode()
def test_cuda_tree_logits_equal_each_path_run_alone():
    model = as_target(gpu_check.build("tiny-gemma3", "cuda"))
    rng = random.Random(0)
    prompt = gpu_check.prompts(512, 1, 20)[0]
    tree = gpu_check.bushy_tree(12, rng, 512)
    cache = model.new_cache()
    model.forward(torch.tensor([prompt[:-1]], device="cuda"), cache)
    got = tree_forward(model, tree, prompt[-1], cache)
    for node in range(len(tree.tokens)):
        path = [prompt[-1]] + [tree.tokens[i] for i in tree.path(node)]
        alone = model.forward(torch.tensor([prompt + path[1:]], device="cuda"))[-1]
        torch.testing.assert_close(got[node], alone, atol=1e-4, rtol=1e-4)


@cuda
def test_cuda_sampling_runs_with_a_device_generator():
    """Sampling through a tree on the GPU: the generator, uniforms and residual draws live on the
    device (the distribution itself is tested on the CPU, tests/test_tree.py, test_sampling.py)."""
    model = gpu_check.build("tiny-llama", "cuda")
    prompt = gpu_check.prompts(512, 1, 24)[0]
    ref = Decoder(model, eos_ids=()).generate(prompt, max_new_tokens=32).tokens

    def sample():
        dec = Decoder(model, eos_ids=(), drafter=gpu_check.Oracle(ref, len(prompt), 6, 0.3, 2, 512))
        return dec.generate(prompt, max_new_tokens=32, sampling=Sampling(temperature=1.0), seed=5).tokens
    a = sample()
    assert a == sample() and len(a) == 32



def report_on(device: str, dtype: str, model_dir) -> dict:
    """The whole `hd generate --device D` path: load there, the cost curve measured there, the
    default hierarchy, the comparison with plain decoding and transformers' generate."""
    from hdcli.config import DecodingConfig
    from hdcli.commands.generate import generate_report
    cfg = DecodingConfig(model=str(model_dir), device=device, dtype=dtype, max_new_tokens=48)
    data = generate_report(cfg, "the cat sat on the mat and the dog sat on the mat", compare=True).data
    assert data["config"]["device"] == device
    return data


def test_the_report_path_the_cuda_test_takes_runs_on_cpu(tiny_model_dir):
    assert report_on("cpu", "fp32", tiny_model_dir)["compare"]["identical"]


@cuda
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_hd_generate_with_its_default_layers(tiny_model_dir, dtype):
    """fp32 equals plain decoding; bf16 is reported, not asserted (docs/dtype.md)."""
    data = report_on("cuda", dtype, tiny_model_dir)
    if dtype == "fp32":
        assert data["compare"]["identical"], data["compare"]
