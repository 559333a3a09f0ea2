"""The online Hadamard rotation of the down projections' inputs (--rotate down, SpinQuant's R4): the
fast Walsh-Hadamard transform against the dense matrix, exactness on every dense model type of the
zoo that has a down_proj (refusal, the model left as it was, where not), the checkpoint's
transform config as compressed-tensors reads it (its own transform of our config gives qtk's
logits), and qtk's runtime running the rotated checkpoint as the loader's forward does."""
from __future__ import annotations

import copy
import json

import pytest
import torch

import zoo
from qtk import hadamard, pipeline, rotation
from qtk.arch import discover
from qtk.errors import CheckpointError, InputError
from qtk.recipe import build
from test_rotation import _logits  # noqa: E402  (the same no-grad forward as the fused rotation's tests)


@pytest.mark.parametrize("block", [1, 2, 8, 64, 512])
def test_the_transform_is_the_block_diagonal_sylvester_matrix(block):
    x = torch.randn(3, 5, 1536, dtype=torch.float64)
    H = torch.block_diag(*[hadamard.sylvester(block)] * (1536 // block))
    torch.testing.assert_close(hadamard.fwht(x.float(), block).double(), x @ H, rtol=1e-5, atol=1e-5)
    assert hadamard.fwht(x.to(torch.bfloat16), block).dtype == torch.bfloat16
    torch.testing.assert_close(hadamard.fwht(hadamard.fwht(x.float(), block), block), x.float(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="does not divide"):
        hadamard.fwht(torch.zeros(2, 1537), max(block, 2))


def test_the_block_is_the_largest_power_of_two_dividing_the_input():
    assert [hadamard.block_size(n) for n in (1536, 576, 4096, 11008, 8960, 96)] == [512, 64, 512, 256, 256, 32]
    assert hadamard.sylvester(2).mul(2 ** 0.5).tolist() == [[1.0, 1.0], [1.0, -1.0]]


@pytest.mark.parametrize("model_type", sorted(zoo.DENSE))
def test_the_rotated_model_computes_the_same_function(model_type):
    model = zoo.tiny(model_type)
    arch = discover(model)
    downs = {n: m.weight.clone() for n, m in model.named_modules() if n.endswith("mlp.down_proj")}
    ids = torch.randint(3, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    if not downs:  # GPT-NeoX, OPT, ...: not rotated, the model as it was (the default recipe still runs)
        assert rotation.rotate_down(model, arch) == 0
        assert torch.equal(_logits(model, ids), before) and not any(hadamard.of(m) for m in model.modules())
        return
    assert rotation.rotate_down(model, arch) == len(downs)
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-4, atol=1e-4)
    for n, w in downs.items():
        m = model.get_submodule(n)
        assert hadamard.of(m) == hadamard.block_size(m.in_features) and not torch.equal(m.weight, w)
    # AWQ's up -> down fold no longer holds through the rotation: the probe drops that pair
    assert not any(p.linears[-1].endswith("down_proj") and p.prev.endswith("up_proj")
                   for ps in discover(model).smooth for p in ps)


def test_a_model_the_rotation_would_change_is_refused_and_left_as_it_was(monkeypatch):
    model = zoo.tiny("llama")
    with torch.no_grad():  # a random tiny model's MLPs add little: make them count
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(100)
    arch = discover(model)
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    before = _logits(model, ids)
    monkeypatch.setattr(rotation, "_rotate_inputs", lambda linear, block: None)  # the weights no longer undo it
    with pytest.raises(InputError, match="changes the model's outputs"):
        rotation.rotate_down(model, arch)
    assert torch.equal(_logits(model, ids), before)
    assert not any(hadamard.of(m) for m in model.modules())


@pytest.fixture(scope="module")
def rotated(tiny_dir, tmp_path_factory):
    """W4A16 g32 checkpoints (RTN, float32) of the tiny Llama with its MLPs made to count (a random
    tiny model's add little to the logits), with and without --rotate down."""
    import shutil

    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("online-rotation")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(30)
    model.save_pretrained(out / "float")
    for f in tiny_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, out / "float" / f.name)
    for rotate in ((), ("down",)):
        recipe = build(method="rtn", scheme="w4a16", group_size=32, dtype="float32", rotate=rotate)
        pipeline.quantize(str(out / "float"), recipe, out / f"q{len(rotate)}", progress=False)
    return out / "q1", out / "q0"


def test_the_checkpoint_carries_the_transform_as_compressed_tensors_writes_it(rotated):
    from qtk.checkpoint import read_tensors
    from qtk.loading import load_model

    q1, q0 = rotated
    qc = json.loads((q1 / "config.json").read_text())["quantization_config"]
    assert json.loads((q0 / "config.json").read_text())["quantization_config"]["transform_config"] == {}
    target = ["re:.*down_proj$"]
    assert qc["transform_config"] == {"config_groups": {"R4": {
        "type": "hadamard", "randomize": False, "requires_grad": False, "head_dim": 128, "precision": "torch.float32",
        "apply": [{"targets": target, "location": "input", "inverse": False, "ignore": []},
                  {"targets": target, "location": "weight_input", "inverse": True, "ignore": []}]}}}
    tensors = read_tensors(q1)
    h = tensors.pop("model.layers.0.mlp.down_proj.R4_input.weight")
    assert h.dtype == torch.bfloat16 and torch.equal(h.double(), hadamard.sylvester(128).mul(128 ** 0.5))  # one, +-1
    assert set(tensors) == set(read_tensors(q0))
    assert build(recipe_file=str(q1 / "recipe.yaml")).rotate == ("down",)
    from qtk.inspect import inspect_checkpoint, render

    info = inspect_checkpoint(str(q1))
    assert info["rotations"] == [{"group": "R4", "type": "hadamard", "block": 128, "targets": target}]
    assert "online rotation R4: hadamard, blocks of 128" in render(info)
    assert info["bf16_size_bytes"] == inspect_checkpoint(str(q0))["bf16_size_bytes"]  # the matrix is not the model's
    # the rotation changes no function: both checkpoints are as close to the float model
    base, tok = load_model(str(q1.parent / "float"), dtype=torch.float32)
    ids = torch.randint(3, len(tok), (2, 24), generator=torch.Generator().manual_seed(2))
    p = _logits(base, ids).log_softmax(-1)
    for q in (q0, q1):
        lq = _logits(load_model(str(q), dtype=torch.float32)[0], ids).log_softmax(-1)
        assert (p.exp() * (p - lq)).sum(-1).mean().item() < 1e-2
    model = load_model(str(q1), dtype=torch.float32)[0]
    assert sorted(n for n, m in model.named_modules() if hadamard.of(m)) == [
        f"model.layers.{i}.mlp.down_proj" for i in range(2)]


def test_compressed_tensors_own_transform_of_the_config_gives_qtks_logits(rotated):
    """compressed-tensors (the system env's) builds the online transform from the checkpoint's config
    (its deterministic Hadamard, head_dim blocks, its normalization) on transformers' load of the
    weights: the logits are qtk's. (transformers' loader alone does not apply transform configs.)"""
    ct = pytest.importorskip("compressed_tensors.transform")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from qtk.loading import load_model

    q1, _ = rotated
    tc = json.loads((q1 / "config.json").read_text())["quantization_config"]["transform_config"]
    ct.TransformConfig.model_validate(tc)  # the whole config, as vLLM validates it
    online = copy.deepcopy(tc)
    for g in online["config_groups"].values():  # the weight_input half is already in the weights
        g["apply"] = [a for a in g["apply"] if a["location"] == "input"]
    theirs = AutoModelForCausalLM.from_pretrained(q1, quantization_config=CompressedTensorsConfig(dequantize=False),
                                                  dtype=torch.float32)
    ct.apply_transform_config(theirs, ct.TransformConfig.model_validate(online))
    ids = torch.randint(3, 2000, (2, 24), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_logits(theirs, ids), _logits(load_model(str(q1), dtype=torch.float32)[0], ids),
                               rtol=1e-5, atol=1e-5)


def test_the_runtime_runs_what_the_loader_runs(rotated):
    """qtk's runtime (its packed int4 kernels, the fused CPU forward, prefill chunks beside decodes)
    on the rotated checkpoint: every step's logits are the loader's transformers forward's; and the
    engine's greedy tokens its generate's."""
    from test_runtime import greedy_through_runtime

    from qtk.loading import load_model

    q1, _ = rotated
    ref = load_model(str(q1), dtype=torch.float32)[0]
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 2000, (n,), generator=g).tolist() for n in (19, 1, 6)]
    seqs, logits, _ = greedy_through_runtime(load_model(str(q1), dtype=torch.float32)[0], prompts, new_tokens=5)
    for s in seqs:
        want = _logits(ref, torch.tensor([s.token_ids]))[0, s.num_prompt_tokens - 1:len(s) - 1]
        torch.testing.assert_close(torch.stack(logits[s.seq_id]), want, atol=2e-3, rtol=1e-3)
    # in bf16 (on a CPU with bf16 units: the bf16 matmuls and MLP of prefill chunks), within bf16's rounding
    long = [torch.randint(3, 2000, (90,), generator=g).tolist()]  # a prefill of many rows
    seqs, logits, _ = greedy_through_runtime(load_model(str(q1), dtype=torch.bfloat16)[0], prompts + long,
                                             new_tokens=5, budget=128)
    for s in seqs:
        want = _logits(ref, torch.tensor([s.token_ids]))[0, s.num_prompt_tokens - 1:len(s) - 1]
        got = torch.stack(logits[s.seq_id]).float()
        assert (got - want).abs().max() < 0.05 * want.abs().max(), (got - want).abs().max()
    assert_engine_greedy_is_the_loaders(q1, ref)


def assert_engine_greedy_is_the_loaders(path, model):
    """qtk's engine on the checkpoint at `path` decodes greedily the tokens `model` (its loader's) does."""
    from qtk import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory=2**22, block_size=8)
    out = llm.generate(["The capital of France is a city that"],
                       SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    ids = llm.tokenizer("The capital of France is a city that", return_tensors="pt").input_ids
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                          do_sample=False)[0, ids.shape[1]:].tolist()
    assert out.outputs[0].token_ids == want


def test_other_transforms_are_refused_with_what_qtk_applies(rotated, tmp_path):
    import shutil

    from qtk.loading import load_model

    q1, _ = rotated
    bad = tmp_path / "random"
    shutil.copytree(q1, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["transform_config"]["config_groups"]["R4"]["type"] = "random-hadamard"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="type 'random-hadamard'"):
        load_model(str(bad))


def test_rotations_fused_into_the_weights_need_nothing_at_load(rotated, tmp_path):
    """SpinQuant's R1 and R2 as llm-compressor writes them: groups applied at weight_output and
    weight_input only, fused into the weights when saved. The loader applies nothing for them (the
    same logits as without them); R4's online rotation is still applied."""
    import shutil

    from qtk.loading import load_model

    q1, _ = rotated
    fused = tmp_path / "fused"
    shutil.copytree(q1, fused)
    cfg = json.loads((fused / "config.json").read_text())
    cfg["quantization_config"]["transform_config"]["config_groups"]["R1"] = {
        "type": "hadamard", "head_dim": 64, "randomize": False, "requires_grad": False, "precision": "torch.float64",
        "apply": [{"targets": ["re:.*embed_tokens$", "re:.*o_proj$", "re:.*down_proj$"], "location": "weight_output",
                   "inverse": False, "ignore": []},
                  {"targets": ["re:.*q_proj$", "lm_head"], "location": "weight_input", "inverse": True, "ignore": []}]}
    (fused / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(3, 2000, (1, 16), generator=torch.Generator().manual_seed(2))
    want = _logits(load_model(str(q1), dtype=torch.float32)[0], ids)
    model = load_model(str(fused), dtype=torch.float32)[0]
    assert hadamard.of(model.model.layers[0].mlp.down_proj) is not None
    torch.testing.assert_close(_logits(model, ids), want, rtol=0, atol=0)


def test_the_runtimes_direct_calls_rotate_the_input():
    """The runtime's plan calls kernels directly, past the module's hook: packed_linear.direct and
    bf16_matmul (the bf16 MLP of prefill chunks) rotate a rotating layer's input themselves."""
    from types import SimpleNamespace

    from qtk.runtime import packed_linear

    w = torch.randn(8, 64)
    product = lambda x: x.float() @ w.t()  # noqa: E731

    class Many(torch.nn.Module):  # the attributes bf16_matmul reads of a WOQLinear with a bf16 copy
        many = SimpleNamespace(bf16=True, bias=None, rows=4, bf16_product=product)
        dot = None

    layer = hadamard.attach(Many(), 16)
    x = torch.randn(5, 64)
    rows, f = packed_linear.bf16_matmul(layer)
    torch.testing.assert_close(f(x), hadamard.fwht(x, 16) @ w.t())
    plain = packed_linear.PackedLinear.__new__(packed_linear.PackedLinear)
    torch.nn.Module.__init__(plain)
    plain.direct = lambda: product
    torch.testing.assert_close(packed_linear.direct(hadamard.attach(plain, 16))(x), hadamard.fwht(x, 16) @ w.t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernel_is_the_transform(dtype):
    """csrc/cpu_layers.cpp's hadamard (what the runtime's plan calls) against hadamard.fwht: float32
    rows, and bf16 rows in and out (the bf16 MLP of prefill chunks), with the math in float32."""
    from qtk.kernels import cpu

    lib = cpu.ops()
    if lib is None:
        pytest.skip("qtk's CPU kernels are not built on this machine")
    x = torch.randn(7, 1536).to(dtype)
    for block in (1, 2, 64, 512):
        got = lib.hadamard(x, block)
        assert got.dtype == dtype
        torch.testing.assert_close(got, hadamard.fwht(x, block), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-5 if dtype == torch.float32 else 1e-2)
    torch.testing.assert_close(lib.hadamard(x[:, :512], 512), hadamard.fwht(x[:, :512], 512),
                               rtol=1e-2, atol=1e-2)  # rows of a strided view
    with pytest.raises(RuntimeError, match="power of two dividing"):
        lib.hadamard(x, 3)


def test_the_command_line_rotates_and_inspect_says_so(tiny_dir, tmp_path):
    from click.testing import CliRunner

    from qtk.cli import main

    out = tmp_path / "rot"
    result = CliRunner().invoke(main, ["quantize", str(tiny_dir), "--method", "rtn", "--scheme", "w8a16",
                                       "--rotate", "down", "--rotate", "v_o", "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert build(recipe_file=str(out / "recipe.yaml")).rotate == ("down", "v_o")
    shown = CliRunner().invoke(main, ["inspect", str(out)]).stdout.splitlines()
    assert shown[2:4] == ["  kv cache: float", "  online rotation R4: hadamard, blocks of 128, on the input of "
                          "['re:.*down_proj$']"]
    assert build().rotate == ("down",) and build(rotate=("none",)).rotate == ()  # the default recipe's, or none
    bad = CliRunner().invoke(main, ["quantize", str(tiny_dir), "--method", "rtn", "--rotate", "r1", "-o",
                                    str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "r1" in bad.output and not (tmp_path / "bad").exists()


def test_the_engine_runs_a_rotated_bundled_checkpoint_as_the_loader_does(bundled_dir, tmp_path):
    """The bundled model rotated and rounded to int4 (RTN): the engine's perplexity (its real paths on
    this CPU: the int4 kernels, with bf16 units their bf16 kernel for prefill chunks) is the loader's
    transformers forward's, within the bf16 rounding of those paths; a path that skipped the rotation
    (an unrotated input to a rotated W) gives a perplexity of 1e9 and more."""
    from qtk import LLM
    from qtk.evals.perplexity import engine_perplexity, eval_windows, perplexity
    from qtk.loading import load_model

    recipe = build(method="rtn", scheme="w4a16_asym", group_size=64, rotate=("down",))
    pipeline.quantize(str(bundled_dir), recipe, tmp_path / "q", progress=False)
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_model_len=512)
    windows = eval_windows(llm.tokenizer, "builtin", 256, 2)
    engine = engine_perplexity(llm, windows, batch_size=2, progress=False).ppl
    loader = perplexity(load_model(str(tmp_path / "q"))[0], windows, progress=False).ppl
    assert loader < 40 and abs(engine / loader - 1) < 0.02, (engine, loader)
